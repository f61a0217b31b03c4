"""Errors of the layer that servers and clients share: a model directory, addresses, the DHT, membership.

    SwarmError                      root of every swarm error, here and in swarmclient.errors
    ├── ModelDirError               the local model directory is unusable (not retryable: fix the path)
    ├── NetworkConfigError          a listen or announce address that cannot work (fix --host / --announce-host)
    ├── DHTUnreachable              no initial peer answered (retry after starting `swarmbatch dht`)
    ├── membership.MembershipError  a bad swarm file or member key, or not a member of the swarm (fix the setup)
    └── swarmclient.errors.*        what a client meets on the way through the swarm (missing blocks, failed peers)
"""
from __future__ import annotations


class SwarmError(Exception):
    """Root of every swarm error (shared layer and client)."""


class ModelDirError(SwarmError):
    """Raised when a model directory is missing, incomplete or of an unsupported family; retrying cannot help."""


class NetworkConfigError(SwarmError, ValueError):
    """Raised before a P2P node starts, for a listen or announce address that cannot work; the message says which."""


class DHTUnreachable(SwarmError):
    """Raised when none of the initial peers could be reached; retry once a DHT node is up."""
