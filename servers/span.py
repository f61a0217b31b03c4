"""`BlockSpan`: a server's contiguous decoder layers, run with one KV cache per layer and session.

Each layer gets its own `DynamicCache` (and attention `layer_idx` 0 inside it), so a session may use any
sub-span [a, b) of the served blocks, and the causal mask can be built from the first used layer's cache.
Weights and caches live on the span's device; `forward` takes CPU tensors (as they come off the wire) and gives its
output back on the CPU in the compute dtype, which is what travels on to the next hop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from servers.kv_cache import session_caches
from servers.merged_attention import MergedLayerCache, merged_attention_config
from swarmnet.model_spec import ModelSpec

MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


@dataclass
class DecodeStep:
    """One session's decode step: hidden [b,1,H], mask [b,past+1], positions [b,1], one cache per layer."""

    hidden: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    caches: list[DynamicCache]

    @property
    def rows(self) -> int:
        """The step's batch size."""
        return int(self.hidden.shape[0])

    @property
    def cached_tokens(self) -> int:
        """Rows x cached length: what merging this step by a padded copy would copy (batching.py)."""
        return self.rows * self.caches[0].get_seq_length()


def row_bounds(steps: list[DecodeStep]) -> list[tuple[int, int]]:
    """Each step's rows [low, high) in the batch of all the steps' rows, stacked in order."""
    bounds, low = [], 0
    for step in steps:
        bounds.append((low, low + step.rows))
        low += step.rows
    return bounds


class BlockSpan(nn.Module):
    """Decoder layers [start, end) of a model, plus the rotary embedding they share."""

    def __init__(self, spec: ModelSpec, start: int, end: int) -> None:
        super().__init__()
        self.spec, self.start, self.end, self.family = spec, start, end, spec.family
        layer_cls = spec.family_class("DecoderLayer")
        self.merges_per_session = spec.family.attention_per_session
        layers_config = merged_attention_config(spec.config, spec.family.module, spec.modeling.eager_attention_forward) \
            if self.merges_per_session else spec.config
        self.layers = nn.ModuleList(layer_cls(layers_config, layer_idx=i) for i in range(start, end))
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
        masks = self._masks(hidden, attention_mask, position_ids, caches[0], first, last)  # before the layers append
        rotary = self._rotary(hidden, position_ids, first, last)
        for offset, layer in enumerate(self.layers[first:last]):
            kind = self.layer_types[first + offset]
            hidden = self.family.layer_call(layer, hidden, mask=masks[kind], position_ids=position_ids,
                                            position_embeddings=rotary[kind], cache=caches[offset])
        return hidden.cpu()  # waits for the device: the caller's timings and frames see a finished output

    @torch.inference_mode()
    def forward_sessions(self, steps: list[DecodeStep], start: int, end: int) -> list[torch.Tensor]:
        """Several sessions' decode steps through blocks [start, end) as one forward: the linear layers run once on
        all rows, the attention per session on its own caches (merged_attention.py; only where
        `merges_per_session`). Returns each step's output, in order; each session's caches get its step."""
        first, last = start - self.start, end - self.start
        bounds = row_bounds(steps)
        hidden = torch.cat([step.hidden.to(self.compute_dtype) for step in steps]).to(self.device)
        position_ids = torch.cat([step.positions for step in steps]).to(self.device)
        masks = [self._masks(hidden[low:high], step.mask.to(self.device), position_ids[low:high], step.caches[0],
                             first, last) for step, (low, high) in zip(steps, bounds, strict=True)]
        rotary = self._rotary(hidden, position_ids, first, last)
        for offset, layer in enumerate(self.layers[first:last]):
            kind = self.layer_types[first + offset]
            merged = MergedLayerCache([step.caches[offset] for step in steps], bounds, [m[kind] for m in masks])
            hidden = self.family.layer_call(layer, hidden, mask=None, position_ids=position_ids,
                                            position_embeddings=rotary[kind], cache=merged, merged_sessions=merged)
        output = hidden.cpu()
        return [output[low:high] for low, high in bounds]

    def _masks(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
               cache: DynamicCache, first: int, last: int) -> dict[str, Any]:
        """The attention mask of each layer kind in [first, last), from the first layer's cache as it is now."""
        return {kind: MASK_BUILDERS[kind](config=self.spec.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                          cache=cache, position_ids=position_ids,
                                          allow_is_causal_skip=self.family.causal_skip)
                for kind in set(self.layer_types[first:last])}

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor, first: int, last: int) -> dict[str, Any]:
        """The rotary embedding (cos, sin) of each layer kind in [first, last)."""
        kinds = set(self.layer_types[first:last])
        if self.family.rotary_by_layer_type:
            return {kind: self.rotary_emb(hidden, position_ids, kind) for kind in kinds}
        return dict.fromkeys(kinds, self.rotary_emb(hidden, position_ids=position_ids))
