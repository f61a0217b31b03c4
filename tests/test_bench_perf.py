"""bench/perf.py's arithmetic: the push floor, the verdicts of its rows and the table, from the JSON its scripts write.

The scripts themselves are benchmarks (minutes, real servers) and are not run here; these inputs have the shapes
bench/throughput.py --out, bench/swarm.py --out and bench/wan.py --out write.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_perf", ROOT / "bench" / "perf.py")
assert _spec is not None and _spec.loader is not None
perf = sys.modules["bench_perf"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(perf)


def wan_run(batch: int, push: bool, ms: float, ping: float = 50.5, ring: bool = False) -> dict[str, Any]:
    return {"model": "tiny", "servers": 2, "rtt": 50, "ping_ms": ping, "push": push, "batch": batch, "hops": 2,
            "ms_per_token": ms, "ring": ring}


def test_the_push_floor_is_half_an_rtt_per_link_of_hops_plus_one() -> None:
    assert perf.push_floor(2, 50.5) == 75.75  # issue 30's 75.8 ms floor for 2 servers at a 50.5 ms ping
    assert perf.push_floor(3, 50.0) == 100.0


def test_wan_rows_set_the_median_push_on_run_against_the_floor() -> None:
    runs = [wan_run(1, True, ms) for ms in (95.0, 91.3, 80.0)] + [wan_run(1, False, 110.0)] + \
           [wan_run(8, True, ms) for ms in (82.0, 83.0, 81.0)]
    b1, b8 = perf.wan_rows(runs)
    assert b1.target == "WAN 2 servers, 50 ms RTT, b1" and b1.measured.startswith("**1.21x** (91.3 ms/token on a 75.8 ms floor")
    assert "push off 110.0" in b1.measured and b1.met is False
    assert b8.measured.startswith("**1.08x**") and b8.met is True


def test_wan_rows_take_the_ring_where_it_ran_with_push_alone_and_off_beside_it() -> None:
    runs = [wan_run(1, True, ms) for ms in (95.0, 91.3)] + [wan_run(1, False, 110.0)] + \
           [wan_run(1, True, ms, ring=True) for ms in (58.0, 57.0, 60.0)]
    [b1] = perf.wan_rows(runs)
    assert b1.measured.startswith("**0.77x** (the ring, 58.0 ms/token on a 75.8 ms floor")
    assert "push without the ring 93.2; push off 110.0" in b1.measured and b1.met is True


def test_the_cost_of_checks_is_the_median_paired_rep_met_only_under_three_percent_with_identical_texts() -> None:
    data = {"settings": {"reps": 3}, "same_texts": True, "paired": {"verify 0.02": [0.99, 0.975, 0.90]},
            "best": {"no checks": {"tokens_per_s": 100.0}, "verify 0.02": {"tokens_per_s": 99.0}},
            "checks": {"no checks": {"verified": 0, "mismatches": 0, "unverified": 0},
                       "verify 0.02": {"verified": 7, "mismatches": 0, "unverified": 0}}}
    [row] = perf.verify_rows(data)
    assert row.measured.startswith("**2.5 %** (median of 3 paired reps: 0.990, 0.975, 0.900; best runs 99.0 vs no "
                                   "checks 100.0 tok/s, 1.0 %") and "7 hop steps verified" in row.measured
    assert row.met is True
    assert perf.verify_rows({**data, "same_texts": False})[0].met is False
    slower = {**data, "paired": {"verify 0.02": [0.99, 0.96, 0.90]}}  # the best runs alone would pass it
    assert perf.verify_rows(slower)[0].met is False


def test_loopback_rows_take_the_paired_median_per_batch() -> None:
    results = [{"config": "local", "batch": 1, "tokens_per_s": 13.0},
               {"config": "swarm-2", "batch": 1, "tokens_per_s": 13.2, "paired_ratio": 1.01,
                "paired_ratios": [0.95, 1.01, 1.04]},
               {"config": "local", "batch": 8, "tokens_per_s": 50.0},
               {"config": "swarm-2", "batch": 8, "tokens_per_s": 46.0, "paired_ratio": 0.93,
                "paired_ratios": [0.93, 0.90, 0.96]}]
    b1, b8 = perf.loopback_rows({"results": results})
    assert b1.measured.startswith("**1.01x** paired (reps 0.95–1.04, 13.2 vs local 13.0") and b1.met is True
    assert b8.target.endswith("b8") and b8.met is False


def test_the_table_marks_unmeasured_rows_with_a_dash() -> None:
    table = perf.markdown_table([perf.Row("a", "**0.95x**", ">= 0.9x", True), perf.Row("b", "0.5x", ">= 0.9x", False),
                                 perf.Row("d", "not run: no root", "<= 1.1x", None)])
    assert table.splitlines()[2:] == ["| a | **0.95x** | >= 0.9x | yes |", "| b | 0.5x | >= 0.9x | **NO** |",
                                      "| d | not run: no root | <= 1.1x | — |"]
