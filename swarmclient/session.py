"""`InferenceSession`: a fault-tolerant chain of `ServerSession`s (server_session.py, one stream to one server each).

An InferenceSession keeps its history as one `StepRecord` per completed step: the hidden states it sent to
each block boundary of its route, the positions, the rows kept and the mask columns the step added. When a
server fails, the client bans it, routes the failed hop's blocks through other servers, and replays those
records in order (same shapes, same inputs), so the replacement caches are the same as the lost ones and the
generation goes on with identical tokens. A step may keep only some rows of the batch (`keep_rows`: finished
requests leave the session); its record says so, and a replay drops the same rows.

With `verify_fraction` > 0, a sampled fraction of hop steps is checked: the records give the hop's whole input
history, which a second holder of its blocks recomputes (`verifier`). A server found lying is banned for the rest
of the process and its hop replayed through others, like a failed one. With `deferred` (a job's lane), the session
checks by window instead (deferred_checks.py): when the caller settles its checks, sampled rows of each hop are
compared at every position since the last settle, beside the generation; a caught lie raises LieCaught at the next
step or at the settle, and the caller drops the tokens since it last settled them. Each record then also keeps the
last hop's outputs (the positions a window compares).

A server whose stream was lost (it ended or broke under us: a relay resets a connection after 128 KiB) is first asked
to resume the session on a new stream (`_reattach`, ClientConfig.reattach_timeout): it kept the session, so the
client resends only the step it has no answer to, and replays nothing. Only if that fails does it fail over.

With push (ClientConfig.push) a step goes to the first hop only, naming the rest of the route, and each server pushes
its outputs on; every hop's outputs still come back as its answer, so the history and replays are the same. A failed
step resumes at the first hop whose outputs are missing, after replacing the broken hops (`_push_attempt`). Each hop's
answer names the digest of the input it computed on, checked against the record before anything else (push_audit.py):
a server that pushed other than it answered, or a hop that cannot prove its input, is banned for good and the hops
from there on are replayed.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from swarmclient.deferred_checks import Caught, DeferredChecks
from swarmclient.errors import InvalidRequest, NoRoom, PeerFailed, PushReported, WrongOutput
from swarmclient.hop_verifier import HopCheck, HopVerifier, unpadded_start
from swarmclient.push_audit import Blame, InputClaim, InputRecord, judge_input
from swarmclient.retry import with_retries
from swarmclient.server_session import ServerSession, close_in_background
from swarmclient.swarm import Swarm, wire_hidden
from swarmclient.verification_policy import Verdict, VerificationTally, sampled, sampled_row, stack_history
from swarmclient.warm_checks import WarmCheck, WarmPrefix
from swarmnet.data_structures import RouteHop
from swarmnet.push_proof import input_digest

logger = logging.getLogger(__name__)
# one warning per push lie caught (tests read it): the liar's blocks, its peer id, what it did
RELAYED_STEP_BYTES = 64 << 10  # the most hidden-state bytes of one step to a route with a relayed server
PUSH_LIE_LOG = "Server on blocks %d:%d, %s, %s; banned for the rest of this process"
# one line per session resumed on a new stream after its stream was lost (tests read it)
REATTACHED_LOG = "Resumed the session on blocks %d:%d at server %s on a new stream (%d steps applied there)"


@dataclass(frozen=True, eq=False)
class StepRecord:
    """One completed step of an InferenceSession: what a replay sends a replacement server again, in order."""

    inputs: dict[int, torch.Tensor]  # block index where a hop starts -> the hidden states sent to that hop
    position_ids: torch.Tensor
    keep_rows: tuple[int, ...] | None  # the rows the step kept first (None: all of them)
    # the attention mask's columns this step added; a step that starts a row set (the first step, or one with
    # keep_rows) holds its whole mask. Within a row set each step's mask extends the previous one, so the
    # columns rebuild every step's mask without keeping one full mask per step (quadratic in the length).
    mask_columns: torch.Tensor
    length: int  # tokens processed after this step (prompt included)

    @classmethod
    def of(cls, inputs: dict[int, torch.Tensor], attention_mask: torch.Tensor, position_ids: torch.Tensor,
           keep_rows: Sequence[int] | None, *, past: int) -> StepRecord:
        """The record of a step sent with this mask after `past` tokens."""
        if keep_rows is not None or past == 0:
            columns = attention_mask
        else:  # a copy: a view would keep the caller's whole mask alive
            columns = attention_mask[:, past:].clone()
        return cls(inputs, position_ids, None if keep_rows is None else tuple(keep_rows), columns,
                   attention_mask.shape[1])


def step_masks(history: Sequence[StepRecord]) -> Iterator[torch.Tensor]:
    """Each step's whole attention mask, rebuilt from the columns the steps added."""
    mask: torch.Tensor | None = None
    for record in history:
        if mask is None or record.keep_rows is not None:  # a row set starts: the record holds its whole mask
            mask = record.mask_columns
        else:
            mask = torch.cat([mask, record.mask_columns], dim=1)
        yield mask


def window_inputs(hop: RouteHop, history: Sequence[StepRecord], first: int, rows: list[int]) -> HopCheck:
    """The check of `rows` (of the last step's row set) on `hop` over the steps [first, end of `history`): the rows'
    whole input to the hop, and the hop's recorded outputs at every position of the window."""
    mask = collections.deque(step_masks(history), maxlen=1)[0]  # the last step's whole mask
    whole, positions = stack_history([(r.inputs[hop.start], r.position_ids, r.keep_rows) for r in history])
    outputs, _ = stack_history([(r.inputs[hop.end], r.position_ids, r.keep_rows) for r in history[first:]])
    picked = torch.tensor(rows)
    return HopCheck(hop, whole[picked], mask[picked], positions[picked], outputs[picked])


class InferenceSession:
    """A chain of server sessions covering blocks [0, num_blocks) that survives server failures."""

    def __init__(self, swarm: Swarm, *, batch_size: int, max_length: int,
                 verification: VerificationTally | None = None, deferred: DeferredChecks | None = None,
                 ring: bool = False) -> None:
        self.swarm, self.batch_size, self.max_length = swarm, batch_size, max_length
        # the ring (servers/ring.py): the caller feeds each next token greedily and keeps every row; off for good once
        # a hop fails or a guess was not the caller's token
        self._ring = ring and swarm.config.push
        self.verification = verification or VerificationTally()  # checked outputs: counts, shared by a job's lanes
        self._verifier = HopVerifier(swarm, self.verification, uuid.uuid4().hex)
        self._deferred = deferred                          # checks run beside the steps, settled by the caller
        self._window = (0, 0)                            # deferred: (windows settled, the first step of this one)
        if deferred is not None:
            deferred.on_caught, deferred.before_settle = self._on_caught, self._start_window_checks
            deferred.on_window_open = self._warm_window
        self._warm: dict[int, WarmCheck] = {}            # deferred: hop start -> the open window's warm check
        self._open_batch_size = batch_size               # a (replacement) server session opens with it, then replays
        self._row_ids = list(range(batch_size))          # each current row's index when the session opened
        self._sessions: dict[int, ServerSession] = {}   # hop start -> live session
        self._opening: list[RouteHop] = []               # hops routed and not in _sessions yet (routing counts them)
        self._closing: set[asyncio.Future[None]] = set()  # sessions being closed in the background
        self._broken: set[int] = set()                   # hop starts whose server failed
        self._history: list[StepRecord] = []             # every completed step, in order: what a replay sends
        self._opened: dict[str, str] = {}                # push: every session id opened -> its server's peer id
        self._sent: dict[int, set[bytes]] = {}           # push: hop start -> digests of inputs sent it this step
        self.failovers = 0
        self.reattachments = 0  # sessions resumed on a new stream to the same server

    @property
    def position(self) -> int:
        """Tokens processed so far (prompt included)."""
        return self._history[-1].length if self._history else 0

    @property
    def last_compute_seconds(self) -> float:
        """The servers' own compute time of the last step, summed over the route (the rest was network and waits)."""
        return sum(session.last_compute_seconds for session in self._sessions.values())

    @property
    def received_bytes(self) -> dict[int, int]:
        """Answer bytes each live hop (by its first block) sent so far: hidden states travel in its compute dtype."""
        return {start: session.received_bytes for start, session in sorted(self._sessions.items())}

    @property
    def guessed_steps(self) -> int:
        """Steps whose first hop computed the ring's guess of them before this client's copy came (all of them
        confirmed, or the session replayed them)."""
        return sum(session.guessed_steps for session in self._sessions.values())

    @property
    def route(self) -> list[RouteHop]:
        """The current hops, in block order."""
        return [self._sessions[start].hop for start in sorted(self._sessions)]

    # ---- sync facade (runs on the swarm's event loop) ---------------------------------------------------
    def __enter__(self) -> InferenceSession:
        self.swarm.loop.run(self.open())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is None and self._deferred is not None:
                self._deferred.settle()  # what the caller got from this session was checked as sampled
        finally:
            self.swarm.loop.run(self.close())

    def step(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             keep_rows: list[int] | None = None) -> torch.Tensor:
        """Run one step (a prefill of T tokens or a decode token) through all blocks; returns final hidden states.

        keep_rows: first drop every other row of the session's batch (sorted, unique indices of the current
        rows); the step's tensors then have len(keep_rows) rows, and so has the session from then on.
        """
        return self.swarm.loop.run(self.astep(hidden, attention_mask, position_ids, keep_rows))

    # ---- async core -----------------------------------------------------------------------------------
    async def open(self) -> None:
        """Find a route and open a session with each of its servers."""
        await with_retries(lambda: self._open_range(0, self.swarm.num_blocks), config=self.swarm.config,
                           on_failure=self._on_failure)

    async def close(self) -> None:
        """Close every server session (and drop deferred checks still running)."""
        if self._deferred is not None:
            self._deferred.cancel()
            self._drop_warm()
        await asyncio.gather(*(s.close() for s in self._sessions.values()), return_exceptions=True)
        self._sessions.clear()
        self.swarm.holders.discard(self)

    async def astep(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    keep_rows: list[int] | None = None) -> torch.Tensor:
        """Async `step`."""
        keep_rows = self._check_keep_rows(keep_rows)
        self._check_step(hidden, attention_mask, position_ids,
                         self.batch_size if keep_rows is None else len(keep_rows))
        if self._deferred is not None:
            self._deferred.raise_caught()  # a lie caught since the last step: the session's outputs are void
        chunk = self._step_chunk(hidden)
        if chunk < hidden.shape[1]:
            return await self._astep_chunked(hidden, attention_mask, position_ids, keep_rows, chunk)
        hidden = wire_hidden(hidden)
        attention_mask, position_ids = attention_mask.long(), position_ids.long()
        if self.swarm.config.push:
            return await self._astep_pushed(hidden, attention_mask, position_ids, keep_rows)
        inputs: dict[int, torch.Tensor] = {}
        position = 0
        while position < self.swarm.num_blocks:
            hidden_in = hidden
            hidden, position_next = await with_retries(
                lambda: self._step_hop(position, hidden_in, attention_mask, position_ids, keep_rows),  # noqa: B023 - awaited now
                config=self.swarm.config, on_failure=self._on_failure)
            inputs[position] = hidden_in
            position = position_next
        self._record(inputs, attention_mask, position_ids, keep_rows, hidden)
        return hidden

    def _step_chunk(self, hidden: torch.Tensor) -> int:
        """The most positions of this step one message may carry. All of them, but at most `prefill_chunk_tokens`
        (rows x positions) when the config sets it, and at most RELAYED_STEP_BYTES of hidden states when a hop is
        reached through a relay (whose connection is reset after 128 KiB each way: swarmnet/relays.py). A longer
        step (a long prompt's prefill) goes as several steps, each on a connection resumed if a relay reset the last
        one."""
        rows, chunk = hidden.shape[0], hidden.shape[1]
        if self.swarm.config.prefill_chunk_tokens is not None:
            chunk = min(chunk, max(1, self.swarm.config.prefill_chunk_tokens // rows))
        if any(hop.peer_id in self.swarm.relayed for hop in self.route):
            chunk = min(chunk, max(1, RELAYED_STEP_BYTES // (rows * hidden.shape[2] * 4)))
        return chunk

    async def _astep_chunked(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                             keep_rows: list[int] | None, chunk: int) -> torch.Tensor:
        """`astep` of a step as consecutive steps of at most `chunk` tokens (a chunked prefill): the same caches."""
        past, outputs = self.position, []
        for low in range(0, hidden.shape[1], chunk):
            high = min(hidden.shape[1], low + chunk)
            outputs.append(await self.astep(hidden[:, low:high], attention_mask[:, :past + high],
                                            position_ids[:, low:high], keep_rows if low == 0 else None))
        return torch.cat(outputs, dim=1)

    def _record(self, inputs: dict[int, torch.Tensor], attention_mask: torch.Tensor, position_ids: torch.Tensor,
                keep_rows: list[int] | None, output: torch.Tensor) -> None:
        """Add a completed step to the history that a replay feeds a replacement server (deferred: and its outputs,
        after checking the rows it leaves out over their window)."""
        if self._deferred is not None:
            if keep_rows is not None:
                self._check_leaving(keep_rows)
            inputs = {**inputs, self.swarm.num_blocks: output}
        self._history.append(StepRecord.of(inputs, attention_mask, position_ids, keep_rows, past=self.position))
        if keep_rows is not None:
            self.batch_size = len(keep_rows)
            self._row_ids = [self._row_ids[row] for row in keep_rows]

    def _check_keep_rows(self, keep_rows: list[int] | None) -> list[int] | None:
        if keep_rows is None:
            return None
        rows = [int(i) for i in keep_rows]
        if not rows or rows != sorted(set(rows)) or rows[0] < 0 or rows[-1] >= self.batch_size:
            raise InvalidRequest(f"keep_rows must be sorted unique row indices in [0, {self.batch_size}), "
                                 f"got {rows[:16]}")
        return rows

    def _check_step(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    batch_size: int) -> None:
        batch, length = hidden.shape[0], hidden.shape[1]
        if batch != batch_size or attention_mask.shape != (batch, self.position + length) or \
                position_ids.shape != (batch, length):
            raise InvalidRequest(
                f"step shapes do not fit the session: hidden {tuple(hidden.shape)}, mask {tuple(attention_mask.shape)},"
                f" positions {tuple(position_ids.shape)} at position {self.position} with batch {batch_size}")
        if attention_mask.shape[1] > self.max_length:
            raise InvalidRequest(f"the session is {self.max_length} tokens long; step would reach "
                                 f"{attention_mask.shape[1]}")

    async def _step_hop(self, position: int, hidden: torch.Tensor, attention_mask: torch.Tensor,
                        position_ids: torch.Tensor, keep_rows: list[int] | None) -> tuple[torch.Tensor, int]:
        if position in self._broken or self.swarm.bans.banned_for_good(self._sessions[position].hop.peer_id):
            await self._repair(position)
        session = self._sessions[position]
        try:
            output = await session.step(hidden, attention_mask, position_ids, keep_rows, step_id=len(self._history))
        except PeerFailed:
            self._broken.add(position)
            raise
        if self._deferred is None and sampled(self.swarm.config.verify_fraction, self._verifier.key,
                                              len(self._history), position):
            await self._check(session.hop, hidden, attention_mask, position_ids, keep_rows, output)
        self.swarm.bans.forgive(session.hop.peer_id)
        return output, session.hop.end

    async def _check(self, hop: RouteHop, hidden: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: torch.Tensor, keep_rows: list[int] | None, output: torch.Tensor) -> None:
        """Have another holder recompute this hop step; raises WrongOutput if the hop's server is found lying."""
        def build() -> HopCheck:
            history = [(record.inputs[hop.start], record.position_ids, record.keep_rows) for record in self._history]
            kept = None if keep_rows is None else tuple(keep_rows)
            whole, positions = stack_history([*history, (hidden, position_ids, kept)])
            return HopCheck(hop, whole, attention_mask, positions, output)
        verdict = await self._verifier.check(hop, len(self._history), build)
        if verdict is Verdict.CHECKED_FAULTY:
            self._broken.add(hop.start)
            raise WrongOutput(hop.peer_id, "its output differs from other servers' (banned for good)")

    # ---- deferred: checks by window (deferred_checks.py) ---------------------------------------------------------------
    async def _start_window_checks(self) -> None:
        """Check this window's sampled rows of every hop (the caller settles its checks); the next window begins."""
        assert self._deferred is not None
        for hop, rows in list(self._sampled_rows(range(self.batch_size))):
            warm = self._take_warm(hop, rows)
            if not self._verifier.skipped_as_uncheckable(hop):  # none could: counted unverified, the checkpoint goes on
                await self._deferred.start(hop, self._window[1], self._window_check(hop, len(self._history), rows, warm))
            elif warm is not None:
                warm.drop()
        self._drop_warm()
        self._window = (self._window[0] + 1, len(self._history))

    def _warm_window(self) -> None:
        """The window that opens now: begin the check of each hop's rows sampled in it (warm_checks.py)."""
        settled, first = self._window
        if first == 0 or first != len(self._history):
            return
        for hop in self.route:
            rows = self._rows_sampled(settled, hop, range(self.batch_size))
            if rows and all(hop.start in r.inputs for r in self._history):
                self._warm[hop.start] = self._begin_warm(hop, first, rows)

    def _begin_warm(self, hop: RouteHop, first: int, rows: list[int]) -> WarmCheck:
        """A warm check of `rows` on `hop` from step `first`: the rows' history so far, less its leading padding
        (gathered only once a holder could check it)."""
        history, picked = self._history[:first], torch.tensor(rows)

        def prefix() -> WarmPrefix:
            mask = collections.deque(step_masks(history), maxlen=1)[0][picked]
            whole, positions = stack_history([(r.inputs[hop.start], r.position_ids, r.keep_rows) for r in history])
            cut = unpadded_start(mask, 0)
            return WarmPrefix(whole[picked, cut:], mask[:, cut:], positions[picked, cut:], cut)
        return self._verifier.begin_warm(hop, first, [self._row_ids[row] for row in rows], self.max_length,
                                         history[-1].length, prefix)

    def _take_warm(self, hop: RouteHop, rows: list[int]) -> WarmCheck | None:
        """The warm check begun for this window's check of `rows` on `hop`, if it is that one (else dropped)."""
        warm = self._warm.pop(hop.start, None)
        if warm is not None and not warm.fits(hop, self._window[1], [self._row_ids[row] for row in rows]):
            warm.drop()
            return None
        return warm

    def _drop_warm(self) -> None:
        for warm in self._warm.values():
            warm.drop()
        self._warm.clear()

    def _check_leaving(self, keep_rows: list[int]) -> None:
        """Rows leaving the session at this step: check the sampled ones over the window so far, from here."""
        assert self._deferred is not None
        kept = set(keep_rows)
        for hop, rows in self._sampled_rows([row for row in range(self.batch_size) if row not in kept]):
            if not self._verifier.skipped_as_uncheckable(hop):
                self._deferred.start_now(hop, self._window[1], self._window_check(hop, len(self._history), rows))

    def _sampled_rows(self, rows: Sequence[int]) -> Iterator[tuple[RouteHop, list[int]]]:
        """Each hop with the rows (of the last step's row set) sampled for it in this window, if any and if the
        window has steps."""
        settled, first = self._window
        if first >= len(self._history):
            return
        for hop in self.route:
            picked = self._rows_sampled(settled, hop, rows)
            if picked:
                yield hop, picked

    def _rows_sampled(self, window: int, hop: RouteHop, rows: Iterable[int]) -> list[int]:
        """The rows (current indices) sampled for `hop` in `window`: drawn by each row's index when the session opened,
        so a row keeps its draw when rows before it leave."""
        return [row for row in rows if sampled_row(self.swarm.config.verify_fraction, self._verifier.key, window,
                                                   self._row_ids[row], hop.start)]

    def _window_check(self, hop: RouteHop, end: int, rows: list[int], warm: WarmCheck | None = None
                      ) -> Callable[[], Awaitable[Verdict | None]]:
        """The check of `rows` (of step end-1's row set) on `hop` at every position of the steps [window, end)."""
        history, first = self._history[:end], self._window[1]

        async def check() -> Verdict | None:
            if any(hop.start not in r.inputs or hop.end not in r.inputs for r in history):
                if warm is not None:
                    warm.drop()
                self.verification.add(unverified=1)  # the route changed its boundaries: nothing to compare with
                return None
            return await self._verifier.check(hop, first, lambda: window_inputs(hop, history, first, rows), warm)
        return check

    def _on_caught(self, caught: Caught) -> None:
        """A deferred check caught a lie: the liar's hop and every later one computed on it are replaced."""
        self._break_from(caught.hop.start)

    def _break_from(self, start: int) -> None:
        """The hops from block `start` on are marked broken: each is replaced (and replayed) before its next step."""
        for hop in self.route:
            if hop.start >= start:
                self._broken.add(hop.start)

    # ---- push: the client sends a step to the first hop only; each server pushes its outputs to the next -------------
    async def _astep_pushed(self, hidden: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                            keep_rows: list[int] | None) -> torch.Tensor:
        """`astep` with server-to-server push. Every hop's outputs still come back (its answer), so the history
        records each hop's inputs as without push: a failover replays them and a check recomputes them."""
        step_id = len(self._history)
        boundaries: dict[int, torch.Tensor] = {0: hidden}  # block index -> this step's hidden states there
        self._sent.clear()
        await with_retries(lambda: self._push_attempt(step_id, boundaries, attention_mask, position_ids, keep_rows),
                           config=self.swarm.config, on_failure=self._on_failure)
        self._record({hop.start: boundaries[hop.start] for hop in self.route}, attention_mask, position_ids, keep_rows,
                     boundaries[self.swarm.num_blocks])
        return boundaries[self.swarm.num_blocks]

    async def _push_attempt(self, step_id: int, boundaries: dict[int, torch.Tensor], attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, keep_rows: list[int] | None) -> None:
        """Repair broken hops, then send the step to the first hop whose outputs are missing, with the route on."""
        for start in sorted(self._sessions):
            session = self._sessions.get(start)
            if session is not None and (start in self._broken or self.swarm.bans.banned_for_good(session.hop.peer_id)):
                await self._repair(start)  # the replacement has not run this step: its outputs and later ones go
                for block in [b for b in boundaries if session.hop.start < b <= session.hop.end]:
                    del boundaries[block]
        hops = self.route
        first = next(i for i, hop in enumerate(hops) if hop.end not in boundaries)
        pending = hops[first:]
        shape = boundaries[0].shape
        # sessions opened for the ring go on guessing after a resume on a new stream (the ring ends only for new ones)
        guessing = any(session.ring_from or session.ring_to for session in self._sessions.values())
        for hop in pending:
            self._sessions[hop.start].expect(shape, step_id)
            if guessing:  # the next step's answers may come before the client sends it: the ring guessed it
                self._sessions[hop.start].expect(torch.Size((shape[0], 1, shape[2])), step_id + 1)
        head = self._sessions[pending[0].start]
        self._sent.setdefault(head.hop.start, set()).add(
            input_digest(boundaries[head.hop.start], attention_mask, position_ids, keep_rows, step_id))
        sent = time.perf_counter()
        try:
            await head.send(boundaries[pending[0].start], attention_mask, position_ids, keep_rows, step_id=step_id,
                            route=[[hop.peer_id, self._sessions[hop.start].session_id] for hop in pending[1:]])
        except PeerFailed:
            self._broken.add(head.hop.start)
            raise
        try:
            arrivals = await self._collect(step_id, pending, boundaries, shape)
        except Exception:  # the answers that came before the failure stay for the next attempt: check them too
            self._audit_inputs(step_id, pending, boundaries, attention_mask, position_ids, keep_rows)
            raise
        self._audit_inputs(step_id, pending, boundaries, attention_mask, position_ids, keep_rows)
        if shape[1] == 1:  # a decode step: each hop's time, from its input's arrival to its answer (network included)
            for hop, began, ended in zip(pending, [sent, *arrivals], arrivals, strict=False):
                if ended > began:  # answers travel separately: one may overtake the one before it
                    self.swarm.observe_step(hop.peer_id, hop.end - hop.start, ended - began)
        for hop in pending:
            if self._deferred is None and sampled(self.swarm.config.verify_fraction, self._verifier.key, step_id,
                                                  hop.start):
                await self._check_pushed(hop, boundaries, attention_mask, position_ids, keep_rows)
            self.swarm.bans.forgive(hop.peer_id)

    async def _collect(self, step_id: int, hops: list[RouteHop], boundaries: dict[int, torch.Tensor],
                       shape: torch.Size) -> list[float]:
        """Wait for each hop's outputs of the step; the first failure stops the wait (a reported push included).
        Returns when each hop's answer came (perf_counter), in route order."""
        waits = {asyncio.ensure_future(self._sessions[hop.start].answer(step_id, shape)): hop for hop in hops}
        arrived: dict[int, float] = {}
        try:
            while waits:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    hop = waits.pop(task)
                    try:
                        boundaries[hop.end] = task.result()
                        arrived[hop.start] = time.perf_counter()
                    except PushReported:
                        raise
                    except PeerFailed:
                        self._broken.add(hop.start)
                        raise
        finally:
            for task in waits:
                task.cancel()
        return [arrived[hop.start] for hop in hops]

    def _audit_inputs(self, step_id: int, hops: list[RouteHop], boundaries: dict[int, torch.Tensor],
                      attention_mask: torch.Tensor, position_ids: torch.Tensor, keep_rows: list[int] | None) -> None:
        """Check that each hop that answered computed on the input recorded for it (push_audit.py), in route order;
        at the first that did not, drop its outputs and the later hops' (computed from them), ban whoever lied and
        raise WrongOutput, or PushReported for a stale input (the hop is replayed, nobody is banned)."""
        owner = self.swarm.p2p.peer_id.to_base58()
        for hop in hops:
            session = self._sessions.get(hop.start)
            if session is None or hop.start not in boundaries or hop.end not in boundaries:
                continue
            upstream = next((s for s in self._sessions.values() if s.hop.end == hop.start), None)
            record = InputRecord(
                input_digest(boundaries[hop.start], attention_mask, position_ids, keep_rows, step_id), owner,
                session.session_id, step_id, None if upstream is None else (upstream.hop.peer_id, upstream.session_id),
                self._sent.get(hop.start, ()), self._opened)
            blame = judge_input(session.claims.pop(step_id, InputClaim(None, None)), record)
            if blame is not Blame.NONE:
                self._redo_from(hop.start if blame is not Blame.UPSTREAM or upstream is None else upstream.hop.start,
                                boundaries)
                raise self._input_failure(blame, hop, upstream)

    def _redo_from(self, start: int, boundaries: dict[int, torch.Tensor]) -> None:
        """The hops from block `start` on computed this step from a wrong input: their sessions are replaced."""
        self._break_from(start)
        for block in [b for b in boundaries if b > start]:
            del boundaries[block]

    def _input_failure(self, blame: Blame, hop: RouteHop, upstream: ServerSession | None) -> PeerFailed:
        if blame is Blame.STALE:
            logger.info("Server %s answered a step from an earlier input; replaying the record to it", hop.peer_id[-8:])
            return PushReported(hop.peer_id, "it applied an earlier input of the step")
        liar = upstream.hop if blame is Blame.UPSTREAM and upstream is not None else hop
        self.swarm.bans.ban_for_good(liar.peer_id)
        what = "pushed to the next server other outputs than it answered" if liar is not hop else \
            "claims to have computed on an input it cannot prove it was sent"
        logger.warning(PUSH_LIE_LOG, liar.start, liar.end, liar.peer_id, what)
        return WrongOutput(liar.peer_id, f"it {what} (banned for good)")

    def _push_failed(self, reporter: ServerSession, step_id: int, peer_id: str, reason: str) -> bool:
        """A server reports that it could not push step `step_id` to `peer_id`: stop waiting for that server, if it
        is the reporter's next hop and the step is the one in progress. A report naming any other peer steers
        nothing, and is counted against the reporter (False)."""
        following = self._sessions.get(reporter.hop.end)
        if following is None or following.hop.peer_id != peer_id:
            return False
        if step_id == len(self._history):  # (a late report of an earlier step is dropped)
            following.fail_step(step_id, PushReported(peer_id, f"the server before it could not push: {reason}"))
        return True

    async def _check_pushed(self, hop: RouteHop, boundaries: dict[int, torch.Tensor], attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, keep_rows: list[int] | None) -> None:
        """A sampled hop's check; found lying, its outputs and every later hop's (computed from them) are redone."""
        try:
            await self._check(hop, boundaries[hop.start], attention_mask, position_ids, keep_rows, boundaries[hop.end])
        except WrongOutput:
            self._redo_from(hop.start, boundaries)
            raise

    async def _on_failure(self, exc: BaseException) -> None:
        if isinstance(exc, PushReported):  # not its fault yet: the step goes to it directly next
            logger.info("Server %s: %r; sending the step to it directly", exc.peer_id[-8:], exc.reason)
            return
        if isinstance(exc, PeerFailed) and not isinstance(exc, WrongOutput):  # the verifier banned it for good
            duration = self.swarm.ban(exc)
            logger.warning("Server %s %s (%r); %s for %.0f s, routing around it", exc.peer_id[-8:],
                           *(("has no room", exc.reason, "skipped") if isinstance(exc, NoRoom) else
                             ("failed", exc.reason, "banned")), duration)

    async def _reattach(self, session: ServerSession) -> bool:
        """Resume a session whose stream was lost on a new stream to the same server (one try, short); whether it
        is back where this session is: all past steps applied there, the current one perhaps too (resent, a
        duplicate is answered again). A server found elsewhere gets the session closed, and is failed over."""
        timeout = self.swarm.config.reattach_timeout
        if not session.lost or timeout <= 0 or self.swarm.bans.banned_for_good(session.hop.peer_id):
            return False
        try:
            applied = await session.reattach(timeout, len(self._history))
        except PeerFailed as e:
            logger.info("Server %s did not resume the session (%r); failing over", session.hop.peer_id[-8:], e.reason)
            return False
        if applied not in (len(self._history), len(self._history) + 1):
            logger.info("Server %s resumed the session at step %d, not %d; failing over", session.hop.peer_id[-8:],
                        applied, len(self._history))
            return False
        self.swarm.bans.lift(session.hop.peer_id)  # its stream was lost, not its fault
        self.reattachments += 1
        logger.info(REATTACHED_LOG, session.hop.start, session.hop.end, session.hop.peer_id[-8:], applied)
        return True

    async def _repair(self, position: int) -> None:
        """Resume the failed hop starting at `position` on a new stream if its stream was lost; else replace it with
        a new route, and replay its history. The ring ends for the session either way."""
        self._ring = False
        if await self._reattach(self._sessions[position]):
            self._broken.discard(position)
            return
        failed = self._sessions.pop(position)
        self._close_later(failed)
        self._broken.discard(position)
        hops: list[RouteHop] = []
        try:
            hops = await self._open_range(failed.hop.start, failed.hop.end)
            await self._replay(hops)
        except BaseException:
            # drop the half-made replacement; the range stays broken so the next attempt repairs it again
            for hop in hops:
                self._close_later(self._sessions.pop(hop.start))
            self._sessions[position] = failed
            self._broken.add(position)
            raise
        self.failovers += 1
        if self._deferred is not None:  # the window's earlier outputs came from another server: compare from here
            self._window = (self._window[0], len(self._history))
            self._drop_warm()

    def _close_later(self, session: ServerSession) -> None:
        """Close a session in the background (held in `_closing` until it is closed)."""
        close_in_background(session, self._closing)

    def held_peers(self) -> list[str]:
        """Each server session's peer id, open or being opened: this session's load on them, as routing counts it."""
        return [session.hop.peer_id for session in self._sessions.values()] + [hop.peer_id for hop in self._opening]

    async def _open_range(self, start: int, end: int) -> list[RouteHop]:
        self.swarm.holders.add(self)  # (before routing: a route chosen meanwhile by another lane counts this one's)
        hops = await self.swarm.route(start, end, session_tokens=self._open_batch_size * self.max_length)
        self._opening = hops
        try:
            return await self._open_sessions(hops)
        finally:
            self._opening = []

    async def _open_sessions(self, hops: list[RouteHop]) -> list[RouteHop]:
        """Open a session on each hop's server (the ring's where the route takes it); all of them, or none."""
        sessions = [ServerSession(self.swarm, hop, batch_size=self._open_batch_size, max_length=self.max_length,
                                  push=self.swarm.config.push, on_push_failure=self._push_failed) for hop in hops]
        # (not through a relay: a long step goes there as several shorter ones, which the ring would take for tokens)
        if self._ring and len(hops) > 1 and hops[0].start == 0 and hops[-1].end == self.swarm.num_blocks and \
                not any(hop.peer_id in self.swarm.relayed for hop in hops):
            sessions[0].ring_from = hops[-1].peer_id
            sessions[-1].ring_to = [[hop.peer_id, session.session_id] for hop, session in zip(hops, sessions, strict=True)]
        opened = await asyncio.gather(*(s.open() for s in sessions), return_exceptions=True)
        failure = next((r for r in opened if isinstance(r, BaseException)), None)
        if failure is not None:
            await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
            raise failure
        for session in sessions:
            self._sessions[session.hop.start] = session
            self._opened[session.session_id] = session.hop.peer_id
        return hops

    async def _replay(self, hops: list[RouteHop]) -> None:
        """Feed the new hops every past step's inputs, in order, so their caches match the lost ones."""
        replayed: list[StepRecord] = []
        for step_id, (record, mask) in enumerate(zip(self._history, step_masks(self._history), strict=True)):
            inputs, hidden = dict(record.inputs), record.inputs[hops[0].start]
            for hop in hops:
                inputs[hop.start] = hidden  # a new hop boundary gets its inputs recorded for later replays
                hidden = await self._sessions[hop.start].step(hidden, mask, record.position_ids, record.keep_rows,
                                                              step_id=step_id)
            replayed.append(dataclasses.replace(record, inputs=inputs))
        self._history = replayed  # only once the whole replay worked: a failed one leaves the history as it was
        if replayed:
            logger.info("Replayed %d steps to %s", len(replayed),
                        ", ".join(f"{h.start}:{h.end}@{h.peer_id[-6:]}" for h in hops))
