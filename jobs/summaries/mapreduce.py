"""Summarizing documents of any length with requests of the durable job machinery.

A document that fits the model's context (with the prompt and the summary) is one request. A longer one is
split into token chunks with overlap (stage 0: one summary per chunk); when every request of a document's
last stage is completed, `advance` adds the next stage: the summaries packed into as few prompts as fit,
recursively, until one request summarizes everything (`final`). Each stage's requests are ordinary requests:
claimed under leases, checkpointed, resumed, counted in the job's status.

Stage requests are named `<document>#<stage>.<n>`; a job's (job, custom_id) pair is unique in SQL, so two
workers advancing the same document at once cannot both add a stage.
"""
from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs.batch_input import CHAT_URL, COMPLETIONS_URL, InputLimits, ParsedBatch, parse_batch_file
from jobs.ingest import runtime_context_length
from jobs.models import Job, Request, RequestStatus
from jobs.runtime import Runtime
from jobs.store import add_requests
from jobs.summaries.schedule_file import Schedule, ScheduleError

logger = logging.getLogger(__name__)

SAFETY_TOKENS = 32  # re-encoding a decoded chunk may take a few more tokens than the chunk had
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class SummaryShape:
    """How a job summarizes (stored in its summary run, so later stages don't depend on the schedules file)."""

    prompt: str
    reduce_prompt: str
    chat: bool
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    chunk_overlap: int

    @classmethod
    def of(cls, schedule: Schedule) -> SummaryShape:
        """The shape a schedule asks for."""
        return cls(schedule.prompt, schedule.reduce_prompt, schedule.chat, schedule.max_tokens, schedule.temperature,
                   schedule.top_p, schedule.seed, schedule.chunk_overlap)

    def to_dict(self) -> dict[str, Any]:
        """For SummaryRun.shape."""
        return asdict(self)


@dataclass(frozen=True)
class PlannedRequest:
    """One request to add: its OpenAI batch line and where it sits in its document's map-reduce."""

    line: dict[str, Any]
    document: str
    stage: int
    final: bool

    @property
    def annotation(self) -> dict[str, Any]:
        """The Request columns beyond the line."""
        return {"document": self.document, "stage": self.stage, "final": self.final}


class Planner:
    """Turns document text and summaries into requests that fit the model's context."""

    def __init__(self, shape: SummaryShape, tokenizer: Any, context: int, model: str) -> None:
        self.shape, self.tokenizer, self.context, self.model = shape, tokenizer, context, model
        self.map_room = self._room(shape.prompt, "{document}")
        self.reduce_room = self._room(shape.reduce_prompt, "{summaries}")
        if self.reduce_room < 2 * (shape.max_tokens + len(self._ids(SEPARATOR))):
            raise ScheduleError(f"max_tokens {shape.max_tokens} is too large to combine summaries within the "
                                f"model's context of {context} tokens; lower max_tokens")

    def document(self, key: str, text: str) -> list[PlannedRequest]:
        """Stage 0 of a document: one request, or one per chunk when it is too long."""
        ids = self._ids(text)
        if len(ids) <= self.map_room:
            return [self._request(key, key, 0, True, self.shape.prompt.replace("{document}", text))]
        chunks = chunk_ids(ids, self.map_room, min(self.shape.chunk_overlap, self.map_room // 4))
        logger.info("Document %s: %d tokens -> %d chunks of up to %d", key, len(ids), len(chunks), self.map_room)
        return [self._request(key, f"{key}#0.{i}", 0, False,
                              self.shape.prompt.replace("{document}", self.tokenizer.decode(chunk)))
                for i, chunk in enumerate(chunks)]

    def reduce(self, key: str, stage: int, summaries: list[str]) -> list[PlannedRequest]:
        """The next stage: summaries packed into prompts that fit; one prompt means the final summary."""
        groups = pack(summaries, [len(self._ids(s + SEPARATOR)) for s in summaries], self.reduce_room)
        final = len(groups) == 1
        return [self._request(key, f"{key}#{stage}.{i}", stage, final,
                              self.shape.reduce_prompt.replace("{summaries}", SEPARATOR.join(group)))
                for i, group in enumerate(groups)]

    def parse(self, planned: list[PlannedRequest]) -> ParsedBatch:
        """Validate the lines as any batch input (token ids, limits); a line that does not fit is a bug here."""
        data = "".join(json.dumps(p.line) + "\n" for p in planned).encode()
        limits = InputLimits(max_file_bytes=max(len(data), 1), max_lines=max(len(planned), 1),
                             max_tokens_cap=self.shape.max_tokens, context_length=self.context)
        parsed = parse_batch_file(data, tokenizer=self.tokenizer, model_name=self.model, limits=limits)
        if parsed.errors:
            error = parsed.errors[0]
            raise ScheduleError(f"request {error.custom_id}: {error.message}")
        return parsed

    def _request(self, key: str, custom_id: str, stage: int, final: bool, text: str) -> PlannedRequest:
        shape = self.shape
        body: dict[str, Any] = {"max_tokens": shape.max_tokens, "temperature": shape.temperature,
                                "top_p": shape.top_p, "seed": shape.seed}
        if shape.chat:
            line = {"url": CHAT_URL, "body": {"messages": [{"role": "user", "content": text}], **body}}
        else:
            line = {"url": COMPLETIONS_URL, "body": {"prompt": text, **body}}
        return PlannedRequest({"custom_id": custom_id, "method": "POST", **line}, key, stage, final)

    def _room(self, template: str, placeholder: str) -> int:
        """Tokens left for the inserted text once the template, its chat wrapping and the summary are counted."""
        empty = template.replace(placeholder, "")
        if self.shape.chat:
            rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": empty}], tokenize=False,
                                                          add_generation_prompt=True)
            overhead = len(self._ids(str(rendered)))
        else:
            overhead = len(self.tokenizer(empty).input_ids)
        room = self.context - overhead - self.shape.max_tokens - SAFETY_TOKENS
        if room < 64:
            raise ScheduleError(f"the prompt and max_tokens {self.shape.max_tokens} leave {room} tokens of the "
                                f"model's {self.context}-token context for the document; shorten them")
        return room

    def _ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False).input_ids]


def planner_for(runtime: Runtime, job: Job) -> Planner:
    """The planner of a summary job, from the shape stored in its summary run."""
    if job.summary is None:
        raise ValueError(f"job {job.id} is a {job.kind} job, not a summary job")
    shape = SummaryShape(**job.summary.shape)
    return Planner(shape, runtime.tokenizer(job.model), runtime_context_length(runtime, job.model), job.model)


def chunk_ids(ids: list[int], size: int, overlap: int) -> list[list[int]]:
    """Windows of `size` tokens, each starting `size - overlap` after the previous, covering every token."""
    step = size - overlap
    starts = range(0, max(len(ids) - overlap, 1), step)
    return [ids[start:start + size] for start in starts]


def pack(texts: list[str], lengths: list[int], room: int) -> list[list[str]]:
    """Consecutive texts grouped greedily so that each group's total length fits `room`."""
    groups: list[list[str]] = [[]]
    used = 0
    for text, length in zip(texts, lengths, strict=True):
        if groups[-1] and used + length > room:
            groups.append([])
            used = 0
        groups[-1].append(text)
        used += length
    return groups


def advance(*, session: Session, job: Job, planner: Planner) -> int:
    """Add the next stage of every document whose last stage completed without a final summary.

    Returns the number of requests added (0 when another worker added them first). The caller commits.
    """
    rows = session.execute(select(Request.document, Request.stage, Request.final, Request.status,
                                  Request.output_text).where(Request.job_id == job.id, Request.document.is_not(None))
                           .order_by(Request.document, Request.stage, Request.index)).all()
    stages: dict[str, dict[int, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        stages[row.document][row.stage].append(row)
    planned: list[PlannedRequest] = []
    for document, by_stage in stages.items():
        top = max(by_stage)
        last = by_stage[top]
        if any(r.final for r in last) or any(r.status != RequestStatus.completed for r in last):
            continue  # finished, still running, or failed (a failed chunk fails its document)
        planned += planner.reduce(document, top + 1, [r.output_text or "" for r in last])
    if not planned:
        return 0
    try:
        with session.begin_nested():
            add_requests(session=session, job=job, parsed=planner.parse(planned),
                         annotations={p.line["custom_id"]: p.annotation for p in planned})
    except IntegrityError:
        logger.info("Job %s: another worker added the next stage first", job.id)
        return 0
    return len(planned)
