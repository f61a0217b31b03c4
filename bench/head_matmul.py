"""Benchmark: the LM head's product in its two forms, by row count, and the form the client's head keeps.

`F.linear(x, W)` and `(W · xᵀ)ᵀ` compute the same logits from the same weight; MKL's speed for each depends on the row
count and the CPU. For each row count this times both (interleaved, median of --reps), then what
`swarmnet.head_matmul.HeadMatmul` returns after it timed the forms itself, against F.linear: the ratio is the head's
speed-up at that row count (1.00 where it keeps F.linear). Random weights of the model's head shape (the speed does
not depend on the values), float32, one thread unless --threads.

usage: python bench/head_matmul.py [--vocab 49152] [--hidden 576] [--rows 1,2,3,4,6,8,12,16,64] [--reps 15]
       [--threads 1]
"""
from __future__ import annotations

import argparse
from functools import partial

import torch
from timing import median_call_seconds  # bench/ is the script's folder, first on sys.path

from swarmnet.head_matmul import HeadMatmul
from swarmnet.product_forms import linear, transposed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16,64")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weight = torch.randn(args.vocab, args.hidden)
    head = HeadMatmul(weight)
    print(f"LM head {args.vocab} x {args.hidden} float32, {args.threads} thread(s), median of {args.reps}")
    print("| rows | F.linear ms | (W xᵀ)ᵀ ms | HeadMatmul keeps | HeadMatmul ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for count in (int(r) for r in args.rows.split(",")):
        x = torch.randn(count, args.hidden)
        head(x)  # times the forms on first sight of this row count
        runs = (partial(linear, x, weight), partial(transposed, x, weight), partial(head, x))
        for run in runs:
            run()  # warm
        plain, other, chosen = (median_call_seconds(run, reps=args.reps) * 1000 for run in runs)
        kept = head.choices.get(count, "linear (untimed)")
        print(f"| {count} | {plain:.2f} | {other:.2f} | {kept} | {chosen:.2f} | {plain / chosen:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
