"""Identity key files: the peer id matches what hivemind (and so p2pd) derives, signatures bind the key."""
from __future__ import annotations

from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID

from swarmnet.identity import Identity, IdentityError, decode_key_message, encode_key_message, peer_id_of_public_key, verify


def test_peer_id_matches_hiveminds_derivation(tmp_path: Path) -> None:
    identity = Identity.create(tmp_path / "a.key")
    assert identity.peer_id == PeerID.from_identity((tmp_path / "a.key").read_bytes()).to_base58()
    assert (tmp_path / "a.key").stat().st_mode & 0o777 == 0o400


def test_reads_a_key_file_written_by_hivemind(tmp_path: Path) -> None:
    P2P.generate_identity(str(tmp_path / "h.key"))
    assert Identity.load(tmp_path / "h.key").peer_id == PeerID.from_identity((tmp_path / "h.key").read_bytes()).to_base58()


def test_signature_verifies_only_for_its_key_and_data(tmp_path: Path) -> None:
    alice, bob = Identity.create(tmp_path / "alice.key"), Identity.create(tmp_path / "bob.key")
    signature = alice.sign(b"record")
    assert verify(alice.public_key_der, b"record", signature)
    assert not verify(alice.public_key_der, b"recorD", signature)
    assert not verify(bob.public_key_der, b"record", signature)
    assert not verify(b"not a key", b"record", signature)
    assert peer_id_of_public_key(alice.public_key_der) != bob.peer_id


def test_create_never_overwrites_and_load_or_create_keeps_the_key(tmp_path: Path) -> None:
    first = Identity.create(tmp_path / "k.key")
    with pytest.raises(IdentityError, match="refusing to overwrite"):
        Identity.create(tmp_path / "k.key")
    assert Identity.load_or_create(tmp_path / "k.key").peer_id == first.peer_id
    assert Identity.load_or_create(tmp_path / "new.key").peer_id != first.peer_id


def test_bad_key_files_raise_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="cannot read key file"):
        Identity.load(tmp_path / "missing.key")
    (tmp_path / "junk.key").write_bytes(b"\x00garbage")
    with pytest.raises(IdentityError, match="not a swarmbatch/libp2p key file"):
        Identity.load(tmp_path / "junk.key")


def test_key_files_and_peer_ids_are_encoded_byte_for_byte_as_hiveminds_crypto_pb2(tmp_path: Path) -> None:
    from hivemind.proto import crypto_pb2

    identity = Identity.create(tmp_path / "k.key")
    written = (tmp_path / "k.key").read_bytes()
    parsed = crypto_pb2.PrivateKey.FromString(written)
    assert written == crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=parsed.data).SerializeToString()
    assert encode_key_message(crypto_pb2.RSA, identity.public_key_der) == crypto_pb2.PublicKey(
        key_type=crypto_pb2.RSA, data=identity.public_key_der).SerializeToString()
    assert decode_key_message(written) == (crypto_pb2.RSA, parsed.data)


@pytest.mark.parametrize("garbage", [b"", b"\x08\x00", b"\x08\x00\x12\x05abc", b"\x08\x00\x12\x01a\x1a\x00", b"\xff" * 12])
def test_a_malformed_key_file_is_one_line_not_a_key_file(tmp_path: Path, garbage: bytes) -> None:
    (tmp_path / "bad.key").write_bytes(garbage)
    with pytest.raises(IdentityError, match="is not a swarmbatch/libp2p key file"):
        Identity.load(tmp_path / "bad.key")
