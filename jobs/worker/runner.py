"""Generating a claimed batch of requests through the swarm, committing new token ids every K tokens.

A request resumes from its committed `generated_ids`: prompt + committed tokens are prefilled, sampling
is seeded by absolute position, and the penalties and the output's grammar (response_format) are rebuilt from the
committed tokens, so the continuation equals an uninterrupted run.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from jobs.errors import JobCancelled, LeaseLost
from jobs.line_format import output_grammar
from jobs.line_sampling import sampling_extras
from jobs.models import Request
from jobs.worker.sizing import PipelinePlan
from swarmclient.constraints import Grammar, grammar_tokenizer
from swarmclient.deferred_checks import DeferredChecks
from swarmclient.errors import SwarmBusy
from swarmclient.generation import TokenLogprobs
from swarmclient.model import DistributedModelForCausalLM
from swarmclient.penalties import Penalties
from swarmclient.sampling import SamplingParams
from swarmclient.verification_policy import VerificationTally

logger = logging.getLogger(__name__)
STEP_LOG = "step %d: %s"  # a debug line per decode step, read by tests: "ID=TOKENS" per row, space-separated
NO_ROOM_LOG = "No room on the servers for %d requests (%s); they wait for room, the batch goes on with %d in flight"
MAX_BUSY_WAIT = 30.0  # seconds between retries of rows the servers had no room for, at most


class Checkpoint(Protocol):
    """Commit {request id: all generated ids}, their texts, and their logprobs (passed only when a row asks for
    them); returns the ids still leased to us. It raises JobCancelled to stop the batch."""

    def __call__(self, progress: dict[int, list[int]], texts: dict[int, str],
                 logprobs: dict[int, list[Any]] | None = None, /) -> set[int]: ...


@dataclass
class RowState:
    """One request's progress inside a batch."""

    request_id: int
    generated: list[int]
    stop: list[str]
    finish_reason: str | None = None
    committed: int = 0
    text: str = ""
    logprobs: list[Any] | None = None  # with the request's top_logprobs: an entry per generated id (logprob_entry)
    error: str | None = None  # why the request fails without running (it can never fit the servers' cache)


@dataclass(frozen=True)
class RowResult:
    """How a request ended in this batch."""

    generated: list[int]
    finish_reason: str
    text: str
    error: str | None = None  # the request failed: this is why


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), left padded."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids, mask


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in `text`, if any."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


Refill = Callable[[int], list[Request]]
"""Claim up to n more pending requests of the job (under the same lease token); [] when none is left."""


class BatchRunner:
    """Runs one claimed batch; `run()` returns {request id: RowResult} for every row it ran.

    The batch is split into `lanes` micro-batches, each its own inference session in its own thread, so
    that every server of the chain has a micro-batch to work on (pipelining). With `continuous`, a finished
    row leaves its session at once (keep_rows) and `refill` claims pending requests for the freed slots, which
    start in a new lane right away; the servers merge the lanes' decode steps into batched forwards.
    """

    def __init__(self, model: DistributedModelForCausalLM, tokenizer: Any, requests: list[Request], *,
                 checkpoint_every: int, checkpoint: Checkpoint, lanes: int = 1, continuous: bool = False,
                 refill: Refill | None = None, capacity: int | None = None, plan: PipelinePlan | None = None,
                 renew: Callable[[], None] | None = None, renew_every: float = 20.0,
                 verification: VerificationTally | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.verification = verification or VerificationTally()  # every lane's checked outputs
        self.checkpoint_every, self.checkpoint = checkpoint_every, checkpoint
        self.plan = plan or PipelinePlan(capacity or len(requests), max(1, lanes), max(1, lanes))
        self.lanes, self.continuous, self.refill = max(1, self.plan.lanes), continuous, refill
        self.capacity = self.plan.claim       # rows in flight at most; shrinks when the servers have no room
        self.renew, self.renew_every = renew, renew_every
        self.requests: list[Request] = []
        self.rows: list[RowState] = []
        self._lock = threading.Lock()          # guards requests/rows (lanes append through _add)
        self._changed = threading.Event()      # a row finished or a lane ended: the scheduler looks again
        self._stop = threading.Event()         # a lane failed: the others stop at their next token
        self._exhausted = refill is None
        self._running: dict[Future[None], Lane] = {}
        self._waiting: list[tuple[RowState, Request]] = []  # rows to start once there is room (no lane yet)
        self._busy_retry_at, self._busy_delay = 0.0, 1.0
        self._add(requests)

    def run(self) -> dict[int, RowResult]:
        """Generate until every row ends; raises JobCancelled / LeaseLost / swarm errors from any lane."""
        todo = self._startable(list(zip(self.rows, self.requests, strict=True)))
        self._waiting = [pair for group in split_lanes(todo, self.lanes) for pair in group]
        with ThreadPoolExecutor(max_workers=max(self.capacity, self.plan.max_lanes),
                                thread_name_prefix="swarmbatch-lane") as pool:
            try:
                self._supervise(pool)
            except BaseException:
                self._stop.set()  # every lane stops at its next token
                wait(self._running)
                raise
        self._commit(self.rows, force=True)
        return {row.request_id: RowResult(row.generated, row.finish_reason or "length", row.text, row.error)
                for row in self.rows}

    def _add(self, requests: list[Request]) -> list[tuple[RowState, Request]]:
        pairs = [(RowState(r.id, list(r.generated_ids), list(r.stop), committed=len(r.generated_ids),
                           logprobs=None if r.top_logprobs is None else list(r.generated_logprobs or [])), r)
                 for r in requests]
        with self._lock:
            self.requests += requests
            self.rows += [row for row, _ in pairs]
        return pairs

    def _startable(self, pairs: list[tuple[RowState, Request]]) -> list[tuple[RowState, Request]]:
        """The rows that still need tokens (a resumed row may already be finished by its committed tokens)."""
        for row, request in pairs:
            if row.generated:
                logger.info("Request %s resumes at token %d", request.id, len(row.generated))
            self._check_finished(row, request)
            if row.finish_reason is None:
                self._check_fits(row, request)
        return [(row, request) for row, request in pairs if row.finish_reason is None]

    def _check_fits(self, row: RowState, request: Request) -> None:
        """End a row at once, failed, when its session could never get its KV cache from the servers: waiting for
        room would last until the job expires."""
        need, ceiling = len(request.prompt_ids) + request.max_tokens, self.plan.ceiling
        if ceiling is not None and need > ceiling:
            row.finish_reason = "error"
            row.error = (f"this request needs {need} tokens of KV cache per block (prompt {len(request.prompt_ids)} "
                         f"+ max_tokens {request.max_tokens}), and the most any server of the swarm grants one caller "
                         f"is {ceiling}: lower max_tokens or shorten the prompt, or run the servers with a larger "
                         "--attn-cache-tokens or --max-cache-share-per-peer")
            logger.warning("Request %s fails: %s", request.id, row.error)

    def _supervise(self, pool: ThreadPoolExecutor) -> None:
        """Start lanes while there is room, refill freed slots, renew the leases; re-raise a lane's failure."""
        renewed = time.monotonic()
        while True:
            self._reap()
            if self.renew is not None and time.monotonic() - renewed > self.renew_every:
                self.renew()  # rows waiting for room have no checkpoint to renew their lease
                renewed = time.monotonic()
            if not self._exhausted and not self._stop.is_set():
                self._waiting += self._refill()
            self._start_waiting(pool)
            if not self._running and not self._waiting:
                return
            self._changed.wait(0.5)
            self._changed.clear()

    def _reap(self) -> None:
        """Take ended lanes out; rows the servers had no room for wait again; any other failure is raised."""
        for future in [future for future in self._running if future.done()]:
            lane = self._running.pop(future)
            error = future.exception()
            if isinstance(error, SwarmBusy):
                self._no_room(lane, error)
            elif error is not None:
                raise error
            else:  # a lane went through: grow back towards the plan
                self.capacity = min(self.plan.claim, self.capacity + max(1, self.plan.claim // 8))
                self._busy_delay = 1.0

    def _no_room(self, lane: Lane, error: SwarmBusy) -> None:
        unfinished = [(row, request) for row, request in lane.pairs if row.finish_reason is None]
        self._waiting = unfinished + self._waiting
        in_flight = sum(lane.alive() for lane in self._running.values())
        self.capacity = max(1, in_flight)
        self._busy_retry_at = time.monotonic() + self._busy_delay
        self._busy_delay = min(MAX_BUSY_WAIT, self._busy_delay * 2)
        logger.warning(NO_ROOM_LOG, len(unfinished), error, in_flight)

    def _start_waiting(self, pool: ThreadPoolExecutor) -> None:
        """Start waiting rows as lanes, while the plan's cache and lanes allow; with nothing running, one lane is
        tried anyway (after a backoff if the servers had no room): the servers decide."""
        while self._waiting and not self._stop.is_set() and time.monotonic() >= self._busy_retry_at:
            if len(self._running) >= self.plan.max_lanes:
                return
            group = self._next_group()
            if self._running and not self._fits(group):
                return
            del self._waiting[:len(group)]
            lane = Lane(group)
            self._running[pool.submit(self._lane, lane)] = lane

    def _next_group(self) -> list[tuple[RowState, Request]]:
        """The next micro-batch of waiting rows: at most the claim's share of one lane and the servers' batch size,
        and no more than fits the cache share alone (a claim reaches ahead of what runs at once: sizing.py)."""
        per_lane = max(1, min(-(-self.capacity // self.lanes), self.plan.rows_per_session or self.capacity))
        group = self._waiting[:per_lane]
        while len(group) > 1 and self.plan.cache_tokens is not None \
                and Lane(group).reservation() > self.plan.cache_tokens:
            group = group[:-1]
        return group

    def _fits(self, group: list[tuple[RowState, Request]]) -> bool:
        if self.plan.cache_tokens is None:
            return True
        reserved = sum(lane.reservation() for lane in self._running.values())
        return reserved + Lane(group).reservation() <= self.plan.cache_tokens

    def _refill(self) -> list[tuple[RowState, Request]]:
        with self._lock:
            in_flight = sum(1 for row in self.rows if row.finish_reason is None)
            known = {row.request_id for row in self.rows}
        free = self.capacity - in_flight
        if free < self._refill_threshold() or self.refill is None:
            return []
        fetched = self.refill(free)
        if not fetched:
            self._exhausted = True  # nothing pending now; requests released later are found by the next task
            return []
        # a request that came back to pending while one of our lanes still runs it (its lease lapsed during a slow
        # step) is claimed again under our token: the running lane goes on with it, a second lane would repeat it
        claimed = [request for request in fetched if request.id not in known]
        return self._startable(self._add(claimed)) if claimed else []

    def _refill_threshold(self) -> int:
        """Freed slots worth a new lane: any while lanes are few, else half a lane's worth (fewer, fuller lanes)."""
        if len(self._running) < self.lanes:
            return 1
        return max(1, self.capacity // self.lanes // 2)

    def _lane(self, lane: Lane) -> None:
        """One micro-batch: its own session through the swarm, committing its rows every K tokens."""
        pairs = lane.pairs
        rows = [row for row, _ in pairs]
        ids, mask = left_pad([list(r.prompt_ids) + row.generated for row, r in pairs], self.model.pad_token_id)
        limits = [r.max_tokens - len(row.generated) for row, r in pairs]
        params = [sampling_params(r, earlier=len(row.generated), grammar=self._grammar(r)) for row, r in pairs]
        checks = DeferredChecks(self.model.swarm.loop)  # checked outputs: a window's pass before its tokens commit
        # the rows' lengths at the last checkpoint whose window's checks were still running: the next one commits them
        # (the checks run while the next window's steps do) unless its own window's are done by then
        waiting: dict[int, int] = {}

        def on_token(index: int, column: torch.Tensor, logprobs: TokenLogprobs | None = None) -> torch.Tensor:
            # the rows this step ran with: the servers hold their cache until the next step leaves the finished out
            lane.held = sum(1 for row in rows if row.finish_reason is None)
            if self._stop.is_set():
                return torch.ones(len(rows), dtype=torch.bool)
            stop = torch.zeros(len(rows), dtype=torch.bool)
            for b, (row, request) in enumerate(pairs):
                if row.finish_reason is None:
                    row.generated.append(int(column[b]))
                    if row.logprobs is not None and logprobs is not None:
                        row.logprobs.append(logprob_entry(self.tokenizer, int(column[b]), logprobs, b,
                                                          request.top_logprobs or 0))
                    stop[b] = self._check_finished(row, request)
            logger.debug(STEP_LOG, index, " ".join(f"{row.request_id}={len(row.generated)}" for row in rows))
            if (index + 1) % self.checkpoint_every == 0:
                nonlocal waiting
                checked = checks.close_window()  # raises LieCaught: nothing since the last checkpoint is kept
                now = {row.request_id: len(row.generated) for row in rows}
                self._commit(rows, upto=now if checked else waiting)
                waiting = now
            if stop.any():
                self._changed.set()
            return stop

        try:
            self.model.generate_new_tokens(ids, mask, max_new_tokens=limits, params=params, on_token=on_token,
                                           shrink=self.continuous, verification=self.verification, deferred=checks)
            self._commit(rows)  # every check of the session passed: its rows' last tokens are kept now
        finally:
            self._changed.set()

    def _grammar(self, request: Request) -> Grammar | None:
        """The grammar a request's output must follow (its response_format), for this model's EOS and vocabulary."""
        text = output_grammar(request.body)
        if text is None:
            return None
        tokenizer = grammar_tokenizer(self.tokenizer, eos_token_ids=self.model.eos_token_ids,
                                      vocab_size=self.model.spec.config.vocab_size)
        return Grammar(text, tokenizer)

    def _check_finished(self, row: RowState, request: Request) -> bool:
        """Whether the row just ended (EOS, stop string or max_tokens); sets its finish reason and text."""
        if row.finish_reason is not None:
            return True
        eos = bool(row.generated) and row.generated[-1] in self.model.eos_token_ids
        full = len(row.generated) >= request.max_tokens
        if not (row.stop or eos or full):
            return False  # decoding is only needed to look for stop strings or to finish
        row.text = self.tokenizer.decode(row.generated, skip_special_tokens=True)
        cut = find_stop(row.text, row.stop)
        if cut is not None:
            row.text, row.finish_reason = row.text[:cut], "stop"
        elif eos or full:
            row.finish_reason = "stop" if eos else "length"
        return row.finish_reason is not None

    def _text(self, row: RowState, length: int | None = None) -> str:
        """The row's output text so far (cut at a stop string once finished), or of its first `length` tokens."""
        if length is not None and length < len(row.generated):
            return str(self.tokenizer.decode(row.generated[:length], skip_special_tokens=True))
        if row.finish_reason is not None or row.stop:
            return row.text  # _check_finished decoded it at this very step
        return str(self.tokenizer.decode(row.generated, skip_special_tokens=True))

    def _commit(self, rows: list[RowState], *, force: bool = False, upto: dict[int, int] | None = None) -> None:
        """Checkpoint rows that gained tokens (upto: only their first tokens, by request id; a row not in it gained
        none); raises LeaseLost if another worker took one over."""
        lengths = {row.request_id: len(row.generated) if upto is None else upto.get(row.request_id, 0) for row in rows}
        progress = {rid: row.generated[:lengths[rid]] for row in rows if lengths[(rid := row.request_id)] > row.committed}
        if not progress and not force:
            return
        texts = {rid: self._text(row, lengths[rid]) for row in rows if (rid := row.request_id) in progress}
        logprobs = {rid: row.logprobs[:lengths[rid]] for row in rows
                    if (rid := row.request_id) in progress and row.logprobs is not None}
        try:
            owned = self.checkpoint(progress, texts, logprobs) if logprobs else self.checkpoint(progress, texts)
        except JobCancelled:  # raised once this checkpoint is committed: the cancelled rows keep what it wrote
            mark_committed(rows, progress)
            raise
        mark_committed(rows, progress, owned)



def mark_committed(rows: list[RowState], progress: dict[int, list[int]], owned: set[int] | None = None) -> None:
    """Count the tokens a checkpoint wrote as committed; raises LeaseLost for a row not in `owned` (None: all)."""
    for row in rows:
        if row.request_id in progress:
            if owned is not None and row.request_id not in owned:
                raise LeaseLost(f"request {row.request_id} was claimed by another worker")
            row.committed = len(progress[row.request_id])

@dataclass
class Lane:
    """A micro-batch in flight: its rows, and what its session reserves on every server of the chain."""

    pairs: list[tuple[RowState, Request]]

    def __post_init__(self) -> None:
        # the session's length: the longest prompt so far (left padded) + the most new tokens any row may still take
        self.max_length = (max(len(r.prompt_ids) + len(row.generated) for row, r in self.pairs)
                           + max(r.max_tokens - len(row.generated) for row, r in self.pairs))
        self.held = len(self.pairs)  # rows its session holds on the servers (a finished row leaves at the next step)

    def alive(self) -> int:
        """Rows still generating."""
        return sum(1 for row, _ in self.pairs if row.finish_reason is None)

    def reservation(self) -> int:
        """Tokens per block its session holds now."""
        return self.held * self.max_length


def logprob_entry(tokenizer: Any, token: int, logprobs: TokenLogprobs, row: int, top: int) -> list[Any]:
    """What a request keeps of one generated token's logprobs: [text, logprob, [[text, logprob] x top]]."""
    ids, values = logprobs.top_ids[row, :top].tolist(), logprobs.top_values[row, :top].tolist()
    return [tokenizer.decode([token]), float(logprobs.chosen[row]),
            [[tokenizer.decode([i]), float(v)] for i, v in zip(ids, values, strict=True)]]


def split_lanes(pairs: list[tuple[RowState, Request]], lanes: int) -> list[list[tuple[RowState, Request]]]:
    """Up to `lanes` micro-batches of near-equal size, of similar prompt lengths (less padding per lane)."""
    ordered = sorted(pairs, key=lambda pair: len(pair[1].prompt_ids) + len(pair[0].generated))
    count = min(lanes, len(ordered))
    return [ordered[i * len(ordered) // count:(i + 1) * len(ordered) // count] for i in range(count)] if count else []


def sampling_params(request: Request, *, earlier: int, grammar: Grammar | None = None) -> SamplingParams:
    """How a request samples: its columns, the penalties and extensions of its stored body, and its output's grammar;
    `earlier` of its input's last tokens are its own output from before a resume (the penalties count them as
    generated, the grammar's matcher consumes them)."""
    extras = sampling_extras(request.body)
    top_k, min_p = extras.pop("top_k"), extras.pop("min_p")
    return SamplingParams(temperature=request.temperature, top_p=request.top_p, seed=request.seed,
                          top_logprobs=request.top_logprobs, top_k=top_k, min_p=min_p, penalties=Penalties(**extras),
                          earlier_tokens=earlier, grammar=grammar)
