"""Schedules: the TOML file (`SWARMBATCH_SCHEDULES`) of recurring summarization batches, and cron arithmetic.

    [[schedule]]
    name = "nightly-notes"              # unique; names the job's idempotency key and the summaries' state
    cron = "30 2 * * *"                 # five-field cron, evaluated in `timezone`
    timezone = "Europe/Berlin"          # default UTC
    source = "notes/**/*.md"            # a glob of .txt/.md files, or a .jsonl file of {"id", "text"} lines
    prompt = "Summarize:\n\n{document}" # {document} is replaced by the text (or by one chunk of it)
    model = "smollm2"
    output = "summaries/notes"          # one Markdown file per document, plus index.md

Relative `source` and `output` paths are relative to the schedules file's folder. Optional: `reduce_prompt`
(with `{summaries}`; combines chunk summaries of long documents), `max_tokens` (default 128), `temperature`
(default 0), `top_p`, `seed`, `chat` (default true: the prompt goes through the model's chat template),
`chunk_overlap` (tokens, default 64), `misfire_grace` (how late a firing may still happen, default "1h").
"""
from __future__ import annotations

import hashlib
import tomllib
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jobs.durations import parse_window
from jobs.errors import InvalidJob

DEFAULT_REDUCE_PROMPT = ("Below are summaries of consecutive parts of one document. Combine them into one "
                         "concise summary of the whole document.\n\n{summaries}")


class ScheduleError(InvalidJob):
    """The schedules file or one schedule is unusable; the message names the file, schedule and field."""


class Schedule(BaseModel):
    """One recurring summarization batch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    cron: str
    timezone: str = "UTC"
    source: str
    prompt: str
    model: str
    output: str
    reduce_prompt: str = DEFAULT_REDUCE_PROMPT
    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int = Field(default=0, ge=0)
    chat: bool = True
    chunk_overlap: int = Field(default=64, ge=0)
    misfire_grace: str = "1h"
    base_dir: Path = Path(".")  # the schedules file's folder (set by load_schedules)

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        if len(value.split()) != 5 or not croniter.is_valid(value):
            raise ValueError(f"{value!r} is not a five-field cron expression like '30 2 * * *'")
        return value

    @field_validator("timezone")
    @classmethod
    def _valid_timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown timezone {value!r} (use an IANA name like 'Europe/Berlin')") from None
        return value

    @model_validator(mode="after")
    def _placeholders(self) -> Schedule:
        if "{document}" not in self.prompt:
            raise ValueError("prompt must contain {document}")
        if "{summaries}" not in self.reduce_prompt:
            raise ValueError("reduce_prompt must contain {summaries}")
        try:
            parse_window(self.misfire_grace)
        except InvalidJob:
            raise ValueError(f"misfire_grace {self.misfire_grace!r} is not a duration like 1h, 30m or 600s") from None
        return self

    @property
    def zone(self) -> ZoneInfo:
        """The schedule's timezone."""
        return ZoneInfo(self.timezone)

    @property
    def grace(self) -> timedelta:
        """How long after its time a period may still fire (beat was down, or restarting)."""
        return timedelta(seconds=parse_window(self.misfire_grace))

    @property
    def output_dir(self) -> Path:
        """Where the Markdown summaries go."""
        return (self.base_dir / self.output).resolve()

    @property
    def template_sha(self) -> str:
        """Fingerprint of everything but the document that shapes a summary: a change re-summarizes all."""
        shape = [self.prompt, self.reduce_prompt, self.max_tokens, self.temperature, self.top_p, self.seed,
                 self.chat, self.chunk_overlap]
        return hashlib.sha256(repr(shape).encode()).hexdigest()

    def last_period(self, now: datetime) -> datetime:
        """The latest scheduled time at or before `now` (aware, in the schedule's timezone)."""
        local = now.astimezone(self.zone)
        if croniter.match(self.cron, local.replace(second=0, microsecond=0)):
            return local.replace(second=0, microsecond=0)
        return croniter(self.cron, local).get_prev(datetime)  # type: ignore[no-any-return]

    def next_run(self, now: datetime) -> datetime:
        """The first scheduled time after `now`."""
        return croniter(self.cron, now.astimezone(self.zone)).get_next(datetime)  # type: ignore[no-any-return]

    def due_period(self, now: datetime) -> datetime | None:
        """The period to fire at `now`: the last scheduled time, unless it is older than the grace."""
        period = self.last_period(now)
        return period if now - period <= self.grace else None


def load_schedules(path: Path) -> list[Schedule]:
    """Parse and validate a schedules file; raises ScheduleError with one line naming what is wrong."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScheduleError(f"schedules file {path} does not exist (set SWARMBATCH_SCHEDULES)") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ScheduleError(f"{path}: not valid TOML: {e}") from None
    entries = data.get("schedule", [])
    if not isinstance(entries, list) or set(data) - {"schedule"}:
        raise ScheduleError(f"{path}: expected only [[schedule]] tables")
    schedules = [_schedule(path, i, entry) for i, entry in enumerate(entries)]
    names = [s.name for s in schedules]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        raise ScheduleError(f"{path}: schedule names must be unique; repeated: {', '.join(duplicated)}")
    return schedules


def _schedule(path: Path, index: int, entry: Any) -> Schedule:
    try:
        return Schedule.model_validate({**entry, "base_dir": path.resolve().parent})
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "schedule"
        name = entry.get("name", f"#{index + 1}") if isinstance(entry, dict) else f"#{index + 1}"
        raise ScheduleError(f"{path}: schedule {name}: {where}: {error['msg']}") from None


def find_schedule(schedules: list[Schedule], name: str) -> Schedule:
    """The schedule called `name`; raises ScheduleError listing the known names."""
    for schedule in schedules:
        if schedule.name == name:
            return schedule
    raise ScheduleError(f"no schedule {name!r}; known: {', '.join(s.name for s in schedules) or 'none'}")
