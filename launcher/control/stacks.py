"""`distlaunch stacks`: where every task of a live run is, read from outside the launcher.

Each task is read where it runs, as the run's backend says (`Backend.stacks`), by the same
function of its transport the supervisor's own captures use (`task_stacks` in
launcher/transports/): a local task's program with py-spy here; a remote task by the remote
helper where it runs (its host, a step on its node, its container). Captures land in
RUN/stacks/<time>/; nothing here signals the launcher, an ssh/srun/compose client or anything
but a task's own program (the faulthandler fallback, where py-spy cannot read it), and nothing
stops a task.
"""

from __future__ import annotations

from pathlib import Path

from distlaunch.launcher.control.liveness import launcher_alive
from distlaunch.launcher.core.errors import UsageError
from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.record.state import RunRecord, TaskState
from distlaunch.launcher.transports.base import load_backend

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
    with load_backend(record.backend).stacks(record, run_dir) as read:
        sources = {
            name: read(plans.get(name, {}), entry, native) for name, entry in running.items()
        }
        return stacks.capture(run_dir, sources)
