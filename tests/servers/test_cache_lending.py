"""A caller alone on a server may borrow past its cache share (all but a reserve); a newcomer's first sessions find
room in the reserve at once; once another caller is refused room, each is held to its share again, nothing already
running is taken back, and the refused caller gets its share as sessions end.

What was lent is given back once another caller waits: the borrower's sessions over its share are ended
(`busy`) after `--lent-cache-grace`, and its client replays them on another server.

The budget's rules with a fake clock, then real servers and two real clients (two peers).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server_calls import eventually, info, inputs, session, two_clients
from tiers import process_fixture

from launch.local_swarm import LocalSwarm
from servers.errors import RequestRejected
from servers.memory import CONTENTION_SECONDS, LENDING_RESERVE, CacheBudget
from swarmclient.errors import PeerFailed
from swarmclient.session import InferenceSession
from swarmclient.swarm import Swarm
from swarmnet.protocol import ErrorCode


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lending_budget(clock: Clock, *, lend: bool = True) -> CacheBudget:
    """100 tokens per block over 1 block; a caller's share: 50; lent to a caller alone: 75 (a reserve of 25)."""
    return CacheBudget(100, 1, owner_share=0.5, lend=lend, clock=clock)


def reserve(budget: CacheBudget, session_id: str, owner: str, tokens: int) -> None:
    budget.reserve(session_id, owner=owner, batch_size=1, max_length=tokens, num_blocks=1)


def refused(budget: CacheBudget, owner: str, tokens: int) -> ErrorCode:
    with pytest.raises(RequestRejected) as caught:
        reserve(budget, "refused", owner, tokens)
    return caught.value.code


def test_a_caller_alone_borrows_all_but_the_reserve_and_says_so_in_the_record() -> None:
    budget = lending_budget(Clock())
    assert LENDING_RESERVE == 0.25
    assert budget.use().tokens_per_caller == 75 and budget.tokens_for("a") == 75
    reserve(budget, "a1", "a", 45)
    reserve(budget, "a2", "a", 30)  # 75: half as much again as its share
    assert budget.tokens_for("a") == 0 and budget.use().tokens_per_caller == 75
    assert refused(budget, "a", 1) == ErrorCode.BUSY  # the reserve is not lent
    # a newcomer's session fits in the reserve at once; the borrower is then no longer alone: no more lending to it
    reserve(budget, "b1", "b", 20)
    assert budget.use().tokens_per_caller == 50 and budget.tokens_for("b") == 5


def test_the_most_a_caller_could_ever_hold_is_what_it_is_lent_alone_or_else_its_share() -> None:
    lending = CacheBudget(1000, 10, owner_share=0.5, lend=True)
    assert lending.use().most_per_caller == 1000 - int(1000 * LENDING_RESERVE)
    lending.reserve("a", owner="other", batch_size=1, max_length=100, num_blocks=10)
    assert lending.use().most_per_caller == 750, "the ceiling does not move with who holds cache now"
    assert CacheBudget(1000, 10, owner_share=0.5, lend=False).use().most_per_caller == 500


def test_without_lending_a_caller_alone_is_held_to_its_share() -> None:
    budget = lending_budget(Clock(), lend=False)
    reserve(budget, "a1", "a", 50)
    assert refused(budget, "a", 1) == ErrorCode.BUSY
    assert budget.use().tokens_per_caller == 50 and budget.tokens_for("b") == 50


def test_a_caller_is_lent_nothing_past_its_share_while_another_holds_cache() -> None:
    budget = lending_budget(Clock())
    reserve(budget, "b1", "b", 5)
    reserve(budget, "a1", "a", 50)
    assert refused(budget, "a", 1) == ErrorCode.BUSY  # 45 are free, but "a" is not alone
    assert budget.use().tokens_per_caller == 50 and budget.tokens_for("a") == 0 and budget.tokens_for("b") == 45


def test_a_caller_refused_for_what_was_lent_stops_the_lending_until_the_server_is_quiet() -> None:
    clock = Clock()
    budget = lending_budget(clock)
    reserve(budget, "a1", "a", 40)
    reserve(budget, "a2", "a", 35)  # borrowed: 75 of a share of 50
    # another caller wants its share and finds 25 free: refused, and lending stops
    assert refused(budget, "b", 50) == ErrorCode.CACHE_FULL
    assert budget.use().tokens_per_caller == 50
    # the borrower's running sessions stay; its next one is held to its share although 25 are free
    assert refused(budget, "a", 10) == ErrorCode.BUSY and budget.used == 75
    # one borrowed session ends: the refused caller gets its share on its retry
    budget.release("a1")
    reserve(budget, "b1", "b", 50)
    budget.release("b1")
    # the borrower alone again, but within the quiet period: still held to its share
    clock.now += CONTENTION_SECONDS - 1
    assert refused(budget, "a", 20) == ErrorCode.BUSY
    # after it, lent again
    clock.now += 2
    reserve(budget, "a3", "a", 20)
    assert budget.used_by("a") == 55 and budget.use().tokens_per_caller == 75


def test_a_borrower_is_named_with_what_it_holds_over_its_share_only_while_lending_is_stopped() -> None:
    budget = lending_budget(Clock())
    reserve(budget, "a1", "a", 40)
    reserve(budget, "a2", "a", 35)
    assert budget.borrowers() == {}  # lending: nobody waits
    assert refused(budget, "b", 50) == ErrorCode.CACHE_FULL
    assert budget.borrowers() == {"a": 25} and budget.held("a2") == 35
    budget.release("a2")
    assert budget.borrowers() == {} and budget.held("a2") == 0


def test_a_refusal_that_lending_did_not_cause_keeps_the_lending_on() -> None:
    budget = lending_budget(Clock())
    reserve(budget, "a1", "a", 50)
    reserve(budget, "b1", "b", 40)
    assert refused(budget, "b", 20) == ErrorCode.CACHE_FULL  # both within their shares: the budget is just full
    budget.release("b1")
    reserve(budget, "a2", "a", 25)  # alone again: lent at once
    assert budget.used_by("a") == 75


CACHE_TOKENS = 64  # per block; a caller's share: 32; lent to a caller alone: 48


@process_fixture(scope="module")
def lender(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSwarm, Swarm, Swarm]]:
    """One server of all 6 blocks with a small cache and lending on (the default); two clients: two peers."""
    with LocalSwarm(tiny_model, [], log_dir=tmp_path_factory.mktemp("lending")) as swarm:
        swarm.start_servers([(0, 6, ["--attn-cache-tokens", str(CACHE_TOKENS)])])
        with two_clients(swarm, tiny_model) as (first, second):
            yield swarm, first, second


def test_a_real_server_lends_a_lone_caller_its_cache_and_takes_it_back_as_sessions_end(lender) -> None:
    swarm, borrower, newcomer = lender
    peer = swarm.servers[0].peer_id
    # Given a caller alone on the server: its info answer offers it 48 tokens, not its share of 32
    assert info(borrower, peer)["cache_tokens_for_caller"] == 48
    held = [session(borrower, peer, max_length=24), session(borrower, peer, max_length=24)]  # 48: it borrowed 16
    assert info(borrower, peer)["cache_tokens_for_caller"] == 0
    # When another caller comes, its first session finds room at once, in the reserve
    first = session(newcomer, peer, max_length=8)
    # and when it asks for the rest of its share, there is no room (what was lent is not taken back mid-session)
    with pytest.raises(PeerFailed, match="cache_full"):
        session(newcomer, peer, max_length=24)
    # Then the borrower is held to its share: its next session is refused although 8 tokens are free
    with pytest.raises(PeerFailed, match="busy: .* of the 192 one caller may reserve"):
        session(borrower, peer, max_length=8)
    figures = info(borrower, peer)
    assert (figures["cache_tokens_per_peer"], figures["cache_tokens_for_caller"]) == (32, 0)
    assert (figures["errors"]["cache_full"], figures["errors"]["busy"]) == (1, 1)
    # and its running sessions step on
    hidden = inputs(1)[0]
    output = borrower.loop.run(held[1].step(hidden, torch.ones(1, 5, dtype=torch.long), torch.tensor([[4]])))
    assert output.shape == (1, 1, 64)
    # When one borrowed session ends, Then the refused caller, retrying, gets the rest of its share
    borrower.loop.run(held[0].close())
    assert eventually(lambda: info(newcomer, peer)["cache_tokens_for_caller"] == 24)
    served = session(newcomer, peer, max_length=24)
    for opened, client in [(held[1], borrower), (first, newcomer), (served, newcomer)]:
        client.loop.run(opened.close())
    assert eventually(lambda: info(borrower, peer)["sessions"] == 0)


@pytest.mark.swarm
def test_a_borrowers_lent_session_is_ended_once_another_caller_waits_and_its_client_replays_it_elsewhere(
        tiny_model: Path, tmp_path: Path) -> None:
    with LocalSwarm(tiny_model, [], log_dir=tmp_path) as swarm:
        swarm.start_servers([(0, 6, ["--attn-cache-tokens", str(CACHE_TOKENS), "--lent-cache-grace", "1"])])
        lender = swarm.servers[0].peer_id
        with two_clients(swarm, tiny_model) as (borrower, newcomer):
            # Given a caller alone on the lender with two sessions of 24 tokens (48: it borrowed 16)
            older, newer = (InferenceSession(borrower, batch_size=1, max_length=24) for _ in range(2))
            for chain in (older, newer):
                chain.swarm.loop.run(chain.open())
                assert chain.route[0].peer_id == lender
            prompt = inputs(4)
            assert torch.equal(older.step(*prompt), newer.step(*prompt))
            # and a second server the borrower knows of
            swarm.start_servers([(0, 6, [])])
            other = swarm.servers[1].peer_id
            assert eventually(lambda: len(borrower.loop.run(borrower.member_spans(refresh=True))) == 2)
            # When another caller asks for its share (32) and finds 16 free
            with pytest.raises(PeerFailed, match="cache_full"):
                session(newcomer, lender, max_length=32)
            # Then within the grace the borrower's newest session is ended by the lender
            assert eventually(lambda: info(newcomer, lender)["sessions"] == 1, timeout=5)
            # and its client replays it on the other server: the next step's output is the one the older session,
            # still on the lender, computes from the same inputs
            hidden = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(7))
            step = (hidden, torch.ones(1, 5, dtype=torch.long), torch.tensor([[4]]))
            kept, replayed = older.step(*step), newer.step(*step)
            assert [hop.peer_id for hop in older.route] == [lender] and [hop.peer_id for hop in newer.route] == [other]
            assert newer.failovers == 1 and torch.allclose(kept, replayed, atol=1e-4)
            # and the waiting caller gets its share on the lender
            served = session(newcomer, lender, max_length=32)
            newcomer.loop.run(served.close())
            for chain in (older, newer):
                chain.swarm.loop.run(chain.close())
