"""Soak: 200 restarts of a 4-task local run under random SIGKILLs, then count what is left over.

A parameter-server-shaped run (chief, 2 workers, ps) of a trivial non-TensorFlow task: each task
listens on its port and starts two children (a plain `sleep` and one that called setsid), then
waits. While the run goes on, a random running task is SIGKILLed, either its process (what
run.json names) or its program or one of its children; killing a mere child does not end the
task, so not every kill is a restart. After 200 restarts the launcher is stopped (SIGTERM) and
the orphans are counted:

- processes: any process whose environment carries the run's id;
- namespaces: the tasks' PID namespaces still alive: one lives exactly as long as its init (the
  keeper's child), so each init seen is checked by pid and start time (namespace inode numbers
  are reused, and other runs on the machine make namespaces too);
- ports: the run's ports that something still listens on;
- fds: the launcher's open descriptors just before the stop, over those once the run was up.

Each must be 0. Runs in a few minutes on 2 cores: `python bench/soak.py [--restarts N]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _common import DISTLAUNCH, REPO

sys.path.insert(0, str(REPO / "tests"))
import standins  # noqa: E402

TASK = (
    standins.listening(standins.LOOPBACK)
    + """
import subprocess
subprocess.Popen(["sleep", "600"])
subprocess.Popen(["sleep", "601"], start_new_session=True)
time.sleep(600)
"""
)


def main() -> int:
    """Run the soak and print the orphan counts; exit 1 if any is not 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=14)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="distlaunch-soak-") as scratch:
        folder = Path(scratch)
        (folder / "task.py").write_text(TASK)
        spec = {
            "name": "soak",
            "strategy": "parameter_server",
            "program": {"script": "task.py"},
            "tasks": {
                "chief": {"count": 1},
                "worker": {"count": 2},
                "ps": {"count": 1},
            },
            "isolation": "off",  # so that a port left behind would show on this machine
            "shared_dir": "runs",
            "timeouts": {"grace_s": 1, "startup_s": 60},
            "restart": {
                "policy": "on-failure",
                "max_restarts": args.restarts * 10,
                "backoff": {"initial_s": 0, "max_s": 0},
            },
        }
        (folder / "spec.json").write_text(json.dumps(spec))
        launcher = subprocess.Popen(
            [*DISTLAUNCH, "up", "spec.json"],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            counts = _soak(launcher, folder / "runs", args.restarts, rng)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    for what, count in counts.items():
        print(f"orphan {what}: {count}")
    return 0 if not any(counts.values()) else 1


def _soak(
    launcher: subprocess.Popen, shared: Path, restarts: int, rng: random.Random
) -> dict[str, int]:
    run_dir = _wait(lambda: next((p.parent for p in shared.glob("*/run.json")), None), launcher)
    record = _wait(lambda: _running(run_dir), launcher)
    run_id, ports = record["run_id"], [t["port"] for t in record["tasks"].values()]
    fds_up = len(os.listdir(f"/proc/{launcher.pid}/fd"))
    inits: set[tuple[int, float]] = set()
    kills, started = 0, time.monotonic()
    while _restarts(run_dir) < restarts:
        record = _wait(lambda: _running(run_dir), launcher)
        name = rng.choice(sorted(record["tasks"]))
        family = _family(run_id, record["tasks"][name]["pid"])
        inits |= _inits(record)
        victim = (
            record["tasks"][name]["pid"]
            if rng.random() < 0.5 or not family
            else rng.choice(family).pid
        )
        try:
            os.kill(victim, signal.SIGKILL)
            kills += 1
        except ProcessLookupError:
            pass
        _wait(lambda v=victim: not _alive(v), launcher)
    elapsed = time.monotonic() - started
    fds_end = len(os.listdir(f"/proc/{launcher.pid}/fd"))
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=120)
    print(
        f"{_restarts(run_dir)} restarts from {kills} SIGKILLs in {elapsed:.1f} s;"
        f" launcher exit {launcher.returncode}"
    )
    return {
        "processes": len(_of_run(run_id)),
        "namespaces": sum(_same_process(pid, created) for pid, created in inits),
        "ports": sum(_listening(port) for port in ports),
        "fds": max(0, fds_end - fds_up),
    }


def _wait(predicate, launcher: subprocess.Popen, limit_s: float = 120):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if launcher.poll() is not None:
            sys.exit(f"the launcher exited with {launcher.returncode}: {launcher.stderr.read()}")
        time.sleep(0.01)
    sys.exit(f"gave up after {limit_s} s")


def _record(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def _running(run_dir: Path) -> dict | None:
    record = _record(run_dir)
    tasks = record.get("tasks") or {}
    return (
        record
        if len(tasks) == 4 and all(t.get("state") == "running" for t in tasks.values())
        else None
    )


def _restarts(run_dir: Path) -> int:
    path = run_dir / "events.jsonl"
    text = path.read_text() if path.exists() else ""
    return sum(json.loads(line).get("decision") == "restart" for line in text.splitlines())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _of_run(run_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if (
                proc.environ().get("DISTLAUNCH_RUN_ID") == run_id
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _family(run_id: str, keeper: int) -> list[psutil.Process]:
    """The task's program and its children: the run's processes below the task's keeper."""
    try:
        below = psutil.Process(keeper).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    mine = {p.pid for p in _of_run(run_id)}
    # The keeper's direct child is the namespace's init, which only the kernel may kill.
    return [p for p in below if p.pid in mine and p.ppid() != keeper]


def _inits(record: dict) -> set[tuple[int, float]]:
    """Each running task's PID namespace init (the keeper's only child), as (pid, start time)."""
    found = set()
    for task in record["tasks"].values():
        try:
            found |= {(p.pid, p.create_time()) for p in psutil.Process(task["pid"]).children()}
        except psutil.NoSuchProcess:
            continue
    return found


def _same_process(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
