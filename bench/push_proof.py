"""What push proofs cost per pushed step (swarmnet/push_proof.py), against what a push costs already.

In process, no network. For SmolLM2's hidden size (576) and decode batches of 1, 8 and 64 rows after 200 tokens (and
one prefill of 8 x 128 tokens), float32 and bfloat16, it times as medians over `--reps` loops:
  * the baselines: one decode step of SmolLM2 through a 15-block hop (float32, one thread, on a cache of 200 tokens;
    the hop one push follows), and `protocol.encode` of the pushed frame (output, mask, positions, meta);
  * `input_digest` of the step's input (SHA-256, 128 bits), which the pushing server, the receiving server and the client
    each compute once per pushed step;
  * the pushing server's RSA-2048 signature of the statement, and the receiving server's check of it.
    python bench/push_proof.py [--reps 15] [--loops 200] [--model smollm2|PATH]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from timing import median_call_seconds  # bench/ is the script's folder, first on sys.path

from modelprep import prepare_model
from servers.block_loading import load_span
from swarmnet import protocol
from swarmnet.identity import Identity
from swarmnet.model_spec import ModelSpec
from swarmnet.push_proof import input_digest, proof_signer, sign_push

HIDDEN = 576  # SmolLM2-135M
PAST = 200  # tokens cached before the decode steps timed
MODEL_CACHE = Path.home() / ".swarmbatch" / "models"


def decode_step_us(model: str, rows: int, *, reps: int) -> float:
    """One decode step of `rows` rows through SmolLM2's blocks 0:15 on a cache of PAST tokens, in µs (median)."""
    span = load_span(ModelSpec.open(prepare_model(model, cache_dir=MODEL_CACHE)), 0, 15)
    caches = span.new_caches(0, 15)
    mask = torch.ones(rows, PAST, dtype=torch.long)
    with torch.inference_mode():
        span(torch.randn(rows, PAST, HIDDEN), mask, torch.arange(PAST).expand(rows, PAST), caches)
        times = []
        for i in range(reps):
            mask = torch.ones(rows, PAST + i + 1, dtype=torch.long)
            began = time.perf_counter()
            span(torch.randn(rows, 1, HIDDEN), mask, torch.full((rows, 1), PAST + i), caches)
            times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--loops", type=int, default=200)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hop = {rows: decode_step_us(args.model, rows, reps=args.reps) for rows in (1, 8, 64)}
    print("| step (rows x tokens, dtype) | 15-block decode step µs | encode frame µs | input_digest µs | "
          "digest / decode step |")
    print("|---|---|---|---|---|")
    for rows, tokens, past in [(1, 1, PAST), (8, 1, PAST), (64, 1, PAST), (8, 128, 0)]:
        for dtype in (torch.float32, torch.bfloat16):
            hidden = torch.randn(rows, tokens, HIDDEN).to(dtype)
            mask = torch.ones(rows, past + tokens, dtype=torch.long)
            positions = torch.arange(past, past + tokens).expand(rows, tokens).contiguous()
            meta = {"session_id": "s" * 32, "step_id": 7, "route": []}
            loops = max(5, args.loops // (rows * tokens // 8 + 1))
            encode = 1e6 * median_call_seconds(
                lambda: protocol.encode([hidden, mask, positions], meta),  # noqa: B023 - timed now
                reps=args.reps, loops=loops)
            digest = 1e6 * median_call_seconds(
                lambda: input_digest(hidden, mask, positions, None, 7),  # noqa: B023 - timed now
                reps=args.reps, loops=loops)
            name = str(dtype).removeprefix("torch.")
            step = hop.get(rows) if tokens == 1 else None
            print(f"| {rows} x {tokens}, {name} | {'-' if step is None else f'{step:.0f}'} | {encode:.1f} | "
                  f"{digest:.1f} | {'-' if step is None else f'{digest / step:.4f}'} |")
    with tempfile.TemporaryDirectory() as folder:
        identity = Identity.create(Path(folder) / "key")
        digest_bytes = input_digest(torch.zeros(8, 1, HIDDEN), torch.ones(8, 9), torch.ones(8, 1), None, 7)
        sign = 1e6 * median_call_seconds(
            lambda: sign_push(identity, owner="o" * 46, upstream_session="u" * 32, target_session="t" * 32,
                              step_id=7, digest=digest_bytes), reps=args.reps, loops=20)
        proof = sign_push(identity, owner="o" * 46, upstream_session="u" * 32, target_session="t" * 32, step_id=7,
                          digest=digest_bytes)
        check = 1e6 * median_call_seconds(
            lambda: proof_signer(proof, owner="o" * 46, target_session="t" * 32, step_id=7, digest=digest_bytes),
            reps=args.reps, loops=50)
    print(f"\nRSA-2048 push proof: sign {sign:.0f} µs (pushing server), check {check:.0f} µs (receiving server; the "
          f"client checks one only on a mismatch); against the 8-row decode step: {(sign + check) / hop[8]:.3f}")


if __name__ == "__main__":
    main()
