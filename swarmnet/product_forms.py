"""A product x · Wᵀ of a few rows on a CPU, in the fastest of equal forms: kept per row count, after timing them.

logits = x · Wᵀ is `F.linear(x, W)`, and equally `(W · xᵀ)ᵀ` ("transposed"), and for one row the first row of the
transposed product of that row twice ("paired"). They use the same weight (no copy) and the same sums in another
order, so they differ by float rounding (about 1e-6 relative). Which is fastest depends on the row count, on the
CPU and on whether the weights stream from memory. On an AMD EPYC VM (MKL, one thread, SmolLM2's linear layers
cycled through all 30 blocks so that each streams from memory; a probe of session 28, bench/RESULTS.md, which
bench/product_forms.py follows up on a real span's decode steps):

    rows        1      2      3      4      6      8      16
    linear     37.9   53.5   59.9   48.0   54.9   57.3   74.7  ms
    transposed 37.9   23.6   38.1   39.4   60.1   67.1   86.3
    paired     24.9

MKL computes one row as a matrix-vector product, which streams the weight at ~11 GB/s there, and a product with two
columns at ~17 GB/s. The same matrices timed warm (in cache) rank the other way, so a choice is made by timing the
product where it runs: the LM head one call at a time (head_matmul.py: its 113 MB stream from memory), a server's
blocks a whole span's forward at a time (servers/span_forms.py). `FormLinear` is an nn.Linear that takes the form
its `FormTable` holds for its input's row count.

A fourth form, "packed", is oneDNN's product on a copy of the weight reordered once into the blocked layout its
kernels read (`torch.ops.mkldnn`, in torch's x86 CPU builds). It streams a weight faster than MKL's F.linear at
every row count measured, but it is a layout, not an order of sums: it needs a copy of the weight, which a layer
holds only where some row count takes the packed form, and a layer that takes it for every row count keeps only the
packed copy (its dense weight is freed: `settle_weights`).
On the same VM, SmolLM2's blocks 0:15, one thread, a decode step after 64 tokens (session 29's probe):

    rows           1      2      4      8      16     32     64
    linear        22.0   31.1   31.5   38.8   55.1   76.5  128.2  ms
    dense forms   17.9   17.9   25.7   38.7   55.7   77.3  124.3     (the table above: paired, transposed, linear)
    packed        20.9   24.7   19.5   26.0   39.3   59.3  103.4
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

TUNED_ROWS = 8           # row counts up to this are timed; MKL's large-M path is good above it
MARGIN = 0.9             # another form is kept when it takes at most this fraction of F.linear's time
TIMING_ROUNDS = 3        # each form runs this many times on first sight of a row count; its fastest run counts
PACKED = "packed"        # oneDNN's product on the packed copy of the weight (FormLinear only: it needs the copy)
PACKED_FOR_ROWS = 64     # the row count oneDNN lays the packed copy out for; it serves every other count as well

Form = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
T = TypeVar("T")


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[N, H] x [V, H] -> [N, V], as nn.Linear computes it."""
    return F.linear(x, weight)


def transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same product as `linear`, computed as (W · xᵀ)ᵀ (MKL's path for a tall, thin product), made contiguous as
    F.linear's is (what sampling, penalties and the next layer read row by row; the copy costs 0.1-0.4 ms at 2-6
    rows of a 49152-word head)."""
    return (weight @ x.t()).t().contiguous()


def paired(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One row's product as the first column of W · [x, x]ᵀ: a two-column product, which streams the weight faster
    than the matrix-vector product that one row gets (see above)."""
    return (weight @ torch.cat([x, x]).t())[:, :1].t().contiguous()


FORMS: dict[str, Form] = {"linear": linear, "transposed": transposed, "paired": paired}


def candidates(rows: int) -> tuple[str, ...]:
    """The dense forms timed for a row count: F.linear first (the one kept unless another is clearly faster)."""
    return ("linear", "paired") if rows == 1 else ("linear", "transposed")


def timings(run: Callable[[str], T], names: tuple[str, ...], clock: Callable[[], float]
            ) -> tuple[dict[str, float], dict[str, T]]:
    """Run each form TIMING_ROUNDS times, in turn (the first round warms the paths); each form's fastest run in
    seconds, and its last result."""
    best: dict[str, float] = {}
    results: dict[str, T] = {}
    for _ in range(TIMING_ROUNDS):
        for name in names:
            start = clock()
            results[name] = run(name)
            best[name] = min(best.get(name, float("inf")), clock() - start)
    return best, results


def chosen_form(seconds: dict[str, float], names: tuple[str, ...]) -> str:
    """Of `names` (timed), the first (F.linear) unless another one's fastest run took at most MARGIN of its."""
    challenger = min(names[1:], key=lambda name: seconds[name])
    return challenger if seconds[challenger] <= MARGIN * seconds[names[0]] else names[0]


def fastest(run: Callable[[str], T], names: tuple[str, ...], clock: Callable[[], float]) -> tuple[str, T]:
    """Time the forms (`timings`) and keep one (`chosen_form`); returns it and its last result."""
    seconds, results = timings(run, names, clock)
    choice = chosen_form(seconds, names)
    return choice, results[choice]


def packed_available() -> bool:
    """Whether this torch build has oneDNN's packed linear product (x86 CPU builds do)."""
    try:
        weight = torch.ones(2, 2)
        return bool(torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), pack(weight), None, "none", [], "")
                    .eq(2).all())
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered into oneDNN's blocked layout (an opaque mkldnn tensor of the same values)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


@dataclass
class FormTable:
    """Row count -> the form its products take (`default` for a row count not in it)."""

    choices: dict[int, str] = field(default_factory=dict)
    default: str = "linear"

    def form(self, rows: int) -> str:
        return self.choices.get(rows, self.default)

    def uses(self, form: str) -> bool:
        """Whether some row count takes `form`."""
        return self.default == form or form in self.choices.values()

    def uses_dense(self) -> bool:
        """Whether some row count takes a form of the dense weight (any but packed)."""
        return any(self.uses(form) for form in FORMS)

    def describe(self) -> str:
        """'1 paired, 2-5 transposed; others linear' (a log line)."""
        runs: list[list[int | str]] = []  # [first rows, last rows, form], consecutive row counts of one form joined
        for rows, form in sorted(self.choices.items()):
            if form == self.default:
                continue
            if runs and runs[-1][2] == form and runs[-1][1] == rows - 1:
                runs[-1][1] = rows
            else:
                runs.append([rows, rows, form])
        forms = [f"{low}{'' if low == high else f'-{high}'} {form}" for low, high, form in runs]
        return ", ".join(forms) + ("; others " if forms else "all ") + self.default


class FormLinear(nn.Linear):
    """nn.Linear whose product of few rows takes the form its table holds for that row count (`install`)."""

    table: FormTable
    packed: torch.Tensor | None = None  # the weight as `pack` lays it out, where the table takes the packed form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        form = self.table.form(rows)
        if form == "linear":
            return F.linear(x, self.weight, self.bias)
        if form == PACKED:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        out = FORMS[form](x.reshape(rows, self.in_features), self.weight)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def float32_linears(module: nn.Module) -> list[nn.Linear]:
    """The plain float32 CPU nn.Linear layers in a module (not quantized ones, which subclass it)."""
    return [m for m in module.modules() if isinstance(m, nn.Linear) and type(m) in (nn.Linear, FormLinear)
            and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]


def install(module: nn.Module, table: FormTable) -> int:
    """Make every plain float32 CPU nn.Linear in `module` a FormLinear reading `table` (in place: same weights),
    holding the weights the table's forms read (`settle_weights`); returns how many weights they hold."""
    weights = 0
    for layer in float32_linears(module):
        weights += layer.weight.numel() or layer.out_features * layer.in_features
        layer.__class__ = FormLinear
        setattr(layer, "table", table)  # noqa: B010 (mypy types a Module attribute Tensor | Module)
    settle_weights(module)
    return weights


def settle_weights(module: nn.Module) -> None:
    """Give each FormLinear in `module` what its table's forms read, and free what they do not: the packed copy
    where some row count takes the packed form (made from the dense weight), and the dense weight where some row
    count takes a dense form (freed, to an empty tensor, where none does: the packed copy holds the same values)."""
    for layer in module.modules():
        if not isinstance(layer, FormLinear):
            continue
        dense = layer.table.uses_dense()
        if layer.table.uses(PACKED) and layer.packed is None:
            layer.packed = pack(layer.weight)
        if not layer.table.uses(PACKED):
            layer.packed = None
        if dense and not layer.weight.numel():
            raise ValueError("a packed layer's dense weight was freed: load the span again to take a dense form")
        if not dense and layer.weight.numel():
            layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)
