"""`BlockSpan`: a server's contiguous decoder layers, run with one KV cache per layer and session.

Each layer gets its own `DynamicCache` (and attention `layer_idx` 0 inside it), so a session may use any
sub-span [a, b) of the served blocks, and the causal mask can be built from the first used layer's cache.
Weights and caches live on the span's device; `forward` takes CPU tensors (as they come off the wire) and gives its
output back on the CPU in the compute dtype, which is what travels on to the next hop.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from servers.kv_cache import session_caches
from swarmnet.model_spec import ModelSpec

MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


class BlockSpan(nn.Module):
    """Decoder layers [start, end) of a model, plus the rotary embedding they share."""

    def __init__(self, spec: ModelSpec, start: int, end: int) -> None:
        super().__init__()
        self.spec, self.start, self.end, self.family = spec, start, end, spec.family
        layer_cls = spec.family_class("DecoderLayer")
        self.layers = nn.ModuleList(layer_cls(spec.config, layer_idx=i) for i in range(start, end))
        for module in self.layers.modules():
            # the attention's index into the cache: 0, each layer has its own one-layer cache (setattr, as mypy
            # types a submodule attribute Tensor | Module)
            if isinstance(getattr(module, "layer_idx", None), int):
                setattr(module, "layer_idx", 0)  # noqa: B010
        self.rotary_emb = spec.family_class("RotaryEmbedding")(spec.config)
        self.layer_types = [spec.layer_type(i) for i in range(start, end)]
        self.device = torch.device("cpu")  # set by the loader: where weights, caches and compute are
        self.compute_dtype = torch.float32  # set by the loader (bfloat16 spans compute in bfloat16)

    def new_caches(self, start: int, end: int, max_length: int | None = None) -> list[DynamicCache]:
        """Empty KV caches for blocks [start, end), one per layer, growing in place up to `max_length` tokens
        (kv_cache.py)."""
        return session_caches(end - start, max_length)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                caches: list[DynamicCache] | None = None, start: int | None = None, end: int | None = None
                ) -> torch.Tensor:
        """Run blocks [start, end) (absolute indices, default: all) on hidden [B,T,H].

        attention_mask is 2D [B, past+T] (1 = token, 0 = pad), position_ids [B, T]; caches=None runs
        statelessly (a whole sequence, nothing kept).
        """
        first, last = (start or self.start) - self.start, (end or self.end) - self.start
        caches = caches if caches is not None else [DynamicCache() for _ in range(last - first)]
        hidden = hidden.to(self.device, self.compute_dtype)
        attention_mask, position_ids = attention_mask.to(self.device), position_ids.to(self.device)
        # masks must be built BEFORE the layers append to the cache: they read its current length
        kinds = set(self.layer_types[first:last])
        masks = {kind: MASK_BUILDERS[kind](config=self.spec.config, inputs_embeds=hidden,
                                           attention_mask=attention_mask, cache=caches[0], position_ids=position_ids,
                                           allow_is_causal_skip=self.family.causal_skip)
                 for kind in kinds}
        if self.family.rotary_by_layer_type:
            rotary = {kind: self.rotary_emb(hidden, position_ids, kind) for kind in kinds}
        else:
            rotary = dict.fromkeys(kinds, self.rotary_emb(hidden, position_ids=position_ids))
        for offset, layer in enumerate(self.layers[first:last]):
            kind = self.layer_types[first + offset]
            hidden = self.family.layer_call(layer, hidden, mask=masks[kind], position_ids=position_ids,
                                            position_embeddings=rotary[kind], cache=caches[offset])
        return hidden.cpu()  # waits for the device: the caller's timings and frames see a finished output
