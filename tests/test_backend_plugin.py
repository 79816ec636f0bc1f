"""A backend is one class: a toy backend, defined in this file alone, is seen by the real CLI.

`ToyBackend` below is installed the way another package would install one: an entry point of
the group ``distlaunch.backends`` in a dist-info folder on PYTHONPATH (written by the `installed`
fixture). The CLI subprocesses then list it in `up --backend`, plan with it, run with it, read its
tasks' stacks and clean up after it through its own methods, and keep its typed run.json section.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from conftest import distlaunch, processes_of_run, run_record, wait_for, write_spec
from distlaunch.launcher.transports.base import Opened, UpOptions
from distlaunch.launcher.transports.local.routing import LocalBackend
from distlaunch.launcher.transports.local.transport import LocalTransport

pytestmark = pytest.mark.integration

GREETING = "hello from the toy section"


@dataclass(frozen=True)
class ToySection:
    """The toy backend's run.json section."""

    greeting: str

    def to_json(self) -> dict[str, Any]:
        return {"greeting": self.greeting}


class ToyLaunch:
    """One `up` of the toy backend: the local plan, local processes."""

    def __init__(self, backend: ToyBackend, loaded: Any) -> None:
        self.backend = backend
        self.loaded = loaded

    def plan(self, run_id: str, run_dir: Path, attempt: int) -> Any:
        return self.backend.plan(self.loaded, run_id, run_dir, attempt)

    @contextmanager
    def open(self, plan: Any) -> Iterator[Opened]:
        local = LocalTransport(None, standby=plan.standby)
        yield Opened(local, section=ToySection(GREETING), standbys=local.standbys)


class ToyBackend:
    """Local processes, marked as the toy's in the plan, run.json, `stacks` and `down`."""

    name: ClassVar[str] = "toy"
    title: ClassVar[str] = "toy"
    section_key: ClassVar[str] = "toy"

    def plan(self, loaded: Any, run_id: str, run_dir: Path, attempt: int) -> Any:
        plan = LocalBackend().plan(loaded, run_id, run_dir, attempt)
        tasks = tuple(dataclasses.replace(t, env={**t.env, "TOY_BACKEND": "1"}) for t in plan.tasks)
        return dataclasses.replace(plan, tasks=tasks)

    @contextmanager
    def open(self, loaded: Any, console: Any, options: UpOptions) -> Iterator[ToyLaunch]:
        yield ToyLaunch(self, loaded)

    @contextmanager
    def cleanup(self, record: Any, run_dir: Path, grace_s: float) -> Iterator[list[str]]:
        yield ["toy-job"]
        (run_dir / "toy-cleanup.txt").write_text(record.section["greeting"])

    @contextmanager
    def stacks(self, record: Any, run_dir: Path) -> Iterator[Any]:
        def read(plan: Mapping, entry: Any, native: bool) -> Any:
            return lambda: f"toy stacks of {plan['name']}: {record.section['greeting']}\n"

        yield read


@pytest.fixture
def installed(tmp: Path) -> dict[str, str]:
    """The environment of a CLI that has the toy backend installed (an entry point on its path)."""
    site = tmp / "site"
    info = site / "toy_backend-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[distlaunch.backends]\ntoy = {Path(__file__).stem}:ToyBackend\n"
    )
    path = os.pathsep.join([str(site), str(Path(__file__).parent)])
    return {**os.environ, "PYTHONPATH": path}


def test_a_backend_in_one_file_is_seen_by_up_plan_stacks_and_down(tmp, installed):
    (tmp / "task.py").write_text("import time\ntime.sleep(600)\n")
    fields = {
        "tasks": {"worker": {"count": 1}},
        "isolation": "off",
        "timeouts": {"grace_s": 2, "startup_s": 600},
    }
    spec = write_spec(tmp, **fields)

    assert "toy" not in distlaunch("up", "--help").stdout
    assert "local|compose|slurm|toy" in distlaunch("up", "--help", env=installed).stdout

    toy_spec = write_spec(tmp, "toy.json", **fields, backend="toy")
    plan = distlaunch("plan", str(toy_spec), "--json", cwd=tmp, env=installed)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["tasks"][0]["env"]["TOY_BACKEND"] == "1"
    unknown = distlaunch("plan", str(toy_spec), cwd=tmp)  # not installed: a spec error
    assert unknown.returncode == 2
    assert "$.backend: expected 'local', 'compose' or 'slurm', got \"toy\"" in unknown.stderr

    with open(tmp / "stdout.txt", "w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "distlaunch.launcher", "up", "--backend", "toy", str(spec)],
            cwd=tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=installed,
        )
    try:
        run_dir = wait_for(
            lambda: next((tmp / "runs").glob("*/run.json"), None), "run.json", launcher=launcher
        ).parent
        wait_for(
            lambda: run_record(run_dir)["tasks"].get("worker-0", {}).get("pid"),
            "worker-0 started",
            launcher=launcher,
        )
        record = run_record(run_dir)
        assert record["backend"] == "toy" and record["toy"] == {"greeting": GREETING}

        taken = distlaunch("stacks", str(run_dir), env=installed)
        assert taken.returncode == 0, taken.stderr
        folder = taken.stdout.strip().splitlines()[-1].removeprefix("stacks written to ")
        assert (
            Path(folder) / "worker-0.txt"
        ).read_text() == f"toy stacks of worker-0: {GREETING}\n"

        launcher.send_signal(signal.SIGKILL)  # what it held elsewhere is `down`'s to clean up
        launcher.wait(timeout=60)
        down = distlaunch("down", str(run_dir), env=installed)
    finally:
        launcher.kill()
    assert down.returncode == 0, down.stderr
    assert "cancelled toy toy-job" in down.stdout
    assert (run_dir / "toy-cleanup.txt").read_text() == GREETING
    assert not processes_of_run(run_dir.name)
    assert run_record(run_dir)["state"] == "interrupted"
    assert run_record(run_dir)["toy"] == {"greeting": GREETING}  # kept, as read, by `down`
