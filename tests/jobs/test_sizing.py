"""How a worker sizes its batch: the claim and the lanes, from the chain's room, the next requests and its share."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from factories import span

from jobs.backends import StoreBackend
from jobs.progress import describe_job
from jobs.runtime import Runtime
from jobs.submission import submit_batch
from jobs.worker.job_worker import JobWorker
from jobs.worker.sizing import (
    CLAIM_AHEAD,
    MAX_CLAIM,
    ChainRoom,
    PipelinePlan,
    caller_cache_tokens,
    caller_ceiling,
    lane_reservation,
    plan_pipeline,
    rows_that_fit,
)


def room(*, rows: int = 64, cache: int = 100_000, sessions: int = 16, compute: tuple[float, ...] = (0.03, 0.03),
         rtt: float = 0.002) -> ChainRoom:
    return ChainRoom(rows_per_session=rows, cache_tokens=cache, sessions=sessions, compute_seconds=compute,
                     rtt_seconds=(rtt,) * len(compute))


def test_a_lane_reserves_its_rows_times_its_longest_row() -> None:
    # rows sorted by length and split like the runner splits them: [100, 100] and [300, 500]
    assert lane_reservation([500, 100, 300, 100], 2) == 2 * 100 + 2 * 500
    assert lane_reservation([500, 100, 300, 100], 1) == 4 * 500
    assert lane_reservation([], 4) == 0


def test_the_claim_is_the_most_leading_rows_whose_lanes_fit_the_cache_share_twice() -> None:
    # as many rows as run at once in the share, and as many again waiting to start as lanes finish
    sizes = [300] * 40
    assert rows_that_fit(sizes, 4, 3000) == 10
    plan = plan_pipeline(room(cache=3000), sizes, share=40)
    assert (plan.claim, plan.bound) == (CLAIM_AHEAD * 10, "bound: cache share")
    assert lane_reservation(sizes[:plan.claim], plan.lanes) <= CLAIM_AHEAD * 3000
    assert plan.cache_tokens == 3000  # what the runner lets run at once


def test_a_small_max_batch_size_bounds_the_claim_to_lanes_times_it() -> None:
    plan = plan_pipeline(room(rows=2), [50] * 64, share=64)
    assert plan.claim == plan.lanes * 2
    assert plan.bound == "bound: max batch size"


def test_the_claim_never_exceeds_the_fair_share_or_the_open_requests() -> None:
    assert plan_pipeline(room(), [50] * 64, share=32).claim == 32
    assert plan_pipeline(room(), [50] * 5, share=64).claim == 5
    assert plan_pipeline(room(rows=1000, cache=10**9), [1] * 1000, share=1000).claim == MAX_CLAIM


def test_even_one_row_that_does_not_fit_is_claimed_alone() -> None:
    # the servers decide: a row bigger than the record's free cache is tried once, alone (the runner backs off)
    plan = plan_pipeline(room(cache=100), [500, 500], share=2)
    assert (plan.claim, plan.lanes) == (1, 1)


def test_lanes_cover_the_chain_step_time_over_its_slowest_hop() -> None:
    # two equal hops on a LAN: a lane per hop (plus the round trips' share), plus one for the client
    assert plan_pipeline(room(compute=(0.03, 0.03)), [10] * 64, share=64).lanes == 4
    # one slow hop among fast ones: the fast ones wait on it anyway
    assert plan_pipeline(room(compute=(0.09, 0.01, 0.01)), [10] * 64, share=64).lanes == 3
    # far servers (50 ms round trips, 10 ms of compute per hop): more lanes hide the round trips, as many as the
    # caps allow while each lane keeps 16 rows (smaller lanes cost more CPU per token than the latency they hide)
    assert plan_pipeline(room(compute=(0.01, 0.01), rtt=0.05), [10] * 128, share=128).lanes == 8
    assert plan_pipeline(room(compute=(0.01, 0.01), rtt=0.05), [10] * 64, share=64).lanes == 4
    # but never fewer than keep the servers and the client busy (a hop each, plus one), however few the rows
    assert plan_pipeline(room(compute=(0.01, 0.01), rtt=0.05), [10] * 20, share=20).lanes == 3
    # and the rows that fit the cache at once count, not those claimed ahead to wait: 40 of 10 tokens fit 400
    assert plan_pipeline(room(compute=(0.01, 0.01), rtt=0.05, cache=400), [10] * 128, share=128).lanes == 3
    # and never more than the per-caller session limit allows (each lane may hold two sessions during a failover)
    assert plan_pipeline(room(sessions=4, compute=(0.01,) * 6), [10] * 64, share=64).lanes == 2


def test_the_cache_a_caller_may_take_is_the_servers_answer_now_else_its_record() -> None:
    # a record announced while this worker's last batch held the cache says little is left; the answer says now
    record = span("QmServer", 0, 6, cache_tokens_left=100, cache_tokens_per_peer=800)
    assert caller_cache_tokens(record, {"cache_tokens_for_caller": 1600}) == 1600
    # a server of an older version (no such field), a malformed answer, or a failed call: the record's figures
    for answer in ({}, {"cache_tokens_for_caller": True}, {"cache_tokens_for_caller": -1}, TimeoutError()):
        assert caller_cache_tokens(record, answer) == 100
    assert caller_cache_tokens(span("QmServer", 0, 6, cache_tokens_left=900), {}) == 900  # no share announced


def test_the_ceiling_is_per_block_the_most_generous_holder_and_over_blocks_the_least() -> None:
    spans = [span("QmA", 0, 3, cache_tokens_most_per_peer=100), span("QmB", 0, 6, cache_tokens_most_per_peer=40),
             span("QmC", 3, 6, cache_tokens_most_per_peer=70)]
    assert caller_ceiling(spans, 6) == 70  # blocks 0:3 grant 100 (A), blocks 3:6 grant 70 (C)
    assert caller_ceiling(spans[:2], 6) == 40  # without C, B alone holds 3:6
    assert caller_ceiling(spans[:1], 6) is None  # 3:6 has no server: routing says so, not the ceiling
    assert caller_ceiling([*spans, span("QmOld", 3, 6)], 6) is None  # an older server that does not say may grant more
    assert plan_pipeline(ChainRoom(8, 100, 16, (0.03,), (0.002,), ceiling=70), [10], share=4).ceiling == 70


def test_explicit_settings_win() -> None:
    plan = plan_pipeline(room(rows=2, cache=100), [500] * 64, share=1, claim=48, lanes=6)
    assert (plan.claim, plan.lanes, plan.bound) == (48, 6, "set")
    # lanes set alone win too, even where the sizing would run fewer, fuller ones (20 rows: 3 lanes)
    assert plan_pipeline(room(compute=(0.01, 0.01), rtt=0.05), [10] * 20, share=20, lanes=6).lanes == 6
    assert plan.cache_tokens == 100  # the runner still starts lanes only as the cache allows


def test_without_the_swarm_figures_the_claim_is_small() -> None:
    plan = plan_pipeline(None, [10] * 64, share=64)
    assert plan.claim == 8 and plan.cache_tokens is None
    assert plan_pipeline(None, [10] * 64, share=64, claim=20).claim == 20


def test_status_shows_the_batch_each_worker_sized_while_the_job_runs(make_runtime: Callable[..., Runtime],
                                                                      tiny_model: Path) -> None:
    # Given a job, and a worker that claimed a batch of it with a plan bounded by the cache share
    runtime = make_runtime(broker_url="memory://")
    lines = [json.dumps({"custom_id": name, "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "Hello", "max_tokens": 4}}) for name in "ab"]
    job = submit_batch(runtime, "\n".join(lines).encode(), model=str(tiny_model))
    plan = PipelinePlan(claim=2, lanes=2, max_lanes=8, cache_tokens=100, bound="bound: cache share")
    claim = JobWorker(runtime)._claim(job.id, "token-1", plan)
    assert claim is not None and len(claim.requests) == 2
    # Then `status` says which worker runs how much, and why that much
    shown = describe_job(StoreBackend(runtime).get(job.id))
    assert f"{runtime.worker_name}: claim 2 in 2 lanes (bound: cache share)" in shown, shown
