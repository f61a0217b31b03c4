"""Measure how far two HONEST servers' outputs differ, per precision: what the verification tolerance must allow.

A server computes a session's steps on its KV cache (a prefill, then one token at a time, sometimes merged with
other sessions' decode steps); a verifier recomputes a hop with the stateless `forward` of the whole input
history. Both are honest, so they differ by rounding only. For each precision this runs, in process, on the same
weights (two servers of one precision load identical ones):
  - a left-padded batch of 4 prompts of mixed lengths: prefill, then greedy decode steps on the cache;
  - two sessions whose decode steps are merged into one forward (servers/batching.run_merged), as a busy server
    does;
and compares every step's output with the stateless forward of its history (the whole batch, and row by row as
a verifier sends an oversized history), as swarmclient.verification_policy.relative_error. It also prints the error
that Gaussian noise of a few sizes would make (what SWARMBATCH_FAULT_INJECTION=noise:STD adds), and the error
between a float32 and a bfloat16 server.

usage: python bench/verify_tolerance.py [--model smollm2|PATH] [--steps 24] [--precisions float32,bfloat16,int8,nf4]
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from servers.batching import DecodeStep, run_merged  # noqa: E402
from servers.block_loading import load_span  # noqa: E402
from servers.config import DType, Quant  # noqa: E402
from servers.span import BlockSpan  # noqa: E402
from swarmclient.generation import prefill_positions  # noqa: E402
from swarmclient.textgen import load_tokenizer  # noqa: E402
from swarmclient.verification_policy import relative_error  # noqa: E402
from swarmnet.head import ClientHead  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402

PROMPTS = ["The lighthouse keeper looked at the sea and said", "Once upon a time",
           "Write a long story about a robot who learns to paint, with many details about colors and light:",
           "1, 2, 3,"]
PRECISIONS = {"float32": (DType.float32, Quant.none), "bfloat16": (DType.bfloat16, Quant.none),
              "int8": (DType.float32, Quant.int8), "nf4": (DType.float32, Quant.nf4)}


class Session:
    """A session on a span: its inputs so far and its KV caches, stepped like a server steps one."""

    def __init__(self, span: BlockSpan, hidden: torch.Tensor, mask: torch.Tensor) -> None:
        self.span, self.mask = span, mask
        self.positions = prefill_positions(mask)
        self.caches = span.new_caches(span.start, span.end)
        self.inputs, self.all_positions = hidden, self.positions
        self.output = span(hidden, mask, self.positions, self.caches).float()

    def next_input(self, head: ClientHead) -> None:
        """The greedy next token's embedding, mask and position (not yet run)."""
        token = head.logits(self.output[:, -1:]).argmax(-1)
        self.step_hidden = head.embed(token)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(token), 1)], dim=1)
        self.positions = self.positions[:, -1:] + 1
        self.inputs = torch.cat([self.inputs, self.step_hidden], dim=1)
        self.all_positions = torch.cat([self.all_positions, self.positions], dim=1)

    def errors(self, stateless: BlockSpan) -> Iterator[float]:
        """The last output against the stateless forward of the whole history: whole batch, then row by row."""
        length = self.output.shape[1]
        real = self.mask[:, -length:]
        whole = stateless(self.inputs, self.mask, self.all_positions).float()[:, -length:]
        yield relative_error(self.output, whole, real)
        for row in range(self.inputs.shape[0]):
            alone = stateless(self.inputs[row:row + 1], self.mask[row:row + 1],
                              self.all_positions[row:row + 1]).float()[:, -length:]
            yield relative_error(self.output[row:row + 1], alone, real[row:row + 1])


def measure(spec: ModelSpec, head: ClientHead, batch: dict[str, torch.Tensor], precision: str, steps: int,
            end: int) -> dict[str, float]:
    """Worst relative errors of honest servers of one precision on blocks [0, end)."""
    dtype, quant = PRECISIONS[precision]
    span = load_span(spec, 0, end, dtype=dtype, quant=quant)
    full = end == spec.num_blocks
    worst = {"prefill": 0.0, "decode": 0.0, "merged decode": 0.0}
    alone = Session(span, head.embed(batch["input_ids"]), batch["attention_mask"])
    worst["prefill"] = max(alone.errors(span))
    pair = [Session(span, head.embed(batch["input_ids"][rows]), batch["attention_mask"][rows]) for rows in ([0, 1], [2])]
    for _ in range(steps):
        for session in (alone, *pair):
            if full:
                session.next_input(head)
            else:  # a first hop's output is no token: feed the embeddings of a fixed token
                session.step_hidden = head.embed(torch.full((session.mask.shape[0], 1), 42))
                session.mask = torch.cat([session.mask, session.mask.new_ones(session.mask.shape[0], 1)], dim=1)
                session.positions = session.positions[:, -1:] + 1
                session.inputs = torch.cat([session.inputs, session.step_hidden], dim=1)
                session.all_positions = torch.cat([session.all_positions, session.positions], dim=1)
        alone.output = span(alone.step_hidden, alone.mask, alone.positions, alone.caches).float()
        worst["decode"] = max(worst["decode"], *alone.errors(span))
        outputs = run_merged(span, [DecodeStep(s.step_hidden.to(span.compute_dtype), s.mask, s.positions, s.caches)
                                    for s in pair], 0, end)
        for session, output in zip(pair, outputs, strict=True):
            session.output = output.float()
            worst["merged decode"] = max(worst["merged decode"], *session.errors(span))
    return worst


def noise_errors(spec: ModelSpec, head: ClientHead, batch: dict[str, torch.Tensor], end: int
                 ) -> dict[float, tuple[float, float]]:
    """(median, worst) over tokens of the relative error that Gaussian noise of each std makes on a float32 span's
    outputs; a check sees the worst token of a step (a step of one decode token: that token's)."""
    span = load_span(spec, 0, end)
    output = span(head.embed(batch["input_ids"]), batch["attention_mask"], prefill_positions(batch["attention_mask"]))
    real = batch["attention_mask"].bool()
    found = {}
    for std in (0.001, 0.01, 0.1, 0.5):
        noisy = output + torch.randn_like(output) * std
        errors = ((noisy - output).norm(dim=-1) / output.norm(dim=-1))[real]
        found[std] = (float(errors.median()), float(errors.max()))
    return found


def cross_errors(spec: ModelSpec, head: ClientHead, batch: dict[str, torch.Tensor], end: int,
                 precisions: list[str]) -> dict[str, float]:
    """A float32 server against one of each other precision, on the prefill."""
    hidden, mask = head.embed(batch["input_ids"]), batch["attention_mask"]
    positions = prefill_positions(mask)
    outputs = {}
    for precision in ["float32", *(p for p in precisions if p != "float32")]:
        dtype, quant = PRECISIONS[precision]
        try:
            outputs[precision] = load_span(spec, 0, end, dtype=dtype, quant=quant)(hidden, mask, positions).float()
        except Exception:  # reported as missing
            continue
    return {p: relative_error(out, outputs["float32"], mask) for p, out in outputs.items() if p != "float32"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--precisions", default="float32,bfloat16,int8,nf4")
    args = parser.parse_args()
    from modelprep import prepare_model

    torch.set_num_threads(2)
    home = Path(os.environ.get("SWARMBATCH_HOME", Path.home() / ".swarmbatch"))
    model_dir = prepare_model(args.model, cache_dir=home / "models")
    spec = ModelSpec.open(model_dir)
    head = ClientHead(spec)
    batch = dict(load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True))
    print(f"honest relative errors, {args.model}, {args.steps} decode steps; batch of {len(PROMPTS)} prompts "
          f"of lengths {batch['attention_mask'].sum(1).tolist()}")
    print("| precision | hop | prefill | decode | merged decode |")
    print("|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        for end in (spec.num_blocks // 2, spec.num_blocks):
            try:
                worst = measure(spec, head, batch, precision, args.steps, end)
            except Exception as e:  # e.g. bitsandbytes without a CPU backend for nf4
                print(f"| {precision} | 0:{end} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
                continue
            print(f"| {precision} | 0:{end} | {worst['prefill']:.2e} | {worst['decode']:.2e} | "
                  f"{worst['merged decode']:.2e} |")
    end = spec.num_blocks
    print(f"a float32 server against another precision's, prefill of blocks 0:{end}: " + ", ".join(
        f"{p}: {err:.2e}" for p, err in cross_errors(spec, head, batch, end, args.precisions.split(",")).items()))
    noise = ", ".join(f"std {std}: {median:.2e} / {worst:.2e}"
                      for std, (median, worst) in noise_errors(spec, head, batch, end).items())
    print(f"relative error of Gaussian noise on a token's output, median / worst token (blocks 0:{end}): {noise}")


if __name__ == "__main__":
    main()
