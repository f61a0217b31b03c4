"""The server's membership gate: who passes, what a refusal says, and its cache of verified credentials."""
from __future__ import annotations

from pathlib import Path

import pytest
from factories import ManualClock

from servers.access import MemberGate
from servers.errors import RequestRejected
from swarmnet.identity import Identity
from swarmnet.membership import CLIENT as CLIENT_ROLE
from swarmnet.membership import SERVER, MemberCredential, Membership, SwarmFile
from swarmnet.protocol import ErrorCode

CLIENT = "12D3KooWCxbSVdL8unKt3Y4pzF1KX9GJLuq7DiGtDJwP5HhSaFRP"
NOW = 1_800_000_000.0


@pytest.fixture
def swarm_file(tmp_path: Path, keys: dict[str, Identity]) -> Path:
    swarm = SwarmFile(tmp_path / "swarm.json", {keys["member"].peer_id: "alice", keys["server"].peer_id: "box1"})
    swarm.save()
    return swarm.path


def refusal(gate: MemberGate, caller: str, meta: dict) -> str:
    with pytest.raises(RequestRejected) as caught:
        gate.check(caller, meta)
    assert caught.value.code is ErrorCode.UNAUTHORIZED and "\n" not in str(caught.value)
    return str(caught.value)


def test_an_open_gate_admits_everyone_each_on_its_own_account() -> None:
    assert MemberGate.open().check(CLIENT, {}) == CLIENT


def test_the_gate_names_the_member_a_caller_acts_for(swarm_file: Path, keys: dict[str, Identity]) -> None:
    gate = MemberGate(Membership.from_file(swarm_file), clock=lambda: NOW)
    assert gate.check(keys["server"].peer_id, {}) == keys["server"].peer_id  # a server: itself
    meta = {"credential": MemberCredential.issue(keys["member"], CLIENT, int(NOW) + 100).to_bytes()}
    assert gate.check(CLIENT, meta) == keys["member"].peer_id  # a client process: the member key it acts for
    assert gate.check(CLIENT, meta) == keys["member"].peer_id and gate.checked == 1  # from the cache too


def test_a_member_peer_needs_no_credential_and_others_need_one(swarm_file: Path, keys: dict[str, Identity]) -> None:
    gate = MemberGate(Membership.from_file(swarm_file))
    gate.check(keys["server"].peer_id, {})  # another server of the swarm
    assert "sent no member credential: run the client with --swarm-file and --identity" in refusal(gate, CLIENT, {})
    outsider = MemberCredential.issue(keys["outsider"], CLIENT, int(NOW) + 86400).to_bytes()
    gate = MemberGate(Membership.from_file(swarm_file), clock=lambda: NOW)
    assert "is not a member of this server's swarm: add it with 'swarmbatch swarm add-member" in \
        refusal(gate, CLIENT, {"credential": outsider})


def test_a_verified_credential_is_cached_until_it_expires(swarm_file: Path, keys: dict[str, Identity]) -> None:
    clock = ManualClock(NOW)
    gate = MemberGate(Membership.from_file(swarm_file), clock=clock)
    meta = {"credential": MemberCredential.issue(keys["member"], CLIENT, int(NOW) + 100).to_bytes()}
    for _ in range(3):
        gate.check(CLIENT, meta)
    assert gate.checked == 1, "one signature check per client process"
    clock.now = NOW + 100
    assert "expired" in refusal(gate, CLIENT, meta)


def test_removing_a_member_drops_its_cached_credentials(swarm_file: Path, keys: dict[str, Identity]) -> None:
    monotonic = ManualClock(0.0)
    gate = MemberGate(Membership.from_file(swarm_file, recheck=5.0, clock=monotonic), clock=lambda: NOW)
    meta = {"credential": MemberCredential.issue(keys["member"], CLIENT, int(NOW) + 86400).to_bytes()}
    gate.check(CLIENT, meta)
    swarm = SwarmFile.load(swarm_file)
    swarm.remove("alice")
    swarm.save()
    monotonic.now = 5.0
    assert "is not a member of this server's swarm" in refusal(gate, CLIENT, meta)


def test_the_cache_stays_bounded(swarm_file: Path, keys: dict[str, Identity]) -> None:
    gate = MemberGate(Membership.from_file(swarm_file), clock=lambda: NOW, max_cached=2)
    credentials = [MemberCredential.issue(keys["member"], CLIENT, int(NOW) + 1000 + i).to_bytes() for i in range(3)]
    for blob in credentials:
        gate.check(CLIENT, {"credential": blob})
    assert len(gate._verified) <= 2


def test_a_client_members_own_peer_id_is_no_server_and_must_prove_itself_like_any_client(
        tmp_path: Path, keys: dict[str, Identity]) -> None:
    swarm = SwarmFile(tmp_path / "roles.json")
    swarm.add(keys["member"].peer_id, "worker", CLIENT_ROLE)
    swarm.add(keys["server"].peer_id, "box1", SERVER)
    swarm.save()
    gate = MemberGate(Membership.from_file(swarm.path), clock=lambda: NOW)
    gate.check(keys["server"].peer_id, {})  # a server member: as itself
    assert "sent no member credential" in refusal(gate, keys["member"].peer_id, {})  # a client key run as a peer
    own = MemberCredential.issue(keys["member"], keys["member"].peer_id, int(NOW) + 86400).to_bytes()
    gate.check(keys["member"].peer_id, {"credential": own})  # admitted as the client it is
