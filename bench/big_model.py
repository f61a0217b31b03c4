"""Benchmark: a model of Llama-3-8B's shape, cut to 8 of its 32 layers, in bfloat16, across 3 block servers.

Random weights of Llama-3-8B's shapes (hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab 128256) are written as one
safetensors shard per layer plus one for embeddings, final norm and head (about 5.7 GB in all), with the tiny BPE
tokenizer of our tests (its ids are a subset of the vocabulary). Three servers (`--dtype bfloat16`, spans 0:3, 3:6,
6:8) serve it on this machine; the script then reports, per server, its resident memory (server process and its p2pd)
against its share of the weights plus the KV cache it holds (the rest is the process's own: Python, torch,
transformers, p2pd, about half a GiB whatever the span) (a session is first opened and filled to 3/4 of
`--attn-cache-tokens`, the most one caller may hold on an idle server), and compares the swarm with local
transformers in the same dtype: greedy tokens (equal in float32; in bfloat16 a random model's flat logits flip at
one rounding step), and the teacher-forced per-token logits of local generate's tokens through the swarm's session
against transformers' (swarmclient/logit_check.py: relative error per position, and within tolerance or not).
The local references are computed before the servers start (one model in memory at a time).

usage: python bench/big_model.py [--new-tokens 8] [--cache-tokens 512] [--dtype bfloat16|float32] [--keep DIR]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

LAYERS, HIDDEN, HEADS, KV_HEADS, MLP, VOCAB = 8, 4096, 32, 8, 14336, 128256
SPANS = [(0, 3), (3, 6), (6, 8)]
GIB = 1024 ** 3
PROMPTS = ["The swarm splits the model", "Each server holds a span of"]


def write_model(out: Path) -> Path:
    """Config, tokenizer and bfloat16 shards, written tensor by tensor (never the whole model in memory)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from modelprep.tiny import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=8192,
                rope_theta=500000.0, tie_word_embeddings=False, dtype="bfloat16").save_pretrained(out)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(out))
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    head_dim, kv = HIDDEN // HEADS, KV_HEADS * (HIDDEN // HEADS)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        save_file({p + "self_attn.q_proj.weight": rand(HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": rand(kv, HIDDEN),
                   p + "self_attn.v_proj.weight": rand(kv, HIDDEN), p + "self_attn.o_proj.weight": rand(HIDDEN, HIDDEN),
                   p + "mlp.gate_proj.weight": rand(MLP, HIDDEN), p + "mlp.up_proj.weight": rand(MLP, HIDDEN),
                   p + "mlp.down_proj.weight": rand(HIDDEN, MLP),
                   p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)},
                  out / f"model-{i + 1:05d}-of-{LAYERS + 1:05d}.safetensors", metadata={"format": "pt"})
        assert head_dim * HEADS == HIDDEN
    save_file({"model.embed_tokens.weight": rand(VOCAB, HIDDEN, std=1.0), "lm_head.weight": rand(VOCAB, HIDDEN),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)},
              out / f"model-{LAYERS + 1:05d}-of-{LAYERS + 1:05d}.safetensors", metadata={"format": "pt"})
    write_index(out)
    return out


def write_index(out: Path) -> None:
    """model.safetensors.index.json (transformers loads a sharded checkpoint through it)."""
    import json

    from safetensors import safe_open

    weight_map = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), shard.name))
    total = sum(shard.stat().st_size for shard in out.glob("*.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))


def rss(pids: list[int]) -> int:
    """Resident bytes of these processes together."""
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def fill_caches(model_dir: Path, peers: list[str], tokens: int) -> None:
    """Open one session per server over its span and step it to `tokens`: every server allocates its whole budget."""
    from swarmclient.session import InferenceSession
    from swarmclient.swarm import Swarm
    from swarmnet.model_spec import ModelSpec

    spec = ModelSpec.open(model_dir)
    swarm = Swarm.connect(peers, model_id=spec.model_id, num_blocks=spec.num_blocks)
    try:
        with InferenceSession(swarm, batch_size=1, max_length=tokens) as session:
            hidden = torch.randn(1, tokens, HIDDEN, dtype=torch.float32) * 0.1
            session.step(hidden, torch.ones(1, tokens, dtype=torch.long), torch.arange(tokens)[None])
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--cache-tokens", type=int, default=512, help="each server's --attn-cache-tokens")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="what the servers, the client's head and local generate compute in")
    parser.add_argument("--keep", type=Path, help="write (or reuse) the model here instead of a temporary dir")
    args = parser.parse_args()
    from transformers import AutoConfig

    from launch.local_swarm import LocalSwarm
    from servers.block_sizing import kv_bytes_per_token
    from swarmclient.config import ClientConfig
    from swarmclient.logit_check import compare_logits, load_local, swarm_logits, teacher_forced_reference
    from swarmclient.model import DistributedModelForCausalLM
    from swarmclient.textgen import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="big-model-") as tmp:
        model_dir = args.keep or Path(tmp) / "llama3-8b-shape-8l"
        if (model_dir / "config.json").exists() and not (model_dir / "model.safetensors.index.json").exists():
            write_index(model_dir)  # a model written before the index was
        if not (model_dir / "config.json").exists():
            began = time.perf_counter()
            write_model(model_dir)
            print(f"wrote {sum(f.stat().st_size for f in model_dir.glob('*.safetensors')) / GIB:.2f} GiB of weights "
                  f"in {time.perf_counter() - began:.0f} s", flush=True)
        config = AutoConfig.from_pretrained(model_dir)
        per_layer = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / (LAYERS + 1)  # ~ one layer
        itemsize = 2 if args.dtype == "bfloat16" else 4
        layer_bytes = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * (HIDDEN // HEADS) + 3 * HIDDEN * MLP) * itemsize
        cache_bytes = args.cache_tokens * kv_bytes_per_token(config, itemsize)
        batch = load_tokenizer(model_dir)(PROMPTS, return_tensors="pt", padding=True)
        dtype = getattr(torch, args.dtype)
        local = load_local(model_dir, dtype, "cpu")
        with torch.inference_mode():
            began = time.perf_counter()
            want = local.generate(**batch, max_new_tokens=args.new_tokens, do_sample=False)[:, batch.input_ids.shape[1]:]
            local_s = time.perf_counter() - began
        del local
        forced = teacher_forced_reference(model_dir, batch.input_ids, batch.attention_mask, dtype, continuation=want)
        server_args = ["--dtype", args.dtype, "--attn-cache-tokens", str(args.cache_tokens), "--num-threads", "2"]
        with LocalSwarm(model_dir, SPANS, server_args=server_args, ready_timeout=900) as swarm:
            filled = args.cache_tokens * 3 // 4
            fill_caches(model_dir, swarm.initial_peers, filled)
            print(f"{'server':8} {'blocks':>6} {'weights':>9} {'KV held':>10} {'expected':>9} {'RSS':>9} {'RSS - exp':>9}")
            for server, (start, end) in zip(swarm.servers, SPANS, strict=True):
                weights, cache = (end - start) * layer_bytes, (end - start) * filled * cache_bytes // args.cache_tokens
                resident = rss(server.tree_pids())
                print(f"{server.name[:8]:8} {f'{start}:{end}':>6} {weights / GIB:>5.2f} GiB {cache / GIB:>6.2f} GiB "
                      f"{(weights + cache) / GIB:>5.2f} GiB {resident / GIB:>5.2f} GiB "
                      f"{(resident - weights - cache) / GIB:>5.2f} GiB",
                      flush=True)
            # the head in the checkpoint's dtype, as local generate computes it (on a CPU the client's default is
            # float32 logits: near-ties of a random model's flat logits would then go either way)
            config = ClientConfig(head_dtype=args.dtype)
            with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                             config=config) as model:
                began = time.perf_counter()
                got = model.generate(batch.input_ids, batch.attention_mask, max_new_tokens=args.new_tokens)
                got = got[:, -args.new_tokens:]
                swarm_s = time.perf_counter() - began
                logits = compare_logits(swarm_logits(model, forced), forced)
        print(f"checkpoint {per_layer * (LAYERS + 1) / GIB:.2f} GiB; greedy tokens through 3 servers "
              f"{'EQUAL' if torch.equal(got, want) else 'DIFFER FROM'} local transformers generate ({args.dtype}): "
              f"{got.tolist()} vs {want.tolist()}; {args.new_tokens} tokens x {len(PROMPTS)} rows: swarm {swarm_s:.1f} s, "
              f"local {local_s:.1f} s")
        print(f"teacher-forced logits of local generate's tokens, swarm vs transformers {args.dtype}: "
              f"{logits.summary()}")
        print(f"worst relative error per position ({len(PROMPTS)} rows): {logits.per_step()}")
        if logits.yardstick is not None:
            print("transformers {} vs float32, per position: {}".format(
                args.dtype, ", ".join(f"{'prefill' if s.step == 0 else s.step} {s.yardstick:.1e}" for s in logits.steps)))


if __name__ == "__main__":
    main()
