"""Benchmark: local `generate` vs the swarm (1 server, 2 servers) in tokens/s, plus the per-hop round trip.

Run:  .venv/bin/python bench/swarm.py [--model smollm2|PATH] [--new-tokens 64] [--reps 1] [--out results.json]

What it measures (one run, same prompts, greedy, exactly N new tokens per row):
  local     transformers AutoModelForCausalLM.generate, min_new_tokens=N, 1 torch thread in this process
  swarm-1   LocalSwarm with one server holding all blocks (pinned to one core, 1 thread)
  swarm-2   LocalSwarm with two servers holding halves (each pinned to its own core, 1 thread)
  swarm-2-mb2  the same two servers, each batch split into 2 micro-batches (rows grouped by prompt length) that run
            at once, each in its own session and client thread: while one computes on the second server, the other
            computes on the first (ClientConfig.micro_batches; at batch 1 it is swarm-2)
The swarm client runs in this process with 1 torch thread too; its LM head may
split one product over a thread per core (swarmnet/head_matmul.py: at batch 1 the servers wait for it meanwhile;
local generate gains nothing from a second torch thread at batch 1, as MKL runs a one-row product on one thread).
All three configs are started up front and their
timed runs interleaved rep by rep (local b1, swarm-1 b1, swarm-2 b1, then b8, ...; the order rotates each rep),
so noise from other work on the machine hits them alike; each row is the median of --reps runs, after a short
warm-up generation. Single runs on this VM swing by 10-15 %, so the ratios are also given per rep (paired with
that rep's local run: median and quartiles) and over all reps (ratio of totals).
To force exactly N tokens on the swarm (what min_new_tokens does for HF) it runs the client's own decode loop
(`swarmclient.generation.generate_tokens`) over `model.inference_session` with no EOS ids; `--allow-eos` uses
`model.generate_new_tokens` instead (may stop early). Tokens are counted the same way for every config:
non-pad tokens up to and including EOS.

For each swarm run it also splits the time per generated position: the servers' reported compute
(`InferenceSession.last_compute_seconds`), the hops (step time minus that compute: network, framing and the
servers' Python) and the client (LM head, sampling, thread hand-off: the rest).

Hop round trip (2-server swarm, batch 1, after a prefill):
  hop-1blk  a ServerSession on a 1-block sub-span of each server: 1x1xH decode steps, time of `await step`
            on the client's loop, minus the compute time the server reports for that step (`compute_ms`);
            the same minus a local timing of the block is printed too (it also counts any slowdown of the
            server's core; a block alone is too small to tune its product forms, so that local timing uses
            F.linear while the server's block takes its span's forms: servers/span_forms.py)
  hop-span  the same over each server's whole half-span (15 blocks), minus that span's local compute (the local
            span tuned as a server tunes it)
  chain     full `InferenceSession.step` (both hops, called from this thread) minus both spans' local compute,
            divided by 2 (per hop)
  ping      `Swarm.ping` (the `info` RPC: a stream of its own), 50 calls per server
  floor     the same 1x1xH steps over a bare hivemind stream to an echo process holding the first server's
            1-block and whole span (bench/transport.py): what a hop costs without any of our code

LM head (client, 1 thread): `ClientHead.logits` (its final norm and LM head) against the `nn.Linear` that
`generate` runs, on the same normed hidden states, 1 to 8 rows, 30 interleaved calls each.
"""
from __future__ import annotations

import os

# one thread everywhere in this process, before torch is imported (the client's loop thread included)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

torch.set_num_threads(1)

PARAGRAPHS = [
    "The city council voted on Tuesday to turn the old rail yard into a public park. Construction starts next "
    "spring and should take two years.",
    "Honeybees communicate the location of flowers through a waggle dance. The angle of the dance shows the "
    "direction relative to the sun, and its length tells the distance. Scientists decoded this behaviour in the "
    "1940s, and it remains one of the best studied examples of symbolic communication in animals.",
    "Our quarterly report shows revenue grew by eight percent, mostly from the new subscription plan. Costs rose "
    "as well because we hired twelve engineers.",
    "A heat wave hit the southern region last week. Temperatures passed forty degrees for five days in a row, "
    "schools closed early, and hospitals reported more cases of dehydration. Officials urged residents to drink "
    "water, avoid the midday sun and check on elderly neighbours. Rain is expected to bring relief on Sunday.",
    "The library will extend its opening hours during exam season.",
    "Researchers trained a small robot to fold laundry by watching videos of people. After a week of practice it "
    "folded towels correctly nine times out of ten, but shirts with buttons still confused it.",
    "The bakery on Main Street is closing after forty years. The owners are retiring and could not find a buyer, "
    "so the last loaf will be sold on Saturday. Regular customers plan a small farewell party in front of the "
    "shop.",
    "Volcanic eruptions can cool the planet for a few years because the sulfur they release reflects sunlight. "
    "The 1991 eruption of Mount Pinatubo lowered global temperatures by about half a degree.",
]


def summarize_prompt(paragraph: str) -> str:
    """One user message asking for a one-sentence summary."""
    return f"Summarize the following paragraph in one sentence.\n\n{paragraph}"


# ---------------------------------------------------------------------------------------------------------------
# helpers


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def count_new_tokens(new: torch.Tensor, eos_ids: set[int], pad_id: int) -> int:
    """Tokens actually generated: per row, everything up to and including the first EOS (pads after it dropped)."""
    total = 0
    for row in new.tolist():
        count = 0
        for token in row:
            count += 1
            if token in eos_ids:
                break
        total += count
    return total


def resolve_model(name: str) -> Path:
    """'smollm2' is prepared in $SWARMBATCH_HOME/models (default ~/.swarmbatch); a path is validated."""
    from modelprep import prepare_model

    home = Path(os.environ.get("SWARMBATCH_HOME", Path.home() / ".swarmbatch")).expanduser()
    return prepare_model(name, cache_dir=home / "models")


class Prompts:
    """The 8 chat-templated prompts, tokenized (left padded) for batch 8 and the first one alone for batch 1."""

    def __init__(self, model_dir: Path) -> None:
        from swarmclient.textgen import load_tokenizer, render_prompt

        self.tokenizer = load_tokenizer(model_dir)
        self.texts = [render_prompt(self.tokenizer, summarize_prompt(p), chat=True) for p in PARAGRAPHS]

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.tokenizer(self.texts[:size], return_tensors="pt", padding=True, add_special_tokens=False)
        return encoded.input_ids, encoded.attention_mask

    def lengths(self) -> list[int]:
        return [int(m.sum()) for m in self.batch(len(self.texts))[1]]


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """items rotated left by shift: each rep starts with another config, so no config always runs first."""
    shift %= max(len(items), 1)
    return [*items[shift:], *items[:shift]]


RunFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(input_ids, attention_mask, n) -> the new tokens [B, n]."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Config:
    """One configuration under test: a generate function and how to count its tokens."""

    def __init__(self, name: str, run: RunFn, eos_ids: set[int], pad_id: int,
                 details: dict[str, Any] | None = None) -> None:
        self.name, self.run, self.eos_ids, self.pad_id = name, run, eos_ids, pad_id
        self.details = details if details is not None else {}  # filled by `run`: where the time went
        self.runs: dict[int, list[dict[str, Any]]] = {}

    def timed(self, batch: int, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> None:
        began = time.perf_counter()
        new = self.run(ids, mask, new_tokens)
        seconds = time.perf_counter() - began
        tokens = count_new_tokens(new, self.eos_ids, self.pad_id)
        self.runs.setdefault(batch, []).append({"seconds": seconds, "tokens": tokens, "steps": new.shape[1],
                                                **self.details})
        self.details.clear()
        log(f"  {self.name:8s} batch {batch}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")

    def result(self, batch: int) -> dict[str, Any]:
        """The median run (by wall time) of this batch size."""
        runs = self.runs[batch]
        median = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]
        return {"config": self.name, "batch": batch, **median, "tokens_per_s": median["tokens"] / median["seconds"],
                "all_seconds": [round(r["seconds"], 3) for r in runs], "all_tokens": [r["tokens"] for r in runs]}


# ---------------------------------------------------------------------------------------------------------------
# local baseline


def local_config(model_dir: Path, prompts: Prompts) -> Config:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad_id = prompts.tokenizer.pad_token_id

    def run(ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
        return out[:, ids.shape[1]:]

    return Config("local", run, eos_ids, pad_id)


# ---------------------------------------------------------------------------------------------------------------
# swarm


class StepClock:
    """Wraps an InferenceSession's step: wall time of each step and the servers' reported compute in it."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.wall: list[float] = []     # seconds of each step
        self.compute: list[float] = []  # the servers' reported compute in it

    def __call__(self, *args: Any) -> torch.Tensor:
        began = time.perf_counter()
        out = self.session.step(*args)
        self.wall.append(time.perf_counter() - began)
        self.compute.append(self.session.last_compute_seconds)
        return out

    def breakdown(self, total: float, tokens_per_row: int) -> dict[str, float]:
        """ms per token position of the whole run: servers' compute, network + server overhead, client (the rest)."""
        compute, steps = sum(self.compute), sum(self.wall)
        per = 1000 / max(tokens_per_row, 1)
        return {"server_compute_ms": compute * per, "hops_ms": (steps - compute) * per,
                "client_ms": (total - steps) * per}


def swarm_runner(model: Any, allow_eos: bool, details: dict[str, Any], micro_batches: int = 1) -> RunFn:
    from swarmclient.generation import generate_tokens
    from swarmclient.model import in_micro_batches, micro_batch_rows

    def exactly(ids: torch.Tensor, mask: torch.Tensor, n: int, params: list[Any], timed: bool) -> torch.Tensor:
        """exactly n tokens (like HF min_new_tokens): the same decode loop with no EOS to stop on"""
        with model.inference_session(batch_size=ids.shape[0], max_length=ids.shape[1] + n) as session:
            clock = StepClock(session)
            began = time.perf_counter()
            new = generate_tokens(model.head, clock, ids, mask, max_new_tokens=n, params=params,
                                  eos_token_ids=(), pad_token_id=model.pad_token_id)
            if timed:
                details.update(clock.breakdown(time.perf_counter() - began, new.shape[1]))
        return new

    def run(ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        params = model.sampling_params(ids.shape[0], False, 1.0, 1.0, 0)
        if allow_eos:
            return model.generate_new_tokens(ids, mask, max_new_tokens=n, params=params, micro_batches=micro_batches)
        if micro_batches == 1:
            return exactly(ids, mask, n, params, timed=True)
        # the micro-batches' steps overlap: no per-step breakdown
        return in_micro_batches(micro_batch_rows(mask, micro_batches), ids, mask, model.pad_token_id,
                                lambda rows, group_ids, group_mask: exactly(group_ids, group_mask, n,
                                                                            [params[r] for r in rows], timed=False))
    return run


PIN_CPUS = {"on": True}  # --no-pin turns it off: let the scheduler place the servers


def start_swarm(stack: ExitStack, name: str, model_dir: Path, spans: list[tuple[int, int]], allow_eos: bool,
                log_root: Path | None) -> tuple[Config, Any]:
    """A LocalSwarm (stopped by `stack`, also on Ctrl-C) and a client connected to it."""
    from launch.local_swarm import LocalSwarm
    from swarmclient.model import DistributedModelForCausalLM

    began = time.perf_counter()
    swarm = stack.enter_context(LocalSwarm(model_dir, spans, num_threads=1, pin_cpus=PIN_CPUS["on"],
                                           log_dir=(log_root / name) if log_root else None))
    log(f"{name}: {len(spans)} server(s) {spans} ready in {time.perf_counter() - began:.1f} s "
        f"(logs {swarm.log_dir}; pids {[s.pid for s in swarm.servers]})")
    model = stack.enter_context(DistributedModelForCausalLM.from_pretrained(model_dir,
                                                                            initial_peers=swarm.initial_peers))
    # exactly-N mode counts every column (the decode loop ignored EOS, as HF min_new_tokens does)
    eos_ids = model.eos_token_ids if allow_eos else set()
    details: dict[str, Any] = {}
    return Config(name, swarm_runner(model, allow_eos, details), eos_ids, model.pad_token_id, details), model


def summary(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"median_ms": statistics.median(ms), "p90_ms": percentile(ms, 90), "min_ms": min(ms), "n": len(ms)}


async def _timed_step(session: Any, hidden: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor
                     ) -> tuple[torch.Tensor, float]:
    """One ServerSession step, timed on the client's event loop (no cross-thread hand-off included)."""
    began = time.perf_counter()
    out = await session.step(hidden, mask, pos)
    return out, time.perf_counter() - began


def server_spare_bytes(spec: Any, span: Any) -> int:
    """The memory a float32 server with default settings, serving this loaded span here, has to spare for a second
    copy of its weights (servers/block_sizing.spare_memory, as `swarmbatch serve` computes it)."""
    from servers.block_sizing import spare_memory
    from servers.config import DType, Quant, ServerConfig

    cache_tokens = ServerConfig.__dataclass_fields__["attn_cache_tokens"].default  # a server's default budget
    return spare_memory(spec, span.device, DType.float32, Quant.none, cache_tokens, span.end - span.start)


def server_like_spans(spec: Any, hops: list[Any]) -> list[Any]:
    """Each hop's blocks loaded here, with the product forms a server keeps at start-up (servers/span_forms.py): the
    same compute as the hop's."""
    from servers.block_loading import load_span
    from servers.span_forms import tune_span

    spans = [load_span(spec, h.start, h.end) for h in hops]
    for span in spans:
        tune_span(span, spare_bytes=server_spare_bytes(spec, span))
    return spans


@torch.inference_mode()
def hop_series(model: Any, hops: list[Any], steps: int, prompt_len: int = 64) -> dict[str, Any]:
    """Open one ServerSession per hop, prefill `prompt_len` tokens, then time `steps` 1x1xH steps per hop.

    Each remote step is paired with the same blocks run locally (servers.block_loading.load_span, same shapes,
    same cache length, 1 thread), so round trip - local compute = what the hop adds on top of compute.
    """
    from swarmclient.session import ServerSession

    swarm, spec = model.swarm, model.spec
    spans = server_like_spans(spec, hops)
    caches = [span.new_caches(h.start, h.end) for span, h in zip(spans, hops, strict=True)]
    sessions = [ServerSession(swarm, h, batch_size=1, max_length=prompt_len + steps + 2) for h in hops]
    remote: list[list[float]] = [[] for _ in hops]
    compute: list[list[float]] = [[] for _ in hops]
    server_compute: list[list[float]] = [[] for _ in hops]
    try:
        for session in sessions:
            swarm.loop.run(session.open())
        hidden = torch.randn(1, prompt_len, spec.hidden_size, generator=torch.Generator().manual_seed(0))
        mask = torch.ones(1, prompt_len, dtype=torch.long)
        pos = torch.arange(prompt_len)[None]
        for step in range(steps + 1):
            for number, (session, span) in enumerate(zip(sessions, spans, strict=True)):
                out, seconds = swarm.loop.run(_timed_step(session, hidden, mask, pos))
                began = time.perf_counter()
                span(hidden, mask, pos, caches[number])
                local = time.perf_counter() - began
                if step > 0:  # step 0 is the prefill
                    remote[number].append(seconds)
                    compute[number].append(local)
                    server_compute[number].append(session.last_compute_seconds)
                hidden = out
            hidden = hidden[:, -1:, :]  # the next 1-token step (its values do not matter for timing)
            mask = torch.ones(1, mask.shape[1] + 1, dtype=torch.long)
            pos = torch.tensor([[mask.shape[1] - 1]])
    finally:
        for session in sessions:
            swarm.loop.run(session.close())
    return {"hops": [{"hop": f"{h.start}:{h.end}@{h.peer_id[-6:]}", "round_trip": summary(r),
                      "local_compute": summary(c), "overhead": summary([a - b for a, b in zip(r, c, strict=True)]),
                      "server_compute": summary(sc), "network": summary([a - b for a, b in zip(r, sc, strict=True)])}
                     for h, r, c, sc in zip(hops, remote, compute, server_compute, strict=True)]}


@torch.inference_mode()
def measure_hops(model: Any, prompts: Prompts, steps: int) -> dict[str, Any]:
    """Round trips of decode-sized (1x1xH) hops on the 2-server swarm; see the module docstring."""
    from swarmnet.data_structures import RouteHop

    swarm, spec = model.swarm, model.spec
    ids, _ = prompts.batch(1)
    prompt_len = ids.shape[1]
    route = swarm.loop.run(swarm.route(0, spec.num_blocks))
    results: dict[str, Any] = {"route": [f"{h.start}:{h.end}@{h.peer_id[-6:]}" for h in route]}
    # (1) a 1-block sub-span of each server: the least compute a real hop can carry
    results["hop_1block"] = hop_series(model, [RouteHop(h.peer_id, h.start, h.start + 1) for h in route], steps,
                                       prompt_len)
    # (2) each server's whole span (what a decode step really sends)
    results["hop_span"] = hop_series(model, route, steps, prompt_len)

    # (3) the full chain through InferenceSession.step (called from this thread, as generate does)
    spans = server_like_spans(spec, route)
    caches = [span.new_caches(h.start, h.end) for span, h in zip(spans, route, strict=True)]
    chain, compute = [], []
    with model.inference_session(batch_size=1, max_length=prompt_len + steps + 2) as session:
        hidden = model.head.embed(ids)
        mask = torch.ones(1, prompt_len, dtype=torch.long)
        pos = torch.arange(prompt_len)[None]
        for step in range(steps + 1):
            began = time.perf_counter()
            session.step(hidden, mask, pos)
            seconds = time.perf_counter() - began
            local, h = 0.0, hidden
            for span, cache in zip(spans, caches, strict=True):
                t = time.perf_counter()
                h = span(h, mask, pos, cache)
                local += time.perf_counter() - t
            if step > 0:
                chain.append(seconds)
                compute.append(local)
            hidden = model.head.embed(torch.tensor([[1]]))
            mask = torch.ones(1, mask.shape[1] + 1, dtype=torch.long)
            pos = torch.tensor([[mask.shape[1] - 1]])
    results["chain"] = {"step": summary(chain), "local_compute": summary(compute),
                        "overhead_per_hop": summary([(a - b) / len(route) for a, b in zip(chain, compute, strict=True)])}

    # (4) the info RPC
    results["ping"] = {h.peer_id[-6:]: summary([swarm.loop.run(swarm.ping(h.peer_id)) for _ in range(50)])
                       for h in route}

    # (5) the transport floor: the same steps over a bare stream to an echo of the first server's blocks
    from transport import raw_hop_costs

    first, cpu = route[0], 0 if PIN_CPUS["on"] else None
    results["raw"] = [{"blocks": f"{first.start}:{end}",
                       "network": summary(raw_hop_costs(spec.path, first.start, end, steps, cpu))}
                      for end in (first.start + 1, first.end)]
    return results


# ---------------------------------------------------------------------------------------------------------------
# report


@torch.inference_mode()
def measure_head(model_dir: Path, rows: Sequence[int] = (1, 2, 3, 4, 8), calls: int = 30) -> list[dict[str, Any]]:
    """ms per LM-head call: `ClientHead.logits` vs the model's `nn.Linear` over the same rows (see the docstring)."""
    import torch.nn.functional as F

    from swarmnet.head import ClientHead
    from swarmnet.model_spec import ModelSpec

    head = ClientHead(ModelSpec.open(model_dir))
    results = []
    for count in rows:
        hidden = torch.randn(count, 1, head.lm_head.in_features, generator=torch.Generator().manual_seed(count))
        timings: dict[str, list[float]] = {"linear": [], "client": []}
        for _ in range(calls):
            calls_now = (("linear", lambda: F.linear(head.norm(hidden), head.lm_head.weight)),  # noqa: B023 - run now
                         ("client", lambda: head.logits(hidden)))  # noqa: B023 - run in this iteration
            for name, call in calls_now:
                began = time.perf_counter()
                call()
                timings[name].append(time.perf_counter() - began)
        results.append({"rows": count, "linear": summary(timings["linear"]), "client": summary(timings["client"])})
    return results


def paired_ratios(row: dict[str, Any], local: dict[str, Any] | None) -> list[float]:
    """Per rep: (tokens/s of this config) / (tokens/s of local in the same rep)."""
    if local is None:
        return []
    return [(tokens / seconds) / (local_tokens / local_seconds) for tokens, seconds, local_tokens, local_seconds
            in zip(row["all_tokens"], row["all_seconds"], local["all_tokens"], local["all_seconds"], strict=True)]


def ratio_of_totals(row: dict[str, Any], local: dict[str, Any] | None) -> float:
    """All reps together: (tokens / seconds of this config) / (tokens / seconds of local)."""
    if local is None:
        return float("nan")
    return (sum(row["all_tokens"]) / sum(row["all_seconds"])) / (sum(local["all_tokens"]) / sum(local["all_seconds"]))


def print_head(head: list[dict[str, Any]]) -> None:
    print()
    print("LM head, ms per call (median of 30, 1 thread): the nn.Linear that `generate` runs vs ClientHead.logits")
    print("| rows | nn.Linear | ClientHead.logits | speedup |")
    print("|---|---|---|---|")
    for r in head:
        linear, client = r["linear"]["median_ms"], r["client"]["median_ms"]
        print(f"| {r['rows']} | {linear:.2f} | {client:.2f} | {linear / client:.2f}x |")


def print_report(rows: list[dict[str, Any]], hops: dict[str, Any] | None, meta: dict[str, Any]) -> None:
    local_rows = {r["batch"]: r for r in rows if r["config"] == "local"}
    print()
    print(f"model {meta['model']} ({meta['num_blocks']} blocks), {meta['new_tokens']} new tokens, greedy, "
          f"prompt lengths {meta['prompt_lengths']}, reps {meta['reps']}, "
          f"{'EOS allowed' if meta['allow_eos'] else 'exactly N tokens'}")
    print()
    print("| config | batch | tokens | seconds | tokens/s | ratio vs local | paired ratio [p25, p75] | ratio of totals |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        local_row = local_rows.get(r["batch"])
        ratio = r["tokens_per_s"] / local_row["tokens_per_s"] if local_row else float("nan")
        ratios = paired_ratios(r, local_row)
        r["ratio_vs_local"] = ratio
        r["paired_ratios"] = ratios
        r["paired_ratio"] = statistics.median(ratios) if ratios else float("nan")
        r["ratio_of_totals"] = ratio_of_totals(r, local_row)
        print(f"| {r['config']} | {r['batch']} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{ratio:.2f}x | {r['paired_ratio']:.2f}x [{percentile(ratios, 25):.2f}, {percentile(ratios, 75):.2f}] | "
              f"{r['ratio_of_totals']:.2f}x |")
    print("(ratio: of the median runs; paired ratio: median over reps of this rep's local time / its time, with its"
          " quartiles; ratio of totals: all reps' tokens / seconds against local's. The configs' order rotates"
          " each rep, so none always runs first)")
    split = [r for r in rows if "server_compute_ms" in r]
    if split:
        print()
        print("Where a swarm's time went (median run, ms per generated position, prefill included):")
        print("| config | batch | servers' compute | hops (step - compute) | client (LM head, sampling, hand-off) |")
        print("|---|---|---|---|---|")
        for r in split:
            print(f"| {r['config']} | {r['batch']} | {r['server_compute_ms']:.1f} | {r['hops_ms']:.1f} | "
                  f"{r['client_ms']:.1f} |")
    if not hops:
        return
    print()
    print(f"Per-hop round trip, 2-server swarm, batch 1, 1x1xH decode steps (route {', '.join(hops['route'])}):")

    def line(label: str, s: dict[str, float]) -> str:
        return f"- {label}: median {s['median_ms']:.2f} ms, p90 {s['p90_ms']:.2f} ms (n={s['n']})"

    for key, title in (("hop_1block", "1-block sub-span session"), ("hop_span", "whole-span session")):
        for hop in hops[key]["hops"]:
            print(line(f"{title} {hop['hop']}: round trip", hop["round_trip"]))
            print(line(f"{title} {hop['hop']}: local compute of the same blocks", hop["local_compute"]))
            print(line(f"{title} {hop['hop']}: round trip - local compute", hop["overhead"]))
            print(line(f"{title} {hop['hop']}: compute reported by the server", hop["server_compute"]))
            print(line(f"{title} {hop['hop']}: **hop cost = round trip - server compute**", hop["network"]))
    chain = hops["chain"]
    print(line("full chain InferenceSession.step (2 hops)", chain["step"]))
    print(line("full chain local compute (both spans)", chain["local_compute"]))
    print(line("full chain (step - compute) / 2 hops", chain["overhead_per_hop"]))
    for peer, s in hops["ping"].items():
        print(line(f"Swarm.ping (info RPC) ...{peer}", s))
    for raw in hops["raw"]:
        print(line(f"transport floor: bare-stream echo of blocks {raw['blocks']} (bench/transport.py), "
                   "round trip - its compute", raw["network"]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (prepared in $SWARMBATCH_HOME/models) or a model dir")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma separated (at most 8)")
    parser.add_argument("--configs", default="local,swarm-1,swarm-2", help="which configs to run")
    parser.add_argument("--hop-steps", type=int, default=50, help="decode steps timed for the hop round trip")
    parser.add_argument("--allow-eos", action="store_true", help="swarm: stop at EOS (model.generate_new_tokens)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin each server to its own core")
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    args = parser.parse_args(argv)
    PIN_CPUS["on"] = not args.no_pin
    batches = [int(b) for b in args.batches.split(",")]
    configs = args.configs.split(",")

    # SIGTERM behaves like Ctrl-C, so the LocalSwarm context managers stop every process we started
    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)

    model_dir = resolve_model(args.model)
    from swarmnet.model_spec import ModelSpec

    num_blocks = ModelSpec.open(model_dir).num_blocks
    prompts = Prompts(model_dir)
    meta = {"model": str(model_dir), "num_blocks": num_blocks, "new_tokens": args.new_tokens, "reps": args.reps,
            "prompt_lengths": prompts.lengths(), "allow_eos": args.allow_eos, "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count()}
    log(f"model {model_dir}: {num_blocks} blocks; prompt lengths {meta['prompt_lengths']}; "
        f"torch threads {torch.get_num_threads()}")

    configs_run: list[Config] = []
    hops = None
    head: list[dict[str, Any]] = []
    try:
        with ExitStack() as stack:
            # every configuration stays up at once and the timed runs are interleaved (rep by rep), so a
            # disturbance from other work on the machine hits all of them alike; the median run is reported
            if "local" in configs:
                configs_run.append(local_config(model_dir, prompts))
            two_servers = None
            if "swarm-1" in configs:
                configs_run.append(start_swarm(stack, "swarm-1", model_dir, [(0, num_blocks)], args.allow_eos,
                                               args.log_dir)[0])
            if "swarm-2" in configs or "swarm-2-mb2" in configs:
                half = num_blocks // 2
                config, two_servers = start_swarm(stack, "swarm-2", model_dir, [(0, half), (half, num_blocks)],
                                                  args.allow_eos, args.log_dir)
                if "swarm-2" in configs:
                    configs_run.append(config)
                if "swarm-2-mb2" in configs:  # the same servers, each batch as 2 micro-batches at once
                    configs_run.append(Config("swarm-2-mb2", swarm_runner(two_servers, args.allow_eos, {}, 2),
                                              config.eos_ids, config.pad_id))
            for config in configs_run:  # warm-up: a short generation per batch size
                for batch in batches:
                    config.run(*prompts.batch(batch), 4)
            log(f"warm-up done; timing {args.reps} rep(s) of {[c.name for c in configs_run]} x batch {batches}")
            for rep in range(args.reps):
                for batch in batches:
                    ids, mask = prompts.batch(batch)
                    for config in rotated(configs_run, rep):
                        config.timed(batch, ids, mask, args.new_tokens)
            if two_servers is not None and args.hop_steps > 0:
                log("measuring the per-hop round trip on swarm-2")
                hops = measure_hops(two_servers, prompts, args.hop_steps)
            log("timing the client's LM head")
            head = measure_head(model_dir)
            if os.environ.get("BENCH_PAUSE"):  # for attaching a profiler: keep the swarms up
                input(f"paused; client pid {os.getpid()}; press Enter to stop")
            log("stopping the swarms")
    except KeyboardInterrupt:
        print("interrupted; every process started here has been stopped", file=sys.stderr)
        return 130
    rows = [config.result(batch) for batch in batches for config in configs_run]
    print_report(rows, hops, meta)
    print_head(head)
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": rows, "hop_rtt": hops, "lm_head": head}, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
