"""`distlaunch up`: a loaded spec becomes a run directory, a plan, and a supervised run."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.console import Console
from distlaunch.launcher.core.errors import Interrupted, Preempted, RunFailed, UsageError
from distlaunch.launcher.plan.plan import Plan, masked_spec
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import RunFailure, RunRecord, RunState, latest_unfinished
from distlaunch.launcher.run.supervisor import Supervisor
from distlaunch.launcher.spec.model import LoadedSpec
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.base import UpOptions, load_backend
from distlaunch.worker import contract


@dataclass(frozen=True)
class RunTarget:
    """Which run directory an `up` uses and which attempt it starts."""

    run_id: str
    run_dir: Path
    attempt: int
    previous: RunRecord | None  # the record of the run being resumed


def choose_run(loaded: LoadedSpec, run_id: str | None, resume: bool) -> RunTarget:
    """Pick a fresh run, or the run to resume (``run_id``, or with ``resume`` the latest unfinished one)."""
    shared = loaded.shared_dir
    if run_id is not None:
        rundir.check_run_id(run_id)
    if resume and run_id is None:
        found = latest_unfinished(shared, loaded.spec.name)
        if found is None:
            raise UsageError(f"--resume: no unfinished run of {loaded.spec.name!r} under {shared}")
        run_id = found.name
    if run_id is None:
        run_id = rundir.new_run_id(loaded.spec.name)
        return RunTarget(run_id, shared / run_id, 0, None)
    run_dir = shared / run_id
    if not os.path.lexists(run_dir):
        if resume:
            raise UsageError(f"--resume: no run {run_id!r} under {shared}")
        return RunTarget(run_id, run_dir, 0, None)
    if (run_dir / rundir.BATCH_SCRIPT).is_file() and not os.path.lexists(run_dir / rundir.RUN_JSON):
        # `distlaunch sbatch` made it for its batch script: the job's first start begins the run.
        rundir.check_existing(run_dir, loaded.spec.permissions == "private")
        return RunTarget(run_id, run_dir, 0, None)
    if not run_dir.is_symlink() and not (run_dir / rundir.RUN_JSON).is_file():
        raise UsageError(
            f"run dir {run_dir} already exists and holds no run; pick another --run-id"
        )
    rundir.check_existing(run_dir, loaded.spec.permissions == "private")
    # Only a resumed run asks (psutil): a fresh run's start does not import it.
    from distlaunch.launcher.control.liveness import launcher_alive

    previous = RunRecord.load(run_dir)
    if launcher_alive(previous):
        raise UsageError(
            f"run {run_id} is still running (launcher pid {previous.launcher_pid}); `distlaunch down {run_id}` first"
        )
    return RunTarget(run_id, run_dir, previous.attempt + 1, previous)


def build_plan(loaded: LoadedSpec, target: RunTarget) -> Plan:
    """The plan `up` would start for ``target``, with no host contacted (`plan`, `tfconfig`)."""
    # Only the run's own backend's module is imported: a start does not wait for the others.
    return load_backend(loaded.spec.backend).plan(
        loaded, target.run_id, target.run_dir, target.attempt
    )


def claim_and_up(
    loaded: LoadedSpec,
    target: RunTarget,
    console: Console,
    options: UpOptions = UpOptions(),
    before_start: Callable[[Path], None] | None = None,
) -> None:
    """`up` holding the run dir's claim (one launcher per run dir, for this launcher's life)."""
    previous_attempt = target.previous.attempt if target.previous else None
    with rundir.claim(target.run_dir, previous_attempt, loaded.spec.permissions == "private"):
        up(loaded, target, console, options, before_start)


def up(
    loaded: LoadedSpec,
    target: RunTarget,
    console: Console,
    options: UpOptions = UpOptions(),
    before_start: Callable[[Path], None] | None = None,
) -> None:
    """Run the job to its end; raise RunFailed or Interrupted (after full teardown) if it did not succeed.

    The backend checks its hosts first (HostError, nothing started, when an SSH host is not
    usable), then plans; ``options`` are what the backend reads beyond the spec (compose: the
    tasks' image; slurm: whether to requeue a batch job stopped by its pre-timeout signal).
    ``before_start`` gets the run dir once it exists, before any task starts (`distlaunch.run`
    writes its function there).
    """
    procs.raise_fd_limit()  # a few descriptors per task: hundreds of tasks pass 1024
    private = loaded.spec.permissions == "private"
    with load_backend(loaded.spec.backend).open(loaded, console, options) as launch:
        plan = launch.plan(target.run_id, target.run_dir, target.attempt)
        with _umask(rundir.PRIVATE_UMASK if private else None):
            rundir.make_dirs(target.run_dir, target.attempt, private)
            if before_start is not None:
                before_start(target.run_dir)
            record = _new_record(loaded, plan, target)
            verb = "resuming" if target.previous else "starting"
            contained = all(TaskTransport(t.transport).contained for t in plan.tasks)
            where = " in containers" if contained else ""
            count, elastic = len(plan.tasks), plan.elastic
            if elastic is not None:  # the first world's tasks, of every slot planned
                count += len(elastic.first_world()) - len(elastic.slots)
                where += f" (elastic.workers {elastic.range_text})"
            console.say(
                f"{verb} run {plan.run_id} (attempt {plan.attempt}): {count} tasks{where}, "
                f"{plan.strategy}; run dir {plan.run_dir}"
            )
            _say_program(console, plan)
            for note in plan.cpu_notes():
                console.say(note)
            with launch.open(plan) as opened:
                record.update(opened.record)
                if opened.section is not None:
                    record.section = opened.section.to_json()
                for note in opened.notes:
                    console.say(note)
                shown = opened.console or console
                timeouts = loaded.spec.timeouts
                save_why = None  # the spec's timeouts.save_s
                if opened.save_s is not None and opened.save_s < timeouts.save_s:
                    timeouts = replace(timeouts, save_s=opened.save_s)
                    save_why = opened.save_why
                supervisor = Supervisor(
                    plan,
                    record,
                    shown,
                    timeouts,
                    opened.transport,
                    loaded.spec.restart,
                    opened.standbys,
                    save_why,
                )
                _supervise(supervisor, console, loaded.file)


def _say_program(console: Console, plan: Plan) -> None:
    """Say how the program runs when distlaunch chose it (`"keras": "auto"`, PSS servers)."""
    note = plan.program.start_note(plan.strategy)
    if note:
        console.say(note)
    if plan.program.serve_ps_workers:
        console.say(plan.program.serve_reason)


@contextmanager
def _umask(mask: int | None) -> Iterator[None]:
    """Set the process umask for the block (children inherit it); None leaves it alone."""
    if mask is None:
        yield
        return
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def _supervise(supervisor: Supervisor, console: Console, spec_file: Path) -> None:
    plan, book = supervisor.plan, supervisor.book
    try:
        result = supervisor.run()
    except Interrupted as exc:
        _say_worlds(console, book.record.world)
        book.set_state(RunState.INTERRUPTED, exit_code=exc.exit_code, ended_at=time.time())
        raise
    except BaseException:
        book.set_state(RunState.FAILED, exit_code=1, ended_at=time.time())
        raise
    _say_worlds(console, book.record.world)
    # The lines that tell how a run ended are loaded when it has: imported with the module, they
    # would delay its first task (bench/startup.py).
    from distlaunch.launcher.diagnosis.summary import details, headline, preempted_line

    if result.preemption is not None:
        saved = result.preemption
        preempted = {"step": saved.step, "save_s": saved.save_s}
        if saved.late:
            preempted["late"] = True
        line = preempted_line(plan.run_id, preempted, str(spec_file))
        book.record.update({"preempted": preempted})
        book.set_state(RunState.PREEMPTED, exit_code=contract.EXIT_PREEMPTED, ended_at=time.time())
        if saved.late:
            late = supervisor.timeouts.save_s
            console.say(
                f"the save took longer than timeouts.save_s ({late:g} s) and ended within "
                "timeouts.grace_s"
            )
        console.say(line)
        raise Preempted(line)
    if result.failure is None:
        book.set_state(RunState.SUCCEEDED, exit_code=0, ended_at=time.time())
        took = time.time() - book.record.started_at
        console.say(f"run {plan.run_id} succeeded in {took:.1f} s; run dir {plan.run_dir}")
        return
    line = headline(plan.run_id, result.failure)
    found = result.failure
    failure = RunFailure(found.task, found.how, line, found.kind, found.exit_code)
    book.set_state(RunState.FAILED, exit_code=1, ended_at=time.time(), failure=failure)
    console.say(line + "\n" + details(result.failure))
    raise RunFailed(line)


def _say_worlds(console: Console, world: dict | None) -> None:
    """An elastic run's summary line: the worlds it had (``worlds: 3 -> 2 -> 3``)."""
    if world and world.get("worlds"):
        worlds = " -> ".join(str(n) for n in world["worlds"])
        resizes = world.get("resizes", 0)
        console.say(f"worlds: {worlds} (elastic.workers {world.get('workers')}, {resizes} resizes)")


def _new_record(loaded: LoadedSpec, plan: Plan, target: RunTarget) -> RunRecord:
    history = []
    if target.previous:
        history = [*target.previous.history, target.previous.outcome()]
    return RunRecord(
        run_id=plan.run_id,
        name=loaded.spec.name,
        spec_file=str(loaded.file.resolve()),
        spec=masked_spec(loaded.raw),
        strategy=plan.strategy,
        backend=loaded.spec.backend,
        state=RunState.RUNNING,
        attempt=plan.attempt,
        launcher_pid=os.getpid(),
        started_at=time.time(),
        plan=plan.to_json(),
        history=history,
    )
