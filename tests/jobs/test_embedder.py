"""How an embeddings batch is cut into forwards, and how a vector is stored (pure: no swarm)."""
from __future__ import annotations

import struct
from collections.abc import Callable

import torch

from jobs.models import Request
from jobs.runtime import Runtime
from jobs.worker.embedder import embedding_bytes, micro_batches


def requests(*lengths: int) -> list[Request]:
    return [Request(id=i, prompt_ids=list(range(n))) for i, n in enumerate(lengths)]


def test_micro_batches_group_similar_lengths_within_the_row_and_padded_token_bounds() -> None:
    groups = micro_batches(requests(30, 2, 3, 2, 29, 31), rows=3, tokens=64)
    assert [[r.id for r in group] for group in groups] == [[1, 3, 2], [4, 0], [5]]
    assert all(len(g) <= 3 and len(g) * max(len(r.prompt_ids) for r in g) <= 64 for g in groups)


def test_an_input_longer_than_the_token_bound_still_gets_a_forward_of_its_own() -> None:
    assert [[r.id for r in g] for g in micro_batches(requests(5, 100), rows=8, tokens=64)] == [[0], [1]]


def test_a_vector_is_stored_as_its_float32_little_endian_bytes() -> None:
    vector = torch.tensor([0.5, -1.25, 3.0], dtype=torch.float64)
    assert struct.unpack("<3f", embedding_bytes(vector)) == (0.5, -1.25, 3.0)


def test_a_stored_micro_batch_stays_done_and_only_the_unfinished_inputs_are_claimed_again(
        make_runtime: Callable[..., Runtime]) -> None:
    from jobs import store
    from jobs.batch_input import EMBEDDINGS_URL, ParsedBatch, ParsedRequest
    from jobs.models import RequestStatus
    from jobs.outputs import job_public
    from jobs.worker.job_worker import JobWorker

    # Given an embeddings job of one line with three inputs, all claimed by a worker
    runtime = make_runtime()
    line = ParsedRequest(1, "e", EMBEDDINGS_URL, {"input": ["a", "b c", "d"]}, [5], 0, 0.0, 1.0, 0, [], n=3,
                         inputs=[[5], [6, 7], [8]])
    with runtime.session() as session:
        job = store.create_job(session=session, parsed=ParsedBatch([line], [], EMBEDDINGS_URL), model="tiny")
        token, claimed = store.claim_requests(session=session, job_id=job.id, worker="w", limit=3, lease_seconds=60,
                                              max_attempts=3)
        session.commit()
        job_id = job.id
    # When the worker stores its first micro-batch (two inputs), then dies: its leases are given back
    stored = JobWorker(runtime)._embedded(job_id, token)({claimed[0].id: embedding_bytes(torch.ones(2)),
                                                          claimed[1].id: embedding_bytes(torch.zeros(2))})
    with runtime.session() as session:
        store.release_requests(session=session, token=token, error="worker died")
        session.commit()
    # Then the two are completed with their vectors, and only the third is claimed again
    assert stored == {claimed[0].id, claimed[1].id}
    with runtime.session() as session:
        _, again = store.claim_requests(session=session, job_id=job_id, worker="w2", limit=3, lease_seconds=60,
                                        max_attempts=3)
        assert [r.id for r in again] == [claimed[2].id]
        done = {r.id: (r.status, r.embedding) for r in session.get(type(job), job_id).requests}  # type: ignore[union-attr]
        assert done[claimed[0].id] == (RequestStatus.completed, embedding_bytes(torch.ones(2)))
        # and the batch's usage counts the stored inputs' tokens as input (1 + 2), no output
        usage = job_public(session=session, job=session.get(type(job), job_id))["usage"]  # type: ignore[arg-type]
        assert (usage["input_tokens"], usage["output_tokens"]) == (3, 0)
