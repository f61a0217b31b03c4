"""Tuning a span's few-row products: each row count's fastest form of the blocks' linear layers, timed at start-up.

A decode step of B rows multiplies B rows by each linear layer's weight. product_forms.py has the equal forms of that
product and why their speeds differ: mostly how fast each streams the weights from memory, so a form is timed where
it streams them, over the whole span's forward (a single layer's product, in cache, ranks them the other way). For
each row count 1..TUNED_ROWS, and LAYOUT_ROWS, `tune_span` runs a stateless one-token forward of the span under each
candidate form (TIMING_ROUNDS times, in turn), the packed form among them where torch has it. Where the server has
`spare_bytes` for a second copy of its linear weights (block_sizing.spare_memory), each row count up to TUNED_ROWS
keeps its fastest form of all, F.linear unless another is clearly faster (MARGIN), and the larger ones packed where
packed won at LAYOUT_ROWS: both copies are kept where both are taken. Otherwise the span takes one of two layouts:
- packed: every row count takes the packed form (one copy of each weight, oneDNN's), where one step of each timed
  row count takes at most MARGIN of the time the dense forms' fastest take in all;
- dense: each row count up to TUNED_ROWS keeps its fastest dense form, F.linear unless another is clearly faster
  (MARGIN), and F.linear above.
It runs before the server announces itself and measures its throughput, so every step it serves takes the same
forms. A span holding more than TIMED_SPAN_WEIGHTS is timed on its first blocks that hold that much (a big model's
server would otherwise spend minutes timing); only those blocks hold a packed copy beside their dense weights while
it times (the packed form is timed only where that copy takes at most half of the free memory), and the layout
chosen then settles every block (product_forms.settle_weights). Servers on one machine time
one at a time (TIMING_LOCK, a file lock): two spans timed at once stream their weights through the same memory, and
under that contention the dense forms lost to packed at 1 and 2 rows, where alone they win by a fifth.

Only float32 spans on a CPU whose linear layers hold at least TUNED_MIN_SPAN_WEIGHTS are tuned (a smaller span stays
in cache, where the forms tie); quantized layers are not nn.Linear's and keep their own kernels. ROW_FORMS_ENV sets a
table without timing (tests: the forms on a tiny model; "*:packed" the packed layout).
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from servers.block_sizing import free_memory
from servers.span import BlockSpan
from swarmnet.product_forms import (
    FORMS,
    MARGIN,
    PACKED,
    TUNED_ROWS,
    FormLinear,
    FormTable,
    candidates,
    chosen_form,
    float32_linears,
    install,
    pack,
    packed_available,
    settle_weights,
    timings,
)

logger = logging.getLogger(__name__)

TUNED_MIN_SPAN_WEIGHTS = 1 << 22  # 16 MiB of float32 weights; a span under it is not timed
TIMED_SPAN_WEIGHTS = 1 << 28  # the forms are timed on the span's first blocks holding this much (1 GiB of float32):
# far past any CPU cache, so they stream as in use; a bigger span's start-up stays short (48 forwards of them)
TIMING_LOCK = Path(tempfile.gettempdir()) / "swarmbatch-product-forms.lock"  # one server of a machine times at once
LAYOUT_ROWS = 16  # also timed, for the layout only: a job lane's decode step (the dense table keeps F.linear there)
TUNED_LOG = "Product forms of blocks %d:%d, timed in %.1f s: %s (a step of each timed row count: %s; %s)"
FORCED_LOG = "Product forms of blocks %d:%d, set by %s: %s"
# TEST ONLY: "1:paired,2:transposed" installs this table on any float32 CPU span, untimed; "*:packed" sets the default
ROW_FORMS_ENV = "SWARMBATCH_TEST_ROW_FORMS"


def tune_span(span: BlockSpan, *, spare_bytes: int = 0, clock: Callable[[], float] = time.perf_counter
              ) -> FormTable | None:
    """Time and install the span's product forms (see the module doc); None where the span is not tuned."""
    forced = forced_table()
    linears = float32_linears(span)
    if not linears or span.compute_dtype != torch.float32 or span.device.type != "cpu":
        return None
    if forced is not None:
        install(span, forced)
        logger.info(FORCED_LOG, span.start, span.end, ROW_FORMS_ENV, forced.describe())
        return forced
    weights = sum(layer.weight.numel() for layer in linears)
    if weights < TUNED_MIN_SPAN_WEIGHTS:
        return None
    table = FormTable()
    install(span, table)
    with timing_alone():
        return time_forms(span, table, weights, spare_bytes, clock)


@contextmanager
def timing_alone() -> Iterator[None]:
    """Hold the machine's TIMING_LOCK (released when the process ends, whatever happens); where file locks are not to
    be had, time anyway."""
    try:
        import fcntl
        lock = open(TIMING_LOCK, "a")  # noqa: SIM115 (closed below, after the timing)
    except (ImportError, OSError) as e:
        logger.debug("Timing product forms without the machine's lock: %s", e)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def time_forms(span: BlockSpan, table: FormTable, weights: int, spare_bytes: int, clock: Callable[[], float]
               ) -> FormTable:
    """Time each row count's forms and settle the span's layout (the module doc); `weights`: the span's linear
    weights."""
    began, (end, timed_weights) = clock(), timed_blocks(span)
    packing = packed_available() and packed_copy_fits(span, 4 * timed_weights)
    both = packing and spare_bytes >= 4 * weights
    if packing:
        pack_blocks(span, end)
    totals = {"dense": 0.0, PACKED: 0.0}
    best: dict[int, str] = {}  # of all forms, packed included
    for rows in (*range(1, TUNED_ROWS + 1), LAYOUT_ROWS):
        dense = candidates(rows) if rows <= TUNED_ROWS else ("linear",)
        seconds = time_row_count(span, end, table, rows, dense + ((PACKED,) if packing else ()), clock)
        table.choices[rows] = chosen_form(seconds, dense) if len(dense) > 1 else dense[0]
        best[rows] = chosen_form(seconds, (*dense, PACKED)) if packing else table.choices[rows]
        totals["dense"] += seconds[table.choices[rows]]
        totals[PACKED] += seconds.get(PACKED, float("inf"))
    del table.choices[LAYOUT_ROWS]
    if both:
        table.default = best.pop(LAYOUT_ROWS)
        table.choices = best
    elif totals[PACKED] <= MARGIN * totals["dense"]:
        table.choices.clear()
        table.default = PACKED
    settle_weights(span)
    copies = "both copies kept" if table.uses(PACKED) and table.uses_dense() else "one copy"
    logger.info(TUNED_LOG, span.start, span.end, clock() - began, table.describe(), ", ".join(
        f"{name} {seconds * 1000:.1f} ms" for name, seconds in totals.items() if seconds < float("inf")),
        f"{copies}, {spare_bytes / 2 ** 20:.0f} MiB spare")
    return table


def packed_copy_fits(span: BlockSpan, copy: int) -> bool:
    """Whether a packed copy of the timed blocks (`copy` bytes), held beside their dense weights while the forms are
    timed, takes at most half of the memory free now (else the packed form is not timed, and the span stays dense)."""
    free = free_memory(span.device)
    if 2 * copy <= free:
        return True
    logger.info("Product forms of blocks %d:%d: the packed form is not timed (a packed copy of %d MiB to time it, "
                "%d MiB free)", span.start, span.end, copy >> 20, free >> 20)
    return False


def pack_blocks(span: BlockSpan, end: int) -> None:
    """Give blocks [span.start, end) a packed copy of each weight beside the dense one (to time the packed form)."""
    for layer in span.layers[:end - span.start]:
        for linear in layer.modules():
            if isinstance(linear, FormLinear):
                linear.packed = pack(linear.weight)


def timed_blocks(span: BlockSpan) -> tuple[int, int]:
    """The end of the blocks the forms are timed on (the span's first blocks holding TIMED_SPAN_WEIGHTS, or all),
    and the linear weights they hold."""
    weights = 0
    for offset, layer in enumerate(span.layers):
        weights += sum(linear.weight.numel() for linear in float32_linears(layer))
        if weights >= TIMED_SPAN_WEIGHTS:
            return span.start + offset + 1, weights
    return span.end, weights


@torch.inference_mode()
def time_row_count(span: BlockSpan, end: int, table: FormTable, rows: int, forms: tuple[str, ...],
                   clock: Callable[[], float]) -> dict[str, float]:
    """Each form's seconds for `rows`: a one-token stateless forward of blocks [span.start, end) under it."""
    hidden = torch.randn(rows, 1, span.spec.hidden_size, generator=torch.Generator().manual_seed(rows))
    mask, positions = torch.ones(rows, 1, dtype=torch.long), torch.zeros(rows, 1, dtype=torch.long)

    def forward(form: str) -> None:
        table.choices[rows] = form
        span(hidden, mask, positions, None, span.start, end)
    seconds, _ = timings(forward, forms, clock)
    return seconds


def forced_table() -> FormTable | None:
    """The table ROW_FORMS_ENV sets ("rows:form,..."), or None when it is unset."""
    value = os.environ.get(ROW_FORMS_ENV, "").strip()
    if not value:
        return None
    table = FormTable()
    for item in value.split(","):
        rows, _, form = item.partition(":")
        if form not in (*FORMS, PACKED) or not (rows.strip().isdigit() or rows.strip() == "*"):
            raise ValueError(f"{ROW_FORMS_ENV}={value!r}: expected rows:form pairs (rows a count or *), forms "
                             f"{sorted((*FORMS, PACKED))}")
        if rows.strip() == "*":
            table.default = form
        else:
            table.choices[int(rows)] = form
    return table
