"""The lines of a batch input file, read as a stream of byte pieces: numbered, decoded, and the whole-file limits.

A file is split at b"\\n" (UTF-8 encodes no other character with that byte); every line counts in the numbering,
empty ones are skipped; a UTF-8 byte-order mark before the first line is dropped. Each line is decoded on its own,
so a reader holds one piece and one line at a time, whatever the file's size: the API's store keeps uploads as
1 MiB chunks (jobs.files) and the validation reads them so (jobs.ingest), from any line boundary on.
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


class BatchFileRejected(Exception):
    """Raised when the whole file is refused (no request is made of it); the one-line message says what to do.

    `code` names the problem in the job's `errors` (OpenAI's batch error shape) when a batch fails for it, with the
    parameter and line at fault when there is one.
    """

    def __init__(self, message: str, *, code: str = "invalid_file", param: str | None = None,
                 line: int | None = None) -> None:
        super().__init__(message)
        self.code, self.param, self.line = code, param, line


@dataclass(frozen=True)
class Line:
    """One non-empty line: its 1-based number (empty lines counted), its text, and the byte offset just past it."""

    number: int
    text: str
    end: int


def iter_lines(pieces: Iterable[bytes], *, start: int = 0, first_number: int = 1) -> Iterator[Line]:
    """The non-empty lines of the file whose bytes from offset `start` on (a line boundary) are `pieces`.

    Raises BatchFileRejected at the first line that is not UTF-8.
    """
    pending: list[bytes] = []  # the current line's parts: one line may span many pieces
    offset, number = start, first_number
    for piece in pieces:
        parts = piece.split(b"\n")
        for part in parts[:-1]:
            pending.append(part)
            raw = b"".join(pending)
            pending = []
            line = _line(raw, number, offset, offset + len(raw) + 1)
            if line is not None:
                yield line
            offset, number = offset + len(raw) + 1, number + 1
        if parts[-1]:
            pending.append(parts[-1])
    if pending:
        raw = b"".join(pending)
        line = _line(raw, number, offset, offset + len(raw))
        if line is not None:
            yield line


def _line(raw: bytes, number: int, offset: int, end: int) -> Line | None:
    """The decoded line, or None for an empty one."""
    if offset == 0:
        raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise not_utf8(number, offset + exc.start) from None
    return Line(number, text, end) if text.strip() else None


def read_lines(data: bytes, *, max_bytes: int, max_lines: int) -> list[Line]:
    """The non-empty lines of a file held whole, after the whole-file checks (size, lines, UTF-8)."""
    if len(data) > max_bytes:
        raise too_large(len(data), max_bytes)
    lines = list(iter_lines([data]))
    if len(lines) > max_lines:
        raise too_many_lines(len(lines), max_lines)
    return lines


def too_large(size: int, limit: int) -> BatchFileRejected:
    """The refusal of a file over SWARMBATCH_MAX_FILE_BYTES."""
    return BatchFileRejected(f"the input file is {size} bytes; the limit is {limit} (SWARMBATCH_MAX_FILE_BYTES); "
                             f"split it into smaller files", code="file_too_large")


def too_many_lines(count: int, limit: int) -> BatchFileRejected:
    """The refusal of a file of more than SWARMBATCH_MAX_LINES non-empty lines."""
    return BatchFileRejected(f"the input file has {count} non-empty lines; the limit is {limit} "
                             f"(SWARMBATCH_MAX_LINES); split it into smaller files", code="too_many_lines")


def not_utf8(line: int, byte: int) -> BatchFileRejected:
    """The refusal of a file that is not UTF-8, naming the first bad byte."""
    return BatchFileRejected(f"the input file is not valid UTF-8 (line {line}, byte {byte}); save it as UTF-8 and "
                             f"submit it again", code="invalid_encoding")
