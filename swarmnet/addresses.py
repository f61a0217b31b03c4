"""Which multiaddrs a P2P node listens on and which it announces, from `--host`, `--port` and `--announce-host`.

Peers learn a node's addresses from what it announces, so every announced address must be one that another
machine can dial:

- `--announce-host` given: only that address (an IPv4 or IPv6 literal, or a DNS name: `/dns4` for an IPv4
  `--host`, `/dns6` for an IPv6 one, since the name must lead to the family the node listens on);
- a wildcard `--host` (`0.0.0.0`, `::`): the addresses of this machine's interfaces in that family, without
  loopback and link-local ones (libp2p alone would announce 127.0.0.1 / ::1 too, which on another machine
  leads to that machine itself);
- any other `--host`: that address, as libp2p announces it.

An announced address needs its real port, so a node that announces and was given no `--port` picks a free one
before it starts (another process could take it in between; the start then fails and says so).
"""
from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarmnet.errors import NetworkConfigError
from swarmnet.relays import RelayRole, relay_kwargs

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def parse_ip(value: str) -> IPAddress | None:
    """An IP literal (IPv6 with or without brackets), or None when `value` is not one."""
    try:
        return ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        return None


def listen_ip(host: str) -> IPAddress:
    """`--host` as an IP address; raises NetworkConfigError for anything else (a node listens on addresses)."""
    ip = parse_ip(host)
    if ip is None:
        raise NetworkConfigError(
            f"--host {host!r} is not an IP address: listen on 127.0.0.1, ::1, 0.0.0.0 (every IPv4 interface) or :: "
            "(every IPv6 interface), and put a DNS name in --announce-host")
    return ip


def check_dns_name(name: str) -> str:
    """A DNS name as given; raises NetworkConfigError unless it is a valid host name (RFC 1123)."""
    labels = name.rstrip(".").split(".")
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels) or labels[-1].isdigit():
        raise NetworkConfigError(f"--announce-host {name!r} is neither an IP address nor a DNS name; give the "
                                 "address or name other machines dial to reach this one")
    return name.rstrip(".")


def host_maddr(host: str, port: int, *, listen_family: int = 4) -> str:
    """`/ip4/...`, `/ip6/...` or `/dns4|dns6/...` with `/tcp/port`; a DNS name takes the listening family."""
    ip = parse_ip(host)
    if ip is not None:
        return f"/ip{ip.version}/{ip}/tcp/{port}"
    return f"/dns{listen_family}/{check_dns_name(host)}/tcp/{port}"


def dialable(ip: IPAddress) -> bool:
    """Whether another machine could dial this interface address (not loopback, link-local, wildcard or multicast)."""
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast)


def announce_maddrs(host: str, port: int, announce_host: str | None, interface_ips: list[str]) -> list[str] | None:
    """What to announce (None: leave it to libp2p, which announces the listen address).

    Pure: `interface_ips` are this machine's interface addresses (`interface_addresses()`).
    """
    listen = listen_ip(host)
    if announce_host:
        return [host_maddr(announce_host, port, listen_family=listen.version)]
    if not listen.is_unspecified:
        return None
    ips = [ip for ip in map(parse_ip, interface_ips) if ip is not None and ip.version == listen.version]
    return [host_maddr(str(ip), port) for ip in ips if dialable(ip)] or None


def interface_addresses() -> list[str]:
    """The IP addresses of this machine's interfaces that are up, in interface order (IPv6 without zone ids)."""
    import psutil

    up = {name for name, stats in psutil.net_if_stats().items() if stats.isup}
    return [addr.address.split("%")[0] for name, addrs in psutil.net_if_addrs().items() if name in up
            for addr in addrs if addr.family in (socket.AF_INET, socket.AF_INET6)]


def free_port(host: str) -> int:
    """A TCP port free on `host` right now (the kernel's pick); NetworkConfigError if `host` is not this machine's."""
    family = socket.AF_INET6 if listen_ip(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host.strip("[]"), 0))
        except OSError as e:
            raise NetworkConfigError(f"cannot listen on --host {host}: {e.strerror}; give an address of this "
                                     "machine (or 0.0.0.0 / ::)") from e
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class AddressPlan:
    """The listen and announce multiaddrs of one node, with the port it will use."""

    port: int
    listen: list[str]
    announce: list[str] | None  # None: libp2p announces the listen address
    chosen_port: bool = False   # the port was picked here (no --port given)

    @classmethod
    def make(cls, host: str, port: int, announce_host: str | None) -> AddressPlan:
        """Decide the addresses: reads this machine's interfaces and, when an announcement needs one, a free port."""
        ips = interface_addresses() if listen_ip(host).is_unspecified and not announce_host else []
        chosen = port == 0 and announce_maddrs(host, 1, announce_host, ips) is not None
        if chosen:
            port = free_port(host)
        return cls(port, [host_maddr(host, port)], announce_maddrs(host, port, announce_host, ips), chosen)

    def notes(self, host: str) -> list[tuple[int, str]]:
        """(log level, message) for what the user should know about these addresses."""
        notes: list[tuple[int, str]] = []
        if self.chosen_port:
            notes.append((logging.INFO, f"no --port given: listening on port {self.port} (pass --port to keep it "
                                        "across restarts)"))
        if listen_ip(host).is_unspecified and self.announce is None:
            notes.append((logging.WARNING, f"--host {host}: this machine has no interface address but loopback in "
                                           "that family, so other machines cannot dial it; pass --announce-host"))
        return notes


@dataclass(frozen=True)
class NetworkOptions:
    """Where a P2P node listens and how it identifies itself (what it announces: `swarmnet.addresses`)."""

    host: str = "127.0.0.1"          # listen address (an IP); 0.0.0.0 or :: to accept peers from other machines
    port: int = 0                    # 0 = any free port
    identity_path: str | None = None  # a private key file: keeps the peer id across restarts (created if missing)
    announce_host: str | None = None  # the address (IPv4, IPv6 or DNS name) other machines dial, if not `host`
    relay_role: RelayRole = RelayRole.none  # circuit relays: relay for members, be reached through one, dial them

    def __post_init__(self) -> None:
        """Refuse addresses that cannot work before anything starts (NetworkConfigError)."""
        listen_ip(self.host)
        if self.announce_host:
            host_maddr(self.announce_host, 1)
        if not 0 <= self.port <= 65535:
            raise NetworkConfigError(f"--port {self.port} is not a TCP port (1-65535, or 0 for any free port)")

    def plan(self) -> AddressPlan:
        """The listen and announce multiaddrs; reads the interfaces, and picks a free port if an announcement needs one."""
        return AddressPlan.make(self.host, self.port, self.announce_host or None)

    def p2p_kwargs(self, plan: AddressPlan | None = None, relays: Sequence[str] = ()) -> dict[str, Any]:
        """Keyword arguments for `P2P.create` (`RelayP2P.create` when they hold `extra_flags`). NAT port mapping and
        AutoNAT stay off (no LAN probing); relays as `relay_role` says (`relays`: the relays a node behind NAT
        reserves on, its initial peers)."""
        plan = plan or self.plan()
        kwargs: dict[str, Any] = dict(
            host_maddrs=plan.listen, nat_port_map=False, auto_nat=False, identity_path=self.identity_path,
            **relay_kwargs(self.relay_role, relays),
        )
        if plan.announce is not None:
            kwargs["announce_maddrs"] = plan.announce
        return kwargs
