"""Embedding a claimed batch of `/v1/embeddings` requests: no decoding, one stateless forward per micro-batch.

The requests (one per input of a line) are sorted by length and cut into micro-batches of at most `rows` inputs and
`tokens` padded tokens, `lanes` of them in flight at once; each goes through the swarm once
(DistributedModelForCausalLM.encode: embeddings, the blocks' `forward`, final norm and pooling), and its vectors,
truncated to the line's `dimensions` and normalized as the model says, are stored at once as completed requests
(`Finish`). A crash loses at most the micro-batches in flight: the requests already stored are done, the others
are claimed again.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch

from jobs.errors import LeaseLost
from jobs.models import Request
from jobs.worker.runner import RowResult, RowState, left_pad
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.pooling import finish
from swarmclient.verification_policy import VerificationTally

logger = logging.getLogger(__name__)
MAX_TOKENS_PER_FORWARD = 8192  # padded tokens of one micro-batch: its hidden states travel each hop at once
LANES = 2  # micro-batches in flight: what a server admits of one caller's forwards at once (--max-forwards-per-peer)

Finish = Callable[[dict[int, bytes]], set[int]]
"""Store {request id: embedding bytes} as completed, in one transaction; returns the ids that were still ours. It
raises JobCancelled (after storing) when the job is being cancelled."""


class EmbeddingRunner:
    """Runs one claimed batch of embeddings requests; `run()` stores each micro-batch as it is done.

    `rows` is what the batch runner's caller needs for a cancel: the requests not stored yet (nothing to keep)."""

    def __init__(self, model: DistributedModelForCausalLM, requests: list[Request], *, finish: Finish,
                 rows: int, tokens: int = MAX_TOKENS_PER_FORWARD, lanes: int = LANES,
                 verification: VerificationTally | None = None) -> None:
        self.model, self.requests, self.finish, self.lanes = model, requests, finish, max(1, lanes)
        self.verification = verification or VerificationTally()  # checked hops (docs/security.md "Checked outputs")
        self.max_rows, self.max_tokens = max(1, rows), max(1, tokens)
        self.rows = [RowState(r.id, [], []) for r in requests]

    def run(self) -> dict[int, RowResult]:
        """Embed and store every request; {} (nothing is left for the caller to complete). Raises JobCancelled,
        LeaseLost, swarm errors.

        `lanes` micro-batches are in flight at once (while one is on the second server, the next is on the first);
        each is stored here, in this thread, as soon as it is done."""
        groups = micro_batches(self.requests, self.max_rows, self.max_tokens)
        with ThreadPoolExecutor(max_workers=self.lanes, thread_name_prefix="swarmbatch-embed") as pool:
            futures = [pool.submit(self._vectors, group) for group in groups]
            try:
                for future in as_completed(futures):
                    stored = self._store(future.result())
                    self.rows = [row for row in self.rows if row.request_id not in stored]
            except BaseException:
                for future in futures:
                    future.cancel()  # the ones not started; those running end with their forward
                raise
        return {}

    def _vectors(self, group: list[Request]) -> dict[int, bytes]:
        """A micro-batch's embeddings, as stored (truncated to each line's dimensions, normalized as the model says)."""
        ids, mask = left_pad([list(r.prompt_ids) for r in group], self.model.pad_token_id)
        pooled = self.model.encode(ids, mask, verification=self.verification)
        pooling = self.model.pooling
        logger.info("Embedded %d inputs (%d tokens padded)", len(group), ids.numel())
        return {r.id: embedding_bytes(finish(pooled[row], pooling, r.body.get("dimensions")))
                for row, r in enumerate(group)}

    def _store(self, vectors: dict[int, bytes]) -> set[int]:
        owned = self.finish(vectors)
        lost = sorted(set(vectors) - owned)
        if lost:
            raise LeaseLost(f"requests {', '.join(map(str, lost))} were claimed by another worker")
        return owned


def micro_batches(requests: list[Request], rows: int, tokens: int) -> list[list[Request]]:
    """The requests by length, cut where a group would pass `rows` inputs or `tokens` padded tokens."""
    groups: list[list[Request]] = []
    for request in sorted(requests, key=lambda r: len(r.prompt_ids)):
        group = groups[-1] if groups else None
        if group is None or len(group) >= rows or (len(group) + 1) * len(request.prompt_ids) > tokens:
            groups.append([request])
        else:
            group.append(request)
    return groups


def embedding_bytes(vector: torch.Tensor) -> bytes:
    """A vector as stored: float32, little-endian."""
    return vector.detach().to(torch.float32).numpy().astype("<f4").tobytes()
