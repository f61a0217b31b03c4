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

import base58
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.proto import crypto_pb2

_PADDING = padding.PKCS1v15()
_HASH = hashes.SHA256()
KEY_BITS = 2048


class IdentityError(ValueError):
    """A key file that is missing, unreadable or not an RSA identity."""


def peer_id_of_public_key(public_key_der: bytes) -> str:
    """The base58 libp2p peer id of an RSA public key (DER SubjectPublicKeyInfo), as libp2p derives it."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_key_der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def verify(public_key_der: bytes, data: bytes, signature: bytes) -> bool:
    """Whether `signature` is the owner of `public_key_der` signing `data`; False on any malformed input."""
    try:
        key = serialization.load_der_public_key(public_key_der)
        if not isinstance(key, rsa.RSAPublicKey):
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
            key = serialization.load_der_private_key(crypto_pb2.PrivateKey.FromString(data).data, password=None)
        except OSError as e:
            raise IdentityError(f"cannot read key file {path}: {e.strerror or e}") from e
        except Exception as e:  # protobuf DecodeError, ValueError from cryptography
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
        data = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
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
