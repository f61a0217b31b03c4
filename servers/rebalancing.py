"""When a server that was not pinned moves its span, and where to: pure functions over a coverage snapshot.

Every such server runs `plan` over (nearly) the same snapshot of the swarm's member servers, so they agree on who
moves; `turn` lets only the first candidate act, and the next one only after it has stood still for a few rounds.

- A block is covered when a member server that is ONLINE or JOINING announces it: a server that moves announces
  JOINING on its new span at once, so no second server runs for the same hole.
- A server never moves away from a block no other server covers.
- A move must close holes (leave fewer blocks without a server), or else raise the bottleneck (the weakest block's
  summed throughput) above bottleneck / quality: with quality 0.75, by a third.
- A bottleneck move waits while any member is JOINING (a swarm in transit), and for a server that moved less than
  `cooldown` ago; closing a hole waits for neither.

No thrash: with a stable membership every move raises (fewer holes, bottleneck) in lexicographic order, holes by at
least one block and the bottleneck by a factor of at least 1 / quality, so no move can be undone (no two servers
swap back and forth) and the moves end.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from swarmnet.data_structures import PROTOCOL_VERSION, ServerInfo, ServerState
from swarmnet.discovery import BlockServers, uncovered_ranges

PATIENCE_ROUNDS = 3  # rounds a server waits for each candidate ranked before it (one that does not move)


@dataclass(frozen=True)
class Holder:
    """A member server in the snapshot: its span, its throughput, whether it may move, and when it last did."""

    peer_id: str
    start: int
    end: int
    throughput: float
    movable: bool = False
    joining: bool = False
    last_move: float | None = None  # DHT time

    @property
    def length(self) -> int:
        """Number of blocks it holds."""
        return self.end - self.start


@dataclass(frozen=True)
class Move:
    """A planned move of one server to blocks [start, end), with what it changes and why (one line)."""

    peer_id: str
    start: int
    end: int
    holes: int        # blocks without a server after the move
    bottleneck: float  # weakest block's throughput after the move
    reason: str


@dataclass(frozen=True)
class Coverage:
    """Per block: how many servers hold it, and their summed throughput."""

    counts: tuple[int, ...]
    throughputs: tuple[float, ...]

    @property
    def holes(self) -> int:
        """Blocks no server holds."""
        return sum(count == 0 for count in self.counts)

    @property
    def bottleneck(self) -> float:
        """The weakest block's summed throughput."""
        return min(self.throughputs)


def holders_of(block_infos: list[BlockServers], allows: Callable[[str], bool] = lambda peer: True) -> list[Holder]:
    """The member servers that are ONLINE or JOINING, each with the span of its record that moved last (a record
    left under a block a server no longer serves is ignored: OFFLINE, or listing other blocks, or older)."""
    found: dict[str, Holder] = {}
    for index, servers in enumerate(block_infos):
        for peer, info in servers.items():
            if allows(peer) and _covers(info, index):
                seen, new = found.get(peer), holder_of(peer, info)
                if seen is None or (new.last_move or 0.0) > (seen.last_move or 0.0):
                    found[peer] = new
    return sorted(found.values(), key=lambda h: h.peer_id)


def _covers(info: ServerInfo, index: int) -> bool:
    """Whether a record holds block `index` as clients count it: not OFFLINE, and of our protocol version (clients
    never route to another version's servers, so those leave a hole to fill)."""
    return info.state != ServerState.OFFLINE and info.version == PROTOCOL_VERSION and info.start <= index < info.end


def holder_of(peer: str, info: ServerInfo) -> Holder:
    """The snapshot entry of one server's record."""
    last = max((move.at for move in info.moves), default=None)
    return Holder(peer, info.start, info.end, info.throughput, movable=info.rebalances,
                  joining=info.state == ServerState.JOINING, last_move=last)


def coverage(holders: Iterable[Holder], num_blocks: int) -> Coverage:
    """Counts and summed throughputs per block."""
    counts, throughputs = [0] * num_blocks, [0.0] * num_blocks
    for holder in holders:
        for index in range(holder.start, min(holder.end, num_blocks)):
            counts[index] += 1
            throughputs[index] += holder.throughput
    return Coverage(tuple(counts), tuple(throughputs))


def holes(cover: Coverage) -> list[tuple[int, int]]:
    """The ranges [a, b) of blocks no server holds."""
    return uncovered_ranges(cover.counts)


def plan(holders: list[Holder], num_blocks: int, *, quality: float, cooldown: float, now: float) -> list[Move]:
    """Every move the rules allow, best first (fewest holes after, highest bottleneck after, then peer id)."""
    cover = coverage(holders, num_blocks)
    in_transit = any(h.joining for h in holders)
    moves = [move for holder in holders if holder.movable
             for move in [_best_move(holder, holders, cover, num_blocks, quality)] if move is not None
             and (move.holes < cover.holes or (not in_transit and not _cooling(holder, cooldown, now)))]
    return sorted(moves, key=lambda m: (m.holes, -m.bottleneck, m.peer_id))


def _cooling(holder: Holder, cooldown: float, now: float) -> bool:
    return holder.last_move is not None and now - holder.last_move < cooldown


def _best_move(holder: Holder, holders: list[Holder], cover: Coverage, num_blocks: int, quality: float
               ) -> Move | None:
    """Where this holder should go, if anywhere: the window that leaves fewest holes, then the highest bottleneck,
    then the nearest; None if it alone holds a block, or no window improves the swarm by the rules."""
    if holder.length > num_blocks or any(cover.counts[i] == 1 for i in range(holder.start, holder.end)):
        return None
    others = coverage([h for h in holders if h.peer_id != holder.peer_id], num_blocks)
    options = [(*_after(others, holder, start), start) for start in range(num_blocks - holder.length + 1)]
    holes_after, bottleneck, start = min(options, key=lambda o: (o[0], -round(o[1], 6), abs(o[2] - holder.start),
                                                                  o[2]))
    if start == holder.start:
        return None
    if holes_after < cover.holes:
        reason = f"no server held blocks {_ranges(holes(cover))}"
    elif holes_after == cover.holes and cover.bottleneck < quality * bottleneck:
        reason = f"bottleneck {cover.bottleneck:.0f} -> {bottleneck:.0f} steps/s"
    else:
        return None
    return Move(holder.peer_id, start, start + holder.length, holes_after, bottleneck, reason)


def _after(others: Coverage, holder: Holder, start: int) -> tuple[int, float]:
    """(holes, bottleneck) of `others` plus the holder moved to `start`."""
    end, counts, throughputs = start + holder.length, others.counts, others.throughputs
    outside = counts[:start] + counts[end:]
    weakest = min(throughputs[start:end]) + holder.throughput
    if outside:
        weakest = min(weakest, min(throughputs[:start] + throughputs[end:]))
    return outside.count(0), weakest


def _ranges(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}:{b}" for a, b in ranges)


def turn(moves: list[Move], me: str, rounds_waited: int, patience: int = PATIENCE_ROUNDS) -> Move | None:
    """My move if it is my turn: I am the first candidate, or every candidate before me had `patience` rounds each
    and still did not move (it may be stuck, or see another snapshot)."""
    for rank, move in enumerate(moves):
        if move.peer_id == me:
            return move if rounds_waited >= rank * patience else None
    return None
