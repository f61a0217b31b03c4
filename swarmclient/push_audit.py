"""Push audit, the policy (no I/O): does a hop's answer say it was computed on the input the client recorded, and if
not, who lied (swarmnet/push_proof.py has the digests and proofs).

With push, the client records a hop's input as the answer of the hop before, while the hop computed on what that
server pushed. Each answer of a push session names the digest of its input, and a pushed step's answer carries the
pusher's signed proof. When the digest is not the recorded input's:

- a valid proof signed by the hop before, from the client's current session there, convicts that server: it answered
  the client one thing and signed that it pushed another (UPSTREAM);
- an input the client itself sent the hop earlier in this step, or a valid proof of a session the client opened
  earlier at the proof's signer, is a stale copy (a failover replaced the hop before after the hop had applied its
  push): the hop is replayed from the record and nobody is blamed (STALE);
- anything else convicts the hop: an honest server applies only inputs its client sent or that come with a valid
  proof, and reports their digest (HOP).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import Enum

from swarmnet.push_proof import proof_signer


@dataclass(frozen=True)
class InputClaim:
    """What a hop's answer to a step says of its input: its digest, and the pusher's proof if it was pushed."""

    digest: object  # bytes from an honest server; anything from another
    proof: object   # a push_proof dict, or None for a step the client sent itself


class Blame(Enum):
    """Who a hop's input claim convicts."""

    NONE = "none"          # the hop computed on the recorded input
    UPSTREAM = "upstream"  # the hop before pushed other than it answered: ban it
    HOP = "hop"            # the hop's claim is unproven: ban it
    STALE = "stale"        # the hop applied an earlier attempt's input: replay it, ban nobody


@dataclass(frozen=True)
class InputRecord:
    """What the client knows of one hop's input to a step."""

    expected: bytes                        # the digest of the recorded input (the answer of the hop before, or ours)
    owner: str                             # the client's peer id (the owner of its sessions)
    session_id: str                        # the hop's session
    step_id: int
    upstream: tuple[str, str] | None       # (peer id, session id) of the hop before now; None for the first hop
    sent: Collection[bytes] = ()           # digests of the inputs the client sent this hop itself during this step
    opened: Mapping[str, str] | None = None  # every session id the client opened -> its server's peer id


def judge_input(claim: InputClaim, record: InputRecord) -> Blame:
    """Who lied, if the hop's claimed input is not the recorded one."""
    if claim.digest == record.expected:
        return Blame.NONE
    if not isinstance(claim.digest, bytes):
        return Blame.HOP
    signer = proof_signer(claim.proof, owner=record.owner, target_session=record.session_id,
                          step_id=record.step_id, digest=claim.digest)
    if signer is not None and (signer.peer_id, signer.upstream_session) == record.upstream:
        return Blame.UPSTREAM
    if claim.digest in record.sent:
        return Blame.STALE
    if signer is not None and (record.opened or {}).get(signer.upstream_session) == signer.peer_id:
        return Blame.STALE
    return Blame.HOP
