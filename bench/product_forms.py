"""Benchmark: a server span's decode steps with its tuned product forms against the same span with F.linear.

Loads the model's blocks [--start, --end) twice, float32, one thread: one span as a server tunes it at start-up
(servers.span_forms.tune_span, with the memory a server with default settings would have to spare here, or none:
--one-copy), one left with F.linear.
For each row count it prefills --context tokens in each span's own caches, then times --steps decode steps of each
span, interleaved step by step (so drift on the machine hits both alike), and prints the median ms of each, their
ratio, and the largest difference of the outputs relative to their largest value (float rounding: about 1e-6).

usage: python bench/product_forms.py [--model smollm2|PATH] [--start 0] [--end 15] [--rows 1,2,3,4,8]
       [--context 64] [--steps 24] [--one-copy]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread, before torch is imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from swarm import resolve_model, server_spare_bytes  # noqa: E402  (bench/ is the script's folder, first on sys.path)

from servers.block_loading import load_span  # noqa: E402
from servers.span import BlockSpan  # noqa: E402
from servers.span_forms import tune_span  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402


def timed_decode(spans: tuple[BlockSpan, BlockSpan], rows: int, context: int, steps: int
                 ) -> tuple[list[float], list[float], float]:
    """Per-step seconds of each span (interleaved) and the outputs' largest relative difference."""
    hidden_size = spans[0].spec.hidden_size
    generator = torch.Generator().manual_seed(rows)
    caches = [span.new_caches(span.start, span.end) for span in spans]
    prompt = torch.randn(rows, context, hidden_size, generator=generator)
    for span, cache in zip(spans, caches, strict=True):
        span(prompt, torch.ones(rows, context, dtype=torch.long), torch.arange(context).expand(rows, -1), cache)
    seconds: tuple[list[float], list[float]] = ([], [])
    difference = 0.0
    for step in range(steps):
        x = torch.randn(rows, 1, hidden_size, generator=generator)
        mask = torch.ones(rows, context + step + 1, dtype=torch.long)
        positions = torch.full((rows, 1), context + step)
        outputs = []
        for span, cache, spent in zip(spans, caches, seconds, strict=True):
            began = time.perf_counter()
            outputs.append(span(x, mask, positions, cache))
            spent.append(time.perf_counter() - began)
        difference = max(difference, float((outputs[0] - outputs[1]).abs().max() / outputs[1].abs().max()))
    return seconds[0], seconds[1], difference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--end", type=int, default=15)
    parser.add_argument("--rows", default="1,2,3,4,8")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--one-copy", action="store_true",
                        help="tune as a server without memory to spare for a second copy of the weights")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = ModelSpec.open(resolve_model(args.model))
    tuned, plain = load_span(spec, args.start, args.end), load_span(spec, args.start, args.end)
    began = time.perf_counter()
    table = tune_span(tuned, spare_bytes=0 if args.one_copy else server_spare_bytes(spec, tuned))
    if table is None:
        raise SystemExit(f"blocks {args.start}:{args.end} of {spec.path.name} are not tuned (too small, or not float32)")
    print(f"blocks {args.start}:{args.end} of {spec.path.name}, float32, 1 thread; tuned in "
          f"{time.perf_counter() - began:.1f} s: {table.describe()}")
    print(f"decode steps after {args.context} tokens, median of {args.steps}, interleaved")
    print("| rows | form kept | F.linear ms | tuned ms | tuned / F.linear | largest difference |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        tuned_s, plain_s, difference = timed_decode((tuned, plain), rows, args.context, args.steps)
        tuned_ms, plain_ms = statistics.median(tuned_s) * 1000, statistics.median(plain_s) * 1000
        print(f"| {rows} | {table.form(rows)} | {plain_ms:.1f} | {tuned_ms:.1f} | "
              f"{tuned_ms / plain_ms:.2f}x | {difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
