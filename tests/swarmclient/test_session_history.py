"""An InferenceSession's history: the step records a replay sends again (no swarm needed)."""
from __future__ import annotations

import torch

from swarmclient.session import StepRecord, step_masks


def masks_of_a_generation() -> list[tuple[torch.Tensor, list[int] | None]]:
    """(mask, keep_rows) of each step, as `generate_tokens` sends them: row 1 leaves before the fourth step."""
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    sent: list[tuple[torch.Tensor, list[int] | None]] = [(mask, None)]
    for step in range(1, 6):
        keep_rows = [0, 2] if step == 3 else None
        if keep_rows is not None:
            mask = mask[keep_rows]
        mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.long)], dim=1)
        sent.append((mask, keep_rows))
    return sent


def test_the_records_rebuild_every_steps_mask_across_a_row_drop() -> None:
    history, past = [], 0
    for mask, keep_rows in masks_of_a_generation():
        history.append(StepRecord.of({}, mask, mask.cumsum(1)[:, past:] - 1, keep_rows, past=past))
        past = mask.shape[1]
    rebuilt = list(step_masks(history))
    assert len(rebuilt) == 6
    for (mask, _), again in zip(masks_of_a_generation(), rebuilt, strict=True):
        assert torch.equal(mask, again)
    assert [record.length for record in history] == [4, 5, 6, 7, 8, 9]
    assert [record.keep_rows for record in history] == [None, None, None, (0, 2), None, None]


def test_a_decode_step_keeps_only_the_mask_column_it_added() -> None:
    # the history stays linear in the length: a decode step holds one column, not the whole mask
    (prefill, _), (decode, _) = masks_of_a_generation()[:2]
    first = StepRecord.of({}, prefill, prefill, None, past=0)
    second = StepRecord.of({}, decode, decode[:, -1:], None, past=4)
    assert first.mask_columns.shape == (3, 4) and second.mask_columns.shape == (3, 1)
    assert second.mask_columns.untyped_storage().data_ptr() != decode.untyped_storage().data_ptr()
