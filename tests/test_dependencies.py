"""Every third-party module the shipped code imports comes from a distribution that pyproject.toml declares.

A module that is only there because the test extra or another package pulled it in works in the repository's
virtual environment and fails with ModuleNotFoundError in a user's `pip install .` (cryptography, base58 and
multihash once did). The imports are read with `ast` (test_layers' walker: every import, wherever it is written);
the installed metadata says which distribution provides each top-level module.
"""
from __future__ import annotations

import re
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions

from test_layers import ROOT, Edge, edges, imports_in

# what ships (pyproject's packages.find and py-modules); tests, bench and scripts are not installed
SHIPPED = ("swarmnet", "swarmclient", "servers", "jobs", "modelprep", "migrations", "launch", "commands")
FIRST_PARTY = {*SHIPPED, "cli"}
RUNTIME_EXTRAS = ("quant",)  # imported only where the extra is installed (bitsandbytes, for --quant)


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """'celery[redis]>=5.5,<6' -> 'celery'."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return normalized(match.group(1))


@cache
def declared() -> frozenset[str]:
    """The distributions a runtime install gets by name: [project] dependencies and the runtime extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for extra in RUNTIME_EXTRAS
                                                for r in project["optional-dependencies"][extra])]
    return frozenset(requirement_name(r) for r in requirements)


def shipped_imports() -> list[Edge]:
    """Every import written in the shipped packages and in cli.py."""
    found = [edge for package in SHIPPED for edge in edges(package)]
    return found + list(imports_in((ROOT / "cli.py").read_text(), filename="cli.py", module="cli"))


def undeclared(imports: list[Edge]) -> list[str]:
    """'file:line imports X (from distribution D, not in pyproject's dependencies)' for each offending import."""
    providers = packages_distributions()
    bad = []
    for edge in imports:
        top = edge.top
        if not top or top in FIRST_PARTY or top in sys.stdlib_module_names or top == "__future__":
            continue
        dists = {normalized(d) for d in providers.get(top, [])}
        if not dists & declared():
            bad.append(f"{edge} (from {', '.join(sorted(dists)) or 'no installed distribution'}, "
                       "not in pyproject's dependencies)")
    return bad


def test_every_third_party_import_of_the_shipped_code_is_a_declared_dependency() -> None:
    imports = shipped_imports()
    assert any(edge.top == "hivemind" for edge in imports)  # the walker read the packages
    bad = undeclared(imports)
    assert not bad, "declare these in [project] dependencies:\n  " + "\n  ".join(bad)


def test_the_check_catches_an_import_that_only_a_test_dependency_provides() -> None:
    imports = list(imports_in("import pytest\nfrom multihash import Multihash\nimport json\nimport jobs.store\n",
                              filename="x.py", module="jobs.x"))
    bad = undeclared(imports)
    assert len(bad) == 1 and "imports pytest" in bad[0]  # multihash is py-multihash, declared; json is stdlib
