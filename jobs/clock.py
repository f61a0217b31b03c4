"""The one clock of the scheduler, so that tests can move time (the only thing they mock)."""
from __future__ import annotations

from datetime import UTC, datetime


def now() -> datetime:
    """Timezone-aware now, in UTC."""
    return datetime.now(UTC)
