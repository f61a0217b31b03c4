"""The layers (docs/contributing.md, "Layers"), checked on the source: which package may import which.

`cli.py` and the composition roots (`launch/`, `commands/`) sit above every layer. Bottom up: `swarmnet` (the wire
contract, peers, DHT records, membership, discovery) is shared; `servers` and `swarmclient` build on it and know
nothing of each other; `jobs` reaches the block servers only over the swarm; `modelprep` is a leaf. Every
import counts, wherever it is written: module level, inside a function, under `if TYPE_CHECKING:`, or a
constant `importlib.import_module(...)`.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABOVE_THE_LAYERS = ("launch", "commands", "cli")  # composition roots: they may import anything, nothing imports them
FORBIDDEN = {  # package -> the top-level packages and modules it must never import
    "swarmnet": ("swarmclient", "servers", "jobs", *ABOVE_THE_LAYERS),
    "swarmclient": ("servers", "jobs", *ABOVE_THE_LAYERS),
    "servers": ("swarmclient", "jobs", *ABOVE_THE_LAYERS),
    "jobs": ("servers", *ABOVE_THE_LAYERS),
    "modelprep": ("swarmclient", "servers", "jobs", *ABOVE_THE_LAYERS),
}
# inside jobs: the core (every module directly in jobs/ but the assembly) is a leaf under the features and the API;
# the assembly, which wires them into a process's Runtime, sits above them all and nothing in jobs imports it; above
# it, jobs/celery.py is Celery's own entry point (`celery -A jobs`), and nothing imports that either
JOBS_FEATURES = ("jobs.worker", "jobs.summaries", "jobs.api")
JOBS_ASSEMBLY = "jobs.assembly"
JOBS_ENTRY_POINTS = ("jobs/assembly.py", "jobs/celery.py")
# launch/ starts processes for commands/; it never imports a command
ROOT_RULES = {"launch": ("commands", "cli")}
# what the wire contract must load without: the client and the model code (transformers)
NOT_WIRE = ("swarmclient", "swarmnet.model_spec", "swarmnet.network", "transformers")


@dataclass(frozen=True)
class Edge:
    """One import statement: `source` (a path relative to the repository) imports module `target` at `line`."""

    source: str
    line: int
    target: str

    @property
    def top(self) -> str:
        """The imported top-level package or module."""
        return self.target.split(".")[0]

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    """'jobs/worker/tasks.py' -> 'jobs.worker.tasks'; a package's __init__.py is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(source: str, *, filename: str, module: str, is_package: bool = False) -> Iterator[Edge]:
    """Every module that `source` (the text of `module`) imports, with relative imports made absolute."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            yield from (Edge(filename, node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            target = ".".join(part for part in (base, node.module or "") if part)
            yield Edge(filename, node.lineno, target)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _is_import_call(node.func)):
            yield Edge(filename, node.lineno, node.args[0].value)


def _is_import_call(func: ast.expr) -> bool:
    """`importlib.import_module(...)`, `import_module(...)` or `__import__(...)`."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def edges(package: str) -> list[Edge]:
    """Every import written in the package's .py files."""
    found: list[Edge] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        found += imports_in(path.read_text(), filename=str(path.relative_to(ROOT)), module=module_name(path),
                            is_package=path.name == "__init__.py")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_its_layer_forbids(package: str) -> None:
    forbidden = FORBIDDEN[package]
    bad = [edge for edge in edges(package) if edge.top in forbidden]
    assert not bad, f"{package} must not import {', '.join(forbidden)}:\n  " + "\n  ".join(map(str, bad))


def is_under(target: str, packages: tuple[str, ...]) -> bool:
    """Whether module `target` is one of `packages` or inside one."""
    return any(target == package or target.startswith(package + ".") for package in packages)


def test_the_jobs_core_imports_no_feature_and_nothing_imports_the_assembly() -> None:
    jobs_edges = edges("jobs")
    core = [edge for edge in jobs_edges if edge.source.count("/") == 1 and edge.source not in JOBS_ENTRY_POINTS]
    bad = [edge for edge in core if is_under(edge.target, (*JOBS_FEATURES, JOBS_ASSEMBLY))]
    bad += [edge for edge in jobs_edges if edge.source not in JOBS_ENTRY_POINTS
            and is_under(edge.target, (JOBS_ASSEMBLY, "jobs.celery"))]
    assert not bad, "the jobs core must not import jobs.worker, jobs.summaries, jobs.api or jobs.assembly:\n  " + \
        "\n  ".join(map(str, bad))
    assert any(edge.source == "jobs/submission.py" for edge in core)  # the walker read the core


@pytest.mark.parametrize("package", sorted(ROOT_RULES))
def test_a_composition_root_imports_no_root_above_it(package: str) -> None:
    bad = [edge for edge in edges(package) if edge.top in ROOT_RULES[package]]
    assert not bad, f"{package} must not import {', '.join(ROOT_RULES[package])}:\n  " + "\n  ".join(map(str, bad))


def test_the_walker_sees_every_kind_of_import() -> None:
    source = '''
import servers.handler
from jobs import store
from . import sibling
from ..data import thing
if TYPE_CHECKING:
    from cli import app
def later():
    from launch.demo import run
    importlib.import_module("commands.serve")
'''
    found = {(edge.line, edge.target) for edge in imports_in(source, filename="x.py", module="pkg.sub.mod")}
    assert found == {(2, "servers.handler"), (3, "jobs"), (4, "pkg.sub"), (5, "pkg.data"), (7, "cli"),
                     (9, "launch.demo"), (10, "commands.serve")}


def test_the_walker_finds_the_allowed_edges_in_the_repository() -> None:
    # the layer tests above pass vacuously if the walker reads no file: it must see what we know is there
    tops = {package: {edge.top for edge in edges(package)} for package in FORBIDDEN}
    assert "swarmnet" in tops["servers"] and "swarmnet" in tops["swarmclient"]  # both import the wire contract
    assert "swarmclient" in tops["jobs"]     # workers generate through the client
    assert all(package in tops[package] for package in FORBIDDEN)  # every package imports its own modules


def loaded_after(code: str) -> list[str]:
    """sys.modules after running `code` in a fresh interpreter at the repository root."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    modules: list[str] = json.loads(done.stdout.splitlines()[-1])
    return modules


@pytest.mark.swarm  # a fresh interpreter
def test_the_wire_contract_imports_without_the_client_stack() -> None:
    loaded = loaded_after("import swarmnet.protocol, swarmnet.data_structures, swarmnet.errors")
    assert "swarmnet.protocol" in loaded and "swarmnet.data_structures" in loaded
    leaked = [name for name in loaded if name in NOT_WIRE or name.split(".")[0] in NOT_WIRE]
    assert not leaked, f"importing the wire contract loaded {leaked}"


@pytest.mark.swarm  # a fresh interpreter
def test_the_package_still_exports_the_model_class() -> None:
    loaded = loaded_after("from swarmclient import DistributedModelForCausalLM\n"
                          "assert DistributedModelForCausalLM.__module__ == 'swarmclient.model'")
    assert "swarmclient.model" in loaded
