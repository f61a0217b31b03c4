"""swarmclient: generate with a model whose transformer blocks are served by a swarm of block servers.

The wire contract, peers, records, membership, the P2P node and discovery live in `swarmnet` (shared with
`servers`). Modules here, from the route up:
    routing          pure functions: spans, round trips (client's and servers' links), trusted throughputs, free cache,
                     each machine's open sessions and bans -> a chain of hops
    retry            the one retry policy (tenacity backoff with jitter) and the BanList
    swarm            Swarm: a client's live view of one model's servers (reads, pings, bans, routes, forward)
    verification_policy  checked outputs, the policy: sampled steps, tolerances by precision, the majority rule,
                     counts
    hop_verifier     HopVerifier: recomputes a sampled hop step on other holders, bans the one that lies
    deferred_checks  DeferredChecks: a job lane's checks by window, run beside its steps and the next window's; a
                     window's tokens are committed once its checks passed; a caught lie (LieCaught) voids the
                     tokens since the last commit
    warm_checks      WarmCheck: a window's check begun when the window opens (a background session on the second
                     holder, fed the sampled rows' history meanwhile), so closing it costs only the window's tokens
    push_audit       pure: does a hop's answer say it computed on the input the client recorded, and if not, who
                     lied (the pusher, by its signed proof; the hop; or nobody: a stale input, replayed)
    answers          AnswerReader: a push session's answers, read in the background and matched to steps by step id
    server_session   ServerSession: one inference stream to one server (request/answer, or push: send / answer)
    session          InferenceSession: a chain that fails over by replaying its StepRecords, checks sampled steps, and
                     with push sends each step to the first hop only
    penalties        logit_bias, repetition / frequency / presence penalties over a sequence's token History
    constraints      constrained decoding (llguidance): a sequence's grammar masks its logits (JSON, JSON Schema)
    sampling         greedy / temperature, top-k, top-p, min-p, seeded by (seed, position), after the penalties and
                     the grammar's mask
    generation       the decode loop shared by every caller
    forward          whole sequences through every block by the stateless forward RPC (no KV cache), failing over hop
                     by hop: embeddings
    pooling          a model's embedding recipe: sentence-transformers pooling (mean / cls / lasttoken), Normalize,
                     Matryoshka sizes; pool and finish vectors
    model            DistributedModelForCausalLM, the Petals-style entry point
    textgen          prompts in, texts out (tokenizer, chat template)
    logit_check      teacher-forced per-token logits of the swarm against transformers in the same dtype, within a
                     tolerance measured against that dtype's own rounding (the bfloat16 / float16 check)
    coverage         the `swarm status` coverage map
    config, errors   ClientConfig; the client's errors (under swarmnet.errors.SwarmError)

Boundary: nothing here imports `servers` or `jobs`. This `__init__` loads none of the modules above: the client stack
(and transformers) loads on first use of `DistributedModelForCausalLM`. tests/test_layers.py checks both.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmclient.model import DistributedModelForCausalLM

__all__ = ["DistributedModelForCausalLM"]


def __getattr__(name: str) -> type[DistributedModelForCausalLM]:
    """Load `DistributedModelForCausalLM` (and with it the client stack) on first access (PEP 562)."""
    if name == "DistributedModelForCausalLM":
        from swarmclient.model import DistributedModelForCausalLM
        return DistributedModelForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
