"""servers: a block server holds a contiguous span of a model's transformer blocks and serves it over P2P.

Modules:
    block_loading    load_span: read only the span's tensors, cast (float32/bfloat16) or quantize (int8/nf4)
    span             BlockSpan: the decoder layers, one KV cache per layer and session, any sub-range
    block_selection  pure: which span a `--num-blocks` server should take (least covered)
    throughput       measure_throughput: block-steps per second, announced for routing (and a test-only overstatement)
    memory           CacheBudget: KV-cache tokens reserved per session within --attn-cache-tokens, a share per caller
                     (a caller alone may borrow the rest until another is refused room)
    admission        Slots: forwards admitted and not yet answered, per caller and per server (over: busy)
    validation       checks on every request before compute
    access           MemberGate: the membership check (swarm file, member credentials) before a request is served
    status           ServerStatus: one reading of a server, from which info, /metrics and the DHT record are made
    batching         DecodeBatcher: concurrent sessions' decode steps on the same blocks merged into one forward
    push             Pusher / PushLink: a step's outputs pushed to the next server's session (server-to-server push)
    neighbours       NextServerPings: round trips to the servers that may follow this one, for push routing
    handler          BlockHandler: the info / forward / inference / push streams, their frame limits, the authorize hook
                     on a stream's first message, per-caller limits; errors become responses in one place
    announcer        Announcer: the status's DHT record per block, refreshed, OFFLINE on shutdown
    server           ServerConfig + BlockServer: composition, start-up, status() and ordered shutdown
    bootstrap        the `swarmbatch dht` bootstrap node
    faults           TEST-ONLY: SWARMBATCH_FAULT_INJECTION=noise:STD makes the span's outputs wrong (checked outputs)
    metrics          the Prometheus endpoint (--metrics-port): the status as steps, tokens, errors, KV-cache use,
                     sessions, state
    stats, errors    counters; the ServerError tree
"""
