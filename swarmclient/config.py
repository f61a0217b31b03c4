"""Client configuration: timeouts, retries and bans, with the reason for each default."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClientConfig:
    """Knobs of the swarm client."""

    connect_timeout: float = 10.0  # seconds to open a session on one server
    step_timeout: float = 30.0     # seconds one step may take on one server, plus step_timeout_per_token per token
    step_timeout_per_token: float = 0.02  # a CPU server prefills a 64 x 150-token batch in ~30 s: give it time
    # seconds to resume a session on a new stream to the same server after its stream was lost (a relay resets a
    # connection after 128 KiB): one try, then the client fails over and replays; 0 = fail over at once
    reattach_timeout: float = 5.0
    close_timeout: float = 5.0     # seconds close() waits for a server to confirm it freed the session (~1 ms)
    max_retries: int = 8           # failed attempts of one step before giving up (each routes around bans)
    min_backoff: float = 0.05      # first retry waits about this long; failover should be quick
    max_backoff: float = 10.0      # cap of the exponential backoff between retries
    ban_timeout: float = 15.0      # first ban of a failing server; doubles on each further failure
    max_ban_timeout: float = 300.0
    # a server that refused a session for lack of room (cache_full, busy) is left out of routes this long, without
    # a ban: it is healthy, and our own sessions ending there make room again
    full_timeout: float = 5.0
    discovery_ttl: float = 5.0     # seconds a DHT read is reused before routing reads it again
    # seconds a server's measured round trip (and the links to the servers after it, which its answer reports) is
    # trusted before routing pings it again: a long-lived worker outlives networks and sees servers join
    rtt_max_age: float = 60.0
    # seconds a server's count of other callers' sessions (its `info` answer) is trusted when a route would use it and
    # another server could stand in: older, the route's servers are pinged again before the session opens (one round
    # trip), so a long-lived worker's new sessions see the sessions other workers opened since (docs/swarm.md)
    load_max_age: float = 5.0
    # fraction of hop steps recomputed on a second server holding the hop's blocks (checked outputs, docs/security.md);
    # 0 = no checks. Jobs default to SWARMBATCH_VERIFY_FRACTION (0.02), one-off `generate` to 0
    verify_fraction: float = 0.0
    # server-to-server push (docs/swarm.md): the client sends each step to the first server of the
    # chain only, each server pushes its outputs to the next, and every server's outputs still come back to the
    # client (what a failover replays and a check recomputes). About (hops + 1) / 2 round trips per token instead of
    # hops. On by default: every test of the client, the servers, generation, checks and membership passes with it
    push: bool = True
    # one-off `generate` splits a batch into this many micro-batches, each its own session, run at once: while one
    # micro-batch computes on the second server, the next one computes on the first (pipeline parallelism; jobs do
    # this with their lanes). Rows are grouped by prompt length. Each row's tokens are what it gets alone, but its
    # micro-batch's padding differs from the whole batch's, so greedy ties may round differently: 1 = one session
    micro_batches: int = 1
    # the ring (docs/swarm.md): a greedy generation (every row argmax, no penalties, no grammar, no rows leaving the
    # session; a head that embeds as the server's: ClientHead.embeds_as_ring) asks its last server, where that one
    # holds the head (started with --ring), to guess each next token and push its step straight to the first server;
    # the client still samples and sends every token, and a guess that is not its token is replayed without the
    # ring. A token costs hops / 2 round trips instead of (hops + 1) / 2
    ring: bool = True
    # a prefill of more than this many tokens (rows x positions) goes as consecutive steps of at most this many, on
    # the same caches. Several sessions' prefills (a job's lanes) then take turns on each server instead of queueing
    # whole behind one another, and the lanes start generating closer together, so fewer of them run alone at the end
    # (the default job 1.10-1.19x faster on 2 cores: bench/RESULTS.md, session 26). None = one step. Jobs default to
    # SWARMBATCH_PREFILL_CHUNK_TOKENS (1024); one-off `generate` (one session: nothing to take turns with) to None
    prefill_chunk_tokens: int | None = None
    # where the embeddings, final norm and LM head live and compute: auto (cuda when torch sees a GPU), cpu, cuda:N
    device: str = "auto"
    # the final norm's and LM head's dtype: auto is the checkpoint's dtype on a GPU and float32 on a CPU, where a
    # bfloat16 GEMM is 1.2-3x slower without bfloat16 instructions (swarmnet/head.py); "bfloat16" halves its memory
    head_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"verify_fraction must be in [0, 1], got {self.verify_fraction}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be at least 1 (or None), got {self.prefill_chunk_tokens}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {self.micro_batches}")
        if self.head_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"head_dtype must be auto, float32, bfloat16 or float16, got {self.head_dtype!r}")
