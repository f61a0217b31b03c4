"""Push proofs: what binds the input a server computed a pushed step on to what its client recorded (checked outputs).

With server-to-server push (protocol.py) the client records each hop's input as the *answer* of the hop before,
while the hop computes on what that server *pushed*. Two facts bind them:

- every answer of a session opened for push carries `input_digest`: a SHA-256 digest of the step's input as the
  server applied it (hidden states with their dtype and shape, attention mask, position ids, keep_rows, step id);
- every pushed step carries a `push_proof`: the pushing server's RSA signature, with its peer key, of the statement
  "for the session of <owner> I hold as <upstream session>, I pushed step input <digest> into <target session>",
  which the receiving server checks before it applies the step and returns in its answer.

The client compares the digest with the digest of the upstream answer it recorded. On a mismatch, a valid proof by
the hop before it convicts that server (it answered one thing and signed that it pushed another); a proof missing,
forged or naming another digest convicts the server that answered (an honest one applies only proven pushes).
docs/security.md explains why the signature is needed: without it either server could frame the other.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from swarmnet.identity import Identity, peer_id_of_public_key, verify

DIGEST_BYTES = 16  # SHA-256 cut to 128 bits: a collision takes 2^64 work, a second input for a given digest 2^128
STATEMENT_TAG = b"swarmbatch push proof/1\x00"


def input_digest(hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 keep_rows: Sequence[int] | None, step_id: int | None) -> bytes:
    """The digest of one step's input as a server applies it: hidden states (their dtype, shape and bytes), the mask
    and position ids as int64, the rows kept and the step id."""
    digest = hashlib.sha256()  # SHA-256: x86's SHA extensions make it ~2x BLAKE2b here (bench/push_proof.py)
    header = [str(hidden.dtype), list(hidden.shape), list(mask.shape), list(positions.shape),
              None if keep_rows is None else [int(row) for row in keep_rows], step_id]
    digest.update(msgpack.packb(header))
    for tensor in (hidden, mask.long(), positions.long()):
        digest.update(_buffer(tensor))
    return digest.digest()[:DIGEST_BYTES]


def _buffer(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in C order; no copy for a contiguous CPU tensor (the hop path runs cold: few torch calls)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.requires_grad:
        tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: the same bytes as int16
        tensor = tensor.view(torch.int16)
    return tensor.numpy().data


def statement(owner: str, upstream_session: str, target_session: str, step_id: int, digest: bytes) -> bytes:
    """What a pushing server signs: it pushed step `step_id`'s input `digest` into `target_session`, for `owner`'s
    session `upstream_session` on it. (The step id is named apart from the digest so that a proof of one step can
    never stand for another's.)"""
    return STATEMENT_TAG + msgpack.packb([owner, upstream_session, target_session, step_id, digest])


def sign_push(identity: Identity, *, owner: str, upstream_session: str, target_session: str, step_id: int,
              digest: bytes) -> dict[str, Any]:
    """The `push_proof` a pushing server puts in a pushed step's meta."""
    return {"session_id": upstream_session, "identity": identity.public_key_der,
            "signature": identity.sign(statement(owner, upstream_session, target_session, step_id, digest))}


@dataclass(frozen=True)
class ProofSigner:
    """Who signed a valid push proof, and from which of their sessions."""

    peer_id: str
    upstream_session: str


def proof_signer(proof: object, *, owner: str, target_session: str, step_id: int, digest: bytes
                 ) -> ProofSigner | None:
    """The signer of `proof` if it is a valid signature of pushing step `step_id`'s input `digest` into
    `target_session` for `owner`; None for anything else (missing, malformed, a key that is not RSA-2048/3072 with
    e = 65537, a bad signature)."""
    if not isinstance(proof, dict):
        return None
    session, key, signature = proof.get("session_id"), proof.get("identity"), proof.get("signature")
    if not (isinstance(session, str) and len(session) <= 128 and isinstance(key, bytes) and len(key) <= 1024
            and isinstance(signature, bytes) and len(signature) <= 512):
        return None
    if not verify(key, statement(owner, session, target_session, step_id, digest), signature):
        return None
    return ProofSigner(peer_id_of_public_key(key), session)
