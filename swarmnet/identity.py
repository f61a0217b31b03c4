"""`Identity`: a peer's RSA key, stored as a hivemind/libp2p identity file (the `--identity` key files).

The libp2p peer id is the multihash of the public key, so whoever holds the key file *is* that peer id: the
handshake proves it to anyone we dial, and `Identity.sign` lets us prove it in data (DHT records, member
credentials) that others check with `verify` and `peer_id_of_public_key`, without trusting the sender.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import base58
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

_PADDING = padding.PKCS1v15()
_HASH = hashes.SHA256()
KEY_BITS = 2048
ACCEPTED_KEY_BITS = (2048, 3072)  # the keys whose signatures we check (others are refused unread)
PUBLIC_EXPONENT = 65537
RSA_KEY_TYPE = 0  # libp2p's crypto.pb KeyType.RSA


class IdentityError(ValueError):
    """A key file that is missing, unreadable or not an RSA identity."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def encode_key_message(key_type: int, data: bytes) -> bytes:
    """libp2p's crypto.pb `PublicKey` / `PrivateKey` message (proto2, both fields required: always written, in
    field order), byte for byte what hivemind's crypto_pb2 writes. Encoded here so that the key commands need not
    import hivemind (whose package import loads torch: seconds per `swarm new-key`)."""
    return b"\x08" + _varint(key_type) + b"\x12" + _varint(len(data)) + data


def decode_key_message(encoded: bytes) -> tuple[int, bytes]:
    """(key_type, data) of a crypto.pb key message; ValueError unless it is exactly one of each field."""
    fields: dict[int, int | bytes] = {}
    at = 0

    def varint() -> int:
        nonlocal at
        value = shift = 0
        while True:
            if at >= len(encoded) or shift > 63:
                raise ValueError("truncated varint")
            byte = encoded[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while at < len(encoded):
        tag = varint()
        if tag == 0x08 and 1 not in fields:
            fields[1] = varint()
        elif tag == 0x12 and 2 not in fields:
            length = varint()
            if at + length > len(encoded):
                raise ValueError("truncated key data")
            fields[2], at = encoded[at:at + length], at + length
        else:
            raise ValueError(f"unexpected field tag {tag}")
    key_type, data = fields.get(1), fields.get(2)
    if not isinstance(key_type, int) or not isinstance(data, bytes):
        raise ValueError("a key message needs key_type and data")
    return key_type, data


def usable_key(key: object) -> TypeGuard[rsa.RSAPublicKey]:
    """Whether a public key is one we verify signatures of: RSA of ACCEPTED_KEY_BITS with the exponent 65537.

    The cost of a check grows with the exponent, which a key's owner picks: a 3072-bit exponent made one check ~70x
    dearer. libp2p and hivemind make 2048-bit keys with e = 65537, and so do we (KEY_BITS).
    """
    return (isinstance(key, rsa.RSAPublicKey) and key.key_size in ACCEPTED_KEY_BITS
            and key.public_numbers().e == PUBLIC_EXPONENT)


def accepted_public_key(public_key_der: bytes) -> bool:
    """Whether a DER public key parses and is one we verify signatures of (`usable_key`)."""
    try:
        return usable_key(serialization.load_der_public_key(public_key_der))
    except (ValueError, TypeError):
        return False


def peer_id_of_public_key(public_key_der: bytes) -> str:
    """The base58 libp2p peer id of an RSA public key (DER SubjectPublicKeyInfo), as libp2p derives it."""
    encoded = encode_key_message(RSA_KEY_TYPE, public_key_der)
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def verify(public_key_der: bytes, data: bytes, signature: bytes) -> bool:
    """Whether `signature` is the owner of `public_key_der` signing `data`; False on any malformed input, and for any
    key but RSA-2048/3072 with e = 65537 (a huge exponent would make each check cost milliseconds; see `usable_key`)."""
    try:
        key = serialization.load_der_public_key(public_key_der)
        if not usable_key(key):
            return False
        key.verify(signature, data, _PADDING, _HASH)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


@dataclass(frozen=True)
class Identity:
    """An RSA private key and the peer id it proves."""

    private_key: rsa.RSAPrivateKey
    path: Path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Read a key file written by `create` (or by hivemind/p2pd); raises IdentityError."""
        path = Path(path)
        try:
            data = path.read_bytes()
            key = serialization.load_der_private_key(decode_key_message(data)[1], password=None)
        except OSError as e:
            raise IdentityError(f"cannot read key file {path}: {e.strerror or e}") from e
        except Exception as e:  # a malformed key message (ValueError), or cryptography's errors
            raise IdentityError(f"{path} is not a swarmbatch/libp2p key file ({type(e).__name__})") from e
        if not isinstance(key, rsa.RSAPrivateKey):
            raise IdentityError(f"{path} holds a {type(key).__name__}; swarmbatch needs an RSA key file")
        return cls(key, path)

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> Identity:
        """Write a new key file (mode 0400, atomically; refuses to overwrite one) and return it."""
        path = Path(path)
        if path.exists():
            raise IdentityError(f"{path} already exists; refusing to overwrite a key file")
        key = rsa.generate_private_key(public_exponent=65537, key_size=KEY_BITS)
        der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
        data = encode_key_message(RSA_KEY_TYPE, der)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o400)
            os.link(tmp, path)  # fails if another process created the file meanwhile: never overwrite a key
        finally:
            os.unlink(tmp)
        return cls(key, path)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """The key in `path`, created first if the file does not exist."""
        try:
            return cls.create(path)
        except IdentityError:
            return cls.load(path)

    @property
    def public_key_der(self) -> bytes:
        """The public key as DER SubjectPublicKeyInfo (what `peer_id_of_public_key` and `verify` take)."""
        return self.private_key.public_key().public_bytes(serialization.Encoding.DER,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo)

    @property
    def peer_id(self) -> str:
        """The base58 peer id that p2pd uses for this key."""
        return peer_id_of_public_key(self.public_key_der)

    def sign(self, data: bytes) -> bytes:
        """An RSA PKCS#1 v1.5 SHA-256 signature of `data`."""
        return self.private_key.sign(data, _PADDING, _HASH)
