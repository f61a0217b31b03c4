"""swarmclient: generate with a model whose transformer blocks are served by a swarm of block servers.

Modules, from the wire up:
    data_structures  the wire contract: ServerState, ServerInfo (DHT announcements), RemoteSpanInfo, RouteHop
    protocol         RPC names, the one frame codec (tensors + msgpack metadata), stream framing, error codes
    model_spec       a local model directory: config, family classes, weight files, revision, model id
    network          in-process hivemind P2P + DHT node, NetworkOptions, uvloop loops, LoopThread (sync facade)
    discovery        the only module that reads the DHT: who announced which block
    routing          pure functions: spans, round trips and bans -> a chain of hops
    retry            the one retry policy (tenacity backoff with jitter) and the BanList
    swarm            Swarm: a client's live view of one model's servers (reads, pings, bans, routes)
    session          ServerSession (one stream) and InferenceSession (a chain that fails over by replay)
    head             ClientHead: embeddings, final norm and LM head, run locally
    sampling         greedy / temperature + top-p, seeded by (seed, position)
    generation       the decode loop shared by every caller
    model            DistributedModelForCausalLM, the Petals-style entry point
    textgen          prompts in, texts out (tokenizer, chat template)
    coverage         the `swarm status` coverage map
    config, errors   ClientConfig; the SwarmError tree

Boundary: nothing here imports `servers`.
"""
from __future__ import annotations

from swarmclient.model import DistributedModelForCausalLM

__all__ = ["DistributedModelForCausalLM"]
