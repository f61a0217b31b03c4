"""Options that several command modules share, and the root's --verbose flag."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

PeersOption = Annotated[list[str], typer.Option("--initial-peers", envvar="SWARMBATCH_INITIAL_PEERS",
                                                help="DHT multiaddrs to join (from 'swarmbatch dht').")]
# where a DHT node or block server listens and what it announces (swarmnet.addresses)
HostOption = Annotated[str, typer.Option(
    "--host", envvar="SWARMBATCH_HOST",
    help="Listen address: 127.0.0.1 (this machine), 0.0.0.0 / :: (every IPv4 / IPv6 interface; their addresses "
         "are announced, loopback excluded), ::1.")]
PortOption = Annotated[int, typer.Option("--port", envvar="SWARMBATCH_PORT", min=0, max=65535,
                                         help="TCP port; 0 = any free port.")]
AnnounceHostOption = Annotated[str | None, typer.Option(
    "--announce-host", envvar="SWARMBATCH_ANNOUNCE_HOST",
    help="The address other machines dial, announced instead of --host's: an IPv4 or IPv6 address or a DNS name.")]
RelayOption = Annotated[bool, typer.Option(
    "--relay", envvar="SWARMBATCH_RELAY",
    help="Relay for the swarm's members (libp2p circuit relay v2): servers behind NAT that run --use-relay are "
         "reached through this node; a non-member that takes a relay slot is disconnected. Run it where others can "
         "dial this node.")]
UseRelayOption = Annotated[bool, typer.Option(
    "--use-relay", envvar="SWARMBATCH_USE_RELAY",
    help="This server cannot be dialed (behind NAT, no open port): reserve a slot on the --initial-peers (DHT nodes "
         "running --relay) and be reached through them.")]
SwarmFileOption = Annotated[Path | None, typer.Option(
    "--swarm-file", envvar="SWARMBATCH_SWARM_FILE",
    help="A private swarm's member list ('swarmbatch swarm init'); without it the swarm is open to anyone who can "
         "reach its ports.")]
MemberKeyOption = Annotated[Path | None, typer.Option(
    "--identity", envvar="SWARMBATCH_IDENTITY",
    help="A member key file ('swarmbatch swarm new-key'): proves this client a member of the private swarm.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="Debug logs and tracebacks.")]
VERBOSE = "verbose"  # the root callback's parameter name for VerboseOption


def verbose_requested(ctx: typer.Context) -> bool:
    """Whether the root command got --verbose (read from the context: no global state to reset in tests)."""
    return bool(ctx.find_root().params.get(VERBOSE))
