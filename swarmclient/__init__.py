"""swarmclient: generate with a model whose transformer blocks are served by a swarm of block servers.

Modules, from the wire up:
    data_structures  the wire contract: ServerState, ServerInfo (DHT announcements), RemoteSpanInfo, RouteHop
    protocol         RPC names, the one frame codec (tensors + msgpack metadata), stream framing, error codes
    model_spec       a local model directory: config, family classes, weight files, revision, model id
    identity         Identity: an RSA key file, the peer id it proves, signatures others can verify
    addresses        what a P2P node listens on and announces (--host, --port, --announce-host): no loopback
                     for a wildcard host, DNS names and IPv6, a free port when an announcement needs one
    records          signed, short-lived DHT records: the validator every node runs, GuardedDHTNode
    membership       a private swarm: the swarm file, Membership, member credentials, a client's SwarmAccess
    network          in-process hivemind P2P + DHT node, NetworkOptions, uvloop loops, LoopThread (sync facade)
    discovery        the only module that reads the DHT: who announced which block
    routing          pure functions: spans, round trips (client's and servers' links), trusted throughputs, free cache
                     and bans -> a chain of hops
    retry            the one retry policy (tenacity backoff with jitter) and the BanList
    swarm            Swarm: a client's live view of one model's servers (reads, pings, bans, routes, forward)
    verification     checked outputs, the policy: sampled steps, tolerances by precision, the majority rule, counts
    verifier         HopVerifier: recomputes a sampled hop step on other holders, bans the one that lies
    answers          AnswerReader: a push session's answers, read in the background and matched to steps by step id
    server_session   ServerSession: one inference stream to one server (request/answer, or push: send / answer)
    session          InferenceSession: a chain that fails over by replaying its StepRecords, checks sampled steps, and
                     with push sends each step to the first hop only
    head             ClientHead: embeddings, final norm and LM head, run locally
    penalties        logit_bias, repetition / frequency / presence penalties over a sequence's token History
    sampling         greedy / temperature, top-k, top-p, min-p, seeded by (seed, position), after the penalties
    generation       the decode loop shared by every caller
    model            DistributedModelForCausalLM, the Petals-style entry point
    textgen          prompts in, texts out (tokenizer, chat template)
    coverage         the `swarm status` coverage map
    config, errors   ClientConfig; the SwarmError tree

Boundary: nothing here imports `servers`. This `__init__` loads none of the modules above: the client stack
loads on first use of `DistributedModelForCausalLM`, so servers import the wire contract (`data_structures`,
`protocol`, `errors`) without it. tests/test_layers.py checks both.
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
