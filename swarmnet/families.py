"""The model families swarmbatch runs: everything that differs between them, in one registry (FAMILIES).

A `Family` says, for one Hugging Face `model_type`: where transformers keeps its modeling code and the class-name
prefix there (its decoder layer, rotary embedding and norm are `<prefix>DecoderLayer`, `<prefix>RotaryEmbedding`,
`<prefix>RMSNorm`), how its checkpoint names the tensors of block i, of the embeddings and of the final norm, how a
decoder layer is called, the embedding scale, the final-logit soft-capping, which layers use a sliding window, and
the extra config a tiny random model of the family needs. Servers (`servers/span.py`, `servers/block_loading.py`)
and the client head (`swarmnet/head.py`) read only these fields; neither has a per-family branch.

Adding a family (the model_type `foo`, classes `FooDecoderLayer` etc. in transformers.models.foo.modeling_foo):
1. add `"foo": Family("foo", "Foo", tiny={...})` to FAMILIES below, overriding only what differs from Llama
   (the defaults): e.g. `layer_call=call_falcon_layer` for another decoder-layer signature, `convert_block` when
   the checkpoint stores a block's tensors under other names than the layer's state dict (Mixtral's experts);
2. add `"foo"` to the parametrized family tests (tests/servers/test_span.py, tests/test_families.py):
   `swarmbatch model tiny OUT --arch foo` then makes a tiny random model of it, and the tests check it is
   token-identical to transformers' greedy generate, in one process and through two servers;
3. add a row to the families table of docs/models.md.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only where a block or a head is built: the CLI and modelprep import this cheaply
    import torch

LayerCall = Callable[..., "torch.Tensor"]
BlockConversion = Callable[[dict[str, "torch.Tensor"]], dict[str, "torch.Tensor"]]


def call_layer(layer: Any, hidden: torch.Tensor, *, mask: Any, position_ids: torch.Tensor,
               position_embeddings: Any, cache: Any, **attention_kwargs: Any) -> torch.Tensor:
    """A Llama-style decoder layer: keyword `cache`, returns the hidden states; `attention_kwargs` reach the attention
    function (a merged decode step's sessions: servers/merged_attention.py)."""
    return layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings,
                 cache=cache, use_cache=True, **attention_kwargs)


def call_falcon_layer(layer: Any, hidden: torch.Tensor, *, mask: Any, position_ids: torch.Tensor,
                      position_embeddings: Any, cache: Any) -> torch.Tensor:
    """Falcon's decoder layer: `layer_past` and `alibi` (None: rotary Falcon), returns (hidden, attentions)."""
    return layer(hidden, alibi=None, attention_mask=mask, position_ids=position_ids, layer_past=cache,
                 use_cache=True, position_embeddings=position_embeddings)[0]  # type: ignore[no-any-return]


def same_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A block whose checkpoint names are its layer's state-dict names."""
    return state


_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def merge_mixtral_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral's checkpoint layout (`block_sparse_moe.experts.E.w1/w2/w3`) -> transformers 5's fused experts.

    As transformers' own conversion mapping does: gate_up_proj = [w1; w3] per expert, stacked; down_proj = w2s.
    A block already in the fused layout passes through (only `block_sparse_moe.` is renamed to `mlp.`).
    """
    import torch

    experts: dict[str, dict[int, torch.Tensor]] = {"w1": {}, "w2": {}, "w3": {}}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _EXPERT.match(name)
        if match:
            experts[match[2]][int(match[1])] = tensor
        else:
            out[name.replace("block_sparse_moe.", "mlp.", 1)] = tensor
    if experts["w1"]:
        order = sorted(experts["w1"])
        out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([experts["w1"][e], experts["w3"][e]]) for e in order])
        out["mlp.experts.down_proj"] = torch.stack([experts["w2"][e] for e in order])
    return out


def gemma_embed_scale(config: Any) -> float:
    """Gemma multiplies the token embeddings by sqrt(hidden_size)."""
    return float(config.hidden_size) ** 0.5


@dataclass(frozen=True)
class Family:
    """One model family; the defaults are Llama's (see the module docstring for what each field is for)."""

    module: str  # transformers.models.<module>.modeling_<module>
    prefix: str  # class-name prefix there, e.g. "Llama"
    layer_prefix: str = "model.layers.{index}."
    embed_prefix: str = "model.embed_tokens."
    norm_prefix: str = "model.norm."
    norm: str = "RMSNorm"  # the final norm: a class suffix of the family, or "LayerNorm" (torch's, with a bias)
    layer_call: LayerCall = call_layer
    convert_block: BlockConversion = same_names
    rotary_by_layer_type: bool = False  # Gemma 3: local and global layers have their own RoPE
    window_on_every_layer: bool = False  # config.sliding_window (when set) applies to all layers (Mistral, Phi-3)
    attn_implementation: str = "sdpa"  # "eager" where transformers' SDPA path lacks a feature (Gemma 2 soft-capping)
    experts_implementation: str | None = None  # mixtures of experts: the expert kernel transformers picks for them
    causal_skip: bool = True  # False: always materialize the causal mask, as the family's own model does
    # its attention goes through transformers' registry, so a merged decode step runs it per session on the session's
    # own cache (servers/merged_attention.py); False: merged steps copy the caches into one padded batch (Falcon)
    attention_per_session: bool = True
    embed_scale: Callable[[Any], float] = field(default=lambda config: 1.0)
    refused: dict[str, Any] = field(default_factory=dict)  # config values of the family we cannot run (key: value)
    tiny: dict[str, Any] = field(default_factory=dict)  # config of a tiny random model (modelprep/tiny.py)

    def refusal(self, config: Any) -> str | None:
        """Why this family cannot run a model of `config` (a variant we do not support), or None."""
        for key, value in self.refused.items():
            if getattr(config, key, None) == value:
                return f"{config.model_type} with {key}={value!r} is not supported; use a model without it"
        return None

    def layer_prefix_of(self, index: int) -> str:
        """Checkpoint name prefix of block `index`'s tensors."""
        return self.layer_prefix.format(index=index)


# head_dim 16 = hidden 64 / 4 heads; small windows so that sliding layers matter within a test's few tokens
_GEMMA_TINY = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"] * 2}

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "Llama"),
    "mistral": Family("mistral", "Mistral", window_on_every_layer=True),
    "qwen2": Family("qwen2", "Qwen2"),
    "qwen3": Family("qwen3", "Qwen3", tiny={"head_dim": 16}),
    "phi3": Family("phi3", "Phi3", window_on_every_layer=True),
    "mixtral": Family("mixtral", "Mixtral", window_on_every_layer=True, convert_block=merge_mixtral_experts,
                      experts_implementation="grouped_mm",
                      tiny={"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma2": Family("gemma2", "Gemma2", attn_implementation="eager", embed_scale=gemma_embed_scale,
                     tiny={**_GEMMA_TINY, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3_text": Family("gemma3", "Gemma3", rotary_by_layer_type=True, embed_scale=gemma_embed_scale,
                          tiny=_GEMMA_TINY),
    "falcon": Family("falcon", "Falcon", layer_prefix="transformer.h.{index}.",
                     embed_prefix="transformer.word_embeddings.", norm_prefix="transformer.ln_f.", norm="LayerNorm",
                     layer_call=call_falcon_layer, causal_skip=False, attention_per_session=False, refused={"alibi": True},
                     tiny={"num_kv_heads": 1, "multi_query": True, "parallel_attn": True, "alibi": False,
                           "new_decoder_architecture": False, "bias": False}),
}


def unsupported_family(model_type: object) -> str:
    """The line that refuses a model family, naming the supported ones (model dirs, `model tiny --arch`)."""
    return f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}"
