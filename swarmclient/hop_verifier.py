"""`HopVerifier`: recompute a sampled hop step on other holders of its blocks and judge who lies (checked outputs).

The policy (sampling, tolerances, the majority rule) is in `verification`; this module asks the servers. The
second server recomputes the hop with the stateless `forward` RPC of the hop's whole input history; on a
mismatch a third holder, when there is one, decides. The server found faulty is banned for the rest of the
process (`BanList.ban_for_good`); the caller replays the hop elsewhere when it was the checked one.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from swarmclient.errors import InvalidRequest, PeerFailed
from swarmclient.generation import leading_padding
from swarmclient.server_session import ServerSession
from swarmclient.swarm import Swarm
from swarmclient.verification_policy import (
    Verdict,
    VerificationTally,
    comparable,
    judge,
    max_difference,
    relative_error,
    tolerance,
    verifier_order,
)
from swarmclient.warm_checks import WarmCheck, WarmPrefix, open_warm_session
from swarmnet.data_structures import RemoteSpanInfo, RouteHop

logger = logging.getLogger(__name__)
# one warning per mismatch (tests read it): blocks, checked server, second server, errors, verdict, banned server
MISMATCH_LOG = ("Outputs differ on blocks %d:%d between server %s and server %s: relative error %.3g (tolerance "
                "%.3g), max difference %.3g; %s; server %s is banned for the rest of this process")
# a history is sent in row chunks of at most this size: one check never makes a server hold a large forward
MAX_FORWARD_BYTES = 3 << 20


@dataclass(frozen=True)
class HopCheck:
    """One hop step to check: the hop, its whole input so far (this step included), and the checked output."""

    hop: RouteHop
    hidden: torch.Tensor     # [B, L, H]: every step's input to the hop, in order
    mask: torch.Tensor       # [B, L]
    positions: torch.Tensor  # [B, L]
    output: torch.Tensor     # [B, T, H]: the checked server's answer to the step (its last T tokens)

    def unpadded(self) -> HopCheck:
        """The same check without the history's leading columns that no row attends to (`unpadded_start`)."""
        first = unpadded_start(self.mask, self.output.shape[1])
        if first == 0:
            return self
        return HopCheck(self.hop, self.hidden[:, first:], self.mask[:, first:], self.positions[:, first:], self.output)

    @property
    def real(self) -> torch.Tensor:
        """[B, T]: which of the step's tokens are real (padding is not compared)."""
        return self.mask[:, -self.output.shape[1]:]


@dataclass(frozen=True)
class Recomputed:
    """A holder's answer for the step's tokens."""

    span: RemoteSpanInfo
    output: torch.Tensor  # [B, T, H]
    warm: bool = False    # answered by a warm check (warm_checks.py), not by a stateless forward


class HopVerifier:
    """Checks hop steps of one inference session; counts into `tally`; `key` seeds the session's choices."""

    def __init__(self, swarm: Swarm, tally: VerificationTally, key: str) -> None:
        self.swarm, self.tally, self.key = swarm, tally, key

    async def check(self, hop: RouteHop, step: int, build: Callable[[], HopCheck], warm: WarmCheck | None = None
                    ) -> Verdict | None:
        """Recompute the hop's step on another holder of the same precision and compare; None when none could
        (counted as unverified). `build` gathers the check's tensors, only once some holder could recompute them.
        `warm`: the check begun when its window opened (warm_checks.py), whose holder answers first if it can."""
        holders = self._holders(hop, await self.swarm.member_spans())
        checked, peers = self._second_holders(hop, holders)
        if checked is None or not peers:
            if warm is not None:
                warm.drop()
            self.tally.add(unverified=1)
            return None
        whole = build()
        check = whole.unpadded()
        second = None if warm is None else await self._warm_answer(warm, whole, holders)
        order = iter([holders[p] for p in verifier_order(peers, self.key, step, hop.start)
                      if second is None or p != second.span.peer_id])
        if second is None:
            second = await self._recompute(order, check)
        if second is None:
            self.tally.add(unverified=1)
            return None
        limit = tolerance(checked.info, second.span.info)
        error = relative_error(check.output, second.output, check.real)
        warmed = int(second.warm)
        if error <= limit:
            self.tally.add(verified=1, warm=warmed)
            return Verdict.AGREE
        third = await self._recompute(order, check)
        third_agrees = None if third is None else relative_error(check.output, third.output, check.real) <= limit
        verdict = judge(False, third_agrees)
        faulty = check.hop.peer_id if verdict is Verdict.CHECKED_FAULTY else second.span.peer_id
        self.swarm.bans.ban_for_good(faulty)
        self.tally.add(verified=1, mismatches=1, warm=warmed)
        logger.warning(MISMATCH_LOG, check.hop.start, check.hop.end, check.hop.peer_id, second.span.peer_id, error,
                       limit, max_difference(check.output, second.output, check.real), _explain(verdict, third),
                       faulty)
        return verdict

    def begin_warm(self, hop: RouteHop, first: int, rows: list[int], max_length: int, columns: int,
                   prefix: Callable[[], WarmPrefix]) -> WarmCheck:
        """Begin the check of `rows` (by their indices when the session opened) on `hop` over the window that starts at
        step `first` (warm_checks.py): the holder that check will ask gets a background session and the rows' history
        so far (`columns` columns, less its leading padding), beside the window's steps."""
        warm = WarmCheck(hop, first, rows, columns)
        warm.task = asyncio.ensure_future(self._warm_session(warm, max_length, prefix))
        return warm

    async def _warm_session(self, warm: WarmCheck, max_length: int, prefix: Callable[[], WarmPrefix]
                            ) -> ServerSession | None:
        """The warm check's session on the first holder `check` would ask; None when there is none it could use."""
        holders = self._holders(warm.hop, await self.swarm.member_spans())
        checked, peers = self._second_holders(warm.hop, holders)
        if checked is None or not peers:
            return None
        span = holders[verifier_order(peers, self.key, warm.first, warm.hop.start)[0]]
        if max_length > span.info.max_length or len(warm.rows) > span.info.max_batch_size:
            return None
        warm.holder = span.peer_id
        return await open_warm_session(warm, RouteHop(span.peer_id, warm.hop.start, warm.hop.end), max_length, prefix,
                                       functools.partial(ServerSession, self.swarm))

    @staticmethod
    async def _warm_answer(warm: WarmCheck, whole: HopCheck, holders: dict[str, RemoteSpanInfo]
                           ) -> Recomputed | None:
        """The warm check's holder's outputs for the window (`whole`: the check with its leading columns); None when
        it has none (the window is then recomputed statelessly)."""
        output = await warm.window_outputs(whole.hidden, whole.mask, whole.positions, whole.output.shape[1])
        span = holders.get(warm.holder or "")
        return None if output is None or span is None else Recomputed(span, output, warm=True)

    def skipped_as_uncheckable(self, hop: RouteHop) -> bool:
        """Whether a fresh DHT read (`Swarm.fresh_member_spans`) shows no other holder that could check the hop: then
        it is counted as unverified now and the caller starts no check, so a checkpoint never waits for checks that
        nobody can make. Without a fresh read: False, and the check itself reads the DHT (one read, begun now, that the
        session's other checks share: a checkpoint never waits for the DHT)."""
        spans = self.swarm.fresh_member_spans()
        if spans is None:
            return False
        checked, peers = self._second_holders(hop, self._holders(hop, spans))
        if checked is not None and not peers:
            self.tally.add(unverified=1)
            return True
        return False

    def _holders(self, hop: RouteHop, spans: list[RemoteSpanInfo]) -> dict[str, RemoteSpanInfo]:
        """Online, unbanned members' servers holding all of the hop's blocks (the checked one, banned or not), by peer
        id: a check sends the hop's whole input history, so it goes where routing may send it, to members only."""
        return {s.peer_id: s for s in spans if s.start <= hop.start and hop.end <= s.end
                and (s.peer_id == hop.peer_id or not self.swarm.bans.is_banned(s.peer_id))}

    @staticmethod
    def _second_holders(hop: RouteHop, holders: dict[str, RemoteSpanInfo]) -> tuple[RemoteSpanInfo | None, list[str]]:
        """The checked server's span (None if it is gone) and the other holders of a comparable precision."""
        checked = holders.pop(hop.peer_id, None)
        return checked, [] if checked is None else [p for p, s in holders.items() if comparable(s.info, checked.info)]

    async def _recompute(self, candidates: Iterator[RemoteSpanInfo], check: HopCheck) -> Recomputed | None:
        """The first candidate's answer that comes back; a failing candidate is banned like any failed server."""
        for span in candidates:
            chunks = row_chunks(check, span)
            if chunks is None:
                continue
            try:
                outputs = [await self._forward(span, check, rows) for rows in chunks]
            except PeerFailed as e:
                duration = self.swarm.bans.ban(span.peer_id)
                logger.warning("Server %s could not check a step (%s); banned for %.0f s", span.peer_id[-8:],
                               e.reason, duration)
                continue
            except InvalidRequest as e:
                logger.info("Server %s refused to check a step: %s", span.peer_id[-8:], e)
                continue
            return Recomputed(span, torch.cat(outputs))
        return None

    async def _forward(self, span: RemoteSpanInfo, check: HopCheck, rows: slice) -> torch.Tensor:
        """The step's tokens [rows, T, H] recomputed by one server from these rows' history, without its leading
        padding (columns no row of the chunk attends to: a row with a shorter prompt, or one that joined later)."""
        first = unpadded_start(check.mask[rows], check.output.shape[1])
        output = await self.swarm.forward_hidden(span.peer_id, check.hop.start, check.hop.end,
                                                 check.hidden[rows, first:], check.mask[rows, first:],
                                                 check.positions[rows, first:])
        return output[:, -check.output.shape[1]:]


def unpadded_start(mask: torch.Tensor, tail: int) -> int:
    """The first column of the history [L] to send: the leading columns that no row attends to are left out, never
    the last `tail` (the compared step's tokens). Masked keys add nothing to attention and positions are sent with
    each token, and only a leading run is dropped, so the distance between any two tokens (what a sliding window
    counts) stays the same: the real tokens' outputs are the same without it."""
    return min(leading_padding(mask), mask.shape[1] - tail)


def row_chunks(check: HopCheck, span: RemoteSpanInfo) -> list[slice] | None:
    """Row slices of the history that fit one forward call to this server; None if a single row cannot."""
    rows, length, hidden = check.hidden.shape
    if length > span.info.max_length:
        return None
    per_row = length * (hidden * 4 + 16)  # hidden states, mask and position ids
    per_call = min(span.info.max_batch_size, MAX_FORWARD_BYTES // per_row)
    if per_call < 1:
        return None
    return [slice(low, min(low + per_call, rows)) for low in range(0, rows, per_call)]


def _explain(verdict: Verdict, third: Recomputed | None) -> str:
    if verdict is Verdict.SECOND_FAULTY:
        assert third is not None
        return f"server {third.span.peer_id[-8:]} agrees with the checked one"
    if third is None:
        return "no third holder to ask: the checked server is treated as faulty"
    return f"server {third.span.peer_id[-8:]} does not agree with the checked one"
