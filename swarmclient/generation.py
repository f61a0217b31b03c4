"""The decode loop: embed locally, run the blocks through a session, LM head and sampling locally.

It mirrors transformers' `generate` for left-padded batches (positions = cumsum(mask) - 1, finished rows
emit the pad token), so greedy output through the swarm equals `generate` token for token.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from swarmclient.penalties import History
from swarmclient.sampling import SamplingParams, sample_next, start_constraints, start_histories
from swarmnet.head import ClientHead, next_decode_inputs


class StepFn(Protocol):
    """(hidden [B,T,H], attention_mask [B,past+T], position_ids [B,T], keep_rows) -> hidden [B,T,H] after every block.

    keep_rows (optional): the session first keeps only these of its rows (B = len(keep_rows)).
    """

    def __call__(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 keep_rows: list[int] | None = None, /) -> torch.Tensor: ...


def prefill_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: cumsum(mask) - 1, pads at 0 (what `generate` does)."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def leading_padding(attention_mask: torch.Tensor) -> int:
    """How many leading columns of a batch's mask [B, L] no row attends to (L when none attends to any)."""
    attended = attention_mask.bool().any(dim=0).nonzero()
    return int(attended[0]) if len(attended) else attention_mask.shape[1]


TokenHook = Callable[..., "torch.Tensor | None"]
"""(step index, new token column [B][, TokenLogprobs]) -> optional bool mask [B] of rows that must stop now (e.g. a
stop string). The third argument is passed only when a row's SamplingParams asks for logprobs."""


@dataclass(frozen=True)
class TokenLogprobs:
    """One step's log-probabilities under the model's own distribution (the LM head's log-softmax, before temperature
    and top-p), per batch row: the chosen token's, and the `k` most likely tokens with theirs (k = the largest
    top_logprobs asked in the batch; a row asking fewer takes the first ones). Rows not in the session read 0."""

    chosen: torch.Tensor      # [B] float
    top_ids: torch.Tensor     # [B, k] long
    top_values: torch.Tensor  # [B, k] float


def step_logprobs(logits: torch.Tensor, sampled: torch.Tensor, rows: torch.Tensor, batch: int, k: int
                  ) -> TokenLogprobs:
    """TokenLogprobs of one step from the session rows' logits [R, V] and the tokens sampled from them [R]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    chosen, top_ids, top_values = torch.zeros(batch), torch.zeros(batch, k, dtype=torch.long), torch.zeros(batch, k)
    chosen[rows] = logprobs.gather(-1, sampled[:, None].long())[:, 0]
    top_ids[rows], top_values[rows] = top.indices, top.values
    return TokenLogprobs(chosen, top_ids, top_values)


@torch.inference_mode()
def generate_tokens(
    head: ClientHead,
    step: StepFn,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int | Sequence[int],
    params: list[SamplingParams],
    eos_token_ids: Collection[int],
    pad_token_id: int,
    on_token: TokenHook | None = None,
    shrink: bool = False,
    feed_argmax: bool = False,
) -> torch.Tensor:
    """New tokens [B, N]: N is at most the largest limit, and the loop stops once every row is finished.

    A row finishes at EOS, at its own `max_new_tokens` limit, or when `on_token` says so; after that it
    emits the pad token. With `shrink`, finished rows also leave the session (`keep_rows`), so the blocks stop
    computing them; without it they ride along as padding until the whole batch ends (`feed_argmax`: fed their
    greedy token, not the pad token, as the ring guesses it: servers/ring.py). When a row's params ask for logprobs,
    `on_token` also gets each step's TokenLogprobs.
    """
    wanted = [p.top_logprobs for p in params if p.top_logprobs is not None]
    top_k = max(wanted) if wanted else None
    batch = input_ids.shape[0]
    limits = torch.tensor([max_new_tokens] * batch if isinstance(max_new_tokens, int) else list(max_new_tokens))
    mask = attention_mask.long()
    positions = prefill_positions(mask)
    real_lengths = mask.sum(-1)
    eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
    unfinished = limits > 0
    rows = torch.arange(batch)  # the session's rows, as indices into the batch
    columns: list[torch.Tensor] = []
    histories: list[History | None] = []  # each row's tokens for its penalties, from the first step's vocabulary
    constraints = start_constraints(input_ids, params)  # each row's grammar matcher, past its earlier output
    hidden = step(head.embed(input_ids), mask, positions) if unfinished.any() else None
    for index in range(int(limits.max()) if batch else 0):
        assert hidden is not None
        logits = head.logits(hidden[:, -1:, :])[:, -1, :]
        histories = histories or start_histories(input_ids, attention_mask, params, logits.shape[-1])
        sampled = sample_next(logits, [params[r] for r in rows.tolist()], (real_lengths[rows] + index).tolist(),
                              [histories[r] for r in rows.tolist()],
                              [constraints[r] if unfinished[r] else None for r in rows.tolist()])
        token = torch.full((batch,), pad_token_id, dtype=torch.long)
        token[rows] = sampled
        token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
        columns.append(token)
        for row in unfinished.nonzero().flatten().tolist():  # what each row's penalties and grammar have seen
            for tracked in (histories[row], constraints[row]):
                if tracked is not None:
                    tracked.add(int(token[row]))
        unfinished &= ~torch.isin(token, eos) & (limits > index + 1)
        if on_token is not None:
            stop = on_token(index, token) if top_k is None else \
                on_token(index, token, step_logprobs(logits, sampled, rows, batch, top_k))
            if stop is not None:
                unfinished &= ~stop
        if not unfinished.any():
            break
        keep_rows = None
        if shrink and not bool(unfinished[rows].all()):
            kept = unfinished[rows].nonzero().flatten()
            rows, mask, positions, keep_rows = rows[kept], mask[kept], positions[kept], kept.tolist()
        mask, positions = next_decode_inputs(mask, positions)
        fed = token
        if feed_argmax:  # finished rows too (what they are fed changes no other row's tokens)
            fed = token.clone()
            fed[rows] = sampled
        embedded = head.embed(fed[rows][:, None])
        hidden = step(embedded, mask, positions) if keep_rows is None else step(embedded, mask, positions, keep_rows)
    if not columns:
        return input_ids.new_zeros(batch, 0)
    return torch.stack(columns, dim=1)
