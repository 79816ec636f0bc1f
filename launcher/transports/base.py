"""The interface between the supervisor and the places tasks run: a Transport and its TaskHandles.

The supervisor knows nothing else of a backend. A transport starts a planned task and returns a
handle; the handle says when the task has exited (an fd that turns readable, which the
supervisor's one `select` watches), how it exited, and whether its TensorFlow server has joined.
Stopping is the transport's: it knows whether SIGTERM goes to a local process group, a remote
helper or a container; so is reading a task's stacks (`stacks`), for the same reason.

A backend (the spec's `backend`) is one `Backend` class: how it plans (`plan`, pure apart from
the port lookup), how one `up` opens it (`open`: preflight, then the plan, then a transport, each
released on the way out), what `down` does after its launcher died (`cleanup`), where `distlaunch
stacks` reads a task (`stacks`) and its own section of run.json. launcher/core/backends.py names
them all; `load_backend` imports the one a run uses. A new backend is one module with one of these.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from distlaunch.launcher.core import backends
from distlaunch.launcher.core.console import Console
from distlaunch.launcher.plan.plan import Plan, TaskPlan
from distlaunch.launcher.spec.model import LoadedSpec

if TYPE_CHECKING:
    from distlaunch.launcher.diagnosis.stacks import Source
    from distlaunch.launcher.record.state import RunRecord, TaskRecord


class TaskHandle(Protocol):
    """One started task as the supervisor watches it."""

    task: TaskPlan
    # a warm standby became this task (launcher/transports/local/standby.py): it skipped the imports
    warm: bool

    @property
    def pid(self) -> int:
        """The local process that stands for the task (also its process group id)."""

    @property
    def exit_fd(self) -> int:
        """An fd that becomes readable once the task has exited (a pidfd for a local process)."""

    def exit_status(self) -> int | None:
        """The task's exit status once it has exited (negative: killed by that signal), else None.

        Reaps what the transport must reap; cheap to call again."""

    def joined(self) -> bool:
        """Whether the task's TensorFlow server accepts connections on its port."""

    def close(self) -> None:
        """Release what the handle holds (fds, pipes); safe to call more than once."""


class Transport(Protocol):
    """Starts and stops tasks. After `stop` or `kill` returns, every handle has an exit status."""

    def start(self, task: TaskPlan) -> TaskHandle:
        """Start one task; its output goes to its log file."""

    def stop(self, handles: Sequence[TaskHandle], grace_s: float) -> None:
        """Stop these tasks: SIGTERM, ``grace_s``, SIGKILL."""

    def kill(self, handles: Sequence[TaskHandle]) -> None:
        """Kill these tasks now (nothing of theirs is worth a grace period)."""

    def stacks(self, handle: TaskHandle, native: bool) -> Source:
        """Where the task's stacks are read: its program, where it runs (never the local client
        that stands for a remote task). Calling the source may signal that program alone."""


class NoticeTransport(Transport, Protocol):
    """A transport that can send a stop notice (the supervisor asks the others to stop at once)."""

    def notify(self, handles: Sequence[TaskHandle]) -> bool:
        """Ask these tasks to save and stop: SIGTERM to each one's program process alone. False,
        with nothing sent, where the transport cannot reach some task's program alone."""


class ResizeTransport(Transport, Protocol):
    """A transport that can tell an elastic run which of its machines are gone and whether one
    answers again (launcher/run/elastic.py). Both methods are optional capabilities: the
    supervisor looks each up with ``getattr``; a transport with neither still runs an elastic
    range on its slots (restarts exhausted hold a slot out; it rejoins after its cooldown).

    Threads: `probe` is only ever called from the elastic run's probe threads, never from the
    supervisor's loop, and may block for as long as one connection attempt takes (bound it:
    a few seconds to ``connect_timeout_s``); several probes of different machines may run at
    once. `lost_hosts` is called from the loop every quarter second and must not block: answer
    from what the transport already knows (its agents' channels, the scheduler's node states
    polled in a thread of its own).
    """

    def probe(self, host_name: str) -> bool:
        """Whether the machine the spec calls ``host_name`` answers now, well enough to run a
        task again: e.g. a fresh SSH connection that runs ``true``, or a Slurm node that is
        neither DOWN, DRAIN nor FAIL and still in the allocation. False on any error or timeout;
        never raises."""

    def lost_hosts(self) -> Mapping[str, str]:
        """The machines of the run that are lost now, by ``host_name``, each with why in a few
        words for the run's lines ("node DOWN: Not responding", "agent lost: ssh: connect to host
        ... timed out"). A state, not a queue: a machine stays listed while it is lost and goes
        off the list once it is usable again (for SSH: once a task starts there again). Every
        task still running on a lost machine must also end (with agent_link.LOST_EXIT) for the
        gang to restart at once; the supervisor acts on a listed machine of the current world
        even before its tasks end (a Slurm node set DOWN whose steps linger)."""


class StandbyPool(Protocol):
    """A transport's warm standbys (launcher/transports/local/standby.py); the transport's `start`
    uses one made for exactly the task plan it starts. The supervisor says when to make them, and
    for which plans."""

    def prepare(self, tasks: Sequence[TaskPlan]) -> None:
        """Have one standby for exactly each of ``tasks`` the transport runs; drop the others."""

    def poll(self) -> None:
        """Note which standbys are ready (for `record`)."""

    def record(self) -> dict:
        """run.json's ``standbys``: per task, the standby's pid, attempt and readiness."""

    def close(self) -> None:
        """Kill every standby; return once nothing of theirs is left."""


class Section(Protocol):
    """A backend's own section of run.json (`RunRecord.section`), under its registry key."""

    def to_json(self) -> dict[str, Any]:
        """The section as JSON data."""


@dataclass
class Opened:
    """A backend opened for one run: its transport and what `up` records and says about it."""

    transport: Transport
    record: dict = field(default_factory=dict)  # run.json fields (the sandbox, the network...)
    section: Section | None = None  # the backend's own run.json section (SSH hosts, the job...)
    notes: tuple[str, ...] = ()  # lines `up` prints before the tasks start
    console: Console | None = None  # a console that prefixes lines differently (task@host)
    standbys: StandbyPool | None = None  # the local tasks' warm standbys: the supervisor tends them
    # The most the source of a stop notice leaves to save (Slurm's --signal lead, GraceTime):
    # the run's save deadline is the smaller of this and timeouts.save_s; ``save_why`` names it.
    save_s: float | None = None
    save_why: str | None = None


class Launch(Protocol):
    """One `up` of a backend, in order: `plan` (after any preflight), then `open` its transport."""

    def plan(self, run_id: str, run_dir: Path, attempt: int) -> Plan:
        """The attempt's plan; SSH hosts are checked first (HostError, nothing started)."""

    def open(self, plan: Plan) -> AbstractContextManager[Opened]:
        """The transport for ``plan``; on the way out everything it holds is released."""


@dataclass(frozen=True)
class UpOptions:
    """What `up` asks of a backend beyond the spec; each backend reads what applies to it."""

    # compose: the tasks' image tag and the base it is built on (None: the defaults)
    image: str | None = None
    base_image: str | None = None
    requeue: bool = False  # slurm: requeue the batch job stopped by its pre-timeout signal


class TaskStacks(Protocol):
    """Where a task of a recorded run has its stacks read (`Backend.stacks`)."""

    def __call__(self, plan: dict, entry: TaskRecord, native: bool) -> Source:
        """The source of the task ``plan`` (its run.json plan entry) whose record is ``entry``."""


class Backend(Protocol):
    """A kind of backend, named in launcher/core/backends.py (see the module docstring). One
    installed through an entry point states the registry's facts (`backends.Entry`) as class
    attributes: ``section_key``, ``hosts_are_nodes``, ``own_python``, ``resizes``."""

    name: ClassVar[str]
    title: ClassVar[str]  # how messages name it: "cancelled Slurm 12.3"

    def plan(self, loaded: LoadedSpec, run_id: str, run_dir: Path, attempt: int) -> Plan:
        """A dry run's plan (`plan`, `tfconfig`): no host contacted, nothing started."""

    def open(
        self, loaded: LoadedSpec, console: Console, options: UpOptions
    ) -> AbstractContextManager[Launch]:
        """One `up` of the backend; on the way out everything it holds is released."""

    def cleanup(
        self, record: RunRecord, run_dir: Path, grace_s: float
    ) -> AbstractContextManager[list[str]]:
        """What `down` does for what outlives a dead launcher elsewhere (job steps, containers),
        around its sweep of the run's local processes (the block); the list it yields names
        what it cancelled, for `down` to say."""

    def stacks(self, record: RunRecord, run_dir: Path) -> AbstractContextManager[TaskStacks]:
        """Where `distlaunch stacks` reads the tasks of the live run ``record``, from its run.json
        (the same functions the supervisor's captures use)."""


def load_backend(name: str) -> Backend:
    """The backend called ``name`` (UnknownBackend when there is none); only its module is
    imported."""
    return backends.load_class(backends.entry(name).target)()


def exit_description(status: int) -> str:
    """Describe an exit status: ``exit code 3`` or ``signal SIGKILL``."""
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit code {status}"
