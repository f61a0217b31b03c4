"""Benchmark: issue 30's performance targets in one command, one table.

Run:  .venv/bin/python bench/perf.py [--only a,b,c,d] [--quick] [--out perf.json] [--log-dir DIR]

Each row runs an existing benchmark script as a subprocess (its raw output and JSON go to the log dir, printed
first) and reads its JSON back; every ratio is measured side by side in that script's run:
  a  the user's default job against local generate: `bench/throughput.py --cli-path` (SmolLM2, 64 chat requests x
     64 new tokens, mixed prompt lengths, a `swarmbatch worker` process with default settings (Celery, embedded
     broker), 2 unpinned servers; `--user-path` runs the worker's code in process instead) against transformers
     generate of the same prompts at batch 64 with 2 threads, interleaved; job tok/s / local tok/s >= 0.9
  b  checked outputs: `bench/throughput.py --verify-fractions 0.02` (4 servers, two holders of each half);
     cost = 1 - the median over 5 reps of (tok/s with F = 0.02 / tok/s without checks, run one after the other)
     <= 3 % (the best runs' cost is shown beside it)
  c  loopback: `bench/swarm.py --configs local,swarm-2,swarm-2-mb2 --batches 1,8`: the paired ratio (median over
     reps) of 2 pinned servers against local generate (1 thread), batch 1 and 8, one session and (b8) 2 micro-batches
     at once, >= 1.0
  d  a WAN: `bench/wan.py --models tiny --servers 2 --rtts 50 --batches 1,8` (root, network namespaces): the
     ring's ms/token (push on, the last server started with --ring: servers/ring.py) against the push floor
     (hops + 1) / 2 x RTT (the RTT `ping -U` measured in the lab) <= 1.1x; push alone and push off beside it
About 13-16 minutes on the project's 2-core VM; --quick runs far smaller sizes in about 3 minutes (a smoke check:
its figures are not the targets' figures).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    """One line of the table: a target, what was measured (with its baseline from the same run), the goal."""

    target: str
    measured: str
    goal: str
    met: bool | None  # None: not measured (failed, or not possible on this machine)


@dataclass(frozen=True)
class Bench:
    """One sub-benchmark: the script's arguments (full, quick) and how its JSON becomes rows."""

    key: str
    title: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    rows: Callable[[Any], list[Row]]
    timeout: float  # seconds, full size


def user_path_rows(data: dict[str, Any]) -> list[Row]:
    """Row a: the default job against local generate (best runs, and the per-rep ratios)."""
    local_label = "local transformers generate, whole batch, 2 threads"
    job = next(best["tokens_per_s"] for label, best in data["best"].items() if label != local_label)
    local = data["best"][local_label]["tokens_per_s"]
    ratio = job / local
    paired = ", ".join(f"{r:.2f}" for r in data["paired"])
    return [Row("default job vs local generate b64", f"**{ratio:.2f}x** (job {job:.1f} vs local {local:.1f} tok/s, "
                f"best of {data['settings']['reps']}; per rep {paired})", ">= 0.9x", ratio >= 0.9)]


def verify_rows(data: dict[str, Any]) -> list[Row]:
    """Row b: the cost of checked outputs at each fraction against no checks: the median of the paired reps (each rep
    runs both, one after the other; at F = 0.02 a run makes ~10 checks, so single runs swing by several %), with the
    best runs' cost beside it."""
    off = data["best"]["no checks"]["tokens_per_s"]
    rows = []
    for label, best in data["best"].items():
        if label == "no checks":
            continue
        paired = data["paired"][label]
        cost = 1 - statistics.median(paired)
        checks = data["checks"][label]
        rows.append(Row(f"checked outputs cost, F = {label.split()[-1]}",
                        f"**{cost * 100:.1f} %** (median of {len(paired)} paired reps: "
                        f"{', '.join(f'{r:.3f}' for r in paired)}; best runs {best['tokens_per_s']:.1f} vs no checks "
                        f"{off:.1f} tok/s, {(1 - best['tokens_per_s'] / off) * 100:.1f} %; {checks['verified']} hop "
                        f"steps verified, {checks['mismatches']} mismatches; texts identical: "
                        f"{'yes' if data['same_texts'] else 'NO'})", "<= 3 %", cost <= 0.03 and data["same_texts"]))
    return rows


LOOPBACK_LABELS = {"swarm-2": "loopback 2 servers vs local",
                   "swarm-2-mb2": "loopback 2 servers, 2 micro-batches (ClientConfig.micro_batches=2) vs local"}


def loopback_rows(data: dict[str, Any]) -> list[Row]:
    """Row c: 2 servers against local generate, paired per rep, at each batch size."""
    local = {r["batch"]: r for r in data["results"] if r["config"] == "local"}
    rows = []
    for r in data["results"]:
        if r["config"] not in LOOPBACK_LABELS or (r["config"] == "swarm-2-mb2" and r["batch"] == 1):
            continue  # at batch 1, 2 micro-batches are one: swarm-2's row
        ratios = r["paired_ratios"]
        spread = f"reps {min(ratios):.2f}–{max(ratios):.2f}, " if ratios else ""
        rows.append(Row(f"{LOOPBACK_LABELS[r['config']]}, b{r['batch']}",
                        f"**{r['paired_ratio']:.2f}x** paired ({spread}{r['tokens_per_s']:.1f} vs local "
                        f"{local[r['batch']]['tokens_per_s']:.1f} tok/s, median of {len(ratios)} reps)", ">= 1.0x",
                        r["paired_ratio"] >= 1.0))
    return rows


def push_floor(hops: int, rtt_ms: float) -> float:
    """The least ms/token push allows: a step crosses hops + 1 links of RTT / 2 each (client, servers, client)."""
    return (hops + 1) / 2 * rtt_ms


def wan_rows(data: list[dict[str, Any]]) -> list[Row]:
    """Row d: per (RTT, batch), the median ms/token over reps against the push floor at the pinged RTT: the ring's
    runs where they ran (servers/ring.py: the default of a greedy client where the last server holds the head), with
    push alone and push off beside them; else push's."""
    groups: dict[tuple[int, int, bool], list[dict[str, Any]]] = {}
    for run in data:
        if run["push"]:
            groups.setdefault((run["rtt"], run["batch"], bool(run.get("ring"))), []).append(run)
    rows = []
    for rtt, batch in sorted({(rtt, batch) for rtt, batch, _ in groups}):
        runs = groups.get((rtt, batch, True)) or groups[rtt, batch, False]
        ms = statistics.median(run["ms_per_token"] for run in runs)
        ping = statistics.median(run["ping_ms"] for run in runs)
        floor = push_floor(runs[0]["hops"], ping)
        pushed = [r["ms_per_token"] for r in groups.get((rtt, batch, False), [])] if runs[0].get("ring") else []
        off = [r["ms_per_token"] for r in data if not r["push"] and (r["rtt"], r["batch"]) == (rtt, batch)]
        beside = "".join(f"; {name} {statistics.median(values):.1f}" for name, values in
                         (("push without the ring", pushed), ("push off", off)) if values)
        how = "the ring, " if runs[0].get("ring") else ""
        rows.append(Row(f"WAN {runs[0]['servers']} servers, {rtt} ms RTT, b{batch}",
                        f"**{ms / floor:.2f}x** ({how}{ms:.1f} ms/token on a {floor:.1f} ms floor: {runs[0]['hops']} "
                        f"hops, ping {ping:.1f} ms; median of {len(runs)}{beside})", "<= 1.1x", ms / floor <= 1.1))
    return rows


BENCHES = (
    Bench("a", "default job vs local generate", "throughput.py", ("--cli-path", "--reps", "3"),
          ("--cli-path", "--requests", "8", "--max-tokens", "8", "--reps", "1"), user_path_rows, 1800),
    Bench("b", "checked outputs", "throughput.py", ("--verify-fractions", "0.02", "--max-tokens", "32", "--reps", "5"),
          ("--verify-fractions", "0.02", "--requests", "8", "--max-tokens", "8", "--batch-size", "8", "--reps", "1"),
          verify_rows, 1800),
    Bench("c", "loopback", "swarm.py", ("--configs", "local,swarm-2,swarm-2-mb2", "--batches", "1,8", "--reps", "7",
                                        "--hop-steps", "0"),
          ("--configs", "local,swarm-2,swarm-2-mb2", "--batches", "1,8", "--reps", "1", "--new-tokens", "8",
           "--hop-steps", "0"),
          loopback_rows, 1800),
    Bench("d", "WAN", "wan.py", ("--models", "tiny", "--servers", "2", "--rtts", "50", "--batches", "1,8",
                                 "--reps", "3"),
          ("--models", "tiny", "--servers", "2", "--rtts", "50", "--batches", "1,8", "--reps", "1", "--tokens", "8"),
          wan_rows, 900),
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_bench(bench: Bench, quick: bool, log_dir: Path) -> tuple[list[Row], str]:
    """Run one sub-benchmark's script, its output to log_dir; (its rows, its command line with its minutes and the
    machine's load average before and after: other work on a shared machine shows there)."""
    out = log_dir / f"{bench.key}.json"
    command = [sys.executable, str(ROOT / "bench" / bench.script), *(bench.quick if quick else bench.full),
               "--out", str(out)]
    shown = " ".join(["python", f"bench/{bench.script}", *(bench.quick if quick else bench.full)])
    if bench.key == "d" and (reason := netlab_unavailable()) is not None:
        return [Row(f"WAN ({bench.title})", f"not run: {reason}", "<= 1.1x", None)], f"`{shown}`"
    log(f"{bench.key} ({bench.title}): {shown}  (log {log_dir / f'{bench.key}.log'})")
    began, load = time.perf_counter(), os.getloadavg()[0]
    with open(log_dir / f"{bench.key}.log", "wb") as output:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (
                                    str(ROOT), os.environ.get("PYTHONPATH"))))})
        code = wait(proc, bench.timeout / (4 if quick else 1))
    log(f"{bench.key}: exit {code} after {time.perf_counter() - began:.0f} s")
    shown = f"`{shown}`: {(time.perf_counter() - began) / 60:.1f} min, load average {load:.1f} → {os.getloadavg()[0]:.1f}"
    if code != 0 or not out.exists():
        return [Row(bench.title, f"failed: exit {code} (see {log_dir / f'{bench.key}.log'})", "", None)], shown
    return bench.rows(json.loads(out.read_text())), shown


def wait(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """The exit code; past `timeout`, Ctrl-C (the scripts stop their servers on it), then a kill after 2 minutes."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 124


def netlab_unavailable() -> str | None:
    """Why bench/wan.py cannot build its network namespaces here, or None."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))
    from netlab.lab import unavailable

    return unavailable()


def markdown_table(rows: Sequence[Row]) -> str:
    """target | measured | goal | met? as a markdown table (met: yes, NO, or a dash when not measured)."""
    lines = ["| target | measured (baseline from the same run) | goal | met? |", "|---|---|---|---|"]
    for row in rows:
        met = "—" if row.met is None else ("yes" if row.met else "**NO**")
        lines.append(f"| {row.target} | {row.measured} | {row.goal} | {met} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """What the figures depend on: cores, torch's default threads, the load when asked."""
    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="a,b,c,d", help="which rows to run, e.g. a,c")
    parser.add_argument("--quick", action="store_true", help="much smaller sizes: a smoke check, not the targets")
    parser.add_argument("--out", type=Path, default=None, help="write every row as JSON here")
    parser.add_argument("--log-dir", type=Path, default=None, help="each script's output (default: a temp dir)")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHES if b.key in args.only.split(",")]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="swarmbatch-perf-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"logs of each benchmark in {log_dir}")
    before, began = machine(), time.perf_counter()
    rows, commands = [], {}
    for bench in chosen:
        bench_rows, commands[bench.key] = run_bench(bench, args.quick, log_dir)
        rows += bench_rows
    minutes = (time.perf_counter() - began) / 60
    after = machine()
    print()
    print(f"Issue 30's targets, {time.strftime('%Y-%m-%d %H:%M')}, {before['cpus']} CPUs, torch {before['torch']} "
          f"({before['torch_threads']} threads by default), load average {before['load_avg_1m']} before and "
          f"{after['load_avg_1m']} after; {minutes:.1f} minutes"
          + ("; **--quick: small sizes, not the targets' figures**" if args.quick else ""))
    print()
    print(markdown_table(rows))
    print()
    for key, command in commands.items():
        print(f"- {key}: {command}")
    print(f"\nlogs: {log_dir}")
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": before,
                                        "load_avg_after": after["load_avg_1m"], "minutes": minutes,
                                        "quick": args.quick, "commands": commands, "log_dir": str(log_dir),
                                        "rows": [asdict(row) for row in rows]}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
