"""Circuit relays (libp2p circuit relay v2, in hivemind's p2pd) for servers that nobody can dial: behind a home
router or a cloud NAT.

Roles (`NetworkOptions.relay_role`; `RelayP2P` in swarmnet/network.py starts p2pd with them):

- `RelayRole.relay` (`dht --relay`, `serve --relay`): this node relays for the swarm's members.
- `RelayRole.behind_nat` (`serve --use-relay`): this node cannot be dialed; it keeps a reservation on the relays
  (its initial peers, the DHT nodes that run `--relay`) and announces `/p2p/<relay>/p2p-circuit` addresses, which
  libp2p dials like any other.
- `RelayRole.dial` (every swarm client): can dial such addresses, relays for nobody reachable (it listens on
  loopback).
- `RelayRole.none`: relays off (no circuit dialing at all), as before.

What this p2pd (learning-at-home/go-libp2p-daemon v0.5.0.hivemind1, go-libp2p 0.32.1) does, measured
(tests/test_relay.py, bench/relay.py) and read in its source:

- Any node started with `-relay=1` runs a relay service with go-libp2p's default limits: each relayed connection
  carries at most 128 KiB each way and lives at most 2 minutes, then the relay resets it. The daemon's
  `-relayDataLimit`/`-relayTimeLimit`/`-relayMaxCircuits` flags configure a first service that its
  `EnableRelayV2` replaces with a default one, so they change nothing. A client whose relayed connection is reset
  dials a new one and resumes the session there (the server keeps it detached for its session grace:
  servers/handler.py), resending only the step it has no answer to.
- The relay has no ACL the daemon lets us set. What keeps it from serving strangers is `RelayGuard`: the relay's
  p2pd logs every reservation and every circuit (the "relay" logger at debug level), and the guard disconnects a
  non-member the moment it holds a reservation, and both ends of a circuit to a non-member; libp2p drops a
  reservation with its connection. Circuits from strangers to members are left to the members, whose servers
  refuse non-member callers (servers/access.py) as they refuse direct ones.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from swarmnet.errors import NetworkConfigError

logger = logging.getLogger(__name__)

RELAY_LOGGER = "relay"  # go-libp2p's logger of the relay service (p2p/protocol/circuitv2/relay); RelayP2P reads it
_RESERVED = re.compile(r"^reserving relay slot for (\w+)$")
_RELAYING = re.compile(r"^relaying connection from (\w+) to (\w+)$")
RELAY_CONNECTION_CAP = "128 KiB each way or 2 minutes"  # what p2pd's relay lets one relayed connection carry
MAX_LOGGED_STRANGERS = 100  # refused strangers logged by name (one line each); more are refused silently


class RelayRole(str, enum.Enum):
    """What a node does with circuit relays."""

    none = "none"              # no relay transport
    dial = "dial"              # dials relayed addresses (clients)
    behind_nat = "behind_nat"  # reserves a slot on relays and is reached through them (serve --use-relay)
    relay = "relay"            # relays for members (dht --relay, serve --relay)


def relay_kwargs(role: RelayRole, relays: Sequence[str]) -> dict[str, Any]:
    """`P2P.create` keyword arguments (with `extra_flags` for RelayP2P) for a role; `relays`: the relays'
    multiaddrs (with /p2p/) for `behind_nat`."""
    if role is RelayRole.none:
        return {"use_relay": False, "use_auto_relay": False}
    if role is not RelayRole.behind_nat:
        return {"use_relay": True, "use_auto_relay": False}
    if not relays:
        raise NetworkConfigError("--use-relay needs --initial-peers: the DHT nodes that relay (run 'swarmbatch dht "
                                 "--relay' on a machine others can dial)")
    # static relays only: without relayDiscovery=0, p2pd would also reserve on any DHT peer, members or not
    return {"use_relay": True, "use_auto_relay": True, "trusted_relays": list(relays),
            "force_reachability": "private", "extra_flags": {"relayDiscovery": False}}


class RelayDaemon(Protocol):
    """What RelayGuard needs of the relay's node (swarmnet.network.RelayP2P): its relay log, and its daemon client."""

    on_relay_event: Callable[[str], None] | None
    _client: Any


class RelayGuard:
    """Keeps a relay for members: a non-member that got a reservation, or a circuit to a non-member, is cut at once.

    `allows(peer_id)`: membership (a swarm file's `Membership.allows`). Counts what it cut (`cut`), for tests and
    logs. Runs on the relay's event loop: the p2pd log reader calls `on_event` there.
    """

    def __init__(self, p2p: RelayDaemon, allows: Callable[[str], bool]) -> None:
        self.p2p, self.allows = p2p, allows
        self.cut: dict[str, int] = {}
        self._logged: set[str] = set()        # strangers logged by name
        self._members_seen: set[str] = set()  # members whose reservation was logged
        self._tasks: set[asyncio.Task[None]] = set()
        p2p.on_relay_event = self.on_event

    def on_event(self, message: str) -> None:
        """One relay log message: a reservation or a circuit to check. Only the reserving end needs cutting: a
        circuit's streams run over the relay's connection to it, and the source's stream is reset with them."""
        reserved, relaying = _RESERVED.match(message), _RELAYING.match(message)
        peer = reserved.group(1) if reserved else relaying.group(2) if relaying else None
        if peer is None:
            return
        if self.allows(peer):
            if reserved and peer not in self._members_seen:
                self._members_seen.add(peer)
                logger.info("Relay: member %s holds a reservation (reachable through this node)", peer[-8:])
            return
        self._disconnect(peer, "held a relay reservation" if reserved else "was a circuit's destination")

    def _disconnect(self, peer: str, why: str) -> None:
        self.cut[peer] = self.cut.get(peer, 0) + 1
        if peer not in self._logged and len(self._logged) < MAX_LOGGED_STRANGERS:
            self._logged.add(peer)
            logger.info("Relay: disconnected %s, not a member of this swarm: it %s", peer[-8:], why)
        task = asyncio.get_running_loop().create_task(self._drop(peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drop(self, peer: str) -> None:
        from hivemind.p2p import PeerID

        try:
            await self.p2p._client.disconnect(PeerID.from_base58(peer))
        except Exception as e:  # the peer may be gone already; the next event tries again
            logger.debug("Relay: could not disconnect %s: %s", peer[-8:], e)
