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
    MAX_CREDENTIAL_AHEAD,
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

CLIENT = "12D3KooWCxbSVdL8unKt3Y4pzF1KX9GJLuq7DiGtDJwP5HhSaFRP"  # a client process's ephemeral peer id
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
    assert check_peer_id(CLIENT) == CLIENT                           # Ed25519: an identity multihash
    with pytest.raises(SwarmFileError):
        check_peer_id("Qm" + "1" * 44)


# ---- membership ----------------------------------------------------------------------------------------------------
def test_an_open_membership_allows_everyone_and_a_file_only_its_members(swarm_file: Path,
                                                                        keys: dict[str, Identity]) -> None:
    assert Membership.open().allows(keys["outsider"].peer_id) and Membership.open().is_open
    membership = Membership.from_file(swarm_file)
    assert membership.allows(keys["member"].peer_id) and membership.allows(keys["server"].peer_id)
    assert not membership.allows(keys["outsider"].peer_id) and not membership.allows(CLIENT)
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
def credential(identity: Identity, peer: str = CLIENT, expires: float = NOW + 86400) -> bytes:
    return MemberCredential.issue(identity, peer, int(expires)).to_bytes()


def test_a_member_credential_proves_its_member_for_its_peer(swarm_file: Path, keys: dict[str, Identity]) -> None:
    blob = credential(keys["member"])
    assert len(blob) < 1024
    assert verify_credential(blob, CLIENT, Membership.from_file(swarm_file), NOW) == keys["member"].peer_id


def tampered(identity: Identity) -> bytes:
    data = msgpack.unpackb(credential(identity))
    data["expires"] += 1  # the signature covers it
    return msgpack.packb(data)


@pytest.mark.parametrize("case, make, caller, message", [
    ("a non-member's key", lambda k: credential(k["outsider"]), CLIENT, "is not a member of this server's swarm"),
    ("made for another peer", lambda k: credential(k["member"]), OTHER_CLIENT, "was made for peer"),
    ("expired", lambda k: credential(k["member"], expires=NOW - 1), CLIENT, "expired"),
    ("too far ahead", lambda k: credential(k["member"], expires=NOW + MAX_CREDENTIAL_AHEAD + 10), CLIENT,
     "more than 7 days ahead"),
    ("a forged signature", lambda k: tampered(k["member"]), CLIENT, "signature does not match"),
    ("oversized", lambda k: b"\x00" * 5000, CLIENT, "over the limit of 4096"),
    ("garbage", lambda k: b"\xc1\xc1", CLIENT, "malformed member credential"),
    ("not bytes", lambda k: "a string", CLIENT, "expected bytes"),
    ("a wrong shape", lambda k: msgpack.packb({"key": 1}), CLIENT, "expected {key: bytes"),
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
                                         f"add-member {swarm_file} {keys['outsider'].peer_id}'"):
        SwarmAccess.load(swarm_file, keys["outsider"].path)
    with pytest.raises(IdentityError, match="cannot read key file"):
        SwarmAccess.load(swarm_file, swarm_file.parent / "missing.key")
    status = SwarmAccess.load(swarm_file, keys["outsider"].path, strict=False)  # swarm status only reports it
    assert status.describe()["key"] == {"peer_id": keys["outsider"].peer_id, "member": False}
    assert SwarmAccess.load(None, None).credential(CLIENT) is None


def test_a_clients_credential_is_reused_then_renewed_before_it_expires(swarm_file: Path,
                                                                       keys: dict[str, Identity]) -> None:
    clock = ManualClock(NOW)
    access = SwarmAccess(Membership.from_file(swarm_file), keys["member"], clock=clock)
    first = access.credential(CLIENT)
    assert access.credential(CLIENT) is first
    clock.now = NOW + 86400 - 3601  # more than an hour left: kept
    assert access.credential(CLIENT) is first
    clock.now = NOW + 86400 - 3599
    renewed = access.credential(CLIENT)
    assert renewed != first
    assert verify_credential(renewed, CLIENT, access.membership, clock.now + 3600) == keys["member"].peer_id
    assert access.credential(OTHER_CLIENT) != renewed  # one per peer id


def test_key_files_stay_unreadable_to_others(keys: dict[str, Identity]) -> None:
    assert os.stat(keys["member"].path).st_mode & 0o077 == 0
