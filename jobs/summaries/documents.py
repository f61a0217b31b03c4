"""The documents a schedule summarizes: a glob of .txt/.md files, or a JSONL file of {"id", "text"} lines."""
from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from jobs.summaries.schedule_file import Schedule, ScheduleError

TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class Document:
    """One document: `key` names it across nights (a path relative to the glob's folder, or the JSONL id)."""

    key: str
    source: str  # where it came from, for the summary's header
    text: str

    @property
    def content_sha(self) -> str:
        """sha256 of the text: a changed document gets a new summary."""
        return hashlib.sha256(self.text.encode()).hexdigest()


def collect_documents(schedule: Schedule) -> list[Document]:
    """The schedule's documents, sorted by key; raises ScheduleError if the source is unusable."""
    source = schedule.source
    if source.endswith(".jsonl"):
        return _jsonl_documents(schedule.base_dir / source)
    return _glob_documents(schedule.base_dir, source)


def _glob_documents(base_dir: Path, pattern: str) -> list[Document]:
    absolute = pattern if Path(pattern).is_absolute() else str(base_dir / pattern)
    root = _glob_root(absolute)
    paths = sorted(Path(p) for p in glob.glob(absolute, recursive=True))
    return [Document(key=str(p.relative_to(root)), source=str(p), text=_read_text(p))
            for p in paths if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES]


def _glob_root(pattern: str) -> Path:
    """The folder before the first wildcard: document keys are relative to it."""
    parts = Path(pattern).parts
    magic = next((i for i, part in enumerate(parts) if glob.has_magic(part)), None)
    return Path(pattern).parent if magic is None else Path(*parts[:magic])


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ScheduleError(f"{path} is not UTF-8 text; convert it or exclude it from the source glob") from None


def _jsonl_documents(path: Path) -> list[Document]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ScheduleError(f"source file {path} does not exist") from None
    documents: dict[str, Document] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            key, text = str(item["id"]), item["text"]
        except (ValueError, KeyError, TypeError):
            raise ScheduleError(f"{path}:{number}: expected a JSON object with string 'id' and 'text'") from None
        if not isinstance(text, str) or key in documents:
            raise ScheduleError(f"{path}:{number}: 'text' must be a string and ids unique (id {key!r})")
        documents[key] = Document(key=key, source=f"{path}#{key}", text=text)
    return sorted(documents.values(), key=lambda d: d.key)
