"""Two callers on two machines: does a second client route around the first one's session? (swarmclient/routing.py)

Run:  .venv/bin/python bench/callers.py [--reps 2] [--batch 8] [--new-tokens 64] [--delay 1.0] [--out callers.json]

Two servers each hold all of SmolLM2's blocks, each pinned to its own core with one thread (two one-core machines,
announced as such with `--machine`); the first announces a speed of 100 block-steps/s and the second 80 (`--throughput`:
one box a little faster, so that where a client goes does not hang on round-trip noise). Two clients in this process
(two workers, or two users of `swarmbatch generate`) each generate `--batch` rows x `--new-tokens` greedy tokens in one
session; the second starts `--delay` s after the first one's session opened. Two configs, alternating:

  others counted   as clients route now: the second client's ping of each server returns the sessions other callers
                   hold there, and the faster server, shared with the first client, counts at half its speed
  others ignored   as clients routed before (this script drops `Swarm.others` from the route search): both take the
                   faster server, whose steps then merge the two sessions while the other server idles

Reported: the wall time until both are done, the tokens per second of both together, and which server each took.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

COUNTED, IGNORED = "others counted", "others ignored"
SPEEDS = {"core-0": "100", "core-1": "80"}
PROMPTS = ["Summarize in one sentence why the tides rise and fall twice a day.",
           "Explain to a child how a bicycle stays upright while it moves.",
           "List three reasons a team might run a language model on its own hardware.",
           "Describe what happens to water as it freezes, in two sentences.",
           "Write a short note thanking a colleague for reviewing a long pull request.",
           "Give two tips for keeping a nightly batch job from losing work when a machine fails.",
           "What is the difference between latency and throughput? Answer briefly.",
           "Name a few things a good README tells a newcomer first."]


def generate(model: Any, tokenizer: Any, batch: int, new_tokens: int, opened: Callable[[str], None]
             ) -> tuple[torch.Tensor, float]:
    """`batch` rows x exactly `new_tokens` greedy tokens in one session; calls `opened(peer)` once it is open."""
    from swarmclient.generation import generate_tokens
    from swarmclient.textgen import render_prompt

    texts = [render_prompt(tokenizer, p, chat=True) for p in (PROMPTS * batch)[:batch]]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = encoded.input_ids, encoded.attention_mask
    params = model.sampling_params(batch, False, 1.0, 1.0, 0)
    began = time.perf_counter()
    with model.inference_session(batch_size=batch, max_length=ids.shape[1] + new_tokens) as session:
        new = generate_tokens(model.head, WhenOpened(session, opened), ids, mask, max_new_tokens=new_tokens,
                              params=params, eos_token_ids=(), pad_token_id=model.pad_token_id)
    return new, time.perf_counter() - began


class WhenOpened:
    """The session, calling `opened` with its first server once its first step (the prefill) has been sent."""

    def __init__(self, session: Any, opened: Callable[[str], None]) -> None:
        self.session, self.opened, self.told = session, opened, False

    def __call__(self, *args: Any) -> torch.Tensor:
        out = self.session.step(*args)
        if not self.told:
            self.told = True
            self.opened(self.session.route[0].peer_id)
        return out


def run_pair(model_dir: Path, args: argparse.Namespace, label: str, log_dir: Path) -> dict[str, Any]:
    """One run of both clients on a fresh swarm."""
    from launch.local_swarm import LocalSwarm
    from swarmclient import swarm as swarm_module
    from swarmclient.model import DistributedModelForCausalLM
    from swarmclient.textgen import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    blocks = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    routing_loads = swarm_module.machine_loads
    ignoring = mock.patch.object(swarm_module, "machine_loads",
                                 lambda spans, held, others=None: routing_loads(spans, held))
    with LocalSwarm(model_dir, [], num_threads=1, pin_cpus=True, log_dir=log_dir) as swarm, \
            (ignoring if label == IGNORED else contextlib.nullcontext()):
        servers = swarm.start_servers([(0, blocks, ["--machine", name, "--throughput", speed])
                                       for name, speed in SPEEDS.items()])
        names = {server.peer_id: name for server, name in zip(servers, SPEEDS, strict=True)}
        with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as first, \
                DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as second:
            taken: dict[str, str] = {}
            results: dict[str, tuple[torch.Tensor, float]] = {}
            first_open = threading.Event()

            def caller(name: str, model: Any, wait: threading.Event | None) -> None:
                if wait is not None:
                    wait.wait()
                    time.sleep(args.delay)

                def opened(peer: str) -> None:
                    taken[name] = names.get(peer, peer[-6:])
                    if name == "first":
                        first_open.set()
                results[name] = generate(model, tokenizer, args.batch, args.new_tokens, opened)
            began = time.perf_counter()
            threads = [threading.Thread(target=caller, args=("first", first, None)),
                       threading.Thread(target=caller, args=("second", second, first_open))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - began
    tokens = 2 * args.batch * args.new_tokens
    return {"label": label, "wall": wall, "tok_s": tokens / wall, "taken": taken,
            "seconds": {name: result[1] for name, result in results.items()},
            "tokens": {name: result[0].tolist() for name, result in results.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (prepared in $SWARMBATCH_HOME/models) or a dir")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds the second client starts after the first")
    parser.add_argument("--out", type=Path, default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    from modelprep import prepare_model

    home = Path(os.environ.get("SWARMBATCH_HOME", Path.home() / ".swarmbatch")).expanduser()
    model_dir = prepare_model(args.model, cache_dir=home / "models")
    runs = []
    for rep in range(args.reps):
        for label in ((COUNTED, IGNORED) if rep % 2 == 0 else (IGNORED, COUNTED)):
            run = run_pair(model_dir, args, label, home / "bench-callers" / f"{rep}-{label.split()[1]}")
            runs.append(run)
            print(f"  {label}: {run['wall']:.1f} s, {run['tok_s']:.1f} tok/s, servers taken {run['taken']}, "
                  f"each client's seconds {({k: round(v, 1) for k, v in run['seconds'].items()})}", flush=True)
    median = {label: statistics.median(r["tok_s"] for r in runs if r["label"] == label) for label in (COUNTED, IGNORED)}
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    print(f"\nTwo clients, {args.batch} rows x {args.new_tokens} tokens each (the second {args.delay:g} s after the "
          f"first's session opened); 2 servers of all blocks, one core each, announced 100 and 80; {args.reps} reps")
    print("| config | tokens/s of both (median) | vs others ignored | servers taken (first, second) |")
    print("|---|---|---|---|")
    for label in (COUNTED, IGNORED):
        taken = sorted({(r["taken"].get("first"), r["taken"].get("second")) for r in runs if r["label"] == label})
        print(f"| {label} | {median[label]:.1f} | {median[label] / median[IGNORED]:.2f}x | {taken} |")
    print(f"greedy tokens identical in every run: {same}")
    if args.out:
        args.out.write_text(json.dumps({"runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
                                        "median_tok_s": median, "same_tokens": same}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
