"""The decode loop: embed locally, run the blocks through a session, LM head and sampling locally.

It mirrors transformers' `generate` for left-padded batches (positions = cumsum(mask) - 1, finished rows
emit the pad token), so greedy output through the swarm equals `generate` token for token.
"""
from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from swarmclient.head import ClientHead
from swarmclient.sampling import SamplingParams, sample_next

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(hidden [B,T,H], attention_mask [B,past+T], position_ids [B,T]) -> hidden [B,T,H] after every block."""


def prefill_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: cumsum(mask) - 1, pads at 0 (what `generate` does)."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


@torch.inference_mode()
def generate_tokens(
    head: ClientHead,
    step: StepFn,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    params: list[SamplingParams],
    eos_token_ids: Collection[int],
    pad_token_id: int,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """New tokens [B, N] (N <= max_new_tokens; stops when every row has hit EOS); `on_token` sees each column."""
    mask = attention_mask.long()
    positions = prefill_positions(mask)
    real_lengths = mask.sum(-1)
    hidden = step(head.embed(input_ids), mask, positions)
    eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool)
    columns: list[torch.Tensor] = []
    for index in range(max_new_tokens):
        logits = head.logits(hidden[:, -1:, :])[:, -1, :]
        token = sample_next(logits, params, (real_lengths + index).tolist())
        token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
        columns.append(token)
        if on_token is not None:
            on_token(token)
        unfinished &= ~torch.isin(token, eos)
        if not unfinished.any() or index == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        positions = positions[:, -1:] + 1
        hidden = step(head.embed(token[:, None]), mask, positions)
    if not columns:
        return input_ids.new_zeros(input_ids.shape[0], 0)
    return torch.stack(columns, dim=1)
