"""Durations as users write them: '24h', '90m', '3600s' or '3600' (a batch's completion window, a schedule's grace)."""
from __future__ import annotations

import math
import re

from jobs.errors import InvalidJob

WINDOW = re.compile(r"(?P<amount>\d{1,7}(?:\.\d{1,6})?)(?P<unit>[hms]?)")
WINDOW_UNITS = {"h": 3600, "m": 60, "s": 1, "": 1}
MAX_WINDOW_SECONDS = 7 * 24 * 3600  # OpenAI accepts 24h; a week is the longest deadline we keep a job for


def parse_window(value: str) -> int:
    """'24h', '90m', '3600s' or '3600' -> seconds, from 1 s to 7 days; InvalidJob (a 400) otherwise."""
    match = WINDOW.fullmatch(value.strip())
    if match is None:
        raise InvalidJob(f"completion window {value!r} is not a duration like 24h, 90m or 3600s")
    seconds = math.floor(float(match["amount"]) * WINDOW_UNITS[match["unit"]])
    if not 0 < seconds <= MAX_WINDOW_SECONDS:
        raise InvalidJob(f"completion window {value!r} must be between 1s and {MAX_WINDOW_SECONDS // 3600}h (7 days)")
    return seconds
