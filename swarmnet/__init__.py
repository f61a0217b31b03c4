"""swarmnet: what block servers and swarm clients share — the wire contract, peers, the DHT and the model's identity.

The layers, bottom up: `swarmnet` (this package) ← `servers` and `swarmclient` (neither imports the other) ← `jobs`.

Modules:
    data_structures  the wire contract: ServerState, ServerInfo (DHT announcements), RemoteSpanInfo, RouteHop
    protocol         RPC names, the one frame codec (tensors + msgpack metadata), stream framing, error codes
    push_proof       push proofs: the digest of a step's input as a server applied it, and the pusher's signed
                     statement of what it pushed into which session (checked outputs with push)
    errors           SwarmError (the root of every swarm error) and the shared ones: ModelDirError, NetworkConfigError,
                     DHTUnreachable
    families         the model families (FAMILIES): per family, its classes, tensor names, layer call, embedding
                     scale, soft-capping, sliding layers; the one place to add a family
    special_tokens   EOS as transformers reads it: config.json, generation_config.json and the tokenizer, united
    manifest         the weights manifest (swarmbatch-manifest.json): each weight file's sha256 and tensors; its digest is
                     the revision, so a box holds only the files it opens, each checked; cached file digests
    hf_cache         Hugging Face ids: a snapshot of the local hub cache; where the hub is reachable, downloads of only
                     the small files and the shards a process opens (allow_patterns)
    model_spec       a local model directory: config, family classes, manifest, revision, model id, checked tensor loads
    identity         Identity: an RSA key file, the peer id it proves, signatures others can verify
    addresses        NetworkOptions: what a P2P node listens on and announces (--host, --port, --announce-host): no loopback
                     for a wildcard host, DNS names and IPv6, a free port when an announcement needs one
    records          signed, short-lived DHT records: the validator every node runs, GuardedDHTNode
    dht_wire         what a DHT node accepts from peers, bounded before decoding: BoundedSerializer, the caps on store
                     and find requests and on find answers, a record budget per writer
    dht_storage      BoundedStorage: at most 1024 records per key (a full key refuses newcomers, keeps its holders),
                     find answers within 3 MiB, smallest records first
    membership       a private swarm: the swarm file, Membership, member credentials, a client's SwarmAccess
    relays           circuit relays for servers behind NAT: RelayRole (relay / behind_nat / dial), p2pd's options for
                     each, RelayGuard (a private swarm's relay cuts off non-members' reservations)
    network          in-process hivemind P2P (RelayP2P: extra p2pd flags, relay events) + DHT node, uvloop loops,
                     LoopThread (sync facade)
    discovery        the only module that reads the DHT: who announced which block
    head             ClientHead: embeddings, final norm and LM head (the client runs them; a ring server holds a copy);
                     next_decode_inputs: the next decode step's mask and positions, for the client and the ring alike
    product_forms    a few rows' product x·Wᵀ on a CPU in equal forms (linear, transposed, paired; packed: oneDNN's, on
                     a packed copy), the fastest kept by timing; FormLinear, an nn.Linear taking its table's form
    head_matmul      HeadMatmul: the LM head's product on a CPU, in the fastest of its forms per small row count
                     (one of them split over a thread per core)
    devices          --device auto|cpu|cuda|cuda:N resolved against what torch sees; the default dtype there
    allocator        keep_freed_memory: glibc keeps freed tensor memory for the next step (every `swarmbatch` command)

Boundary: nothing here imports `swarmclient`, `servers` or `jobs`; `protocol`, `data_structures` and `errors` load
without transformers (tests/test_layers.py checks both).
"""
