"""Benchmark: a decode step on a server's span with its own KV cache (grows in place) against transformers' cache
(`DynamicLayer`, which concatenates the whole past at every step), by batch and cached length.

For each model, batch and cached length: the span (half of the model's blocks, as each of 2 servers holds) takes a
left-padded random prompt of that length into both kinds of cache, then decode steps are timed in turns, one kind then
the other (--reps turns of --loops steps each; median per step). Both compute the same outputs bit for bit
(tests/servers/test_kv_cache.py); the ratio is the concatenating cache's step time over the growing one's. One torch
thread, as the benches' servers run.

"tiny" is the WAN bench's model (`write_tiny_model(layers=8, hidden_size=256)`: 4 blocks here); "smollm2" is
SmolLM2-135M-Instruct (15 of its 30 blocks), prepared under $SWARMBATCH_HOME/models like bench/swarm.py's.

usage: python bench/kv_cache.py [--models tiny,smollm2] [--batches 1,8,16] [--lengths 64,512,2048] [--reps 7]
       [--loops 4]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from swarm import resolve_model  # bench/ is the script's folder, first on sys.path
from timing import median_call_seconds
from transformers import DynamicCache

from modelprep import write_tiny_model
from servers.block_loading import load_span
from servers.span import BlockSpan
from swarmnet.model_spec import ModelSpec


class Decoder:
    """One session's decode steps on `span`, from a prompt of `length` tokens, on caches of one kind."""

    def __init__(self, span: BlockSpan, caches: list[DynamicCache], batch: int, length: int) -> None:
        self.span, self.caches = span, caches
        self.mask = torch.ones(batch, length, dtype=torch.long)
        for row in range(batch):
            self.mask[row, :row] = 0  # a padded batch: row r has r pads on the left
        self.positions = (self.mask.cumsum(1) - 1).clamp(min=0)
        generator = torch.Generator().manual_seed(0)
        self.token = torch.randn(batch, 1, span.spec.hidden_size, generator=generator)
        for low in range(0, length, 256):  # the prompt in chunks, as a long prefill would not fit one call's memory
            high = min(length, low + 256)
            span(torch.randn(batch, high - low, span.spec.hidden_size, generator=generator),
                 self.mask[:, :high], self.positions[:, low:high], caches)
        self.positions = self.positions[:, -1:]

    def step(self) -> None:
        self.mask = torch.cat([self.mask, torch.ones(self.mask.shape[0], 1, dtype=torch.long)], 1)
        self.positions = self.positions + 1
        self.span(self.token, self.mask, self.positions, self.caches)


def model_span(name: str, workdir: Path) -> BlockSpan:
    path = write_tiny_model(workdir / "tiny", layers=8, hidden_size=256) if name == "tiny" else resolve_model(name)
    spec = ModelSpec.open(path)
    return load_span(spec, 0, spec.num_blocks // 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--lengths", default="64,512,2048")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--loops", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"decode step ms (median of {args.reps} turns of {args.loops} steps, 1 thread); ratio = "
          "concatenating / growing")
    print("| model | blocks | batch | cached | transformers' cache | growing cache | ratio |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models.split(","):
            span = model_span(name, Path(workdir))
            for batch in (int(b) for b in args.batches.split(",")):
                for length in (int(n) for n in args.lengths.split(",")):
                    room = length + args.reps * args.loops * 2 + 8
                    plain = Decoder(span, [DynamicCache() for _ in range(span.start, span.end)], batch, length)
                    growing = Decoder(span, span.new_caches(span.start, span.end, room), batch, length)
                    times: dict[str, list[float]] = {"plain": [], "growing": []}
                    for _ in range(args.reps):
                        for kind, decoder in (("plain", plain), ("growing", growing)):
                            times[kind].append(median_call_seconds(decoder.step, reps=1, loops=args.loops))
                    concat_ms, grow_ms = (statistics.median(t) * 1000 for t in times.values())
                    print(f"| {name} | {span.end - span.start} | {batch} | {length} | {concat_ms:.2f} | "
                          f"{grow_ms:.2f} | {concat_ms / grow_ms:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
