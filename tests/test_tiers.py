"""The fast tier's guard: a test that starts a process without the swarm marker fails, whatever it catches."""
from __future__ import annotations

import pytest

SUITE = '''
import asyncio
import multiprocessing
import os
import subprocess

import pytest
import uvloop

from tiers import process_fixture


@process_fixture()
def tiers_selftest_children():
    yield  # a real one would start processes; declaring it is what marks its users


def test_subprocess():
    subprocess.run(["true"])


def test_a_caught_refusal_still_fails():
    try:
        subprocess.run(["true"])
    except Exception:
        pass


def test_multiprocessing():
    multiprocessing.get_context("fork").Process(target=print).start()


async def spawn_like_hivemind():
    await asyncio.subprocess.create_subprocess_exec("true")  # how hivemind starts p2pd


def test_asyncio_subprocess_on_uvloop():
    uvloop.run(spawn_like_hivemind())


def test_system():
    os.system("true")


@pytest.fixture(scope="module")
def module_child():
    subprocess.run(["true"])


def test_a_module_fixture_that_starts_a_process(module_child):
    pass


def test_using_a_process_fixture(tiers_selftest_children):
    pass


@pytest.mark.swarm
def test_marked():
    pass


def test_no_process():
    assert subprocess.list2cmdline(["a", "b"]) == "a b"
'''


def test_an_unmarked_test_that_starts_a_process_fails_and_marked_ones_leave_the_fast_tier(
        pytester: pytest.Pytester) -> None:
    pytester.makeini('[pytest]\nmarkers =\n    swarm: starts processes\n')
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_inprocess("-p", "tiers", "-m", "not swarm", "-p", "no:cacheprovider")

    result.assert_outcomes(passed=1, failed=5, errors=1, deselected=2)
    refused = {report.nodeid.rsplit("::", 1)[1] for report in result.reprec.getfailures()}  # type: ignore[attr-defined]
    assert refused == {"test_subprocess", "test_a_caught_refusal_still_fails", "test_multiprocessing",
                       "test_asyncio_subprocess_on_uvloop", "test_system", "test_a_module_fixture_that_starts_a_process"}
    assert result.stdout.str().count("is not marked swarm: mark it @pytest.mark.swarm") >= len(refused)
