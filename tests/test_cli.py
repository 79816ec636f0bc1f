"""The command line's shape: shared options declared once, and one map from errors to exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import distlaunch, write_spec
from distlaunch.launcher.cli import ExitCode, exit_code
from distlaunch.launcher.core.errors import HostError, Interrupted, RunFailed, SpecError, UsageError
from distlaunch.launcher.network.netns import SandboxError
from distlaunch.launcher.transports.compose.docker import DockerError

pytestmark = pytest.mark.quick


def test_errors_map_to_their_exit_codes() -> None:
    assert exit_code(SpecError("f", "$", "bad")) == ExitCode.USAGE == 2
    assert exit_code(UsageError("no run")) == 2
    assert exit_code(HostError("host", ["down"])) == 2
    assert exit_code(DockerError("no engine")) == 2
    # A sandbox that cannot be made is a setup error: nothing started, not a failed task.
    assert exit_code(SandboxError("unshare: Operation not permitted")) == 2
    assert exit_code(RunFailed("worker-1 failed")) == ExitCode.FAILED == 1
    assert exit_code(Interrupted(15)) == 128 + 15


def _run(tmp: Path, run_id: str) -> None:
    run_dir = tmp / run_id
    run_dir.mkdir(parents=True)
    record = {"run_id": run_id, "state": "succeeded", "attempt": 0, "tasks": {}}
    (run_dir / "run.json").write_text(json.dumps(record))


def test_shared_dir_is_accepted_after_and_before_the_subcommand(tmp: Path) -> None:
    _run(tmp / "a", "r-a")
    _run(tmp / "b", "r-b")
    after = distlaunch("status", "r-a", "--shared-dir", str(tmp / "a"), "--json", cwd=tmp)
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["run_id"] == "r-a"
    before = distlaunch("--shared-dir", str(tmp / "b"), "status", "--json", cwd=tmp)
    assert before.returncode == 0, before.stderr
    assert json.loads(before.stdout)["run_id"] == "r-b"
    # The subcommand's own option wins over the group's.
    both = distlaunch(
        "--shared-dir", str(tmp / "b"), "status", "--shared-dir", str(tmp / "a"), cwd=tmp
    )
    assert both.returncode == 0 and "run r-a: succeeded" in both.stdout
    # Without either, runs are looked up under ./runs.
    missing = distlaunch("status", "r-a", cwd=tmp)
    assert missing.returncode == 2 and "under runs" in missing.stderr


# Imported by no command before its first task starts (`--help`, and `up` of a JSON spec on
# this machine): each costs the launcher's start milliseconds (bench/startup.py), TensorFlow
# seconds; they are imported where they are used (a YAML spec, a resumed run, a stacks capture).
NOT_AT_START = ("pydantic", "yaml", "psutil", "portpicker", "tensorflow", "concurrent.futures")


def _loaded_after(code: str) -> set[str]:
    """The NOT_AT_START modules a fresh interpreter holds after ``code``."""
    report = f"print(*sorted(m for m in sys.modules if m in {NOT_AT_START!r}))"
    result = subprocess.run(
        [sys.executable, "-c", f"import atexit, sys\natexit.register(lambda: {report})\n{code}"],
        capture_output=True,
        text=True,
    )
    assert "Traceback" not in result.stderr, result.stderr
    return set(result.stdout.split("\n")[-2].split())


def test_the_start_imports_only_what_it_uses() -> None:
    help_run = (
        "from distlaunch.launcher.cli import main\nsys.argv = ['distlaunch', '--help']\nmain()"
    )
    assert _loaded_after(help_run) == set()
    # What `up` of a local JSON spec runs through up to its tasks' start.
    up_path = (
        "from distlaunch.launcher import cli; from distlaunch.launcher.spec import model as spec; from distlaunch.launcher.run import up, supervisor; from distlaunch.launcher.plan import plan; from distlaunch.launcher.record import state\n"
        "from distlaunch.launcher.transports.local import routing; from distlaunch.launcher.transports.local import transport as local; from distlaunch.launcher.network import netns"
    )
    assert _loaded_after(up_path) == set()


# What only a run under way uses (its events, its end): `up` starts its first task before it
# imports any of them (bench/startup.py times that start), nor what they alone import.
AFTER_FIRST_TASK = (
    "distlaunch.launcher.diagnosis.evidence",
    "distlaunch.launcher.diagnosis.formation",
    "distlaunch.launcher.diagnosis.hints",
    "distlaunch.launcher.diagnosis.progress_view",
    "distlaunch.launcher.diagnosis.stacks",
    "distlaunch.launcher.diagnosis.summary",
    "distlaunch.launcher.record.checkpoints",
    "ctypes",
    "secrets",
    "socket",
    "sysconfig",
)


def test_up_starts_its_first_task_before_it_imports_what_runs_use(tmp: Path) -> None:
    (tmp / "noop.py").write_text("")
    spec = write_spec(tmp, program={"script": "noop.py"}, tasks={"worker": {"count": 1}})
    # The modules new since the interpreter's start, seen as the supervisor has started the
    # first task (the `started` event is written), then at the run's end.
    up_run = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "from distlaunch.launcher.run.supervisor import Supervisor\n"
        "start, seen = Supervisor._start, []\n"
        "def first(self, plan, restarts=0):\n"
        "    start(self, plan, restarts)\n"
        "    if not seen:\n"
        "        seen.append(set(sys.modules) - before)\n"
        "Supervisor._start = first\n"
        "from distlaunch.launcher.cli import cli\n"
        f"cli.main(['up', {str(spec)!r}], standalone_mode=False)\n"
        f"later = {AFTER_FIRST_TASK!r}\n"
        "print(*sorted(m for m in later if m in seen[0]))\n"
        "print(*sorted(m for m in later if m in set(sys.modules) - before))"
    )
    result = subprocess.run([sys.executable, "-c", up_run], cwd=tmp, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "succeeded" in result.stderr + result.stdout
    at_start, at_end = result.stdout.split("\n")[-3:-1]
    assert at_start == ""
    # They are imported once used: the task's exit reads its evidence, teardown the checkpoints.
    assert {
        "distlaunch.launcher.diagnosis.evidence",
        "distlaunch.launcher.record.checkpoints",
    } <= set(at_end.split())


# What a run with every task on this machine never needs: the SSH hosts' preflight, transport
# and firewall, and the compose image builder (the CLI's option defaults name its image).
NOT_FOR_LOCAL = (
    "distlaunch.launcher.transports.ssh.preflight",
    "distlaunch.launcher.transports.ssh.transport",
    "distlaunch.launcher.network.firewall",
    "distlaunch.launcher.transports.compose.image",
)


def test_up_imports_its_own_backend_alone_and_scans_no_entry_points(tmp: Path) -> None:
    # Backends are named in launcher/core/backends.py; a built-in one is found without reading the
    # installed packages' entry points (importlib.metadata), and the others are not imported; nor
    # is what only SSH hosts need.
    (tmp / "noop.py").write_text("")
    spec = write_spec(tmp, program={"script": "noop.py"}, tasks={"worker": {"count": 1}})
    up_run = (
        "from distlaunch.launcher.cli import cli\n"
        f"cli.main(['up', {str(spec)!r}], standalone_mode=False)\n"
        "from distlaunch.launcher.core.backends import BUILTIN\n"
        "others = {BUILTIN[b].target.split(':')[0] for b in ('compose', 'slurm')}\n"
        f"others |= set({NOT_FOR_LOCAL!r})\n"
        "print(*sorted(m for m in sys.modules if m == 'importlib.metadata' or m in others))"
    )
    result = subprocess.run(
        [sys.executable, "-c", f"import sys\n{up_run}"], cwd=tmp, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "succeeded" in result.stderr + result.stdout
    assert result.stdout.strip().split("\n")[-1] == ""
