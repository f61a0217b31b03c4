"""Generating a claimed batch of requests through the swarm, committing new token ids every K tokens.

A request resumes from its committed `generated_ids`: prompt + committed tokens are prefilled, and sampling
is seeded by absolute position, so the continuation equals an uninterrupted run.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from jobs.errors import LeaseLost
from jobs.models import Request
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.sampling import SamplingParams

logger = logging.getLogger(__name__)

Checkpoint = Callable[[dict[int, list[int]], dict[int, str]], set[int]]
"""Commit {request id: all generated ids} and their texts; returns the ids still leased to us.

It raises JobCancelled to stop the batch."""


@dataclass
class RowState:
    """One request's progress inside a batch."""

    request_id: int
    generated: list[int]
    stop: list[str]
    finish_reason: str | None = None
    committed: int = 0
    text: str = ""
    fresh: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RowResult:
    """How a request ended in this batch."""

    generated: list[int]
    finish_reason: str
    text: str


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), left padded."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids, mask


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in `text`, if any."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


class BatchRunner:
    """Runs one claimed batch; `run()` returns {request id: RowResult} for the rows that finished."""

    def __init__(self, model: DistributedModelForCausalLM, tokenizer: Any, requests: list[Request], *,
                 checkpoint_every: int, checkpoint: Checkpoint) -> None:
        self.model, self.tokenizer, self.requests = model, tokenizer, requests
        self.checkpoint_every, self.checkpoint = checkpoint_every, checkpoint
        self.rows = [RowState(r.id, list(r.generated_ids), list(r.stop), committed=len(r.generated_ids))
                     for r in requests]

    def run(self) -> dict[int, RowResult]:
        """Generate until every row ends; raises JobCancelled if the job is cancelled meanwhile."""
        for row, request in zip(self.rows, self.requests):
            if row.generated:
                logger.info("Request %s resumes at token %d", request.id, len(row.generated))
            self._check_finished(row, request)
        todo = [(row, req) for row, req in zip(self.rows, self.requests) if row.finish_reason is None]
        if todo:
            self._generate([row for row, _ in todo], [req for _, req in todo])
        self._commit(force=True)
        return {row.request_id: RowResult(row.generated, row.finish_reason or "length", row.text) for row in self.rows}

    def _generate(self, rows: list[RowState], requests: list[Request]) -> None:
        ids, mask = left_pad([list(r.prompt_ids) + row.generated for row, r in zip(rows, requests)],
                             self.model.pad_token_id)
        limits = [r.max_tokens - len(row.generated) for row, r in zip(rows, requests)]
        params = [SamplingParams(temperature=r.temperature, top_p=r.top_p, seed=r.seed) for r in requests]

        def on_token(index: int, column: torch.Tensor) -> torch.Tensor:
            stop = torch.zeros(len(rows), dtype=torch.bool)
            for b, (row, request) in enumerate(zip(rows, requests)):
                if row.finish_reason is None:
                    row.generated.append(int(column[b]))
                    stop[b] = self._check_finished(row, request)
            logger.debug("step %d: %s", index, " ".join(f"{row.request_id}={len(row.generated)}" for row in rows))
            if (index + 1) % self.checkpoint_every == 0:
                self._commit()
            return stop

        self.model.generate_new_tokens(ids, mask, max_new_tokens=limits, params=params, on_token=on_token)

    def _check_finished(self, row: RowState, request: Request) -> bool:
        """Whether the row just ended (EOS, stop string or max_tokens); sets its finish reason and text."""
        if row.finish_reason is not None:
            return True
        eos = bool(row.generated) and row.generated[-1] in self.model.eos_token_ids
        full = len(row.generated) >= request.max_tokens
        if not (row.stop or eos or full):
            return False  # decoding is only needed to look for stop strings or to finish
        row.text = self.tokenizer.decode(row.generated, skip_special_tokens=True)
        cut = find_stop(row.text, row.stop)
        if cut is not None:
            row.text, row.finish_reason = row.text[:cut], "stop"
        elif eos or full:
            row.finish_reason = "stop" if eos else "length"
        return row.finish_reason is not None

    def _text(self, row: RowState) -> str:
        """The row's output text so far (cut at a stop string once finished)."""
        if row.finish_reason is not None or row.stop:
            return row.text  # _check_finished decoded it at this very step
        return str(self.tokenizer.decode(row.generated, skip_special_tokens=True))

    def _commit(self, *, force: bool = False) -> None:
        """Checkpoint rows that gained tokens; drop rows whose lease we lost."""
        progress = {row.request_id: row.generated for row in self.rows if len(row.generated) > row.committed}
        if not progress and not force:
            return
        texts = {rid: self._text(row) for row in self.rows if (rid := row.request_id) in progress}
        owned = self.checkpoint(progress, texts)
        for row in self.rows:
            if row.request_id in progress:
                if row.request_id not in owned:
                    raise LeaseLost(f"request {row.request_id} was claimed by another worker")
                row.committed = len(row.generated)
