"""`distlaunch stacks`: where every task of a live run is, read from outside the launcher.

Local tasks are read here with py-spy (the program below taskinit's keeper, as this machine's
/proc sees it; the task's own faulthandler dump where py-spy cannot attach). SSH tasks are read
on their host by the remote helper, which finds the task by its run id and name and runs py-spy
there. Captures land in RUN/stacks/<time>/; nothing here signals the launcher or stops a task.
"""

from __future__ import annotations

import json
from pathlib import Path

from distlaunch.launcher import stacks
from distlaunch.launcher.control.liveness import launcher_alive
from distlaunch.launcher.errors import UsageError
from distlaunch.launcher.state import RunRecord, TaskRecord, TaskState
from distlaunch.launcher.transports import ssh
from distlaunch.worker import contract

_RUNNING = (TaskState.STARTING, TaskState.RUNNING)


def take_stacks(run_dir: Path, task: str | None, native: bool) -> list[stacks.Capture]:
    """Capture the stacks of a live run's running tasks (or of ``task``)."""
    record = RunRecord.load(run_dir)
    wanted = task.replace(":", "-") if task is not None else None
    if wanted is not None and wanted not in record.tasks:
        names = ", ".join(record.tasks)
        raise UsageError(f"run {record.run_id} has no task {task!r}; expected one of: {names}")
    if not launcher_alive(record):
        raise UsageError(
            f"run {record.run_id} is not running ({record.state.value}); no stacks to take"
        )
    plans = {
        t["name"]: t for t in record.plan.get("tasks", []) if isinstance(t, dict) and "name" in t
    }
    running = {
        name: entry
        for name, entry in record.tasks.items()
        if wanted in (None, name) and entry.state in _RUNNING and entry.pid is not None
    }
    with ssh.Session(ssh.hosts_from_record(record.ssh or {})) as session:
        sources = {}
        for name, entry in running.items():
            plan = plans.get(name, {})
            if plan.get("transport") == "ssh":
                sources[name] = _remote(session, plan["host_name"], record.run_id, name, native)
            else:
                pid = stacks.program_pid(entry.pid)
                sources[name] = stacks.local(pid, native, _signal_file(run_dir, entry))
        return stacks.capture(run_dir, sources)


def _signal_file(run_dir: Path, entry: TaskRecord) -> Path:
    """Where the task's faulthandler writes its stacks (the fallback when py-spy cannot read it)."""
    return contract.stacks_signal_path(run_dir, entry.attempt, entry.role, entry.index)


def _remote(session: ssh.Session, host: str, run_id: str, task: str, native: bool) -> stacks.Source:
    """The stacks of ``task`` on SSH host ``host``, dumped there by the remote helper."""
    python = ssh.remote_python(session.hosts[host].python)
    query = {"stacks": {"run_id": run_id, "task": task, "native": native}}
    line = json.dumps(query).encode() + b"\n"

    def source() -> str:
        command = f"exec {python} -m {ssh.HELPER_MODULE}"
        done = session.run(host, command, stdin=line, timeout=stacks.DUMP_TIMEOUT_S * 2)
        if done.returncode != 0:
            message = ssh.last_message(done.stderr.decode(errors="replace"))
            why = message or f"exit code {done.returncode}"
            raise stacks.StackError(f"on {session.target(host)}: {why}")
        return done.stdout.decode(errors="replace")

    return source
