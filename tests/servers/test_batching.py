"""Server-side batching: merged decode steps equal each session run alone, in every family (the attention per session
on its own cache; Falcon's by a padded copy); `keep_rows` drops rows of a session."""
from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiers import process_fixture
from transformers import DynamicCache

from launch.local_swarm import LocalSwarm
from modelprep.tiny import TINY_ARCHS, write_tiny_model
from servers.batching import DecodeBatcher, run_merged
from servers.block_loading import load_span
from servers.counters import ServerCounters
from servers.span import BlockSpan, DecodeStep
from swarmclient.errors import InvalidRequest
from swarmclient.session import InferenceSession, ServerSession
from swarmclient.swarm import Swarm
from swarmnet.data_structures import RouteHop
from swarmnet.model_spec import ModelSpec

TOLERANCE = 1e-4


class Local:
    """One session's inputs and a local reference: random hidden states with left padding, decoded step by step."""

    def __init__(self, span: BlockSpan, batch: int, prompt: int, seed: int, start: int = 0, end: int = 6) -> None:
        self.span, self.start, self.end = span, start, end
        self.generator = torch.Generator().manual_seed(seed)
        self.hidden_size = span.spec.hidden_size
        self.mask = torch.ones(batch, prompt, dtype=torch.long)
        for row in range(batch):
            self.mask[row, : row % prompt] = 0  # row r has r pads on the left (a padded batch of prompts)
        self.caches = span.new_caches(start, end)

    def prefill(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompt step's (hidden, mask, positions)."""
        hidden = torch.randn(*self.mask.shape, self.hidden_size, generator=self.generator)
        return hidden, self.mask, (self.mask.cumsum(1) - 1).clamp(min=0)

    def decode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next one-token step's (hidden, mask, positions); the mask grows by one column."""
        positions = self.mask.sum(1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones(self.mask.shape[0], 1, dtype=torch.long)], 1)
        return torch.randn(self.mask.shape[0], 1, self.hidden_size, generator=self.generator), self.mask, positions

    def run(self, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step through the local span, alone, on this session's own reference caches."""
        return self.span(hidden, mask, positions, self.caches, self.start, self.end)


@pytest.fixture(scope="module")
def span(tiny_model: Path) -> BlockSpan:
    return load_span(ModelSpec.open(tiny_model), 0, 6)


@pytest.mark.parametrize("shapes", [[(1, 3), (2, 7), (3, 5)], [(3, 9), (1, 1)], [(2, 4), (2, 4)]],
                         ids=["three-sessions", "long-and-short", "same-length"])
def test_merged_decode_steps_equal_each_session_run_alone(span: BlockSpan, shapes: list[tuple[int, int]]) -> None:
    # Given sessions of batch 1-3 with prompts of different lengths, each prefilled alone
    sessions = [Local(span, batch, prompt, seed) for seed, (batch, prompt) in enumerate(shapes)]
    merged_caches = []
    for session in sessions:
        caches = span.new_caches(0, 6)
        span(*session.prefill(), caches)
        merged_caches.append(caches)
        session.caches = copy.deepcopy(caches)
    # When K decode steps run merged, and the same steps run alone
    for _ in range(5):
        inputs = [session.decode() for session in sessions]
        merged = run_merged(span, [DecodeStep(*step, caches) for step, caches in zip(inputs, merged_caches, strict=True)], 0, 6)
        alone = [session.run(*step) for session, step in zip(sessions, inputs, strict=True)]
        # Then every session's output and its cache are those of its own run
        for out, ref in zip(merged, alone, strict=True):
            assert out.shape == ref.shape and (out - ref).abs().max().item() <= TOLERANCE
    for session, caches in zip(sessions, merged_caches, strict=True):
        assert all(cache.get_seq_length() == session.mask.shape[1] for cache in caches)
        for mine, ref in zip(caches, session.caches, strict=True):
            assert (mine.layers[0].keys - ref.layers[0].keys).abs().max().item() <= TOLERANCE


def test_a_session_with_an_empty_cache_merges_with_a_long_one(span: BlockSpan) -> None:
    long, fresh = Local(span, 2, 6, seed=1), Local(span, 1, 1, seed=2)
    long_caches = span.new_caches(0, 6)
    span(*long.prefill(), long_caches)
    long.caches = copy.deepcopy(long_caches)
    fresh_step = (torch.randn(1, 1, span.spec.hidden_size), torch.ones(1, 1, dtype=torch.long),
                  torch.zeros(1, 1, dtype=torch.long))
    fresh_caches: list[DynamicCache] = span.new_caches(0, 6)
    long_step = long.decode()
    merged = run_merged(span, [DecodeStep(*long_step, long_caches), DecodeStep(*fresh_step, fresh_caches)], 0, 6)
    assert (merged[0] - long.run(*long_step)).abs().max().item() <= TOLERANCE
    assert (merged[1] - fresh.run(*fresh_step)).abs().max().item() <= TOLERANCE
    assert fresh_caches[0].get_seq_length() == 1 and long_caches[0].get_seq_length() == 7


def test_the_batcher_merges_concurrent_steps_up_to_the_row_limit(span: BlockSpan) -> None:
    async def step_all(batcher: DecodeBatcher, count: int) -> list[int]:
        sessions = [Local(span, 2, 3, seed) for seed in range(count)]
        steps = []
        for session in sessions:
            span(*session.prefill(), session.caches)
            steps.append(DecodeStep(*session.decode(), session.caches))
        results = await asyncio.gather(*(batcher.run(step, 0, 6, peers=count) for step in steps))
        return [merged for _, merged in results]

    stats = ServerCounters()
    assert asyncio.run(step_all(DecodeBatcher(span, wait_ms=1000, max_rows=64, stats=stats), 3)) == [3, 3, 3]
    assert (stats.merged_steps, stats.max_merged, stats.merged_rows) == (1, 3, 6)
    # 2 rows a session and at most 4 rows a forward: pairs
    assert asyncio.run(step_all(DecodeBatcher(span, wait_ms=1000, max_rows=4, stats=ServerCounters()), 3)) == [2, 2, 1]
    assert asyncio.run(step_all(DecodeBatcher(span, wait_ms=0, max_rows=64, stats=ServerCounters()), 3)) == [1, 1, 1]
    # sessions caching 2 x 3 tokens each, above a merge limit of 5: merged all the same, as nothing is copied
    assert span.merges_per_session
    long = DecodeBatcher(span, wait_ms=1000, max_rows=64, stats=ServerCounters(), max_merge_tokens=5)
    assert asyncio.run(step_all(long, 3)) == [3, 3, 3]


def test_copy_merging_families_run_sessions_above_the_merge_limit_alone(tmp_path: Path) -> None:
    # Falcon's attention does not go through transformers' registry: merging copies the caches, so it has a limit
    model = write_tiny_model(tmp_path / "falcon", layers=2, arch="falcon", seed=2)
    falcon = load_span(ModelSpec.open(model), 0, 2)
    assert not falcon.merges_per_session
    sessions = [Local(falcon, 2, 3, seed, end=2) for seed in range(3)]
    steps = []
    for session in sessions:
        falcon(*session.prefill(), session.caches)
        steps.append(DecodeStep(*session.decode(), session.caches))

    async def step_all(batcher: DecodeBatcher) -> list[int]:
        return [merged for _, merged in await asyncio.gather(*(batcher.run(step, 0, 2, peers=3) for step in steps))]

    # 2 rows x 3 tokens each, above a limit of 5: each runs alone, without waiting
    assert asyncio.run(step_all(DecodeBatcher(falcon, wait_ms=1000, max_rows=64, stats=ServerCounters(),
                                              max_merge_tokens=5))) == [1, 1, 1]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_merged_steps_equal_each_session_alone_in_every_family(arch: str, tmp_path: Path) -> None:
    # Given a tiny model of the family (Gemma's sliding window is 8 tokens), and three sessions: a padded one, a long
    # one past the window, and one whose first step is a single token on empty caches
    model = write_tiny_model(tmp_path / arch, layers=3, arch=arch, seed=4)
    family_span = load_span(ModelSpec.open(model), 0, 3)
    sessions = [Local(family_span, batch, prompt, seed, end=3) for seed, (batch, prompt) in
                enumerate([(3, 5), (2, 12), (1, 1)])]
    merged_caches = []
    for session in sessions[:2]:
        caches = family_span.new_caches(0, 3)
        family_span(*session.prefill(), caches)
        merged_caches.append(caches)
        session.caches = copy.deepcopy(caches)
    merged_caches.append(family_span.new_caches(0, 3))
    fresh = sessions[2]
    fresh.mask = fresh.mask[:, :0]  # its first decode step is its first token
    # When 10 decode steps run merged, and the same steps run alone
    for _ in range(10):
        inputs = [session.decode() for session in sessions]
        merged = run_merged(family_span, [DecodeStep(*step, caches) for step, caches
                                          in zip(inputs, merged_caches, strict=True)], 0, 3)
        alone = [session.run(*step) for session, step in zip(sessions, inputs, strict=True)]
        # Then every session's output is its own run's
        for out, ref in zip(merged, alone, strict=True):
            assert out.shape == ref.shape and (out - ref).abs().max().item() <= TOLERANCE, arch
    # and so is every session's cache, its length included
    for session, caches in zip(sessions, merged_caches, strict=True):
        for mine, ref in zip(caches, session.caches, strict=True):
            assert mine.get_seq_length() == ref.get_seq_length() == session.mask.shape[1]
            assert (mine.layers[0].keys - ref.layers[0].keys).abs().max().item() <= TOLERANCE


# ---- through a real server process --------------------------------------------------------------------------------
@process_fixture(scope="module")
def server_and_client(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, Swarm]]:
    spec = ModelSpec.open(tiny_model)
    # a wide wait window: merging must not depend on this shared machine's timing
    with LocalSwarm(tiny_model, [], log_dir=tmp_path_factory.mktemp("batching")) as swarm:
        swarm.start_servers([(0, 6, ["--batch-wait-ms", "200", "--max-batch-size", "8"])])
        client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
        try:
            yield swarm, client
        finally:
            client.close()


def test_concurrent_sessions_on_a_server_are_merged_and_match_local_blocks(
        span: BlockSpan, server_and_client: tuple[LocalSwarm, Swarm]) -> None:
    swarm, client = server_and_client
    peer = swarm.servers[0].peer_id
    shapes = [(1, 3), (2, 8), (3, 5)]
    locals_ = [Local(span, batch, prompt, seed) for seed, (batch, prompt) in enumerate(shapes)]
    remotes = [ServerSession(client, RouteHop(peer, 0, 6), batch_size=batch, max_length=32) for batch, _ in shapes]

    async def run() -> list[int]:
        await asyncio.gather(*(remote.open() for remote in remotes))
        merged_counts = []
        try:
            for step in range(6):
                inputs = [local.prefill() if step == 0 else local.decode() for local in locals_]
                outputs = await asyncio.gather(*(remote.step(*x) for remote, x in zip(remotes, inputs, strict=True)))
                for local, x, output in zip(locals_, inputs, outputs, strict=True):
                    assert (output - local.run(*x)).abs().max().item() <= TOLERANCE
                merged_counts.append(max(remote.last_merged for remote in remotes))
        finally:
            await asyncio.gather(*(remote.close() for remote in remotes))
        return merged_counts

    merged_counts = client.loop.run(run())
    info = client.loop.run(client.call_info(peer))
    assert merged_counts[0] == 1, "prefills are never merged"
    assert merged_counts[1:] == [3] * 5, merged_counts
    assert info["merged_steps"] >= 5 and info["max_merged"] == 3


KEEP = [0, 2]  # row 1's request finished after the third step


def step_dropping_row_1(session: InferenceSession, full: Local, step: int, reference: list[DynamicCache]) -> float:
    """Step `step` of a 3-row session whose row 1 leaves at step 3; returns max |kept rows - rows 0, 2 alone|."""
    hidden, mask, positions = full.prefill() if step == 0 else full.decode()
    sent = KEEP if step >= 3 else [0, 1, 2]
    output = session.step(hidden[sent], mask[sent], positions[sent], keep_rows=KEEP if step == 3 else None)
    expected = full.span(hidden[KEEP], mask[KEEP], positions[KEEP], reference)
    return (output[[sent.index(row) for row in KEEP]] - expected).abs().max().item()


def test_keep_rows_drops_rows_and_the_rest_equal_a_run_without_them(
        span: BlockSpan, server_and_client: tuple[LocalSwarm, Swarm]) -> None:
    _, client = server_and_client
    full, reference = Local(span, 3, 6, seed=7), span.new_caches(0, 6)
    with InferenceSession(client, batch_size=3, max_length=32) as session:
        diffs = [step_dropping_row_1(session, full, step, reference) for step in range(6)]
        assert max(diffs) <= TOLERANCE, diffs
        assert session.batch_size == 2
        with pytest.raises(InvalidRequest, match="keep_rows"):  # checked before anything is sent
            session.step(*full.decode(), keep_rows=[1, 0])


def test_a_bad_keep_rows_is_refused_in_band_and_the_session_goes_on(
        span: BlockSpan, server_and_client: tuple[LocalSwarm, Swarm]) -> None:
    swarm, client = server_and_client
    local = Local(span, 2, 4, seed=3)
    remote = client.loop.run(ServerSession(client, RouteHop(swarm.servers[0].peer_id, 0, 6), batch_size=2,
                                           max_length=16).open())
    prefill = local.prefill()
    client.loop.run(remote.step(*prefill))
    local.run(*prefill)
    one_row = [torch.zeros(1, 1, span.spec.hidden_size), torch.ones(1, 5, dtype=torch.long), torch.tensor([[4]])]
    for bad in ([2], [1, 1], [], [1, 0]):
        with pytest.raises(InvalidRequest, match="keep_rows"):
            client.loop.run(remote.step(*one_row, keep_rows=bad))
    step = local.decode()
    output = client.loop.run(remote.step(*step))
    assert (output - local.run(*step)).abs().max().item() <= TOLERANCE
    client.loop.run(remote.close())


def test_a_replay_after_a_server_dies_drops_the_same_rows(tiny_model: Path, span: BlockSpan, local_swarm) -> None:
    # Given two servers with all blocks, and a session that dropped row 1 at step 3
    swarm = local_swarm(tiny_model, [(0, 6), (0, 6)])
    by_peer = {server.peer_id: server for server in swarm.servers}
    spec = ModelSpec.open(tiny_model)
    client = Swarm.connect(swarm.initial_peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
    full, reference = Local(span, 3, 6, seed=11), span.new_caches(0, 6)
    try:
        with InferenceSession(client, batch_size=3, max_length=32) as session:
            diffs = [step_dropping_row_1(session, full, step, reference) for step in range(5)]
            # When the server in use is killed -9
            victim = session.route[0].peer_id
            by_peer[victim].kill()
            diffs += [step_dropping_row_1(session, full, step, reference) for step in range(5, 8)]
            route_after = session.route
    finally:
        client.close()
    # Then the other server got the history replayed, row selection included, and the outputs go on unchanged
    assert session.failovers == 1 and route_after[0].peer_id != victim
    assert max(diffs) <= TOLERANCE, diffs
