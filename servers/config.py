"""`ServerConfig`: everything `swarmbatch serve` accepts, each default and description written once.

A field with `option(...)` metadata becomes a `serve` option of the same name (commands/config_options.py builds it
from the field: its type, default, help and bounds); the others are built by `serve` itself from its own arguments
(the model, the peers, --blocks, the network options, the swarm file).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from servers.errors import ServerConfigError
from swarmnet.addresses import NetworkOptions
from swarmnet.data_structures import ANNOUNCE_PERIOD_LIMIT, MAX_MACHINE_NAME
from swarmnet.devices import DeviceUnavailable, default_dtype, dtype_name, resolve_device

if TYPE_CHECKING:
    import torch

HELP = "help"  # the metadata key of an option's help text; "min" and "max" bound numbers


def option(default: Any, help: str, **bounds: float) -> Any:
    """A config field that is also a CLI option: its default, its help text and its bounds (min=, max=)."""
    return field(default=default, metadata={HELP: help, **bounds})


class DType(str, Enum):
    """Weights and activations dtype of a span (auto: the device's default, swarmnet/devices.py)."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    @property
    def torch(self) -> torch.dtype:
        """The torch dtype (auto has none: `ServerConfig.compute_dtype` resolves it)."""
        import torch  # not at module level: `swarmbatch --help` builds its options from this module

        if self is DType.auto:
            raise ValueError("DType.auto has no torch dtype: resolve it with ServerConfig.compute_dtype()")
        return getattr(torch, self.value)  # type: ignore[no-any-return]


class Quant(str, Enum):
    """Weight quantization of a span's linear layers (bitsandbytes)."""

    none = "none"
    int8 = "int8"
    nf4 = "nf4"


@dataclass(frozen=True)
class ServerConfig:
    """Everything `swarmbatch serve` accepts."""

    model_dir: str
    initial_peers: list[str]
    blocks: tuple[int, int] | None = None   # explicit span [start, end) (--blocks A:B)
    num_blocks: int | None = option(None, "Serve N blocks where coverage is weakest (without it and --blocks: as "
                                          "many as fit the memory, see --max-memory-gb).", min=1)
    network: NetworkOptions = field(default_factory=NetworkOptions)  # --host, --port, --announce-host, --identity
    device: str = option("auto", "Where weights, KV cache and compute live: auto (cuda when torch sees a GPU, else "
                                 "cpu), cpu, cuda or cuda:N.")
    dtype: DType = option(DType.auto, "Weights and activations dtype (also on the wire); auto: float32 on CPU, "
                                      "bfloat16 on CUDA where supported, else float16.")
    quant: Quant = option(Quant.none, "Weight quantization (bitsandbytes).")
    attn_cache_tokens: int = option(16384, "KV-cache tokens per block, all sessions.", min=1)
    max_memory_gb: float = option(0.0, "Memory this server may use for weights and KV cache when it sizes its span "
                                       "itself (neither --blocks nor --num-blocks); 0 = the device's free memory.",
                                  min=0)
    max_batch_size: int = option(64, "Largest batch accepted.", min=1)
    max_length: int | None = option(None, "Longest session in tokens; default: the model's context.", min=1)
    announce_period: float = option(15.0, "Seconds between DHT announcements.")
    session_timeout: float = option(300.0, "Idle seconds before a session is closed and its cache freed.")
    session_grace: float = option(30.0, "Seconds a session whose stream was lost (its client did not close it: a "
                                        "relay reset the connection, the network dropped) is kept, cache and all, "
                                        "for its client to resume on a new stream instead of replaying it "
                                        "elsewhere; its cache counts against the caller's share meanwhile. 0 = "
                                        "free it at once.", min=0)
    num_threads: int | None = option(None, "torch threads for compute; default: torch's.", min=1)
    batch_wait_ms: float = option(2.0, "Wait up to this many ms to merge concurrent sessions' decode steps into one "
                                       "forward (at most --max-batch-size rows); 0 = no merging.", min=0)
    max_merge_tokens: int = option(2048, "Falcon only (its merged steps copy the caches): sessions caching more "
                                         "tokens (rows x length) than this run alone.", min=0)
    max_sessions_per_peer: int = option(16, "Sessions one caller may have open here at once (a caller: a member of "
                                            "a private swarm, all its client processes together; a peer id in an "
                                            "open one); more are refused as busy.", min=1)
    max_cache_share_per_peer: float = option(0.5, "Share of the KV-cache budget one caller (member) may reserve; "
                                                  "more is refused as busy.", min=0.0, max=1.0)
    lend_idle_cache: bool = option(True, "Let a caller alone on this server borrow past its share, until another "
                                         "caller is refused room (then each is held to its share for 2 minutes, "
                                         "and the borrower's sessions over its share are ended after "
                                         "--lent-cache-grace).")
    lent_cache_grace: float = option(10.0, "Seconds a borrower's sessions over its share may go on once another "
                                           "caller is refused room; then the newest are ended as busy (their "
                                           "clients replay them elsewhere).", min=0)
    max_queued_forwards: int = option(4, "Stateless forwards admitted and not yet answered, all callers together.",
                                      min=1)
    max_forwards_per_peer: int = option(2, "Stateless forwards admitted and not yet answered, per caller (member).",
                                        min=1)
    max_forward_tokens: int = option(16384, "Tokens (rows x length) one stateless forward may carry; a bigger "
                                            "header is refused as invalid_request before any tensor is read.", min=1)
    max_streams_per_peer: int = option(128, "Streams one peer id may hold open here at once, every RPC together "
                                            "(a server pushing into this one's sessions counts too); more are "
                                            "refused as busy.", min=1)
    rebalance_period: float = option(30.0, "Seconds between coverage checks of a server started with --num-blocks "
                                           "(each jittered by up to a quarter): it moves its span to close a hole "
                                           "or to raise the swarm's weakest block (docs/healing.md); 0 = never "
                                           "move.", min=0)
    throughput: float | None = option(None, "Block-steps per second to announce (blocks x batch-1 decode steps a "
                                            "second) instead of measuring them at start; placement and moves "
                                            "compare servers by it. Pass the same figure on identical boxes to "
                                            "keep a noisy start-up measurement from deciding where they go.",
                                      min=0.001)
    machine: str | None = option(None, "Name of the machine whose compute this server shares, as announced: clients "
                                       "spread their sessions over machines, so servers of one machine must name "
                                       "it alike; default: a digest of this host's boot id, shared by its "
                                       "processes and containers (docs/swarm.md, \"Routing\"). Name it only for "
                                       "virtual machines sharing one host's cores.")
    balance_quality: float = option(0.75, "Move only if the weakest block's throughput would rise above this "
                                          "much of it (0.75: by a third); closing a hole needs no margin.",
                                    min=0.01, max=1.0)
    move_cooldown: float = option(300.0, "Seconds after a move before this server moves again to raise the "
                                         "weakest block (closing a hole does not wait).", min=0)
    move_drain_seconds: float = option(30.0, "When moving, how long running sessions may finish before they are "
                                             "ended (their clients fail over).", min=0)
    ring: bool = option(False, "Where this server's span ends at the model's last block, also hold the model's "
                               "embeddings, final norm and LM head, and guess the next token of clients that decode "
                               "greedily and ask for the ring: the step goes on to their first server from here, so a "
                               "token costs servers / 2 round trips instead of (servers + 1) / 2 (docs/swarm.md, \"The ring\").")
    tune_products: bool = option(True, "At start-up, time the equal forms of the blocks' products of 1-8 and 16 "
                                       "rows (decode steps) and keep each row count's fastest (oneDNN's packed "
                                       "weights kept beside the dense ones where memory is to spare, else one "
                                       "copy: packed for every row count, or dense forms); "
                                       "float32 spans on a CPU only (on an AMD EPYC VM a 16-row decode step of "
                                       "SmolLM2's blocks 0:15 took 0.71x as long, packed). Outputs differ by float "
                                       "rounding, 1e-6 to 1e-4 relative (docs/swarm.md, \"Product forms\").")
    metrics_port: int = option(0, "Serve Prometheus /metrics on this port; 0 = off.", min=0, max=65535)
    metrics_host: str = option("127.0.0.1", "Listen address of /metrics (0.0.0.0 for a scraper elsewhere).")
    swarm_file: str | None = None           # a private swarm's members (--swarm-file); None = open to everyone

    def __post_init__(self) -> None:
        self.torch_device()  # a device this machine lacks is refused now, in one line
        if self.blocks is not None and self.num_blocks is not None:
            raise ServerConfigError("pass one of --blocks A:B and --num-blocks N (or neither: as many blocks as fit "
                                    "the memory)")
        if self.attn_cache_tokens < 1 or self.max_batch_size < 1 or self.announce_period <= 0:
            raise ServerConfigError("--attn-cache-tokens, --max-batch-size and --announce-period must be positive")
        if self.announce_period > ANNOUNCE_PERIOD_LIMIT:
            raise ServerConfigError(f"--announce-period {self.announce_period:g} is above the swarm's limit of "
                                    f"{ANNOUNCE_PERIOD_LIMIT:g} s (peers refuse records living longer than two "
                                    f"periods); pass {ANNOUNCE_PERIOD_LIMIT:g} or less")
        for flag, seconds in (("--rebalance-period", self.rebalance_period), ("--move-cooldown", self.move_cooldown),
                              ("--move-drain-seconds", self.move_drain_seconds)):
            if seconds < 0:
                raise ServerConfigError(f"{flag} {seconds:g} is negative; pass 0 or more seconds")
        if not 0 < self.balance_quality <= 1:
            raise ServerConfigError(f"--balance-quality {self.balance_quality:g} is outside (0, 1]; pass e.g. 0.75 "
                                    "(move when the weakest block would rise by a third)")
        if self.throughput is not None and self.throughput <= 0:
            raise ServerConfigError(f"--throughput {self.throughput:g} is not positive; pass the block-steps per "
                                    "second to announce, or leave it out to measure them")
        if self.batch_wait_ms < 0:
            raise ServerConfigError("--batch-wait-ms must be 0 (no merging) or more")
        if self.swarm_file and not self.network.identity_path:
            raise ServerConfigError("a server of a private swarm (--swarm-file) needs --identity KEYFILE: a key whose "
                                    "peer id is in the swarm file ('swarmbatch swarm new-key', then add-member)")
        if min(self.max_sessions_per_peer, self.max_queued_forwards, self.max_forwards_per_peer,
               self.max_forward_tokens, self.max_streams_per_peer) < 1 or not 0 < self.max_cache_share_per_peer <= 1:
            raise ServerConfigError("--max-sessions-per-peer, --max-queued-forwards, --max-forwards-per-peer, "
                                    "--max-forward-tokens and --max-streams-per-peer must be positive, and "
                                    "--max-cache-share-per-peer in (0, 1]")
        if self.machine is not None and not 0 < len(self.machine) <= MAX_MACHINE_NAME:
            raise ServerConfigError(f"--machine names a machine in 1 to {MAX_MACHINE_NAME} characters; pass a shorter "
                                    "name, or leave it out to announce this host's")
        if self.session_grace < 0:
            raise ServerConfigError(f"--session-grace {self.session_grace:g} is negative; pass 0 or more seconds")
        if self.lent_cache_grace < 0:
            raise ServerConfigError(f"--lent-cache-grace {self.lent_cache_grace:g} is negative; pass 0 or more seconds")

    @property
    def rebalances(self) -> bool:
        """Whether this server may move its span: started with --num-blocks, and --rebalance-period is not 0."""
        return self.blocks is None and self.rebalance_period > 0

    def torch_device(self) -> torch.device:
        """--device resolved (auto: cuda when torch sees a GPU); raises ServerConfigError for one this box lacks."""
        try:
            return resolve_device(self.device)
        except DeviceUnavailable as e:
            raise ServerConfigError(f"--device: {e}") from e

    def compute_dtype(self) -> DType:
        """--dtype resolved: auto is float32 on a CPU, bfloat16 on a GPU that supports it, else float16."""
        if self.dtype is not DType.auto:
            return self.dtype
        return DType(dtype_name(default_dtype(self.torch_device())))
