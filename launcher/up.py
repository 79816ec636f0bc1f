"""`distlaunch up`: a loaded spec becomes a run directory, a plan, and a supervised run."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from distlaunch.launcher import ports, rundir
from distlaunch.launcher.console import Console
from distlaunch.launcher.errors import Interrupted, RunFailed, UsageError
from distlaunch.launcher.plan import Plan, make_plan
from distlaunch.launcher.spec import LoadedSpec
from distlaunch.launcher.summary import details, headline
from distlaunch.launcher.supervisor import Supervisor

EXPOSURE_NOTE = (
    "note: TensorFlow's gRPC servers listen on every interface with no authentication; "
    "ports {ports} can be reached from other machines unless a firewall blocks them (README: Security)"
)


@dataclass(frozen=True)
class RunTarget:
    """Which run directory an `up` uses and which attempt it starts."""

    run_id: str
    run_dir: Path
    attempt: int
    previous: dict | None  # run.json of the run being resumed


def choose_run(loaded: LoadedSpec, run_id: str | None, resume: bool) -> RunTarget:
    """Pick a fresh run, or the run to resume (``run_id``, or with ``resume`` the latest unfinished one)."""
    shared = loaded.shared_dir
    if resume and run_id is None:
        found = rundir.latest_unfinished(shared, loaded.spec.name)
        if found is None:
            raise UsageError(f"--resume: no unfinished run of {loaded.spec.name!r} under {shared}")
        run_id = found.name
    if run_id is None:
        run_id = rundir.new_run_id(loaded.spec.name)
        return RunTarget(run_id, shared / run_id, 0, None)
    run_dir = shared / run_id
    previous = rundir.read_json(run_dir / rundir.RUN_JSON)
    if previous is None:
        if resume:
            raise UsageError(f"--resume: no run {run_id!r} under {shared}")
        return RunTarget(run_id, run_dir, 0, None)
    if previous.get("state") in (rundir.RUNNING, rundir.STOPPING) and _pid_alive(previous.get("launcher_pid")):
        raise UsageError(f"run {run_id} is still running (launcher pid {previous['launcher_pid']}); `distlaunch down {run_id}` first")
    return RunTarget(run_id, run_dir, int(previous.get("attempt", 0)) + 1, previous)


def build_plan(loaded: LoadedSpec, target: RunTarget) -> Plan:
    """Allocate ports and build the plan of this attempt (no files written, nothing started)."""
    return make_plan(
        loaded, ports.allocate(loaded), target.run_id, target.run_dir, target.attempt,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def up(loaded: LoadedSpec, target: RunTarget, console: Console) -> None:
    """Run the job to its end; raise RunFailed or Interrupted (after full teardown) if it did not succeed."""
    plan = build_plan(loaded, target)
    rundir.make_dirs(target.run_dir, target.attempt)
    record = _new_record(loaded, plan, target)
    verb = "resuming" if target.previous else "starting"
    console.say(f"{verb} run {plan.run_id} (attempt {plan.attempt}): {len(plan.tasks)} tasks, {plan.strategy}; run dir {plan.run_dir}")
    console.say(EXPOSURE_NOTE.format(ports=", ".join(str(t.port) for t in plan.tasks)))
    supervisor = Supervisor(plan, record, console, loaded.spec.timeouts)
    try:
        result = supervisor.run()
    except Interrupted as exc:
        _finish(record, target, rundir.INTERRUPTED, exc.exit_code)
        raise
    except BaseException:
        _finish(record, target, rundir.FAILED, 1)
        raise
    if result.failure is None:
        _finish(record, target, rundir.SUCCEEDED, 0)
        console.say(f"run {plan.run_id} succeeded in {time.time() - record['started_at']:.1f} s; run dir {plan.run_dir}")
        return
    line = headline(plan.run_id, result.failure)
    record["failure"] = {"task": result.failure.task, "how": result.failure.how, "summary": line}
    _finish(record, target, rundir.FAILED, 1)
    console.say(line + "\n" + details(result.failure))
    raise RunFailed(line)


def _new_record(loaded: LoadedSpec, plan: Plan, target: RunTarget) -> dict:
    history = []
    if target.previous:
        history = target.previous.get("history", []) + [
            {k: target.previous.get(k) for k in ("attempt", "state", "started_at", "ended_at", "exit_code", "failure")}
        ]
    return {
        "run_id": plan.run_id,
        "name": loaded.spec.name,
        "spec_file": str(loaded.file.resolve()),
        "spec": loaded.raw,
        "strategy": plan.strategy,
        "state": rundir.RUNNING,
        "attempt": plan.attempt,
        "launcher_pid": os.getpid(),
        "started_at": time.time(),
        "ended_at": None,
        "exit_code": None,
        "failure": None,
        "plan": plan.to_json(),
        "tasks": {},
        "history": history,
    }


def _finish(record: dict, target: RunTarget, state: str, exit_code: int) -> None:
    record.update(state=state, exit_code=exit_code, ended_at=time.time())
    rundir.write_json(target.run_dir / rundir.RUN_JSON, record)


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
