"""`distlaunch stacks`: where every task of a live run is, read from outside the launcher.

Each task is read where it runs, by the same function of its backend the supervisor's own
captures use (`task_stacks` in launcher/transports/): a local task's program with py-spy here;
an SSH task by the remote helper on its host; a Slurm task by the helper in a step on its node; a
compose task by the helper in its container. Captures land in RUN/stacks/<time>/; nothing here
signals the launcher, an ssh/srun/compose client or anything but a task's own program (the
faulthandler fallback, where py-spy cannot read it), and nothing stops a task.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from distlaunch.launcher import stacks
from distlaunch.launcher.control.liveness import launcher_alive
from distlaunch.launcher.errors import UsageError
from distlaunch.launcher.state import RunRecord, TaskRecord, TaskState
from distlaunch.launcher.transports import compose, compose_file, local, slurm, ssh
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
    with ExitStack() as stack:
        session = stack.enter_context(ssh.Session(ssh.hosts_from_record(record.ssh or {})))
        sources = {
            name: _source(run_dir, record, plans.get(name, {}), entry, session, native)
            for name, entry in running.items()
        }
        return stacks.capture(run_dir, sources)


def _source(
    run_dir: Path,
    record: RunRecord,
    plan: dict,
    entry: TaskRecord,
    session: ssh.Session,
    native: bool,
) -> stacks.Source:
    """Where one task's stacks are read, as its backend says (from what run.json keeps)."""
    name, kind = plan.get("name", ""), plan.get("transport")
    if kind == "ssh":
        return ssh.task_stacks(session, plan["host_name"], record.run_id, name, native)
    if kind == "slurm":
        # The nodes' interpreter is the tasks' own (a cluster shares its filesystem).
        helper = slurm.helper_argv(plan["argv"][0], None)
        job = str((record.extra.get("slurm") or {}).get("job_id", ""))
        return slurm.task_stacks(job, plan["host_name"], record.run_id, name, helper, native)
    if kind == "compose":
        project = str((record.compose or {}).get("project", ""))
        container = compose_file.container_name(project, name)
        return compose.task_stacks(container, record.run_id, name, native)
    signal_file = contract.stacks_signal_path(run_dir, entry.attempt, entry.role, entry.index)
    assert entry.pid is not None
    return local.task_stacks(entry.pid, signal_file, native)
