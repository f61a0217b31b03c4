"""What a user installs: a non-editable `pip install .` into a fresh virtual environment, used from a folder outside
the repository, runs the demo; and the Python versions pyproject.toml claims are the ones docs/getting-started.md
says were tested.

The fresh environment is made with the interpreter running the tests and sees this environment's third-party
packages through a `.pth` file, and the project is installed with `--no-deps --no-build-isolation --no-index`:
nothing is downloaded, so what is tested is our packaging (modules, package data, the migrations, the `swarmbatch`
entry point), not PyPI. The full matrix (a real `pip install` per Python version) is the table in the docs.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SHIPPED = ("swarmnet", "swarmclient", "servers", "jobs", "modelprep", "migrations", "launch", "commands")
NOT_SHIPPED = {".git", ".venv", "build", "site", "data", "tests", "bench", "swarmbatch.egg-info"}  # at the top
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
DEMO_TIMEOUT_S = 900


# ---- the supported Python versions: pyproject.toml agrees with the tested matrix ------------------------------------

def matrix_versions() -> list[tuple[int, int]]:
    """The versions of the docs' install matrix whose install and demo both passed: `| 3.12 | ok | ok | ...`."""
    rows = re.findall(r"^\| (3\.\d+) \| (\w+) \| (\w+) \|", GETTING_STARTED.read_text(), flags=re.M)
    assert rows, f"{GETTING_STARTED.name} has no install matrix ('| 3.X | ok | ok | ...' rows)"
    return sorted(tuple(map(int, v.split("."))) for v, install, demo in rows if (install, demo) == ("ok", "ok"))


def test_requires_python_is_exactly_the_contiguous_range_the_install_matrix_passed() -> None:
    versions = matrix_versions()
    low, high = versions[0][1], versions[-1][1]
    assert versions == [(3, minor) for minor in range(low, high + 1)], f"a gap in the tested versions: {versions}"
    spec = SpecifierSet(PYPROJECT["project"]["requires-python"])
    allowed = [minor for minor in range(low - 1, high + 2) if f"3.{minor}.0" in spec]
    assert allowed == list(range(low, high + 1)), f"requires-python {spec} is not the tested 3.{low} to 3.{high}"


def test_the_classifiers_name_each_tested_python_version_and_no_other() -> None:
    prefix = "Programming Language :: Python :: 3."
    claimed = {c.removeprefix(prefix) for c in PYPROJECT["project"]["classifiers"] if re.fullmatch(r".*3\.\d+", c)}
    assert claimed == {str(minor) for _, minor in matrix_versions()}


def test_the_image_and_the_tools_use_a_tested_python() -> None:
    major, minor = matrix_versions()[0]
    image = re.search(r"^FROM python:(3\.\d+)-slim$", (ROOT / "Dockerfile").read_text(), flags=re.M)
    assert image and tuple(map(int, image.group(1).split("."))) in matrix_versions()
    # type checking and lint rules for the oldest version, so no newer syntax or API slips in
    assert PYPROJECT["tool"]["mypy"]["python_version"] == f"{major}.{minor}"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py{major}{minor}"


# ---- a non-editable install outside the repository runs the demo ----------------------------------------------------

def not_source(folder: str, names: list[str]) -> set[str]:
    """shutil.copytree's ignore: build outputs, caches and the top level's folders that are not shipped."""
    top = NOT_SHIPPED if Path(folder) == ROOT else set()
    return {n for n in names if n in top or n == "__pycache__" or n.endswith("_cache")}


def run(args: list[str | Path], *, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    """Run a command to completion; its stdout, or a failure with its output."""
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def user_env(home: Path) -> dict[str, str]:
    """A user's shell: no PYTHONPATH, no SWARMBATCH_* setting of the test run, the store under `home`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("SWARMBATCH_")}
    return {**env, "SWARMBATCH_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1", "PIP_NO_INDEX": "1"}


def fresh_venv(where: Path, env: dict[str, str]) -> Path:
    """A venv of this interpreter, without pip, that sees this environment's packages (a .pth file); its purelib."""
    run([sys.executable, "-m", "venv", "--without-pip", where], cwd=where.parent, env=env)
    purelib = Path(run([where / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       cwd=where.parent, env=env).strip())
    (purelib / "_outer_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return purelib


def decoy_folder(folder: Path) -> Path:
    """A user's working folder whose own cli.py and jobs/ would break us if imported."""
    (folder / "jobs").mkdir(parents=True)
    (folder / "cli.py").write_text("raise SystemExit('the decoy cli.py in the working folder was imported')\n")
    (folder / "jobs" / "__init__.py").write_text("raise ImportError('the decoy jobs/ in the working folder was imported')\n")
    return folder


def shipped_files() -> list[Path]:
    """Every file of the shipped packages in the repository, relative to it (what the install must hold)."""
    return sorted(p.relative_to(ROOT) for package in SHIPPED for p in (ROOT / package).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def demo(venv: Path, *, cwd: Path, env: dict[str, str]) -> str:
    """`swarmbatch demo` to completion; every process of its session killed, by group, if it outlives the timeout."""
    proc = subprocess.Popen([venv / "bin" / "swarmbatch", "demo"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"swarmbatch demo ran over {DEMO_TIMEOUT_S} s:\n{out[-6000:]}")
    assert proc.returncode == 0, f"swarmbatch demo exited {proc.returncode}:\n{out[-6000:]}"
    return out


@pytest.mark.slow  # the real SmolLM2 (the session's converted copy, linked into the new home)
@pytest.mark.swarm
@pytest.mark.timeout(DEMO_TIMEOUT_S + 300)
def test_a_non_editable_install_in_a_fresh_venv_outside_the_repository_runs_the_demo(tmp_path: Path,
                                                                                      smollm2_model: Path) -> None:
    # Given a copy of the sources (a build writes build/ and *.egg-info beside them), a fresh venv and a user's folder
    env = user_env(tmp_path / "home")
    source = shutil.copytree(ROOT, tmp_path / "source", ignore=not_source)
    venv = tmp_path / "venv"
    purelib = fresh_venv(venv, env)
    folder = decoy_folder(tmp_path / "work")
    # When the project is installed from it, not editable, with nothing downloaded
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         source], cwd=folder, env=env)
    # Then every file of our packages is in the venv (modules, migrations, package data) and is what Python imports
    missing = [str(f) for f in shipped_files() if not (purelib / f).is_file()]
    assert not missing, f"not installed: {missing}"
    imported = run([venv / "bin" / "python", "-P", "-c", "import cli, jobs, launch.demo as d, migrations as m; "
                    "print(cli.__file__, jobs.__file__, d.__file__, m.__file__, sep='\\n')"], cwd=folder, env=env)
    assert all(Path(f).is_relative_to(purelib) for f in imported.split()), imported
    assert run([venv / "bin" / "swarmbatch", "--version"], cwd=folder, env=env).strip() == \
        f"swarmbatch {PYPROJECT['project']['version']}"
    # And the entry point runs the demo to the end (the model prepared once for the session, linked into the home)
    (tmp_path / "home" / "models").mkdir(parents=True)
    (tmp_path / "home" / "models" / smollm2_model.name).symlink_to(smollm2_model)
    out = demo(venv, cwd=folder, env=env)
    assert "Job completed" in out and "All processes stopped" in out, out[-4000:]
    assert all(f"{doc.name}:" in out for doc in (ROOT / "launch" / "sample_documents").glob("*.txt")), out[-4000:]
