"""A merged decode step's attention: one forward for the linear layers of all sessions' rows, the attention per session
on its own cache (no copy).

Merging sessions' decode steps (batching.py) pays where a forward's cost is in the blocks' linear layers: they run once
for every merged row, reading each weight once. The attention is the part that differs per session (its own cached
past, its own length and mask). The span's layers are built with a config naming `ATTENTION_PREFIX + <the family's
implementation>`, registered here in transformers' attention registry: called without `merged_sessions` it is the
family's own function, unchanged; called with it (a `MergedLayerCache`, passed as the layer's cache too) it runs the
family's function once per session on that session's queries and its own cache's keys and values, and stacks the
outputs. The cache's `update` appends each session's new keys and values to its own cache in place (kv_cache.py), as a
forward of its own would; the merged step copies no cached past, so sessions of any length merge.

Families whose attention does not go through the registry (Falcon) keep the padded-copy merge (batching.py).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION_PREFIX = "swarmbatch_merged_"
RowBounds = list[tuple[int, int]]


class MergedLayerCache:
    """One layer's view of a merged step: the merged sessions' own one-layer caches, their row bounds in the merged
    batch, and each one's attention mask for this layer (None: no mask needed)."""

    def __init__(self, caches: list[DynamicCache], bounds: RowBounds, masks: list[Any]) -> None:
        self.caches, self.bounds, self.masks = caches, bounds, masks
        self.keys_values: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each session's rows of the step's keys and values to its own cache; the merged attention reads the
        full ones back from `keys_values`. Returns the step's own keys and values (what the layer hands on)."""
        self.keys_values = [cache.update(key_states[low:high], value_states[low:high], 0)
                            for cache, (low, high) in zip(self.caches, self.bounds, strict=True)]
        return key_states, value_states


def merged_attention(inner: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The family's attention function `inner`, run per session when the call carries `merged_sessions`."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *, merged_sessions: MergedLayerCache | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if merged_sessions is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        outputs = [inner(module, query[low:high], keys, values, mask, **kwargs)[0]
                   for (low, high), (keys, values), mask
                   in zip(merged_sessions.bounds, merged_sessions.keys_values, merged_sessions.masks, strict=True)]
        return torch.cat(outputs), None  # [rows, T, heads, head_dim]: the layer reshapes it for its output projection

    return attention


def merged_attention_config(config: Any, family_module: str, eager: Callable[..., tuple[torch.Tensor, Any]]) -> Any:
    """A shallow copy of `config` whose attention dispatch goes through `merged_attention` around the family's own
    function (`eager`: the family module's eager_attention_forward, which transformers uses for "eager"; the name
    registered is per family, as each family has its own eager function). Masks are still built from the original
    config (span.py): they key on the family's implementation name."""
    name = config._attn_implementation
    merged_name = f"{ATTENTION_PREFIX}{family_module}_{name}"
    if merged_name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(merged_name, merged_attention(ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)))
    layers_config = copy.copy(config)
    layers_config._attn_implementation = merged_name
    return layers_config
