"""`MemberGate`: the one membership check of a block server, run before a request is decoded further.

An open server (no swarm file) lets everyone in. A private one admits a caller whose libp2p-authenticated peer id is
a member (another server), or who sends a member credential made for that peer id (`swarmnet.membership`). A
credential that verified is cached per (caller, credential) until it expires, so a client process costs the server
one signature check; the cache is dropped whenever the swarm file's member list changes.

`check` returns the caller's *owner*: the member it acts for (the credential's member key, whatever ephemeral peer
id its process has), or the caller itself (a server of the swarm, or anyone in an open swarm). Per-caller limits
count per owner, so a member minting credentials for more peer ids gets no more than one share.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from servers.errors import RequestRejected
from swarmnet.membership import CredentialError, MemberCredential, Membership
from swarmnet.protocol import ErrorCode

MAX_CACHED = 4096  # verified (caller, credential) pairs kept; only members' client processes can add one


class MemberGate:
    """Admits the members of a swarm (or everyone, for an open one)."""

    def __init__(self, membership: Membership, *, clock: Callable[[], float] = time.time,
                 max_cached: int = MAX_CACHED) -> None:
        self.membership, self._clock, self._max_cached = membership, clock, max_cached
        # (caller, sha256 of its credential) -> (its expiry, the member it proves)
        self._verified: dict[tuple[str, bytes], tuple[int, str]] = {}
        self._generation = membership.generation
        self.checked = 0  # credentials checked in full (not found in the cache)

    @classmethod
    def open(cls) -> MemberGate:
        """A gate that admits everyone."""
        return cls(Membership.open())

    def check(self, caller: str, meta: dict[str, Any]) -> str:
        """The owner `caller` (its authenticated peer id) acts for, if it may use this server (itself, or the member
        whose credential it sent); else raise RequestRejected(UNAUTHORIZED) with the reason and the fix, in one line."""
        if self.membership.serves(caller):  # everyone in an open swarm; a server of the swarm in a private one
            return caller
        blob = meta.get("credential")
        if blob is None:
            raise RequestRejected(ErrorCode.UNAUTHORIZED, f"this server serves the members of its swarm only, and "
                                  f"{caller} sent no member credential: run the client with --swarm-file and "
                                  "--identity KEYFILE (a member key)")
        try:
            return self._check_credential(caller, blob)
        except CredentialError as e:
            raise RequestRejected(ErrorCode.UNAUTHORIZED, str(e)) from None

    def _check_credential(self, caller: str, blob: object) -> str:
        if self.membership.generation != self._generation:  # members changed: a removed one's credentials must fail
            self._verified.clear()
            self._generation = self.membership.generation
        credential = MemberCredential.from_bytes(blob)  # bounded size, checked before parsing
        assert isinstance(blob, bytes)  # from_bytes takes nothing else
        now = self._clock()
        key = (caller, hashlib.sha256(blob).digest())
        expires, member = self._verified.get(key, (0, ""))
        if expires > now:
            return member
        self.checked += 1
        member = credential.verify(caller, self.membership, now)
        if len(self._verified) >= self._max_cached:
            self._verified = {k: v for k, v in self._verified.items() if v[0] > now}
            if len(self._verified) >= self._max_cached:
                self._verified.clear()
        self._verified[key] = credential.expires, member
        return member
