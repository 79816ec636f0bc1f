"""Typed errors raised by launcher code; only the CLI turns them into exit codes."""

from __future__ import annotations


class LaunchError(Exception):
    """Base of every error the launcher reports to the user as one line.

    Every one pickles and unpickles as itself, fields and notes included, whatever its
    ``__init__`` takes (a sweep's ProcessPoolExecutor or multiprocessing.Pool sends it back to
    its parent that way): it is rebuilt from its ``args`` and ``__dict__``, not by calling
    ``__init__`` again."""

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuilt, (type(self), self.args), self.__dict__)


def _rebuilt(kind: type[LaunchError], args: tuple[object, ...]) -> LaunchError:
    """An unpickled LaunchError of ``kind`` with ``args`` (its fields follow as its state)."""
    error = kind.__new__(kind)
    error.args = args
    return error


class SpecError(LaunchError):
    """A cluster spec is malformed: names the file, the JSON path and what was expected."""

    def __init__(self, file: str, json_path: str, message: str) -> None:
        self.file = file
        self.json_path = json_path
        self.message = message
        super().__init__(f"{file}: {json_path}: {message}")


class UsageError(LaunchError):
    """The command line names something that does not exist (a task, a run)."""


class HostError(LaunchError):
    """An SSH host cannot be used: unreachable, refused the key, lacks Python or distlaunch, a
    port is taken there... One line per problem, each naming its host. Exit 2 like a bad spec:
    nothing was started, and the fix is in the spec or on the host."""

    def __init__(self, what: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(what + "".join(f"\n  {line}" for line in problems))


class RecordError(LaunchError):
    """The run dir cannot be written (a full disk, a lost mount): the run was stopped, since
    nothing it did could be recorded."""


class RunFailed(LaunchError):
    """A task of the run failed; the message is the root-cause summary."""


class Preempted(LaunchError):
    """The run saved on a stop notice and stopped; the message says where `--resume` goes on."""


class Interrupted(LaunchError):
    """The launcher was stopped by a signal; everything it started has been torn down."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: every task was stopped")


def last_message(stderr: str) -> str:
    """The line of a failed command's stderr that says what went wrong (ssh's, srun's, docker's
    or the remote helper's: the last one, past ssh's ``Warning:`` lines); "" if none."""
    lines = [
        line.strip()
        for line in stderr.splitlines()
        if line.strip() and not line.startswith("Warning:")
    ]
    return lines[-1] if lines else ""
