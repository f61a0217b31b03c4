"""Membership: the swarm file, reloading it, member credentials and a client's access. No processes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack
import pytest
from factories import ManualClock

from swarmnet.identity import Identity, IdentityError
from swarmnet.membership import (
    ANY,
    CLIENT,
    MAX_CREDENTIAL_AHEAD,
    SERVER,
    CredentialError,
    MemberCredential,
    Membership,
    MembershipError,
    NotAMember,
    SwarmAccess,
    SwarmFile,
    SwarmFileError,
    check_peer_id,
    verify_credential,
)

CLIENT_PEER = "12D3KooWCxbSVdL8unKt3Y4pzF1KX9GJLuq7DiGtDJwP5HhSaFRP"  # a client process's ephemeral peer id
OTHER_CLIENT = "12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK"
NOW = 1_800_000_000.0


@pytest.fixture
def swarm_file(tmp_path: Path, keys: dict[str, Identity]) -> Path:
    swarm = SwarmFile.create(tmp_path / "swarm.json")
    swarm.add(keys["member"].peer_id, "alice")
    swarm.add(keys["server"].peer_id, "box1")
    swarm.save()
    return swarm.path


# ---- the swarm file ------------------------------------------------------------------------------------------------
def test_a_swarm_file_round_trips_and_init_never_overwrites(tmp_path: Path, keys: dict[str, Identity]) -> None:
    path = tmp_path / "swarm.json"
    SwarmFile.create(path)
    assert json.loads(path.read_text()) == {"version": 1, "members": {}}
    swarm = SwarmFile.load(path)
    swarm.add(keys["member"].peer_id, "alice")
    swarm.save()
    assert SwarmFile.load(path).members == {keys["member"].peer_id: "alice"}
    with pytest.raises(SwarmFileError, match="refusing to overwrite"):
        SwarmFile.create(path)
    assert SwarmFile.load(path).members == {keys["member"].peer_id: "alice"}
    assert [p.name for p in tmp_path.iterdir()] == ["swarm.json"], "no temporary file is left behind"


def test_members_are_removed_by_peer_id_or_name_and_names_are_unique(swarm_file: Path,
                                                                     keys: dict[str, Identity]) -> None:
    swarm = SwarmFile.load(swarm_file)
    with pytest.raises(SwarmFileError, match="'alice' already belongs to"):
        swarm.add(keys["outsider"].peer_id, "alice")
    swarm.add(keys["member"].peer_id, "alice2")  # re-adding renames
    assert swarm.remove("alice2") == (keys["member"].peer_id, "alice2")
    assert swarm.remove(keys["server"].peer_id) == (keys["server"].peer_id, "box1")
    with pytest.raises(SwarmFileError, match="is not a member of"):
        swarm.remove("alice2")


@pytest.mark.parametrize("content, message", [
    (None, "does not exist; create it with 'swarmbatch swarm init"),
    ("{not json", "is not JSON"),
    ('{"version": 2, "members": {}}', '"version": 1'),
    ('{"version": 1, "members": []}', '"members"'),
    ('{"version": 1, "members": {"not-a-peer-id!": "x"}}', "'not-a-peer-id!' is not a peer id"),
    ('{"version": 1, "members": {"QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5": "x"}}', "is not a peer id"),
])
def test_a_bad_swarm_file_is_one_line_naming_the_file(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "swarm.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SwarmFileError, match="swarm file") as caught:
        SwarmFile.load(path)
    assert message in str(caught.value) and "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_peer_ids_of_both_key_types_are_accepted(keys: dict[str, Identity]) -> None:
    assert check_peer_id(keys["member"].peer_id).startswith("Qm")  # RSA: a sha2-256 multihash
    assert check_peer_id(CLIENT_PEER) == CLIENT_PEER                           # Ed25519: an identity multihash
    with pytest.raises(SwarmFileError):
        check_peer_id("Qm" + "1" * 44)


# ---- membership ----------------------------------------------------------------------------------------------------
def test_an_open_membership_allows_everyone_and_a_file_only_its_members(swarm_file: Path,
                                                                        keys: dict[str, Identity]) -> None:
    assert Membership.open().allows(keys["outsider"].peer_id) and Membership.open().is_open
    membership = Membership.from_file(swarm_file)
    assert membership.allows(keys["member"].peer_id) and membership.allows(keys["server"].peer_id)
    assert not membership.allows(keys["outsider"].peer_id) and not membership.allows(CLIENT_PEER)
    assert membership.name_of(keys["server"].peer_id) == "box1"


def test_a_changed_swarm_file_is_seen_after_the_recheck_interval(swarm_file: Path,
                                                                 keys: dict[str, Identity]) -> None:
    clock = ManualClock()
    membership = Membership.from_file(swarm_file, recheck=5.0, clock=clock)
    swarm = SwarmFile.load(swarm_file)
    swarm.remove("alice")
    swarm.save()
    clock.now = 4.9
    assert membership.allows(keys["member"].peer_id), "not re-read before the interval"
    clock.now = 5.0
    assert not membership.allows(keys["member"].peer_id) and membership.generation == 1
    swarm_file.write_text("{half a copy")  # a file being copied in place: the last good list stays
    clock.now = 10.0
    assert membership.allows(keys["server"].peer_id) and membership.generation == 1


# ---- credentials -------------------------------------------------------------------------------------------------
def credential(identity: Identity, peer: str = CLIENT_PEER, expires: float = NOW + 86400) -> bytes:
    return MemberCredential.issue(identity, peer, int(expires)).to_bytes()


def test_a_member_credential_proves_its_member_for_its_peer(swarm_file: Path, keys: dict[str, Identity]) -> None:
    blob = credential(keys["member"])
    assert len(blob) < 1024
    assert verify_credential(blob, CLIENT_PEER, Membership.from_file(swarm_file), NOW) == keys["member"].peer_id


def tampered(identity: Identity) -> bytes:
    data = msgpack.unpackb(credential(identity))
    data["expires"] += 1  # the signature covers it
    return msgpack.packb(data)


@pytest.mark.parametrize("case, make, caller, message", [
    ("a non-member's key", lambda k: credential(k["outsider"]), CLIENT_PEER, "is not a member of this server's swarm"),
    ("made for another peer", lambda k: credential(k["member"]), OTHER_CLIENT, "was made for peer"),
    ("expired", lambda k: credential(k["member"], expires=NOW - 1), CLIENT_PEER, "expired"),
    ("too far ahead", lambda k: credential(k["member"], expires=NOW + MAX_CREDENTIAL_AHEAD + 10), CLIENT_PEER,
     "more than 7 days ahead"),
    ("a forged signature", lambda k: tampered(k["member"]), CLIENT_PEER, "signature does not match"),
    ("oversized", lambda k: b"\x00" * 5000, CLIENT_PEER, "over the limit of 4096"),
    ("garbage", lambda k: b"\xc1\xc1", CLIENT_PEER, "malformed member credential"),
    ("not bytes", lambda k: "a string", CLIENT_PEER, "expected bytes"),
    ("a wrong shape", lambda k: msgpack.packb({"key": 1}), CLIENT_PEER, "expected {key: bytes"),
])
def test_a_credential_that_proves_nothing_is_refused_in_one_line(swarm_file: Path, keys: dict[str, Identity],
                                                                  case: str, make, caller: str, message: str) -> None:
    with pytest.raises(CredentialError) as caught:
        verify_credential(make(keys), caller, Membership.from_file(swarm_file), NOW)
    assert message in str(caught.value) and "\n" not in str(caught.value), case


# ---- a client's access ---------------------------------------------------------------------------------------------
def test_access_needs_a_member_key_with_a_swarm_file(swarm_file: Path, keys: dict[str, Identity]) -> None:
    with pytest.raises(MembershipError, match="no member key: pass --identity KEYFILE"):
        SwarmAccess.load(swarm_file, None)
    with pytest.raises(NotAMember, match=f"not a member of swarm file {swarm_file}: add it with 'swarmbatch swarm "
                                         f"add-member {swarm_file} {keys['outsider'].peer_id} --role client'"):
        SwarmAccess.load(swarm_file, keys["outsider"].path)
    with pytest.raises(IdentityError, match="cannot read key file"):
        SwarmAccess.load(swarm_file, swarm_file.parent / "missing.key")
    status = SwarmAccess.load(swarm_file, keys["outsider"].path, strict=False)  # swarm status only reports it
    assert status.describe()["key"] == {"peer_id": keys["outsider"].peer_id, "member": False}
    assert SwarmAccess.load(None, None).credential(CLIENT_PEER) is None


def test_a_clients_credential_is_reused_then_renewed_before_it_expires(swarm_file: Path,
                                                                       keys: dict[str, Identity]) -> None:
    clock = ManualClock(NOW)
    access = SwarmAccess(Membership.from_file(swarm_file), keys["member"], clock=clock)
    first = access.credential(CLIENT_PEER)
    assert access.credential(CLIENT_PEER) is first
    clock.now = NOW + 86400 - 3601  # more than an hour left: kept
    assert access.credential(CLIENT_PEER) is first
    clock.now = NOW + 86400 - 3599
    renewed = access.credential(CLIENT_PEER)
    assert renewed != first
    assert verify_credential(renewed, CLIENT_PEER, access.membership, clock.now + 3600) == keys["member"].peer_id
    assert access.credential(OTHER_CLIENT) != renewed  # one per peer id


def test_key_files_stay_unreadable_to_others(keys: dict[str, Identity]) -> None:
    assert os.stat(keys["member"].path).st_mode & 0o077 == 0


# ---- roles ---------------------------------------------------------------------------------------------------------
def test_roles_round_trip_and_a_file_written_before_roles_gives_every_member_both(
        tmp_path: Path, keys: dict[str, Identity]) -> None:
    path = tmp_path / "swarm.json"
    path.write_text(json.dumps({"version": 1, "members": {keys["member"].peer_id: "alice"}}))  # before roles
    swarm = SwarmFile.load(path)
    assert swarm.role_of(keys["member"].peer_id) == ANY
    swarm.add(keys["server"].peer_id, "box1", SERVER)
    swarm.add(keys["outsider"].peer_id, "laptop", CLIENT)
    swarm.save()
    assert json.loads(path.read_text())["members"] == {
        keys["member"].peer_id: "alice", keys["server"].peer_id: {"name": "box1", "role": "server"},
        keys["outsider"].peer_id: {"name": "laptop", "role": "client"}}
    membership = Membership.from_file(path)
    assert [membership.serves(k.peer_id) for k in (keys["member"], keys["server"], keys["outsider"])] == \
        [True, True, False]
    assert [membership.allows(k.peer_id, CLIENT) for k in (keys["member"], keys["server"], keys["outsider"])] == \
        [True, False, True]
    assert Membership.open().serves(OTHER_CLIENT)  # an open swarm: everyone does everything


@pytest.mark.parametrize("entry, message", [({"name": "x", "role": "admin"}, "must be one of server, client, any"),
                                            ({"name": "x", "rank": 1}, 'must be "<name>" or {"name"'),
                                            (7, 'must be "<name>" or {"name"')])
def test_a_member_entry_of_no_known_shape_or_role_is_refused_in_one_line(
        tmp_path: Path, keys: dict[str, Identity], entry: object, message: str) -> None:
    path = tmp_path / "swarm.json"
    path.write_text(json.dumps({"version": 1, "members": {keys["member"].peer_id: entry}}))
    with pytest.raises(SwarmFileError, match=message) as caught:
        SwarmFile.load(path)
    assert "\n" not in str(caught.value)


def test_a_client_key_cannot_serve_and_a_server_key_cannot_run_clients(tmp_path: Path,
                                                                        keys: dict[str, Identity]) -> None:
    swarm = SwarmFile.create(tmp_path / "swarm.json")
    swarm.add(keys["member"].peer_id, "worker", CLIENT)
    swarm.add(keys["server"].peer_id, "box1", SERVER)
    swarm.save()
    membership = Membership.from_file(swarm.path)
    with pytest.raises(NotAMember, match="is a client member of swarm file .* only server members may serve"):
        membership.require(keys["member"].peer_id, "server", str(keys["member"].path))
    membership.require(keys["server"].peer_id, "server", str(keys["server"].path))
    with pytest.raises(CredentialError, match="is a server member of this server's swarm, and server keys do not"):
        verify_credential(credential(keys["server"]), CLIENT_PEER, membership, NOW)
    assert verify_credential(credential(keys["member"]), CLIENT_PEER, membership, NOW) == keys["member"].peer_id
    with pytest.raises(NotAMember, match="server keys do not run clients"):
        SwarmAccess.load(swarm.path, keys["server"].path)
