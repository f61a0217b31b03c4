"""The two test tiers, a pytest plugin: tests marked `swarm` start processes; the rest must not.

`pytest -m "not swarm"` is the fast tier. A test is marked `swarm` when it uses a fixture declared with
`process_fixture` (marked here at collection), or explicitly with `@pytest.mark.swarm` when its own body starts a
process. While any other test sets up or runs, every way of starting a child process raises, so a missing
marker fails loudly instead of slowing the fast tier down.
"""
from __future__ import annotations

import asyncio.subprocess
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])

# names of the fixtures that start processes; a test using any of them (even indirectly) is marked swarm
PROCESS_FIXTURES: set[str] = set()


def process_fixture(**options: Any) -> Callable[[F], F]:
    """`pytest.fixture(**options)` for a fixture that starts processes: every test using it is marked swarm."""
    def declare(function: F) -> F:
        PROCESS_FIXTURES.add(options.get("name", function.__name__))
        return pytest.fixture(**options)(function)  # type: ignore[no-any-return]
    return declare


def starts_processes(item: pytest.Item) -> bool:
    """Whether the test uses a process fixture, directly or through another fixture."""
    return any(name in PROCESS_FIXTURES for name in getattr(item, "fixturenames", ()))


# every way a test's code starts a child: Popen._execute_child is under subprocess.run and os.popen; start() under
# every multiprocessing process; asyncio's functions are what hivemind spawns p2pd with (uvloop bypasses Popen)
SPAWNERS: list[tuple[Any, str]] = [
    (subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"),
    (asyncio, "create_subprocess_exec"), (asyncio, "create_subprocess_shell"),
    (asyncio.subprocess, "create_subprocess_exec"), (asyncio.subprocess, "create_subprocess_shell"),
    (os, "fork"), (os, "posix_spawn"), (os, "system"),
]


class ProcessInFastTier(RuntimeError):
    """A test without the swarm marker tried to start a process."""


@contextmanager
def no_processes(nodeid: str) -> Iterator[None]:
    """Make starting a child process raise ProcessInFastTier for the duration (setup or call of one test).

    The error is raised again on the way out, so that code under test that catches it (a CLI turning errors into
    exit codes) cannot hide it.
    """
    refused: list[ProcessInFastTier] = []

    def refuse(*args: object, **kwargs: object) -> None:
        refused.append(ProcessInFastTier(f"{nodeid} starts a process but is not marked swarm: mark it "
                                         "@pytest.mark.swarm, or declare the fixture that starts it with "
                                         "process_fixture"))
        raise refused[-1]

    saved = [(owner, name, getattr(owner, name)) for owner, name in SPAWNERS]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        if refused:
            raise refused[0]  # replaces whatever the code under test made of it


@pytest.hookimpl(tryfirst=True)  # before -m deselects: it must see the markers added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark swarm every test that uses a process fixture."""
    for item in items:
        if starts_processes(item):
            item.add_marker(pytest.mark.swarm)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Fixtures of a test not marked swarm may not start processes (module-scoped ones included)."""
    if item.get_closest_marker("swarm"):
        return (yield)
    with no_processes(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test not marked swarm may not start processes."""
    if item.get_closest_marker("swarm"):
        return (yield)
    with no_processes(item.nodeid):
        return (yield)
