"""scripts/demo.sh and scripts/test.sh install what each needs: the demo the runtime dependencies alone (what a user
gets from `pip install -e .`), the tests the test extra too; both put the CPU torch in first.

They run for real in a copy of the scripts, against a stand-in `.venv/bin/python` (and `swarmbatch`) that only
writes down how it was called: pip's own work is not under test, what the scripts ask of it is.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAND_IN = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$(dirname "$0")/../../calls.log"
[ "$1" = "-c" ] && exit 1  # 'import torch' fails: torch is not installed yet
[ -n "${FAIL_CALL:-}" ] && [ "$*" = "$FAIL_CALL" ] && exit 3  # the call a test makes fail (a failing test phase)
exit 0
"""
PYTEST = "python -m pytest"
PARALLEL_PHASE = f"{PYTEST} -n auto --dist loadfile -m not alone"
ALONE_PHASE = f"{PYTEST} -m alone"


def calls_of(script: str, tmp_path: Path, *args: str, fail_call: str = "", returncode: int = 0) -> list[str]:
    """Run scripts/SCRIPT in a copy of the repository's scripts, with stand-ins in .venv/bin; what they were asked."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts", ignore=shutil.ignore_patterns("standin-images"))
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "swarmbatch", "ruff"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / script), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "FAIL_CALL": fail_call, "SWARMBATCH_TEST_WORKERS": "auto"})
    assert done.returncode == returncode, done.stderr
    return (tmp_path / "calls.log").read_text().splitlines()


@pytest.mark.swarm  # runs bash
def test_the_demo_installs_the_cpu_torch_then_the_project_without_extras(tmp_path: Path) -> None:
    assert calls_of("demo.sh", tmp_path) == ["python -c import torch", "python -m pip install -q torch==2.13.0",
                                             "python -m pip install -q -e .", "swarmbatch demo"]


@pytest.mark.swarm  # runs bash
def test_the_test_script_installs_the_test_extra(tmp_path: Path) -> None:
    calls = calls_of("test.sh", tmp_path)
    assert calls[:3] == ["python -c import torch", "python -m pip install -q torch==2.13.0",
                         "python -m pip install -q -e .[test]"]


@pytest.mark.swarm  # runs bash
def test_the_whole_suite_runs_on_every_core_then_the_alone_tests_one_at_a_time(tmp_path: Path) -> None:
    calls = calls_of("test.sh", tmp_path)
    assert calls[-2:] == [PARALLEL_PHASE, ALONE_PHASE]


@pytest.mark.swarm  # runs bash
@pytest.mark.parametrize("failing", [PARALLEL_PHASE, ALONE_PHASE], ids=["parallel", "alone"])
def test_a_failing_phase_fails_the_script_and_both_phases_run(tmp_path: Path, failing: str) -> None:
    calls = calls_of("test.sh", tmp_path, fail_call=failing[len("python "):], returncode=3)
    assert calls[-2:] == [PARALLEL_PHASE, ALONE_PHASE]


@pytest.mark.swarm  # runs bash
def test_arguments_go_to_one_pytest_run(tmp_path: Path) -> None:
    calls = calls_of("test.sh", tmp_path, "-m", "not swarm")
    assert calls[-1] == f"{PYTEST} -m not swarm" and PARALLEL_PHASE not in calls
