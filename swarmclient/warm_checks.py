"""`WarmCheck`: a window's check begun when the window opens, so that closing it costs only the window's own tokens.

By window (deferred_checks.py), a sampled row's check recomputes the row's whole history on a second holder of the
hop: its prompt and tokens so far, then the window's tokens, whose outputs it compares. Begun when the window
closes, all of that runs after the window's last step, and a lane whose session ends there waits for it (its last
window's checks are all its finished tokens wait for). A warm check begins the same check when the window opens:
it opens a session on the second holder with `"background": true` (the server computes it on its background thread,
behind inference steps, like a stateless forward), and sends it the sampled rows' history so far while the window's
steps run. When the window closes it sends the window's tokens, and their outputs are compared as a stateless
check's are (`HopVerifier.check`).

The same rows are sampled (the draw depends on the window, not on when it is made), the same holder is asked
(`verifier_order` of the window's first step), and the tolerance and the majority rule are the same, so the catch
guarantees are unchanged. The holder learns which rows it checks one window sooner, which it could use only together
with the checked server, and a holder that colludes with the checked server can already answer with its lie. A warm
check that cannot serve (its holder refused or failed, the route changed, the history does not match) is dropped,
and its window is checked as before, by a stateless forward of the whole history. A sampled row that leaves the
session within the window is checked as it leaves, statelessly, and the warm check goes on with the others.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarmclient.errors import InvalidRequest, NoRoom, PeerFailed, Unauthorized
from swarmclient.server_session import ServerSession, close_in_background
from swarmnet.data_structures import RouteHop

logger = logging.getLogger(__name__)
# what a warm check's holder may answer instead of outputs: then the window is checked statelessly
WARM_FAILURES = (PeerFailed, InvalidRequest, NoRoom, Unauthorized, asyncio.TimeoutError)


@dataclass(frozen=True)
class WarmPrefix:
    """The sampled rows' input to the hop before the window, less its `cut` leading columns that none of them attends
    to (`unpadded_start`): hidden [B, P, H], mask [B, P], positions [B, P]."""

    hidden: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    cut: int


@dataclass
class WarmCheck:
    """One hop's warm check of one window: which rows, from which step, and the task that feeds the holder."""

    hop: RouteHop
    first: int          # the window's first step
    rows: list[int]     # the sampled rows, by their indices when the session opened (what the draw is by)
    columns: int        # the history's columns when the window opened
    task: asyncio.Future[ServerSession | None] = field(init=False, repr=False)  # set by `HopVerifier.begin_warm`
    cut: int = 0        # the leading ones that no sampled row attends to, left out (set once the holder is fed)
    holder: str | None = None  # the second holder's peer id, once chosen
    keep_rows: list[int] | None = None  # the rows of `rows` still in the session at the window's end, if not all

    def fits(self, hop: RouteHop, first: int, rows: list[int]) -> bool:
        """Whether this warm check is the one of the window's check of `rows` (by their indices when the session
        opened) on `hop`: the rows it was begun with, less those that left the session within the window (checked as
        they left), which its window step drops from the holder's session (`keep_rows`)."""
        staying = [index for index, row in enumerate(self.rows) if row in rows]
        if (self.hop, self.first) != (hop, first) or len(staying) != len(rows):
            return False
        self.keep_rows = None if len(staying) == len(self.rows) else staying
        return True

    async def window_outputs(self, hidden: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                             tokens: int) -> torch.Tensor | None:
        """The holder's outputs [B, tokens, H] for the window's last `tokens` columns of the rows' whole input (hidden
        [B, L, H], mask and positions [B, L], the leading columns included); None when this warm check cannot give
        them (the window is then checked statelessly). The holder's session is closed either way."""
        session = await self._session()
        if session is None:
            return None
        try:
            if hidden.shape[1] - tokens != self.columns:
                return None  # the history is not the one sent: a step was replayed elsewhere meanwhile
            return await session.step(hidden[:, -tokens:], mask[:, self.cut:], positions[:, -tokens:], self.keep_rows)
        except WARM_FAILURES as e:
            logger.info("A warm check on server %s failed (%s); checking the window statelessly", session.hop.peer_id[-8:], e)
            return None
        finally:
            await session.close()

    async def _session(self) -> ServerSession | None:
        try:
            return await self.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the check itself is being cancelled
            return None  # the warm check was dropped
        except WARM_FAILURES as e:
            logger.info("A warm check could not begin (%s); checking the window statelessly", e)
            return None
        except Exception:  # a fault of ours: the window is still checked, statelessly
            logger.warning("A warm check failed to begin; checking the window statelessly", exc_info=True)
            return None

    def drop(self) -> None:
        """Give up this warm check (on the event loop): stop feeding the holder and free its session."""
        if not self.task.done():
            self.task.cancel()
            return
        if not self.task.cancelled() and self.task.exception() is None and (session := self.task.result()) is not None:
            close_in_background(session, _closing)


_closing: set[asyncio.Future[None]] = set()  # dropped warm checks' sessions being closed


async def open_warm_session(warm: WarmCheck, hop: RouteHop, max_length: int, prefix: Callable[[], WarmPrefix],
                            open_session: Callable[..., ServerSession]) -> ServerSession:
    """A background session on `hop` (the second holder's peer and the checked blocks) for `warm`'s rows, fed their
    history so far; closed again if feeding it fails."""
    given = prefix()
    warm.cut = given.cut
    session = open_session(hop, batch_size=len(warm.rows), max_length=max_length - given.cut, background=True)
    await session.open()
    try:
        await session.step(given.hidden, given.mask, given.positions)
    except BaseException:
        await session.close()
        raise
    return session
