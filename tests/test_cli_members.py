"""`swarmbatch swarm init / new-key / add-member / remove-member / members`, the flags of a private swarm, their
one-line errors, and the warning of a process that listens beyond loopback in an open swarm."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import cli
from commands.errors import ExitCode
from launch.processes import ManagedProcess, cli_command
from swarmnet.identity import Identity
from swarmnet.membership import SwarmFile

runner = CliRunner()
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWCxbSVdL8unKt3Y4pzF1KX9GJLuq7DiGtDJwP5HhSaFRP"
UNASSIGNED = "192.0.2.1"  # TEST-NET-1: not loopback, and no interface of this machine has it (binding fails)


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_error_line(err: str, kind: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {kind}: "), err
    return lines[0]


def test_every_membership_command_has_help_and_the_flags_are_everywhere() -> None:
    for command in ("init", "new-key", "add-member", "remove-member", "members"):
        code, out, _ = invoke("swarm", command, "--help")
        assert code == 0 and "Usage" in out, command
    root = typer.main.get_command(cli.app)

    def envvars(*path: str) -> dict[str, str | None]:
        command = root
        for name in path:
            command = command.commands[name]  # type: ignore[attr-defined]
        return {param.opts[0]: param.envvar for param in command.params if param.opts[0].startswith("--")}

    for path in (["dht"], ["serve"], ["generate"], ["swarm", "status"], ["worker"]):
        assert envvars(*path)["--swarm-file"] == "SWARMBATCH_SWARM_FILE", path
    for path in (["generate"], ["swarm", "status"], ["worker"]):
        assert envvars(*path)["--identity"] == "SWARMBATCH_IDENTITY", path
    for path in (["dht"], ["serve"]):  # their own libp2p key: one per process, never from a shared variable
        assert envvars(*path)["--identity"] is None, path


def test_members_are_managed_from_the_command_line(tmp_path: Path) -> None:
    swarm_file = tmp_path / "swarm.json"
    assert invoke("swarm", "init", str(swarm_file))[:2] == (0, f"{swarm_file}\n")
    code, out, _ = invoke("swarm", "new-key", str(tmp_path / "box1.key"))
    peer_id = out.strip()
    assert code == 0 and peer_id == Identity.load(tmp_path / "box1.key").peer_id
    code, out, _ = invoke("swarm", "add-member", str(swarm_file), str(tmp_path / "box1.key"), "--role", "server")
    assert code == 0 and out.startswith(f"added {peer_id} (box1, server): 1 members")  # a key file
    other = Identity.create(tmp_path / "laptop.key").peer_id
    assert invoke("swarm", "add-member", str(swarm_file), other, "--name", "laptop")[0] == 0  # a peer id, role any
    swarm = SwarmFile.load(swarm_file)
    assert swarm.members == {peer_id: "box1", other: "laptop"} and swarm.roles == {peer_id: "server"}
    roles = {peer_id: ("box1", "server"), other: ("laptop", "any")}
    code, out, _ = invoke("swarm", "members", str(swarm_file), "--json")
    assert json.loads(out) == [{"peer_id": p, "name": n, "role": r} for p, (n, r) in sorted(roles.items())]
    assert f"{other}  laptop  any" in invoke("swarm", "members", str(swarm_file))[1]
    assert invoke("swarm", "add-member", str(swarm_file), other, "--name", "laptop", "--role", "client")[0] == 0
    assert f"{other}  laptop  client" in invoke("swarm", "members", str(swarm_file))[1]  # its role changed
    assert invoke("swarm", "add-member", str(swarm_file), other, "--role", "admin")[0] == 2  # no such role
    assert invoke("swarm", "remove-member", str(swarm_file), "laptop")[0] == 0  # by name
    assert invoke("swarm", "remove-member", str(swarm_file), str(tmp_path / "box1.key"))[0] == 0  # by key file
    assert SwarmFile.load(swarm_file).members == {}
    assert "no members yet" in invoke("swarm", "members", str(swarm_file))[1]


@pytest.mark.parametrize("command, kind, message", [
    (["swarm", "init", "{swarm}"], "SwarmFileError", "already exists; refusing to overwrite"),
    (["swarm", "new-key", "{key}"], "IdentityError", "already exists; refusing to overwrite a key file"),
    (["swarm", "add-member", "{swarm}", "not-a-peer"], "SwarmFileError", "'not-a-peer' is not a peer id"),
    (["swarm", "add-member", "{missing}", "{key}"], "SwarmFileError", "does not exist; create it with 'swarmbatch swarm init"),
    (["swarm", "add-member", "{swarm}", "{junk}"], "IdentityError", "is not a swarmbatch/libp2p key file"),
    (["swarm", "remove-member", "{swarm}", "nobody"], "SwarmFileError", "'nobody' is not a member of"),
    (["generate", "{model}", "hi", "--swarm-file", "{swarm}", "--initial-peers", DEAD_PEER], "MembershipError",
     "no member key: pass --identity KEYFILE (or set SWARMBATCH_IDENTITY)"),
    (["generate", "{model}", "hi", "--swarm-file", "{swarm}", "--identity", "{key}", "--initial-peers", DEAD_PEER],
     "NotAMember", "is not a member of swarm file"),
    (["generate", "{model}", "hi", "--swarm-file", "{junk}", "--identity", "{key}", "--initial-peers", DEAD_PEER],
     "SwarmFileError", "is not JSON"),
    (["serve", "{model}", "--blocks", "0:3", "--swarm-file", "{swarm}", "--initial-peers", DEAD_PEER],
     "MembershipError", "needs --identity KEYFILE"),
    (["dht", "--swarm-file", "{missing}", "--identity", "{key}"], "SwarmFileError", "does not exist"),
])
def test_membership_mistakes_are_one_line_usage_errors(tmp_path: Path, tiny_model: Path, command: list[str],
                                                       kind: str, message: str) -> None:
    paths = {"swarm": tmp_path / "swarm.json", "key": tmp_path / "k.key", "missing": tmp_path / "nope.json",
             "junk": tmp_path / "junk", "model": tiny_model}
    SwarmFile.create(paths["swarm"])
    Identity.create(paths["key"])
    paths["junk"].write_bytes(b"\x00junk")
    code, _, err = invoke(*[part.format(**paths) for part in command])
    assert code == ExitCode.USAGE and message in one_error_line(err, kind)


def test_the_worker_refuses_a_swarm_file_without_a_member_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    SwarmFile.create(tmp_path / "swarm.json")
    monkeypatch.setenv("SWARMBATCH_HOME", str(tmp_path / "home"))
    for name in ("SWARMBATCH_SWARM_FILE", "SWARMBATCH_IDENTITY"):  # the command sets them: restore them afterwards
        monkeypatch.setenv(name, "")
    from jobs.assembly import set_runtime
    from jobs.settings import get_settings

    get_settings.cache_clear()
    set_runtime(None)
    try:
        code, _, err = invoke("worker", "--swarm-file", str(tmp_path / "swarm.json"))
    finally:
        get_settings.cache_clear()
        set_runtime(None)
    assert code == ExitCode.USAGE and "no member key" in one_error_line(err, "MembershipError")


@pytest.mark.swarm  # each starts a p2pd, which fails to bind the unassigned address
@pytest.mark.parametrize("host, private, warned", [(UNASSIGNED, False, True), (UNASSIGNED, True, False),
                                                   ("127.0.0.1", False, False)])
def test_a_dht_node_beyond_loopback_without_a_swarm_file_warns_in_one_line(tmp_path: Path, host: str, private: bool,
                                                                           warned: bool) -> None:
    args = ["dht", "--host", host, "--initial-peers", DEAD_PEER]
    if private:
        key = Identity.create(tmp_path / "dht.key")
        swarm = SwarmFile.create(tmp_path / "swarm.json")
        swarm.add(key.peer_id, "dht")
        swarm.save()
        args += ["--swarm-file", str(swarm.path), "--identity", str(key.path)]
    dht = ManagedProcess(cli_command(*args), name="dht", log_dir=tmp_path)
    dht.proc.wait(60)
    dht.kill()
    log = dht.log_path.read_text()
    warnings = [line for line in log.splitlines() if line.startswith("Warning: ")]
    assert warnings == ([f"Warning: this DHT node listens on {host} without --swarm-file: anyone who can reach its "
                         "port can join the swarm, announce blocks and be sent hidden states (the prompts); make the "
                         "swarm private with 'swarmbatch swarm init' (docs/deploying.md: Several machines)"]
                        if warned else []), log
    assert "Error: DHTUnreachable" in log  # it got as far as starting (and failing) in every case


@pytest.mark.swarm  # starts a p2pd, which fails to bind the unassigned address
def test_a_server_beyond_loopback_without_a_swarm_file_warns(tmp_path: Path, tiny_model: Path) -> None:
    code, _, err = invoke("serve", str(tiny_model), "--blocks", "0:3", "--host", UNASSIGNED, "--initial-peers", DEAD_PEER)
    assert code == ExitCode.SWARM_UNAVAILABLE
    assert err.startswith(f"Warning: this server listens on {UNASSIGNED} without --swarm-file: ")
