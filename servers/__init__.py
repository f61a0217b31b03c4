"""servers: a block server holds a contiguous span of a model's transformer blocks and serves it over P2P.

Modules:
    block_loading    load_span: read only the span's tensors, cast (float32/bfloat16/float16) or quantize (int8/nf4),
                     then move them to the device (--device)
    span             BlockSpan: the decoder layers, one KV cache per layer and session, any sub-range; DecodeStep, and
                     forward_sessions: several sessions' decode steps as one forward
    span_forms       tune_span: at start-up, each row count's fastest form of the blocks' products (dense, or oneDNN's
                     packed copy; both copies only with memory to spare), a float32 span on a CPU
                     (swarmnet/product_forms.py)
    kv_cache         GrowingLayer: a session's KV cache layer, appended in place into a buffer with room to spare
    block_sizing     how many blocks fit the memory when neither --blocks nor --num-blocks is given
    block_selection  pure: which span a `--num-blocks` server should take (least covered)
    throughput       measure_throughput: block-steps per second, announced for routing (and a test-only overstatement)
    machine          this_machine: the name of the machine whose compute a server shares, announced for routing
    memory           CacheBudget: KV-cache tokens reserved per session within --attn-cache-tokens, a share per caller
                     (a member; a caller alone may borrow the rest until another is refused room, then gives it back)
    admission        Slots: forwards admitted and not yet answered, per caller and per server (over: busy)
    background       the lower-priority thread stateless forwards (checks, embeddings) compute on, behind sessions
    validation       checks on every request before compute
    access           MemberGate: the membership check (swarm file, member credentials) before a request is served;
                     names the member a caller acts for (per-caller limits count per member)
    status           ServerStatus: one reading of a server, from which info, /metrics and the DHT record are made
    batching         DecodeBatcher: concurrent sessions' decode steps on the same blocks merged into one forward
    merged_attention a merged step's attention, per session on its own cache (transformers' attention registry):
                     the linear layers run once for all rows, no cache is copied
    push             Pusher / PushLink: a step's outputs pushed to the next server's session (server-to-server push),
                     each with this server's signed push proof (swarmnet/push_proof.py)
    neighbours       NextServerPings: round trips to the servers that may follow this one, for push routing
    sessions         Stream and Session: what the server keeps per stream and per inference session (a detached one:
                     its stream lost, kept for --session-grace to be resumed)
    streams          StreamService: bounded frame reads, streams per peer, the authorize hook on a stream's first
                     message (and its re-check when the members change), one answer per message, and the one place
                     where exceptions become error answers
    push_receiver    PushReceiver: another server's push stream into one of our sessions; pushing our outputs on
    ring             the ring: a last server holding the head (--ring) guesses a greedy session's next step and pushes
                     it to the first, which applies it once the client's copy of the step before came (RingGuesser,
                     ring_of, takes_guess, confirm_guess)
    handler          BlockHandler: the info / forward / inference streams, their frame limits, sessions' cache
                     reservations and per-caller limits
    announcer        Announcer: the status's DHT record per block, refreshed, OFFLINE on shutdown
    server           ServerConfig + BlockServer: composition, start-up, status() and ordered shutdown
    bootstrap        the `swarmbatch dht` bootstrap node
    faults           TEST-ONLY: SWARMBATCH_FAULT_INJECTION=noise:STD makes the span's outputs wrong, push-noise:STD
                     only the outputs it pushes (checked outputs, push proofs)
    metrics          the Prometheus endpoint (--metrics-port): the status as steps, tokens, errors, KV-cache use,
                     sessions, state
    counters         ServerCounters: steps, tokens, merges and errors counted since start
    errors           the ServerError tree
"""
