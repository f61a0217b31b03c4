"""Relay roles as p2pd options, the CLI's relay flags, and RelayGuard's reading of the relay's events (what p2pd
actually does with them is tests/test_relay.py, in network namespaces)."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from typer.testing import CliRunner

import cli
from swarmnet.addresses import NetworkOptions
from swarmnet.errors import NetworkConfigError
from swarmnet.relays import RelayGuard, RelayRole, relay_kwargs

RELAY = "/ip4/203.0.113.7/tcp/31337/p2p/QmNkLfg5HSm1ytd9FfZiLCkaejBmEpp9NorCCQQvz3ma2d"
MEMBER = "12D3KooWE9chgxETABJtyi7WxDm7bvMoQTH8ZwHv7UckSqRVPZtV"
STRANGER = "QmTgtm7H9hXpDt5xLWCPzmMJimykgbGLqnHL1dUvZZ3NNo"


def test_only_relay_roles_turn_relays_on_and_a_node_behind_nat_reserves_on_its_relays_alone() -> None:
    assert NetworkOptions().p2p_kwargs()["use_relay"] is False  # servers and DHT nodes as before
    for role in (RelayRole.dial, RelayRole.relay):
        assert relay_kwargs(role, [RELAY]) == {"use_relay": True, "use_auto_relay": False}
    behind = NetworkOptions(relay_role=RelayRole.behind_nat).p2p_kwargs(relays=[RELAY])
    assert behind["use_auto_relay"] and behind["trusted_relays"] == [RELAY]
    assert behind["force_reachability"] == "private"  # reserve at once, without waiting for AutoNAT
    assert behind["extra_flags"] == {"relayDiscovery": False}  # never reserve on an arbitrary DHT peer


def test_use_relay_without_initial_peers_is_one_line_saying_what_to_run() -> None:
    with pytest.raises(NetworkConfigError, match="--use-relay needs --initial-peers.*dht --relay"):
        NetworkOptions(relay_role=RelayRole.behind_nat).p2p_kwargs(relays=[])


def test_relay_and_use_relay_together_are_refused_as_a_usage_error() -> None:
    result = CliRunner().invoke(cli.app, ["serve", "tiny", "--blocks", "0:1", "--relay", "--use-relay",
                                          "--initial-peers", RELAY])
    assert result.exit_code == 2 and "give --relay or --use-relay, not both" in result.stderr


class FakeP2P:
    """What RelayGuard touches of a RelayP2P: its event callback and the daemon client's disconnect (hivemind's)."""

    def __init__(self) -> None:
        self.on_relay_event: Any = None
        self.disconnected: list[str] = []
        self._client = self

    async def disconnect(self, peer: Any) -> None:
        self.disconnected.append(peer.to_base58())


def test_the_guard_disconnects_a_stranger_holding_a_slot_or_receiving_a_circuit_and_never_a_member() -> None:
    async def scenario() -> FakeP2P:
        p2p = FakeP2P()
        guard = RelayGuard(p2p, lambda peer: peer == MEMBER)  # type: ignore[arg-type]
        for message in (f"reserving relay slot for {MEMBER}", f"relaying connection from {STRANGER} to {MEMBER}",
                        f"new relay stream from: {STRANGER}", f"reserving relay slot for {STRANGER}",
                        f"relaying connection from {MEMBER} to {STRANGER}"):
            p2p.on_relay_event(message)
        await asyncio.sleep(0.01)
        assert guard.cut == {STRANGER: 2}
        return p2p

    assert asyncio.run(scenario()).disconnected == [STRANGER, STRANGER]
