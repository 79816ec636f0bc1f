"""`distlaunch up`: a loaded spec becomes a run directory, a plan, and a supervised run."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from distlaunch.launcher import ports, procs, rundir
from distlaunch.launcher.transports import compose_file as compose, netns, preflight, ssh
from distlaunch.launcher.console import Console
from distlaunch.launcher.errors import Interrupted, RunFailed, UsageError
from distlaunch.launcher.transports.image import ImageRequest
from distlaunch.launcher.transports.local import LocalTransport
from distlaunch.launcher.plan import Plan, make_plan, masked_spec
from distlaunch.launcher.transports.routing import HostRouter
from distlaunch.launcher.spec import LoadedSpec
from distlaunch.launcher.summary import details, headline
from distlaunch.launcher.supervisor import Supervisor

ISOLATED_NOTE = (
    "isolated: tasks run in a private network namespace (loopback only: their ports cannot be "
    'reached from outside the run, and they cannot reach the network; "isolation": "off" turns it off)'
)
EXPOSURE_NOTE = (
    "note: ports {ports} can be reached from other machines: TensorFlow's gRPC servers listen on every "
    "interface with no authentication, and {reason}. To prevent it, {remedy} (README: Security)"
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
    if run_id is not None:
        rundir.check_run_id(run_id)
    if resume and run_id is None:
        found = rundir.latest_unfinished(shared, loaded.spec.name)
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
    if not run_dir.is_symlink() and not (run_dir / rundir.RUN_JSON).is_file():
        raise UsageError(
            f"run dir {run_dir} already exists and holds no run; pick another --run-id"
        )
    rundir.check_existing(run_dir, loaded.spec.permissions == "private")
    previous = rundir.read_json(run_dir / rundir.RUN_JSON)
    if not isinstance(previous, dict):
        raise UsageError(f"{run_dir / rundir.RUN_JSON} is not a run record")
    if previous.get("state") in (rundir.RUNNING, rundir.STOPPING) and procs.pid_alive(previous.get("launcher_pid")):
        raise UsageError(f"run {run_id} is still running (launcher pid {previous['launcher_pid']}); `distlaunch down {run_id}` first")
    return RunTarget(run_id, run_dir, int(previous.get("attempt", 0)) + 1, previous)


def build_plan(loaded: LoadedSpec, target: RunTarget, remote_ports: dict[ports.TaskKey, int] | None = None) -> Plan:
    """Decide the isolation, allocate ports and build the plan of this attempt (nothing started).

    ``remote_ports`` are the SSH tasks' ports as preflight checked or picked them on their hosts.
    With the compose backend, tasks are containers reached at their service names (compose.compose_plan).
    """
    if loaded.spec.backend == "compose":
        return compose.compose_plan(loaded, target.run_id, target.run_dir, target.attempt)
    isolation = netns.decide(loaded)
    return make_plan(
        loaded, ports.allocate(loaded, private=isolation.private, remote=remote_ports), target.run_id,
        target.run_dir, target.attempt, os.environ.get("CUDA_VISIBLE_DEVICES"), isolation=isolation,
    )


def up(loaded: LoadedSpec, target: RunTarget, console: Console, image: ImageRequest | None = None) -> None:
    """Run the job to its end; raise RunFailed or Interrupted (after full teardown) if it did not succeed.

    SSH hosts are checked first (HostError, nothing started, when one is not usable). With the
    compose backend the tasks run in containers of ``image`` (see `_up_compose`).
    """
    if loaded.spec.backend == "compose":
        _up_compose(loaded, target, console, image or ImageRequest())
        return
    private = loaded.spec.permissions == "private"
    umask = rundir.PRIVATE_UMASK if private else None
    remote_hosts = {name: host for name, host in loaded.hosts.items() if host.transport == "ssh"}
    # The session's master connections outlive every task; they are closed last.
    with ssh.Session(remote_hosts) as session:
        reports = preflight.check(loaded, session, umask)
        for report in reports:
            console.say(f"host {session.target(report.name)}: {report.summary()}")
        plan = build_plan(loaded, target, preflight.picked_ports(reports))
        with _umask(umask), netns.sandbox(plan.isolation, plan.run_id) as sandbox, \
                ssh.SshTransport(session, loaded.spec.timeouts.grace_s, umask) as remote:
            rundir.make_dirs(target.run_dir, target.attempt, private)
            record = _new_record(loaded, plan, target)
            if sandbox is not None:
                record["netns_holder_pid"] = sandbox.pid
            if reports:
                record["ssh"] = ssh.record(loaded, [r.name for r in reports])
            verb = "resuming" if target.previous else "starting"
            console.say(f"{verb} run {plan.run_id} (attempt {plan.attempt}): {len(plan.tasks)} tasks, {plan.strategy}; run dir {plan.run_dir}")
            console.say(_network_note(plan))
            _say_program(console, plan)
            if reports and not loaded.spec.shared_dir_is_shared:
                console.say(f"SSH hosts keep their run files on their own disks; `distlaunch collect {plan.run_id}` copies them here")
            # The sandbox closes only after the supervisor has stopped every task in it.
            transport = HostRouter(LocalTransport(sandbox), remote)
            shown = HostConsole(console, plan) if reports else console
            _supervise(Supervisor(plan, record, shown, loaded.spec.timeouts, transport, loaded.spec.restart), target, console)


class HostConsole(Console):
    """``console`` with each task's host in its line prefix (``worker-0@node1 | ``), for runs on several hosts."""

    def __init__(self, console: Console, plan: Plan) -> None:
        super().__init__(console.out, console.err, console.color)
        self.hosts = {t.name: t.host_name for t in plan.tasks}
        self.extra = max(len(h) + 1 for h in self.hosts.values())

    def prefix(self, name: str, number: int, width: int) -> bytes:
        """The base prefix of ``name@host``, widened by the longest ``@host``."""
        return super().prefix(f"{name}@{self.hosts[name]}", number, width + self.extra)


def _up_compose(loaded: LoadedSpec, target: RunTarget, console: Console, image: ImageRequest) -> None:
    """`up` with every task in a container: the same run dir, supervisor and decisions as a local run."""
    # Imported here: a local run never needs the docker modules.
    from distlaunch.launcher.transports.compose import open_transport

    private = loaded.spec.permissions == "private"
    plan = build_plan(loaded, target)
    with _umask(rundir.PRIVATE_UMASK if private else None):
        rundir.make_dirs(target.run_dir, target.attempt, private)
        record = _new_record(loaded, plan, target)
        verb = "resuming" if target.previous else "starting"
        console.say(f"{verb} run {plan.run_id} (attempt {plan.attempt}): {len(plan.tasks)} tasks in containers, {plan.strategy}; run dir {plan.run_dir}")
        _say_program(console, plan)
        with open_transport(loaded, plan, image, console) as transport:
            record["compose"] = transport.describe()
            console.say(f"compose project {transport.project}: {compose.ISOLATION.reason}")
            _supervise(Supervisor(plan, record, console, loaded.spec.timeouts, transport, loaded.spec.restart), target, console)


def _say_program(console: Console, plan: Plan) -> None:
    """Say how the program runs when distlaunch chose it (`"keras": "auto"`, PSS servers)."""
    note = plan.program.start_note(plan.strategy)
    if note:
        console.say(note)
    if plan.program.serve_ps_workers:
        console.say(plan.program.serve_reason)


def _network_note(plan: Plan) -> str:
    """The one line `up` prints about who can reach the tasks' ports."""
    if plan.isolation.private:
        return ISOLATED_NOTE
    ports = ", ".join(str(t.port) for t in plan.tasks)
    return EXPOSURE_NOTE.format(ports=ports, reason=plan.isolation.reason, remedy=plan.isolation.remedy)


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


def _supervise(supervisor: Supervisor, target: RunTarget, console: Console) -> None:
    plan, record = supervisor.plan, supervisor.record
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
        "spec": masked_spec(loaded.raw),
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
