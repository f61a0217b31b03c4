"""No thrash, simulated: servers of random speeds running the rebalancing rules round after round over a shared
snapshot (some rounds a server reads one a round old, as a slow DHT read would), with a stable membership after the
start. Pure: no network, no clock but the round number."""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest

from servers.block_selection import choose_best_blocks
from servers.rebalancing import Holder, Move, coverage, plan, turn

NUM_BLOCKS, SERVERS, SPAN = 30, 6, 10  # 6 servers x 10 blocks cover 30 blocks twice
PERIOD, COOLDOWN, QUALITY = 30.0, 300.0, 0.75  # the defaults of servers/config.py


@dataclass
class Swarm:
    """The servers as they announce themselves, and what each watcher remembers between rounds."""

    holders: dict[str, Holder]
    rng: random.Random
    stale: float  # chance that a server reads last round's snapshot
    waited: dict[str, int] = field(default_factory=dict)
    previous: list[Holder] = field(default_factory=list)
    moves: list[tuple[int, str, int, int]] = field(default_factory=list)  # (round, peer, start, end)

    def round(self, number: int) -> int:
        """Every server looks once (in a random order, as jitter makes it); moves land at the round's end."""
        now = number * PERIOD
        fresh = sorted(self.holders.values(), key=lambda h: h.peer_id)
        landed = {peer: replace(h, joining=False) for peer, h in self.holders.items()}  # loading takes < a round
        for peer in self.rng.sample(sorted(self.holders), len(self.holders)):
            view = self.previous if self.previous and self.rng.random() < self.stale else fresh
            planned = planned_moves(view, now)
            move = turn(planned, peer, self.waited.get(peer, 0))
            self.waited[peer] = self.waited.get(peer, 0) + 1 if any(m.peer_id == peer for m in planned) else 0
            if move is not None:
                landed[peer] = replace(landed[peer], start=move.start, end=move.end, joining=True, last_move=now)
                self.waited[peer] = 0
                self.moves.append((number, peer, move.start, move.end))
        self.previous, self.holders = fresh, landed
        return sum(1 for m in self.moves if m[0] == number)


PLANS: dict[tuple[object, ...], list[Move]] = {}


def planned_moves(view: list[Holder], now: float) -> list[Move]:
    """`plan`, computed once per snapshot and set of servers in their cool-down (it is pure): the long still runs
    see the same snapshot round after round."""
    key = (*view, *(h.last_move is not None and now - h.last_move < COOLDOWN for h in view))
    if key not in PLANS:
        PLANS[key] = plan(view, NUM_BLOCKS, quality=QUALITY, cooldown=COOLDOWN, now=now)
    return PLANS[key]


def started_together(seed: int, stale: float) -> Swarm:
    """Six servers of speeds 50..400 that all chose their span at once, seeing an empty swarm: all on 0:10."""
    rng = random.Random(seed)
    start, end = choose_best_blocks(SPAN, [{} for _ in range(NUM_BLOCKS)])
    holders = {f"peer{i}": Holder(f"peer{i}", start, end, rng.uniform(50, 400), movable=True) for i in range(SERVERS)}
    return Swarm(holders, rng, stale)


def run(swarm: Swarm, rounds: int, first: int = 0) -> list[int]:
    return [swarm.round(number) for number in range(first, first + rounds)]


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("stale", [0.0, 0.3])
def test_six_servers_settle_then_make_no_move_in_ten_minutes(seed: int, stale: float) -> None:
    swarm = started_together(seed, stale)
    settle = run(swarm, 40)
    assert coverage(swarm.holders.values(), NUM_BLOCKS).holes == 0
    assert sum(settle[20:]) == 0, f"still moving after 20 rounds: {swarm.moves}"
    assert sum(run(swarm, 600, first=40)) == 0  # ten minutes of rounds a second apart, or five hours at the default


@pytest.mark.parametrize("seed", range(10))
def test_from_a_shared_snapshot_one_server_moves_per_round(seed: int) -> None:
    swarm = started_together(seed, stale=0.0)
    assert max(run(swarm, 40)) == 1


@pytest.mark.parametrize("seed", range(10))
def test_no_server_moves_back_and_no_bottleneck_move_within_the_cooldown(seed: int) -> None:
    swarm = started_together(seed, stale=0.0)
    run(swarm, 40)
    visited: dict[str, list[tuple[int, int]]] = {}
    for _, peer, start, end in swarm.moves:
        assert (start, end) not in visited.get(peer, []), f"{peer} went back to {start}:{end}: {swarm.moves}"
        visited.setdefault(peer, []).append((start, end))


@pytest.mark.parametrize("seed", range(10))
def test_after_two_servers_leave_the_swarm_heals_and_is_still_again(seed: int) -> None:
    swarm = started_together(seed, stale=0.3)
    run(swarm, 40)
    first = sorted(swarm.holders.values(), key=lambda h: h.start)[0]
    for peer in [h.peer_id for h in swarm.holders.values() if (h.start, h.end) == (first.start, first.end)][:2]:
        del swarm.holders[peer]
    swarm.previous = []
    healing = run(swarm, 40, first=40)
    assert coverage(swarm.holders.values(), NUM_BLOCKS).holes == 0
    assert sum(healing[20:]) == 0
