"""Benchmark: the cost per token of constrained decoding (response_format json_schema / json_object) vs unconstrained.

The client's own decode loop (`swarmclient.generation.generate_tokens`: head, penalties, grammar mask, sampling) over
the model's blocks run in this process as one span (no network: the client's share of a token is what changes, so
this is the ratio at its largest; through a swarm the hops dilute it). One thread, as the servers run.

For each batch size and mode, a constrained run decodes until every row's JSON is complete (EOS), and an
unconstrained run then decodes exactly as many steps (EOS ignored), interleaved rep by rep; the figures are ms per
decode step (the prefill, timed apart, left out) and their paired ratio. On a busy machine that ratio swings by
±10-20 %, so the loop's sampling (`sample_next`: penalties, the grammar's mask and advance, the draw) is timed in
both runs too: the extra it costs per step, over the unconstrained step, is the cost that holds whatever the noise.

usage: python bench/constrained.py [--model smollm2|PATH] [--reps 5] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import swarmclient.generation  # noqa: E402
from servers.block_loading import load_span  # noqa: E402
from swarmclient.constraints import Constraint, Grammar, grammar_tokenizer, json_grammar  # noqa: E402
from swarmclient.generation import generate_tokens  # noqa: E402
from swarmclient.sampling import SamplingParams  # noqa: E402
from swarmclient.textgen import load_tokenizer, render_prompt  # noqa: E402
from swarmnet.head import ClientHead  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402

torch.set_num_threads(1)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["sentiment", "stars", "topics", "summary"],
          "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                         "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                         "topics": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 20}},
                         "summary": {"type": "string", "maxLength": 120}}}
REVIEWS = ["Arrived late but works well.", "Too expensive for what it is.", "Great support team, fast refund!",
           "The box was damaged and a part was missing.", "Exactly as described, would buy again.",
           "Battery dies within an hour.", "Decent quality for the price.", "Never arrived; no answer from support."]


class SamplingClock:
    """Times every `sample_next` call of the decode loop (wrapped in swarmclient.generation's namespace)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.inner = swarmclient.generation.sample_next

        def timed(*args: Any) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return self.inner(*args)
            finally:
                self.seconds += time.perf_counter() - start
        swarmclient.generation.sample_next = timed  # type: ignore[assignment]

    def take(self) -> float:
        spent, self.seconds = self.seconds, 0.0
        return spent


CLOCK = SamplingClock()


class Bench:
    """The model's blocks as one local span, its head, and its tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        self.spec, self.tokenizer = ModelSpec.open(model_dir), load_tokenizer(model_dir)
        self.span, self.head = load_span(self.spec, 0, self.spec.num_blocks), ClientHead(self.spec)
        self.grammar_tokenizer = grammar_tokenizer(self.tokenizer, eos_token_ids=self.spec.eos_token_ids,
                                                   vocab_size=self.spec.config.vocab_size)

    def inputs(self, rows: int) -> Any:
        texts = [render_prompt(self.tokenizer, f"Classify this review as JSON: {review}", chat=True)
                 for review in REVIEWS[:rows]]
        return self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def run(self, inputs: Any, params: list[SamplingParams], steps: int, eos: set[int]
            ) -> tuple[torch.Tensor, float, float, float]:
        """(new tokens, prefill seconds, decode seconds, sampling seconds)."""
        cache = self.span.new_caches(0, self.spec.num_blocks)
        calls: list[float] = []

        def step(hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            calls.append(time.perf_counter())
            return self.span(hidden, mask, positions, cache)
        CLOCK.take()
        start = time.perf_counter()
        out = generate_tokens(self.head, step, inputs.input_ids, inputs.attention_mask, max_new_tokens=steps,
                              params=params, eos_token_ids=eos, pad_token_id=0)
        end = time.perf_counter()
        prefill = calls[1] - start if len(calls) > 1 else end - start
        return out, prefill, end - start - prefill, CLOCK.take()

    def grammar(self, schema: dict[str, Any] | None) -> Grammar:
        return Grammar(json_grammar(schema), self.grammar_tokenizer)


def mask_cost(bench: Bench, grammar: Grammar, tokens: torch.Tensor) -> float:
    """Microseconds per token of the grammar alone (mask over the vocabulary, then advance), over chosen tokens."""
    logits = torch.zeros(bench.spec.config.vocab_size)
    spent, count = 0.0, 0
    for row in tokens.tolist():
        constraint = Constraint(grammar)
        for token in row:
            start = time.perf_counter()
            constraint.apply(logits)
            constraint.add(token)
            spent += time.perf_counter() - start
            count += 1
            if token in bench.spec.eos_token_ids:
                break
    return spent / count * 1e6


def measure(bench: Bench, rows: int, mode: str, temperature: float, reps: int, max_tokens: int) -> dict[str, Any]:
    inputs = bench.inputs(rows)
    grammar = bench.grammar(SCHEMA if mode == "json_schema" else None)
    constrained = [SamplingParams(temperature=temperature, seed=i, grammar=grammar) for i in range(rows)]
    free = [SamplingParams(temperature=temperature, seed=i) for i in range(rows)]
    bench.run(inputs, constrained, 4, bench.spec.eos_token_ids)  # warm-up
    paired, with_grammar, without, extra = [], [], [], []
    for _ in range(reps):
        tokens, _, decode, sampling = bench.run(inputs, constrained, max_tokens, bench.spec.eos_token_ids)
        steps = tokens.shape[1]
        _, _, free_decode, free_sampling = bench.run(inputs, free, steps, set())
        with_grammar.append(decode / steps * 1e3)
        without.append(free_decode / steps * 1e3)
        paired.append(with_grammar[-1] / without[-1])
        extra.append((sampling - free_sampling) / steps * 1e3)
    done = sum(bool(set(row.tolist()) & bench.spec.eos_token_ids) for row in tokens)
    return {"rows": rows, "mode": mode, "temperature": temperature, "steps": steps, "complete": done,
            "constrained_ms": statistics.median(with_grammar), "free_ms": statistics.median(without),
            "ratio": statistics.median(paired), "p25": _quantile(paired, 0.25), "p75": _quantile(paired, 0.75),
            "extra_ms": statistics.median(extra),
            "derived": 1 + statistics.median(extra) / statistics.median(without),
            "mask_us": mask_cost(bench, grammar, tokens)}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (prepared under $SWARMBATCH_HOME/models) or a dir")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    from swarm import resolve_model  # bench/ is the script's folder, first on sys.path
    bench = Bench(resolve_model(args.model))
    print(f"{args.model}: vocab {bench.spec.config.vocab_size}, {bench.spec.num_blocks} blocks, 1 thread, "
          f"{args.reps} reps, up to {args.max_tokens} tokens")
    print("| batch | format | temperature | steps | rows complete | constrained ms/step | unconstrained ms/step "
          "| paired ratio [p25, p75] | sampling's extra ms/step | ratio from it | grammar µs/token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rows, mode, temperature in ((1, "json_schema", 0.0), (8, "json_schema", 0.0), (8, "json_schema", 1.0),
                                    (8, "json_object", 1.0)):
        r = measure(bench, rows, mode, temperature, args.reps, args.max_tokens)
        print(f"| {rows} | {mode} | {temperature:g} | {r['steps']} | {r['complete']}/{rows} | "
              f"{r['constrained_ms']:.1f} | {r['free_ms']:.1f} | {r['ratio']:.3f} [{r['p25']:.3f}, {r['p75']:.3f}] "
              f"| {r['extra_ms']:.2f} | {r['derived']:.4f} | {r['mask_us']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
