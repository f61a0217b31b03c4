"""Admission of stateless work: at most so many forwards admitted and not yet answered, per server and per caller."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from servers.errors import RequestRejected
from swarmnet.protocol import ErrorCode


class Slots:
    """Counts what callers hold of one kind of work, against a cap per caller and a cap in all.

    `hold(caller)` takes a slot for the duration of a `with` block, or raises RequestRejected(BUSY) and takes nothing.
    """

    def __init__(self, what: str, *, per_caller: int, total: int) -> None:
        self.what, self.per_caller, self.total = what, per_caller, total
        self._held: Counter[str] = Counter()

    @property
    def in_use(self) -> int:
        """Slots held now, by every caller."""
        return self._held.total()

    @contextmanager
    def hold(self, caller: str) -> Iterator[None]:
        """Hold one slot for `caller` while the block runs."""
        if self._held[caller] >= self.per_caller:
            raise RequestRejected(ErrorCode.BUSY, f"this caller already has {self._held[caller]} {self.what} here, "
                                                  f"the most one caller may have; wait for one to finish")
        if self.in_use >= self.total:
            raise RequestRejected(ErrorCode.BUSY, f"this server already has {self.in_use} {self.what}, its most; "
                                                  f"retry later or use another server")
        self._held[caller] += 1
        try:
            yield
        finally:
            self._held[caller] -= 1
            if not self._held[caller]:
                del self._held[caller]
