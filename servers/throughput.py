"""Measuring a span's decode speed at start-up, so clients can route by estimated time."""
from __future__ import annotations

import os
import time

import torch

from servers.span import BlockSpan


@torch.inference_mode()
def measure_throughput(span: BlockSpan, *, steps: int = 4, context: int = 32) -> float:
    """Block-steps per second: how many (block x batch-1 decode step) units this span computes per second."""
    hidden_size = span.spec.hidden_size
    caches = span.new_caches(span.start, span.end)
    prompt = torch.zeros(1, context, hidden_size)
    mask = torch.ones(1, context, dtype=torch.long)
    span(prompt, mask, torch.arange(context)[None], caches)
    began = time.perf_counter()
    for step in range(steps):
        mask = torch.ones(1, context + step + 1, dtype=torch.long)
        span(torch.zeros(1, 1, hidden_size), mask, torch.tensor([[context + step]]), caches)
    seconds = (time.perf_counter() - began) / steps
    return (span.end - span.start) / max(seconds, 1e-6) * overstatement()


# TEST ONLY: a server that lies about its speed. Its record and its `info` answer then overstate its throughput by
# this factor (below 1: understate it), so tests can check that clients route by what they measure (docs/swarm.md,
# "Routing") and make a route's choice independent of the round trips a loaded machine measures.
# Never set it in a deployment.
TEST_OVERSTATE_ENV = "SWARMBATCH_TEST_OVERSTATE_THROUGHPUT"


def overstatement() -> float:
    """The factor of TEST_OVERSTATE_ENV (1 when unset)."""
    return float(os.environ.get(TEST_OVERSTATE_ENV) or 1.0)
