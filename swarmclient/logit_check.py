"""Teacher-forced per-token logits: how close the swarm's logits are to transformers' in the same dtype.

Greedy tokens are the right check in float32 only. In bfloat16 / float16 a server's forward (its blocks, a KV
cache, a prefill then one token per step) is not bit-identical to transformers' whole-model forward, and where a
model's logits are flat (random weights; real ones at near-ties) one rounding step flips the argmax, after which
the two generations see different inputs and nothing more can be compared. So the check here feeds ONE token
sequence through both and compares the logits at every position:

1. `teacher_forced_reference`: transformers' greedy continuation of the prompts (in float32 by default), then
   transformers' logits of that whole sequence in the dtype D under test (and in float32: the yardstick, how far
   D's own rounding moves transformers).
2. `swarm_logits`: the same sequence through the swarm's real inference-session path: a prefill of the prompts,
   then one decode step per continuation token, the client head in D.
3. `compare_logits`: per step (0 = the prefill's real prompt positions, k = the k-th decode step) the largest
   absolute difference, the relative error ||swarm - transformers_D|| / ||transformers_D|| (worst row), and whether
   the top-1 token agrees wherever transformers_D's top-1 margin is more than twice the per-logit tolerance (a
   smaller margin may flip within it).

`check_swarm_logits` does the three. The tolerance, measured (bench/RESULTS.md, "Per-token logits"): in bfloat16 and
float16, the worst position's relative error must be at most YARDSTICK_MULTIPLE (2) x the yardstick, the worst
relative error of transformers_D against transformers_float32 on the same sequence: D's own rounding, which grows with
the model's depth and width (bfloat16: 1.1e-2 on a 6-layer tiny model, 9.4e-2 on SmolLM2-135M's 30 layers; the swarm
measured 0.76-1.12x of it in bfloat16, 0.87-1.01x in float16), so a fixed figure would be either loose for one or
too tight for the other. The per-logit tolerance at a position is the same multiple of the yardstick's largest
|difference| there. In float32 (no yardstick) the limit is FLOAT32_TOLERANCE (measured: 3e-7 tiny, 6e-6 SmolLM2),
per logit that times the position's largest |logit|.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmclient.config import ClientConfig
from swarmclient.generation import prefill_positions
from swarmclient.model import DistributedModelForCausalLM

# the worst position's ||swarm - transformers_D|| / ||transformers_D|| may be this multiple of the worst
# ||transformers_D - transformers_float32|| / ||transformers_float32|| (bfloat16, float16); float32's is fixed
YARDSTICK_MULTIPLE, FLOAT32_TOLERANCE = 2.0, 1e-4


@dataclass(frozen=True)
class TeacherForced:
    """A token sequence (prompts + a greedy continuation) and transformers' logits of it."""

    input_ids: torch.Tensor        # [B, P + N], left-padded prompts then N continuation tokens
    attention_mask: torch.Tensor   # [B, P + N]
    prompt_length: int             # P
    dtype: torch.dtype             # D: what `logits` were computed in
    logits: torch.Tensor           # [B, P + N, V] float32: transformers in D
    float32_logits: torch.Tensor | None  # the same in float32 (None when D is float32)


@dataclass(frozen=True)
class StepError:
    """One step's figures: 0 is the prefill (its real prompt positions), k the k-th decode step."""

    step: int
    max_abs: float
    relative: float       # the worst row's ||got - want|| / ||want||
    top1_checked: int     # positions whose reference margin is big enough to decide the top-1
    top1_agreed: int
    yardstick: float | None = None  # the same relative error of transformers_D against transformers_float32


@dataclass(frozen=True)
class LogitComparison:
    """Per-step errors of the swarm's logits against transformers' in the same dtype, and the verdict."""

    dtype: str
    tolerance: float  # the most the worst position's relative error may be
    steps: list[StepError] = field(default_factory=list)

    @property
    def max_abs(self) -> float:
        return max(s.max_abs for s in self.steps)

    @property
    def relative(self) -> float:
        return max(s.relative for s in self.steps)

    @property
    def yardstick(self) -> float | None:
        values = [s.yardstick for s in self.steps if s.yardstick is not None]
        return max(values) if values else None

    @property
    def top1(self) -> tuple[int, int]:
        """(agreed, checked) over every step."""
        return sum(s.top1_agreed for s in self.steps), sum(s.top1_checked for s in self.steps)

    @property
    def ok(self) -> bool:
        agreed, checked = self.top1
        return self.relative <= self.tolerance and agreed == checked

    def summary(self) -> str:
        """One line: the verdict and the worst figures."""
        agreed, checked = self.top1
        yardstick = "" if self.yardstick is None else f"; transformers {self.dtype} vs float32 {self.yardstick:.2e}"
        return (f"{'within' if self.ok else 'OUTSIDE'} tolerance: worst relative error {self.relative:.2e} "
                f"(limit {self.tolerance:.2e}), max |diff| {self.max_abs:.3g}, top-1 agrees at {agreed}/{checked} "
                f"decided positions{yardstick}")

    def per_step(self) -> str:
        """The worst relative error at each step, prefill first: 'prefill 1.2e-02, 1 9.8e-03, ...'."""
        return ", ".join(f"{'prefill' if s.step == 0 else s.step} {s.relative:.1e}" for s in self.steps)


def teacher_forced_reference(model_dir: str | os.PathLike[str], input_ids: torch.Tensor,
                             attention_mask: torch.Tensor, dtype: torch.dtype, *, new_tokens: int = 8,
                             continuation: torch.Tensor | None = None,
                             continuation_dtype: torch.dtype = torch.float32, device: str = "cpu") -> TeacherForced:
    """transformers' logits in `dtype` and in float32 of the prompts followed by `continuation` [B, N] (default: its
    greedy continuation of `new_tokens`, in `continuation_dtype`). One model in memory at a time."""
    if continuation is None:
        continuation = greedy_continuation(model_dir, input_ids, attention_mask, new_tokens, continuation_dtype, device)
    sequence = torch.cat([input_ids, continuation], dim=1)
    mask = torch.cat([attention_mask, torch.ones_like(continuation, dtype=attention_mask.dtype)], dim=1)
    logits = {each: forward_logits(model_dir, sequence, mask, each, device)
              for each in dict.fromkeys([dtype, torch.float32])}
    return TeacherForced(sequence, mask, input_ids.shape[1], dtype, logits[dtype],
                         None if dtype == torch.float32 else logits[torch.float32])


@torch.inference_mode()
def greedy_continuation(model_dir: str | os.PathLike[str], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        new_tokens: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """transformers' greedy generate in `dtype`: the `new_tokens` new tokens [B, N] (no early stop at EOS)."""
    model = load_local(model_dir, dtype, device)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[:, input_ids.shape[1]:].cpu()  # type: ignore[no-any-return]


@torch.inference_mode()
def forward_logits(model_dir: str | os.PathLike[str], sequence: torch.Tensor, mask: torch.Tensor,
                   dtype: torch.dtype, device: str) -> torch.Tensor:
    """transformers' whole-sequence forward in `dtype` (left-padded: positions from the mask): logits, float32."""
    model = load_local(model_dir, dtype, device)
    out = model(input_ids=sequence.to(device), attention_mask=mask.to(device),
                position_ids=prefill_positions(mask).to(device))
    return out.logits.float().cpu()  # type: ignore[no-any-return]


def load_local(model_dir: str | os.PathLike[str], dtype: torch.dtype, device: str) -> Any:
    """transformers' model of `model_dir` in `dtype` on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def swarm_logits(model: DistributedModelForCausalLM, forced: TeacherForced) -> torch.Tensor:
    """The logits [B, P + N, V] (float32) of `forced`'s sequence through the swarm: one inference session, a prefill
    of the prompts, then one decode step per continuation token (as generation runs), the head in `model`'s dtype."""
    ids, full_mask, prompt = forced.input_ids, forced.attention_mask, forced.prompt_length
    head = model.head
    with model.inference_session(batch_size=ids.shape[0], max_length=ids.shape[1]) as session:
        mask = full_mask[:, :prompt]
        positions = prefill_positions(mask)
        outputs = [head.logits(session.step(head.embed(ids[:, :prompt]), mask, positions))]
        for index in range(prompt, ids.shape[1]):
            mask, positions = full_mask[:, :index + 1], positions[:, -1:] + 1
            outputs.append(head.logits(session.step(head.embed(ids[:, index:index + 1]), mask, positions)))
    return torch.cat(outputs, dim=1)


def compare_logits(got: torch.Tensor, forced: TeacherForced, tolerance: float | None = None) -> LogitComparison:
    """Per-step errors of `got` [B, P + N, V] against `forced.logits`, and the verdict (the module docstring says how
    the tolerance is set when none is given; a given one also sets the per-logit one: it times the largest |logit|)."""
    want, real, yard = forced.logits, forced.attention_mask.bool(), forced.float32_logits
    if tolerance is None and yard is not None:
        tolerance = YARDSTICK_MULTIPLE * float(relative_errors(want[real], yard[real]).max())
        per_logit = YARDSTICK_MULTIPLE * (want - yard).abs().amax(dim=-1)  # [B, T]
    else:
        tolerance = FLOAT32_TOLERANCE if tolerance is None else tolerance
        per_logit = tolerance * want.abs().amax(dim=-1)
    prompt = forced.prompt_length
    steps = [slice(0, prompt)] + [slice(i, i + 1) for i in range(prompt, want.shape[1])]
    return LogitComparison(str(forced.dtype).removeprefix("torch."), tolerance, [
        step_error(index, got[:, part][real[:, part]], want[:, part][real[:, part]], 2 * per_logit[:, part][real[:, part]],
                   None if yard is None else yard[:, part][real[:, part]])
        for index, part in enumerate(steps)])


def relative_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """||got - want|| / ||want|| of each position of [positions, V] logits."""
    return (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12)


def step_error(index: int, got: torch.Tensor, want: torch.Tensor, margin: torch.Tensor,
               float32: torch.Tensor | None) -> StepError:
    """One step's StepError from its real positions' logits [positions, V] and top-1 margins [positions]."""
    top2 = want.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > margin
    agreed = (got.argmax(-1) == want.argmax(-1)) & decided
    return StepError(index, worst((got - want).abs().amax(dim=-1)), worst(relative_errors(got, want)),
                     int(decided.sum()), int(agreed.sum()),
                     None if float32 is None else worst(relative_errors(want, float32)))


def worst(values: torch.Tensor) -> float:
    """The largest of `values` (0 for none); a NaN is infinitely far (no match)."""
    value = float(values.max()) if values.numel() else 0.0
    return value if value == value else float("inf")


def check_swarm_logits(model_dir: str | os.PathLike[str], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       initial_peers: Sequence[str], dtype: torch.dtype, *, new_tokens: int = 8,
                       tolerance: float | None = None, device: str = "cpu",
                       continuation_dtype: torch.dtype = torch.float32) -> LogitComparison:
    """Teacher-forced per-token logits of the swarm at `initial_peers` (servers in `dtype`) against transformers in
    `dtype` on `device`, for the prompts and a greedy continuation of `new_tokens` (module docstring)."""
    forced = teacher_forced_reference(model_dir, input_ids, attention_mask, dtype, new_tokens=new_tokens,
                                      continuation_dtype=continuation_dtype, device=device)
    config = ClientConfig(device=device, head_dtype=str(dtype).removeprefix("torch."))
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=initial_peers, config=config) as model:
        got = swarm_logits(model, forced)
    return compare_logits(got, forced, tolerance)
