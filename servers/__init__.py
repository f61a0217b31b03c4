"""servers: a block server holds a contiguous span of a model's transformer blocks and serves it over P2P.

Modules:
    block_loading    load_span: read only the span's tensors, cast (float32/bfloat16) or quantize (int8/nf4)
    span             BlockSpan: the decoder layers, one KV cache per layer and session, any sub-range
    block_selection  pure: which span a `--num-blocks` server should take (least covered)
    throughput       measure_throughput: block-steps per second, announced for routing
    memory           CacheBudget: KV-cache tokens reserved per session within --attn-cache-tokens
    validation       checks on every request before compute
    status           ServerStatus: one reading of a server, from which info, /metrics and the DHT record are made
    handler          BlockHandler: the info / forward / inference RPCs; errors become responses in one place
    announcer        Announcer: the status's DHT record per block, refreshed, OFFLINE on shutdown
    server           ServerConfig + BlockServer: composition, start-up, status() and ordered shutdown
    bootstrap        the `swarmbatch dht` bootstrap node
    faults           TEST-ONLY: SWARMBATCH_FAULT_INJECTION=noise:STD makes the span's outputs wrong (checked outputs)
    metrics          the Prometheus endpoint (--metrics-port): the status as steps, tokens, errors, KV-cache use,
                     sessions, state
    stats, errors    counters; the ServerError tree
"""
