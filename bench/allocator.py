"""Benchmark: a server's steps with glibc's default allocator settings against swarmnet/allocator.py's.

Each turn runs, in a fresh process with one torch thread, what a server of half of SmolLM2's blocks does for the
default job's lanes: 4 sessions of 21 rows, each a left-padded prefill of 80-140 tokens then 16 decode steps
(bench/kv_cache.py's Decoder; "tiny" is the WAN bench's model). Once with
`keep_freed_memory()` (what every `swarmbatch` command sets), once with SWARMBATCH_MALLOC_TUNING=0 (glibc's defaults),
alternating, --reps turns each. Reported per mode: wall, user and system CPU seconds and page faults (median); the
ratio is the defaults' wall time over the tuned one's.

usage: python bench/allocator.py [--model smollm2|tiny] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TURN = """
import json, resource, sys, tempfile, time
from pathlib import Path
sys.path[:0] = [{root!r}, {bench!r}]
import torch
from swarmnet.allocator import keep_freed_memory
keep_freed_memory()
torch.set_num_threads(1)
from kv_cache import Decoder, model_span
work = tempfile.TemporaryDirectory()  # removed when the turn ends
span = model_span({model!r}, Path(work.name))

def session(rows, length, decode):
    decoder = Decoder(span, span.new_caches(span.start, span.end, length + decode), rows, length)
    for _ in range(decode):
        decoder.step()

session(21, 100, 4)  # warm-up
before, began = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for lane in range(4):
    session(21, 80 + 20 * lane, 16)
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({{"wall": time.perf_counter() - began, "user": after.ru_utime - before.ru_utime,
                  "system": after.ru_stime - before.ru_stime, "faults": after.ru_minflt - before.ru_minflt}}))
"""


def turn(model: str, tuned: bool) -> dict[str, float]:
    """One turn in a fresh process: its wall, user and system seconds and page faults."""
    env = {**os.environ, "SWARMBATCH_MALLOC_TUNING": "1" if tuned else "0", "OMP_NUM_THREADS": "1"}
    script = TURN.format(root=str(ROOT), bench=str(ROOT / "bench"), model=model)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"glibc defaults": [], "keep_freed_memory": []}
    for rep in range(args.reps):
        for tuned in ((False, True) if rep % 2 == 0 else (True, False)):
            label = "keep_freed_memory" if tuned else "glibc defaults"
            runs[label].append(turn(args.model, tuned))
            print(f"rep {rep}: {label}: {json.dumps(runs[label][-1])}", flush=True)
    print(f"\n{args.model}, half of its blocks, 4 lanes of 21 rows (prefill 80-140 tokens + 16 decode steps), one thread; "
          f"median of {args.reps}")
    print("| allocator | wall s | user s | system s | page faults |")
    print("|---|---|---|---|---|")
    median = {label: {key: statistics.median(run[key] for run in rows) for key in rows[0]} for label, rows in runs.items()}
    for label, m in median.items():
        print(f"| {label} | {m['wall']:.2f} | {m['user']:.2f} | {m['system']:.2f} | {m['faults']:.0f} |")
    print(f"defaults' wall time / keep_freed_memory's: "
          f"{median['glibc defaults']['wall'] / median['keep_freed_memory']['wall']:.3f}")


if __name__ == "__main__":
    main()
