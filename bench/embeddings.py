"""Benchmark: embeddings through the swarm (one stateless forward per micro-batch) vs local transformers.

The same texts, cut into the same micro-batches (jobs.worker.embedder.micro_batches), are embedded by transformers'
base model in this process (one thread) and by DistributedModelForCausalLM.encode through two servers holding halves
of the blocks (one pinned core each) with 1 and 2 micro-batches in flight, timed interleaved; prints texts/s of each
and their ratio to local, and the largest cosine distance between the two.

usage: python bench/embeddings.py [--model smollm2|PATH] [--texts 64] [--rows 16] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from jobrun import bench_setup  # noqa: E402  (bench/ is the script's folder, first on sys.path)
from transformers import AutoModel  # noqa: E402

from jobs.models import Request  # noqa: E402
from jobs.worker.embedder import micro_batches  # noqa: E402
from jobs.worker.runner import left_pad  # noqa: E402
from launch.local_swarm import LocalSwarm  # noqa: E402
from swarmclient.model import DistributedModelForCausalLM  # noqa: E402
from swarmclient.pooling import PoolingMode, finish, pool  # noqa: E402
from swarmclient.textgen import load_tokenizer  # noqa: E402
from swarmnet.model_spec import ModelSpec  # noqa: E402

WORDS = ("the city council voted to expand the bike lane network while farmers asked for help after a dry summer "
         "and a small team opened a library in an old train station").split()


def texts(count: int) -> list[str]:
    """Texts of 8 to 40 words, different from one another."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + (i * 5) % 33)) for i in range(count)]


def local_embed(model: torch.nn.Module, groups: list[list[Request]], pad: int) -> dict[int, torch.Tensor]:
    out = {}
    for group in groups:
        ids, mask = left_pad([list(r.prompt_ids) for r in group], pad)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            states = model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        for row, vector in zip(group, pool(states, mask, PoolingMode.lasttoken), strict=True):
            out[row.id] = vector
    return out


def swarm_embed(model: DistributedModelForCausalLM, groups: list[list[Request]], lanes: int
                ) -> dict[int, torch.Tensor]:
    def encode(group: list[Request]) -> list[tuple[int, torch.Tensor]]:
        ids, mask = left_pad([list(r.prompt_ids) for r in group], model.pad_token_id)
        return list(zip([r.id for r in group], model.encode(ids, mask, mode=PoolingMode.lasttoken), strict=True))
    with ThreadPoolExecutor(lanes) as pool:  # as EmbeddingRunner runs them: `lanes` micro-batches in flight
        return dict(pair for pairs in pool.map(encode, groups) for pair in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    home, model_dir = bench_setup(args.model)
    tokenizer = load_tokenizer(model_dir)
    requests = [Request(id=i, prompt_ids=tokenizer(t).input_ids) for i, t in enumerate(texts(args.texts))]
    groups = micro_batches(requests, args.rows, 8192)
    tokens = sum(len(r.prompt_ids) for r in requests)
    local = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = ModelSpec.open(model_dir).num_blocks
    configs = ["local", *(f"swarm, {lanes} in flight" for lanes in (1, 2))]
    times: dict[str, list[float]] = {name: [] for name in configs}
    with LocalSwarm(model_dir, [(0, blocks // 2), (blocks // 2, blocks)], log_dir=home / "logs", pin_cpus=True) as swarm, \
            DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as model:
        pad = model.pad_token_id
        swarm_embed(model, groups[:1], 1)  # warm-up: routes, first forwards
        for rep in range(args.reps):
            for name in configs[rep % 3:] + configs[:rep % 3]:  # the order rotates from rep to rep
                began = time.perf_counter()
                got = local_embed(local, groups, pad) if name == "local" else \
                    swarm_embed(model, groups, int(name.split(", ")[1][0]))
                times[name].append(time.perf_counter() - began)
                if name == "local":
                    expected = got
                else:
                    vectors = got
        worst = max(1 - float(torch.nn.functional.cosine_similarity(finish(vectors[i], model.pooling),
                                                                    finish(expected[i], model.pooling), dim=0))
                    for i in vectors)
    local_s = statistics.median(times["local"])
    print(f"\n{args.texts} texts ({tokens} tokens), micro-batches of {args.rows} ({len(groups)} forwards), "
          f"{blocks} blocks, 2 servers, median of {args.reps}")
    print("| config | seconds | texts/s | vs local |")
    print("|---|---|---|---|")
    for name in configs:
        seconds = statistics.median(times[name])
        print(f"| {name} | {seconds:.2f} | {args.texts / seconds:.1f} | {local_s / seconds:.2f} |")
    print(f"largest cosine distance swarm vs local: {worst:.2e}")


if __name__ == "__main__":
    main()
