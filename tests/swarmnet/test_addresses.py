"""What a P2P node listens on and announces (swarmnet.addresses); pure, plus the CLI refusing bad addresses."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

import cli
from commands.errors import ExitCode
from swarmnet.addresses import AddressPlan, NetworkOptions, announce_maddrs, host_maddr, listen_ip
from swarmnet.errors import NetworkConfigError

# a machine with loopback, a LAN address, a link-local and a ULA IPv6 address, and a link-local IPv4 one
INTERFACES = ["127.0.0.1", "::1", "192.168.1.20", "fe80::1", "fd00::2", "169.254.3.4"]


def test_a_wildcard_host_announces_the_interfaces_of_its_family_without_loopback_or_link_local() -> None:
    assert announce_maddrs("0.0.0.0", 31337, None, INTERFACES) == ["/ip4/192.168.1.20/tcp/31337"]
    assert announce_maddrs("::", 31337, None, INTERFACES) == ["/ip6/fd00::2/tcp/31337"]


def test_a_wildcard_host_on_a_machine_with_only_loopback_leaves_the_announcement_to_libp2p() -> None:
    assert announce_maddrs("0.0.0.0", 31337, None, ["127.0.0.1", "::1"]) is None
    assert AddressPlan(1, ["/ip4/0.0.0.0/tcp/1"], None).notes("0.0.0.0")[0][1].startswith("--host 0.0.0.0: this machine")


def test_a_specific_host_is_announced_as_libp2p_does_it() -> None:
    assert announce_maddrs("127.0.0.1", 31337, None, INTERFACES) is None
    assert announce_maddrs("::1", 31337, None, INTERFACES) is None


def test_the_announce_host_alone_is_announced_an_ip_of_either_family_or_a_dns_name_of_the_listening_family() -> None:
    assert announce_maddrs("0.0.0.0", 5, "203.0.113.7", INTERFACES) == ["/ip4/203.0.113.7/tcp/5"]
    assert announce_maddrs("0.0.0.0", 5, "2001:db8::7", INTERFACES) == ["/ip6/2001:db8::7/tcp/5"]
    assert announce_maddrs("::", 5, "[2001:db8::7]", INTERFACES) == ["/ip6/2001:db8::7/tcp/5"]
    assert announce_maddrs("0.0.0.0", 5, "dht.example.lan", INTERFACES) == ["/dns4/dht.example.lan/tcp/5"]
    assert announce_maddrs("::", 5, "dht.example.lan.", INTERFACES) == ["/dns6/dht.example.lan/tcp/5"]
    assert announce_maddrs("127.0.0.1", 5, "localhost", []) == ["/dns4/localhost/tcp/5"]


def test_host_maddrs_of_every_kind() -> None:
    assert host_maddr("10.0.0.1", 1) == "/ip4/10.0.0.1/tcp/1"
    assert host_maddr("::", 2) == "/ip6/::/tcp/2"
    assert host_maddr("box-1.lan", 3, listen_family=6) == "/dns6/box-1.lan/tcp/3"


@pytest.mark.parametrize("host", ["localhost", "dht.lan", "", "10.0.0.300", "::g"])
def test_a_listen_address_must_be_an_ip(host: str) -> None:
    with pytest.raises(NetworkConfigError, match="is not an IP address"):
        listen_ip(host)


@pytest.mark.parametrize("name", ["bad_name", "-lead.lan", "a..b", "x" * 64 + ".lan", "1.2.3", "two words", "/dns4/x"])
def test_an_announce_host_must_be_an_ip_or_a_dns_name(name: str) -> None:
    with pytest.raises(NetworkConfigError, match="neither an IP address nor a DNS name"):
        NetworkOptions(announce_host=name)


def test_announcing_without_a_port_picks_a_free_one_for_both_listening_and_announcing() -> None:
    options = NetworkOptions(announce_host="localhost")
    kwargs = options.p2p_kwargs()
    port = int(kwargs["host_maddrs"][0].rsplit("/", 1)[1])
    assert port > 0 and kwargs["host_maddrs"] == [f"/ip4/127.0.0.1/tcp/{port}"]
    assert kwargs["announce_maddrs"] == [f"/dns4/localhost/tcp/{port}"]
    assert NetworkOptions(announce_host="localhost", port=4242).p2p_kwargs()["announce_maddrs"] == \
        ["/dns4/localhost/tcp/4242"]


def test_a_plain_local_node_keeps_port_0_and_no_announcement() -> None:
    kwargs = NetworkOptions().p2p_kwargs()
    assert kwargs["host_maddrs"] == ["/ip4/127.0.0.1/tcp/0"] and "announce_maddrs" not in kwargs


runner = CliRunner()


@pytest.mark.parametrize(("args", "env", "says"), [
    (["--host", "localhost"], {}, "--host 'localhost' is not an IP address"),
    ([], {"SWARMBATCH_HOST": "dht.lan"}, "--host 'dht.lan' is not an IP address"),
    ([], {"SWARMBATCH_ANNOUNCE_HOST": "not a name"}, "--announce-host 'not a name' is neither"),
    (["--announce-host", "bad_name!"], {}, "--announce-host 'bad_name!' is neither"),
])
@pytest.mark.parametrize("command", [["dht"], ["serve", "smollm2", "--blocks", "0:1", "--initial-peers", "/ip4/127.0.0.1/tcp/1"]])
def test_the_cli_refuses_a_bad_address_in_one_line_with_exit_code_2(command: list[str], args: list[str],
                                                                   env: dict[str, str], says: str) -> None:
    # flags and SWARMBATCH_HOST / SWARMBATCH_ANNOUNCE_HOST alike; nothing starts (this is the fast tier)
    result = runner.invoke(cli.app, [*command, *args], env=env)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert result.stderr.startswith(f"Error: NetworkConfigError: {says}") and len(result.stderr.splitlines()) == 1


def test_swarmbatch_port_is_read_and_range_checked() -> None:
    result = runner.invoke(cli.app, ["dht"], env={"SWARMBATCH_PORT": "70000"})
    assert result.exit_code == ExitCode.USAGE and "SWARMBATCH_PORT" in result.stderr
