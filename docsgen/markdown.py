"""Markdown pieces the generated pages share: escaped table cells, code spans and tables."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(text: object) -> str:
    """Plain text fit for one table cell: one line, its pipes escaped (a code span needs no escapes: see `code`)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: object) -> str:
    """A code span around text, on one line (a longer fence when the text holds backticks). Python-Markdown's tables
    keep a pipe inside a code span, so it is not escaped."""
    value = " ".join(str(text).split())
    fence = "``" if "`" in value else "`"
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{fence}{pad}{value}{pad}{fence}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A pipe table; the cells are taken as they are (escape them with `cell`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
