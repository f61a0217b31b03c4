"""Membership of a private swarm: the swarm file, and the credentials a client process proves it acts for a member with.

The swarm file lists the members' peer ids, each with a role: `server` (a block server or DHT node: it announces
records, is routed through, pushes and is pushed to), `client` (a worker's or `generate`'s key: it opens sessions and
forwards with credentials, and is never stored, routed through or pushed to), or `any` (both; what a file written
before roles gives every member). A server or DHT node is a member by its own peer id (its `--identity` key file).
A client process cannot use the member key as its libp2p identity: a Celery worker runs many client
processes, and libp2p forbids two processes one peer id. So each client process keeps an ephemeral peer id and
sends a `MemberCredential`: the member key's signature over (its public key, that ephemeral peer id, an expiry).
libp2p authenticates the caller's peer id, so a credential copied off the wire is useless to any other peer.

    Membership        who may take part: everyone (no swarm file) or the swarm file's members, re-read on change
    SwarmFile         the JSON file itself: load, save (atomically), add and remove members
    MemberCredential  a member key vouching for one client peer id until an expiry; `verify_credential` checks one
    SwarmAccess       a client's side: the membership it routes within and the member key it proves itself with
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import base58
import msgpack
import multihash

from swarmnet.errors import SwarmError
from swarmnet.identity import Identity, peer_id_of_public_key, verify

logger = logging.getLogger(__name__)

SWARM_FILE_VERSION = 1
MAX_CREDENTIAL_BYTES = 4096          # a credential is ~600 bytes (a 2048-bit key and signature); refuse more unread
CREDENTIAL_LIFETIME = 86400          # seconds a client's credential is valid; it makes a new one before then
CREDENTIAL_REFRESH = 3600            # ... a new one once the current one has less than this left
MAX_CREDENTIAL_AHEAD = 7 * 86400     # servers refuse credentials expiring further ahead (a wrong clock or a forgery)
RECHECK_SECONDS = 5.0                # how often a running process looks whether its swarm file changed
ADD_MEMBER = "swarmbatch swarm add-member"
SERVER, CLIENT, ANY = "server", "client", "any"  # a member's role: what its key may do in the swarm
ROLES = (SERVER, CLIENT, ANY)


class MembershipError(SwarmError):
    """A swarm file or member key that cannot work, or a client the swarm does not admit; the message says the fix."""


class SwarmFileError(MembershipError):
    """A swarm file that is missing, unparsable, or names something that is not a peer id."""


class NotAMember(MembershipError):
    """This key is not a member of the swarm (the servers refused us, or our own swarm file says so)."""


class CredentialError(ValueError):
    """A credential that does not prove membership; the message is the server's refusal (one line)."""


def check_peer_id(text: object) -> str:
    """`text` if it is a base58 libp2p peer id (a multihash); raises SwarmFileError."""
    if not isinstance(text, str) or not 0 < len(text) <= 128:
        raise SwarmFileError(f"{str(text)[:80]!r} is not a peer id (expected base58, like Qm... or 12D3Koo...)")
    try:
        decoded = multihash.decode(base58.b58decode(text))
    except ValueError:
        raise SwarmFileError(f"{text!r} is not a peer id (expected base58, like Qm... or 12D3Koo...)") from None
    if decoded.name not in ("sha2-256", "id"):  # RSA keys' peer ids hash the key; Ed25519 ones inline it ("id")
        raise SwarmFileError(f"{text!r} is a {decoded.name} multihash, not a libp2p peer id")
    return text


# ---- the swarm file ---------------------------------------------------------------------------------------------------
@dataclass
class SwarmFile:
    """`{"version": 1, "members": {"<peer id>": {"name": "<name>", "role": "server" | "client"}}}` at `path`; a
    member given as a bare name (a file written before roles) has the role `any`."""

    path: Path
    members: dict[str, str] = field(default_factory=dict)  # peer id -> name
    roles: dict[str, str] = field(default_factory=dict)    # peer id -> role, for every member whose role is not `any`

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SwarmFile:
        """Read and validate a swarm file; raises SwarmFileError (one line) for any problem."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise SwarmFileError(f"swarm file {path} does not exist; create it with 'swarmbatch swarm init {path}' "
                                 "or copy it from the machine that keeps it") from None
        except OSError as e:
            raise SwarmFileError(f"cannot read swarm file {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise SwarmFileError(f"swarm file {path} is not JSON ({e})") from None
        if not isinstance(data, dict) or data.get("version") != SWARM_FILE_VERSION or \
                not isinstance(data.get("members"), dict):
            raise SwarmFileError(f'swarm file {path} must be {{"version": {SWARM_FILE_VERSION}, "members": '
                                 '{"<peer id>": {"name": "<name>", "role": "server"}, ...}} (write one with '
                                 '\'swarmbatch swarm init\')')
        swarm = cls(path)
        for peer_id, entry in data["members"].items():
            try:
                name, role = _member_entry(entry)
                swarm.add(check_peer_id(peer_id), name, role)
            except SwarmFileError as e:
                raise SwarmFileError(f"swarm file {path}: {e}") from None
        return swarm

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> SwarmFile:
        """A new swarm file with no members, written now; refuses to overwrite an existing file."""
        swarm = cls(Path(path))
        if swarm.path.exists():
            raise SwarmFileError(f"{swarm.path} already exists; refusing to overwrite a swarm file "
                                 "(edit it with add-member / remove-member)")
        swarm.save()
        return swarm

    def save(self) -> None:
        """Write the file atomically (a reader sees the old file or the new one, never half of one)."""
        members = {peer: name if peer not in self.roles else {"name": name, "role": self.roles[peer]}
                   for peer, name in sorted(self.members.items())}
        text = json.dumps({"version": SWARM_FILE_VERSION, "members": members}, indent=2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise

    def add(self, peer_id: str, name: str, role: str = ANY) -> None:
        """Add a member (or rename one, or change its role); names are unique, so that `remove` can take a name."""
        check_peer_id(peer_id)
        if role not in ROLES:
            raise SwarmFileError(f"the role of {name!r} must be one of {', '.join(ROLES)} (got {str(role)[:32]!r})")
        taken = [peer for peer, other in self.members.items() if other == name and peer != peer_id]
        if taken:
            raise SwarmFileError(f"the name {name!r} already belongs to {taken[0]}; choose another with --name")
        self.members[peer_id] = name
        self.roles.pop(peer_id, None)
        if role != ANY:
            self.roles[peer_id] = role

    def role_of(self, peer_id: str) -> str:
        """A member's role."""
        return self.roles.get(peer_id, ANY)

    def remove(self, who: str) -> tuple[str, str]:
        """Remove the member with this peer id or name; returns (peer id, name)."""
        for peer_id, name in self.members.items():
            if who in (peer_id, name):
                del self.members[peer_id]
                self.roles.pop(peer_id, None)
                return peer_id, name
        raise SwarmFileError(f"{who!r} is not a member of {self.path} (see 'swarmbatch swarm members {self.path}')")


def _member_entry(entry: object) -> tuple[str, str]:
    """(name, role) of a member's entry: a bare name (role `any`) or {"name": ..., "role": ...}."""
    if isinstance(entry, str):
        return entry, ANY
    if isinstance(entry, dict) and isinstance(entry.get("name"), str) and set(entry) <= {"name", "role"}:
        return entry["name"], str(entry.get("role", ANY))
    raise SwarmFileError(f'a member must be "<name>" or {{"name": "<name>", "role": "server" | "client"}} '
                         f"(got {str(entry)[:64]!r})")


# ---- membership ----------------------------------------------------------------------------------------------------
class Membership:
    """Who may take part in the swarm: everyone (`open()`, no swarm file: today's single-box default) or the members
    of a swarm file. A long-running process sees edits to the file within `recheck` seconds (a removed member is
    refused from then on); a file that has become unreadable keeps the last good list and is logged."""

    def __init__(self, path: Path | None, members: Mapping[str, str] | None, *, recheck: float = RECHECK_SECONDS,
                 clock: Callable[[], float] = time.monotonic, roles: Mapping[str, str] | None = None) -> None:
        self.path = path
        self._members = None if members is None else dict(members)
        self._roles = dict(roles or {})  # peer id -> role, where not `any`
        self._recheck, self._clock = recheck, clock
        self._checked_at = clock()
        self._signature = _file_signature(path)
        self._generation = 0  # reloads that changed the members

    @classmethod
    def open(cls) -> Membership:
        """Everyone is a member."""
        return cls(None, None)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, recheck: float = RECHECK_SECONDS,
                  clock: Callable[[], float] = time.monotonic) -> Membership:
        """The members of a swarm file (raises SwarmFileError), re-read when the file changes."""
        swarm = SwarmFile.load(path)
        return cls(swarm.path, swarm.members, recheck=recheck, clock=clock, roles=swarm.roles)

    @property
    def generation(self) -> int:
        """How many reloads changed the members, as of now (the file is looked at, at most every `recheck` s): a
        server drops the credentials it cached, and re-checks its open streams' owners, when it changes."""
        self._refresh()
        return self._generation

    @property
    def is_open(self) -> bool:
        """Whether everyone is a member (no swarm file)."""
        return self._members is None

    def members(self) -> dict[str, str]:
        """Peer id -> name of every member (empty for an open swarm, where everyone is one)."""
        self._refresh()
        return dict(self._members or {})

    def allows(self, peer_id: str, role: str | None = None) -> bool:
        """Whether `peer_id` is a member (in `role`, if given: a member of role `any` has every role)."""
        if self._members is None:
            return True
        self._refresh()
        return peer_id in self._members and (role is None or self._roles.get(peer_id, ANY) in (ANY, role))

    def serves(self, peer_id: str) -> bool:
        """Whether `peer_id` may serve: announce records, be routed through, push and be pushed to."""
        return self.allows(peer_id, SERVER)

    def name_of(self, peer_id: str) -> str | None:
        """The member's name in the swarm file, if it is listed there."""
        return self.members().get(peer_id)

    def require(self, peer_id: str, role: str, key_path: str | None) -> None:
        """Raise NotAMember unless this process's own peer id (a server's or DHT node's) is a member that serves."""
        if not self.allows(peer_id):
            raise NotAMember(f"this {role}'s peer id {peer_id} (key {key_path}) is not a member of swarm file "
                             f"{self.path}: add it with '{ADD_MEMBER} {self.path} {key_path or peer_id} --role "
                             f"{SERVER}' and copy the file to every machine")
        if not self.serves(peer_id):
            raise NotAMember(f"this {role}'s key {key_path or peer_id} is a {self._roles.get(peer_id)} member of swarm "
                             f"file {self.path}, and only server members may serve: use a server key, or change its "
                             f"role with '{ADD_MEMBER} {self.path} {key_path or peer_id} --role {SERVER}'")

    def _refresh(self) -> None:
        if self.path is None or self._clock() - self._checked_at < self._recheck:
            return
        self._checked_at = self._clock()
        signature = _file_signature(self.path)
        if signature == self._signature:
            return
        try:
            swarm = SwarmFile.load(self.path)
        except SwarmFileError as e:
            logger.warning("Keeping the last good member list: %s", e)
            return
        self._signature = signature
        if swarm.members != self._members or swarm.roles != self._roles:
            logger.info("Swarm file %s changed: %d members", self.path, len(swarm.members))
            self._members, self._roles = swarm.members, swarm.roles
            self._generation += 1


def _file_signature(path: Path | None) -> tuple[int, int, int] | None:
    """What tells a changed file: inode (an atomic replace), size and modification time."""
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


# ---- credentials -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemberCredential:
    """A member key's statement: "peer `peer` acts for me until `expires` (unix seconds)"."""

    key: bytes     # the member's RSA public key, DER
    peer: str      # the client process's own (ephemeral) peer id
    expires: int
    sig: bytes     # the member key's signature over `signed_part(key, peer, expires)`

    @staticmethod
    def signed_part(key: bytes, peer: str, expires: int) -> bytes:
        """The bytes the member key signs."""
        return msgpack.packb([key, peer, expires], use_bin_type=True)

    @classmethod
    def issue(cls, identity: Identity, peer: str, expires: int) -> MemberCredential:
        """A credential of `identity` (a member key file) for the client peer id `peer`."""
        key = identity.public_key_der
        return cls(key, peer, expires, identity.sign(cls.signed_part(key, peer, expires)))

    def to_bytes(self) -> bytes:
        """The wire form (msgpack), sent as meta["credential"]."""
        return msgpack.packb({"key": self.key, "peer": self.peer, "expires": self.expires, "sig": self.sig},
                             use_bin_type=True)

    @classmethod
    def from_bytes(cls, blob: object) -> MemberCredential:
        """Parse the wire form; raises CredentialError on anything malformed (size checked before parsing)."""
        if not isinstance(blob, bytes):
            raise CredentialError(f"malformed member credential: expected bytes, got {type(blob).__name__}")
        if len(blob) > MAX_CREDENTIAL_BYTES:
            raise CredentialError(f"member credential of {len(blob)} bytes is over the limit of {MAX_CREDENTIAL_BYTES}")
        try:
            data = msgpack.unpackb(blob, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise CredentialError(f"malformed member credential ({type(e).__name__})") from None
        if not (isinstance(data, dict) and isinstance(data.get("key"), bytes) and isinstance(data.get("peer"), str)
                and type(data.get("expires")) is int and isinstance(data.get("sig"), bytes)):
            raise CredentialError("malformed member credential: expected {key: bytes, peer: str, expires: int, "
                                  "sig: bytes}")
        return cls(data["key"], data["peer"], data["expires"], data["sig"])

    def verify(self, caller: str, membership: Membership, now: float) -> str:
        """The member peer id this credential proves `caller` (its libp2p-authenticated peer id) acts for; raises
        CredentialError. The cheap checks come first: a non-member's key never costs a signature check."""
        _check_binding(self, caller, now)
        try:
            member = peer_id_of_public_key(self.key)
        except Exception:  # a key protobuf cannot encode must not become an internal error
            raise CredentialError("malformed member credential: unusable key") from None
        if not membership.allows(member):
            raise CredentialError(f"key {member} is not a member of this server's swarm: add it with '{ADD_MEMBER} "
                                  f"SWARM_FILE {member} --role {CLIENT}' and copy the file to every machine")
        if not membership.allows(member, CLIENT):
            raise CredentialError(f"key {member} is a server member of this server's swarm, and server keys do not "
                                  f"run clients: use a client key ('{ADD_MEMBER} SWARM_FILE KEY --role {CLIENT}')")
        if not verify(self.key, self.signed_part(self.key, self.peer, self.expires), self.sig):
            raise CredentialError(f"the member credential's signature does not match key {member}")
        return member


def _check_binding(credential: MemberCredential, caller: str, now: float) -> None:
    """The credential is for this caller, now."""
    if credential.peer != caller:
        raise CredentialError(f"the member credential was made for peer {credential.peer[:64]}, not for the caller "
                              f"{caller}: each client process makes its own")
    if credential.expires <= now:
        raise CredentialError(f"the member credential expired {now - credential.expires:.0f} s ago (clients renew "
                              "theirs; check this machine's and the client's clocks)")
    if credential.expires > now + MAX_CREDENTIAL_AHEAD:
        raise CredentialError(f"the member credential expires more than {MAX_CREDENTIAL_AHEAD // 86400} days ahead; "
                              "check the client's clock")


def verify_credential(blob: object, caller: str, membership: Membership, now: float) -> str:
    """The member peer id that the wire credential `blob` proves `caller` acts for; raises CredentialError."""
    return MemberCredential.from_bytes(blob).verify(caller, membership, now)


# ---- a client's side ---------------------------------------------------------------------------------------------
class SwarmAccess:
    """What a client process needs in a swarm: the membership it routes within (it never sends a hidden state to a
    non-member) and the member key it proves itself with. `open()`: route through anyone, prove nothing."""

    def __init__(self, membership: Membership, identity: Identity | None = None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.membership, self.identity, self._clock = membership, identity, clock
        self._credentials: dict[str, tuple[int, bytes]] = {}  # client peer id -> (expiry, credential)

    @classmethod
    def open(cls) -> SwarmAccess:
        """No swarm file, no member key."""
        return cls(Membership.open())

    @classmethod
    def load(cls, swarm_file: str | os.PathLike[str] | None, identity: str | os.PathLike[str] | None, *,
             strict: bool = True) -> SwarmAccess:
        """From `--swarm-file` and `--identity` (a member key); raises MembershipError or IdentityError (one line).

        strict=False (`swarm status`, which only reads the DHT): no key is needed, and a non-member key is reported
        by `describe()` instead of refused."""
        membership = Membership.from_file(swarm_file) if swarm_file else Membership.open()
        if identity is None:
            if swarm_file and strict:
                raise MembershipError(f"--swarm-file {swarm_file} is set but no member key: pass --identity KEYFILE "
                                      "(or set SWARMBATCH_IDENTITY) with a key whose peer id is in the swarm file "
                                      "('swarmbatch swarm new-key', then add-member)")
            return cls(membership)
        key = Identity.load(identity)
        if strict and not membership.allows(key.peer_id):
            raise NotAMember(f"key {identity} (peer id {key.peer_id}) is not a member of swarm file {swarm_file}: add "
                             f"it with '{ADD_MEMBER} {swarm_file} {key.peer_id} --role {CLIENT}' and copy the file to "
                             "every machine")
        if strict and not membership.allows(key.peer_id, CLIENT):
            raise NotAMember(f"key {identity} is a server member of swarm file {swarm_file}, and server keys do not run "
                             f"clients: use a client key ('{ADD_MEMBER} {swarm_file} KEY --role {CLIENT}')")
        if membership.is_open:
            logger.warning("A member key without --swarm-file: this client routes through any server announcing the "
                           "model; pass --swarm-file to use members only")
        return cls(membership, key)

    def credential(self, peer_id: str) -> bytes | None:
        """This process's credential for its own peer id `peer_id` (made anew when less than an hour is left)."""
        if self.identity is None:
            return None
        now = int(self._clock())
        expires, blob = self._credentials.get(peer_id, (0, b""))
        if expires - now < CREDENTIAL_REFRESH:
            expires = now + CREDENTIAL_LIFETIME
            blob = MemberCredential.issue(self.identity, peer_id, expires).to_bytes()
            self._credentials[peer_id] = expires, blob
        return blob

    def describe(self) -> dict[str, Any]:
        """For `swarm status`: whether the swarm is private, and this client's key and whether it is a member."""
        key = self.identity
        return {"private": not self.membership.is_open,
                "swarm_file": None if self.membership.path is None else str(self.membership.path),
                "key": None if key is None else {"peer_id": key.peer_id, "member": self.membership.allows(key.peer_id)}}
