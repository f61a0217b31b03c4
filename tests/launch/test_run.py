"""`swarmbatch run FILE`: a user's own batch file end to end on the embedded stack, started as a user starts it (a real
process on a real tiny model), from a working folder whose own `cli.py` and `jobs/` would break it if imported."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from jobs_support import wait_for

from commands.errors import ExitCode
from jobs.assembly import build_runtime
from jobs.backends import StoreBackend
from jobs.settings import Settings
from launch.processes import cli_command

SWARM_PROCESS = re.compile(r" -m cli (?:-v )?(?:dht|serve|worker)\b|p2pd")


class Run:
    """A `swarmbatch run` process; a thread records every descendant it has while it runs."""

    def __init__(self, args: list[str], *, cwd: Path, home: Path, logs: Path) -> None:
        env = {**os.environ, "SWARMBATCH_HOME": str(home), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        for name in ("SWARMBATCH_DATABASE_URL", "SWARMBATCH_BROKER_URL", "SWARMBATCH_API_URL"):
            env.pop(name, None)
        logs.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = logs / "run.out", logs / "run.err"
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            # Ctrl-C as in a terminal: SIGINT at its default even when pytest was started with it ignored (`cmd &`)
            self.proc = subprocess.Popen(cli_command("run", *args), cwd=cwd, env=env, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL,
                                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.descendants: set[int] = set()
        self.commands: dict[int, str] = {}  # each recorded descendant's command line, where it could be read
        self._watcher = threading.Thread(target=self._record, daemon=True)
        self._watcher.start()

    def _record(self) -> None:
        while self.proc.poll() is None:
            try:
                children = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for child in children:
                self.descendants.add(child.pid)
                try:
                    self.commands[child.pid] = " ".join(child.cmdline())  # the latest: a child may not have exec'd yet
                except psutil.Error:
                    pass
            time.sleep(0.1)

    def swarm_processes(self) -> list[str]:
        """The recorded descendants that were a DHT node, a block server, a worker or a p2pd daemon (a library's own
        short-lived helper, e.g. `file -b` that `platform.architecture()` runs when croniter is imported, is none)."""
        return [command for command in self.commands.values() if SWARM_PROCESS.search(command)]

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """Exit code, stdout and stderr once it exits (killed, by PID, if it outlives `timeout`)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._watcher.join(5)
        return code, self.out, self.err_path.read_text()

    def living_descendants(self) -> list[int]:
        """The recorded descendants still running (a zombie is not running)."""
        alive = []
        for pid in self.descendants:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def stop(self) -> None:
        """Teardown: kill by PID whatever is left of it (nothing, when the test passed)."""
        for pid in [self.proc.pid, *self.living_descendants()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def decoy_folder(tmp_path: Path) -> Path:
    """A working folder with a `cli.py` and a `jobs/` package of the user's own, which fail if imported."""
    folder = tmp_path / "work"
    (folder / "jobs").mkdir(parents=True)
    (folder / "cli.py").write_text("raise SystemExit('the decoy cli.py in the working folder was imported')\n")
    (folder / "jobs" / "__init__.py").write_text("raise ImportError('the decoy jobs/ in the working folder was imported')\n")
    return folder


def write_batch(path: Path, count: int, *, max_tokens: int, bad_line: bool = False) -> list[str]:
    """An OpenAI batch file of `count` chat lines naming gpt-4o-mini (and one line without messages); the good ids."""
    ids = [f"line-{i}" for i in range(count)]
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Count to {i}"}],
                       "max_tokens": max_tokens}} for i, cid in enumerate(ids)]
    if bad_line:
        lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "gpt-4o-mini"}})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ids


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def job_id_in(out: str) -> str:
    match = re.search(r"Job (batch_\w+)", out)
    assert match, out
    return match.group(1)


@pytest.mark.swarm
def test_run_writes_each_line_s_result_once_and_stops_every_process_it_started(tiny_model: Path,
                                                                                tmp_path: Path) -> None:
    # Given a batch file of six good lines and one bad one, in a folder with a decoy cli.py and jobs/
    folder = decoy_folder(tmp_path)
    ids = write_batch(folder / "in.jsonl", 6, max_tokens=8, bad_line=True)
    args, home = ["in.jsonl", "--model", str(tiny_model)], tmp_path / "home"

    # When it is run
    run = Run(args, cwd=folder, home=home, logs=tmp_path / "run1")
    try:
        code, out, err = run.wait(400)
    finally:
        run.stop()

    # Then every good line has its result once, beside the input, and the bad line is in the errors file
    assert code == 0, err
    results = read_jsonl(folder / "in.results.jsonl")
    assert sorted(r["custom_id"] for r in results) == sorted(ids)
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results)
    assert [e["custom_id"] for e in read_jsonl(folder / "in.errors.jsonl")] == ["bad"]
    assert "6 results written to in.results.jsonl" in out and "1 error lines written to in.errors.jsonl" in out
    # and it started a DHT node, two servers and a worker (and their p2pd daemons), all stopped now
    assert len(run.swarm_processes()) >= 4 and not run.living_descendants(), run.commands
    job_id = job_id_in(out)

    # When the same file is run again, it is not run again: same job, its outputs written again, no DHT node, server
    # or worker started
    (folder / "in.results.jsonl").unlink()
    again = Run(args, cwd=folder, home=home, logs=tmp_path / "run2")
    try:
        code, out, err = again.wait(120)
    finally:
        again.stop()
    assert code == 0, err
    assert f"This file already ran: job {job_id} completed" in out
    assert not again.swarm_processes(), again.commands
    assert sorted(r["custom_id"] for r in read_jsonl(folder / "in.results.jsonl")) == sorted(ids)


@pytest.mark.swarm
def test_ctrl_c_stops_every_child_keeps_the_job_and_the_same_command_resumes_it(tiny_model: Path,
                                                                               tmp_path: Path) -> None:
    # Given a run of a file long enough to be interrupted (40 lines of 128 tokens)
    folder = decoy_folder(tmp_path)
    ids = write_batch(folder / "in.jsonl", 40, max_tokens=128)
    args, home = ["in.jsonl", "--model", str(tiny_model)], tmp_path / "home"
    run = Run(args, cwd=folder, home=home, logs=tmp_path / "run1")
    try:
        wait_for(lambda: "Starting a DHT node" in run.out, 120, "the run to store its job")
        job_id = job_id_in(run.out)
        runtime = build_runtime(Settings(home=home))
        client = StoreBackend(runtime)
        wait_for(lambda: client.get(job_id)["tokens_generated"] > 0, 300, "the first checkpoint")

        # When it gets Ctrl-C (SIGINT to its PID) mid-job
        run.proc.send_signal(signal.SIGINT)
        code, out, err = run.wait(120)
    finally:
        run.stop()

    # Then it exits 130 with one line saying the job is kept and how to resume it, and no child is left
    assert code == ExitCode.INTERRUPTED, err
    (line,) = [line for line in err.splitlines() if line.startswith("Error:")]
    assert line.startswith(f"Error: RunInterrupted: every process this run started is stopped; job {job_id} keeps ")
    assert line.endswith(f"run 'swarmbatch run in.jsonl --model {tiny_model}' again to resume it")
    assert len(run.descendants) >= 4 and not run.living_descendants()
    job = client.get(job_id)
    runtime.close()
    assert job["status"] == "in_progress" and job["request_counts"]["completed"] < len(ids)

    # When the same command runs again (beside an errors file an older run left), it resumes that job to its end
    (folder / "in.errors.jsonl").write_text('{"custom_id": "from an older run"}\n')
    resumed = Run(args, cwd=folder, home=home, logs=tmp_path / "run2")
    try:
        code, out, err = resumed.wait(400)
    finally:
        resumed.stop()
    assert code == 0, err
    assert f"Resuming job {job_id} of this file (in_progress)" in out and not resumed.living_descendants()
    assert sorted(r["custom_id"] for r in read_jsonl(folder / "in.results.jsonl")) == sorted(ids)
    assert not (folder / "in.errors.jsonl").exists()  # every line once, and no error line: no errors file
