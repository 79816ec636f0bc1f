"""What the Python API hands back: a run's result, its root-cause failure as data, and the errors
that carry them. Plain data, no process handling; nothing here imports TensorFlow."""

from __future__ import annotations

import enum
import pickle
import re
from dataclasses import dataclass

from distlaunch.launcher.core.errors import LaunchError
from distlaunch.launcher.core.errors import RunFailed as _CliRunFailed


class FailureKind(enum.StrEnum):
    """How the root-cause task ended."""

    EXCEPTION = "exception"  # it raised: the exception's type, message and traceback are known
    EXIT = "exit"  # it exited with a non-zero code, no exception recorded
    SIGNAL = "signal"  # a signal ended it (SIGKILL, SIGSEGV...)
    OOM = "oom"  # the kernel's OOM killer ended it
    HANG = "hang"  # it stopped making progress (silence_s, heartbeat_s) and was killed
    STARTUP = "startup"  # it did not start its TensorFlow server within startup_s
    FORMATION = "formation"  # the cluster never formed (timeouts.formation_s)
    TIMEOUT = "timeout"  # the run hit timeouts.run_s
    OTHER = "other"


# The supervisor's `how` (supervisor.py, oom.py), first match wins.
_KINDS = (
    (re.compile(r"^killed by the OOM killer"), FailureKind.OOM),
    (re.compile(r"^signal "), FailureKind.SIGNAL),
    (re.compile(r"^exit code "), FailureKind.EXIT),
    (re.compile(r"^(hung|no heartbeat|stopped answering)"), FailureKind.HANG),
    (re.compile(r"^did not start its TensorFlow server"), FailureKind.STARTUP),
    (re.compile(r"^never connected"), FailureKind.FORMATION),
    (re.compile(r"time limit"), FailureKind.TIMEOUT),
)


def failure_kind(how: str, has_exception: bool) -> FailureKind:
    """The kind of a failure the supervisor described as ``how``; an exit with a recorded
    exception is an EXCEPTION."""
    kind = next((k for pattern, k in _KINDS if pattern.search(how)), FailureKind.OTHER)
    return FailureKind.EXCEPTION if kind is FailureKind.EXIT and has_exception else kind


@dataclass(frozen=True)
class Failure:
    """The root cause of a failed run, as data: the task that failed first and how."""

    kind: FailureKind
    task: str  # e.g. "worker-1"
    summary: str  # the one line the CLI prints: "run X failed: worker-1 exit code 1 after ..."
    how: str  # the supervisor's words: "exit code 1", "signal SIGKILL", "killed by the OOM killer"
    exit_code: int | None = None  # the task's exit code, when it exited
    signal: str | None = None  # e.g. "SIGKILL", when a signal ended it
    exception_type: str | None = None  # e.g. "ValueError" (as printed), when it raised
    message: str | None = None  # the exception's message
    traceback: str | None = None  # the task's traceback text, when known


@dataclass(frozen=True)
class RunResult:
    """How a run ended (``state`` "running" while it runs)."""

    state: str  # "succeeded", "failed", "interrupted", "running", "lost", ...
    exit_code: int | None  # what `distlaunch up` exits with: 0, 1, 2 or 128+N
    failure: Failure | None = None

    @property
    def ok(self) -> bool:
        """Whether the run succeeded."""
        return self.state == "succeeded"


class RunFailed(_CliRunFailed):
    """A run did not succeed (`distlaunch.up`; `distlaunch.run` when its run was stopped);
    ``.result`` says how and ``.failure`` is its root cause (None when it was interrupted or
    could not finish)."""

    def __init__(self, message: str, result: RunResult, run_dir: str) -> None:
        super().__init__(message)
        self.result = result
        self.failure = result.failure
        self.run_dir = run_dir


class StartError(LaunchError):
    """The launcher could not start the run: an SSH host that failed its check, a Docker engine
    or network sandbox that cannot run it (where the CLI exits 2). The message is the CLI's
    line; nothing was started."""


class TaskError(LaunchError):
    """A task of `distlaunch.run` failed and its own exception cannot be raised here: it was
    killed (a signal, the OOM killer, a hang), or its exception does not unpickle here.
    ``str()`` is the root-cause line; the fields say the rest."""

    def __init__(
        self,
        message: str,
        *,
        task: str,
        run_dir: str,
        failure: Failure | None = None,
        type_name: str | None = None,
        traceback_text: str | None = None,
    ) -> None:
        super().__init__(message)
        self.task = task
        self.run_dir = run_dir
        self.failure = failure
        self.type_name = type_name
        self.traceback_text = traceback_text


class PicklingError(LaunchError, pickle.PicklingError):
    """What `distlaunch.run` must send or bring back cannot be pickled: a function or argument
    (nothing was started), or a task's return value (names the task and the type)."""


class RemoteTraceback(Exception):
    """The cause chained to a task's exception raised in the caller: its traceback in the task,
    as concurrent.futures chains a worker's."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'
