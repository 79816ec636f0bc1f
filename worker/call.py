"""`python -m distlaunch.worker.call`: the program of every task of `distlaunch.run(fn, ...)`.

It loads the function and its arguments from the run dir's payload (written there by the caller
before any task started), calls it with this task's TF_CONFIG set and no strategy made yet (the
function builds its strategy as a script would), and writes the outcome to this task's result
file, which the caller reads after the run:

- ``{"ok": True, "value": <cloudpickle of the return value>}``
- ``{"ok": False, "kind": "exception", "type", "message", "traceback", "exception": <cloudpickle
  of the exception, or None when it cannot be pickled>}``; the exception is then raised again, so
  that the task fails as a script would (the bootstrap's hook writes its error file, exit code 1)
- ``{"ok": False, "kind": "exit", "code"}``: the function ended the process (``sys.exit``,
  ``exit()`` in a library); the task exits with that status and the caller raises a TaskError
  naming it ("worker-0 exited with status 0 before returning")
- ``{"ok": False, "kind": "result", "type", "message"}``: the return value cannot be pickled; the
  task exits with code 1.

The result file is a plain pickle of that dict, written atomically. The payload is two pickles
in one file, read as a stream (a large argument is never held twice): the call's context (the
caller's ``sys.path``, and for the pool its ``os.environ`` and working directory of the moment
of the call), then the cloudpickled ``(fn, args, kwargs)``.

A function that returns while it leaves a thread running does not hold the task: once its
result is written and its output flushed, the task ends (as the pool's task moves on).

A task of the warm pool (launcher/api/pool.py; run with ``--serve``) serves call after call in
the same interpreter: call 0 as above, then it waits on its wake pipe (a FIFO in the run dir,
``call/wake/<task>``, made before call 0) for the number N of the next call, whose payload is
``call/payload-N.pkl`` and result ``<task>.call-N.pkl``. It tells the caller on a channel of
its own, never in its output (which is the user's): a FIFO ``call/done/<task>`` that it holds
open for writing as long as it lives. It writes ``open`` once, then ``N`` after call N's result
is written and its output flushed; the caller reads EOF there when the task has ended, however
it ended (``os._exit(0)`` in the function included). Each call sees what a one-shot call would:
the caller's environment (plus what the launcher sets for the task) and working directory of
that call, the task's own ``sys.argv``. A call that fails ends the task exactly as a one-shot
task ends; the caller then drops the pool entry.

A MultiWorkerMirroredStrategy made again in a warm task re-enables TensorFlow's collective ops,
which drops the task's collective state: a peer that made its strategy first and already sent
its first all-reduce would see it aborted ("Delete called on non-empty BufRendezvous"). So from
call 1 on, each re-enable waits until every task of the cluster has re-enabled (a barrier of
files in the run dir: ``call/barrier/N.K/<job>-<index>``), as TensorFlow's own pool runner waits
on a barrier after making each test's strategy (strategy_combinations.py).

This module imports neither TensorFlow nor the rest of distlaunch: under ParameterServerStrategy
the launcher then runs its own server on the ps and worker tasks and this module only on the chief
(launcher/plan/program_scan.py), and no warm standby imports TensorFlow in advance for it.
"""

from __future__ import annotations

import atexit
import os
import pickle
import stat
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import cloudpickle

# worker/contract.py's names and layout, spelled out: see the module docstring.
_RUN_DIR, _ROLE, _INDEX, _ATTEMPT = (
    "DISTLAUNCH_RUN_DIR",
    "DISTLAUNCH_ROLE",
    "DISTLAUNCH_INDEX",
    "DISTLAUNCH_ATTEMPT",
)
# The payload and result files, relative to the run dir (launcher/api/call.py reads the same).
PAYLOAD = "call/payload.pkl"
RESULTS = "call/results"
WAKE = "call/wake"
DONE = "call/done"
# A task of the warm pool serves calls until the pool closes (CLOSE) or its run is stopped.
SERVE_ARG = "--serve"
# What a serving task writes first on its done FIFO: the caller then knows that EOF there means
# the task has ended (before it, EOF only means the task has not opened the FIFO yet).
OPEN = "open"
# What the caller writes on a task's wake pipe instead of a call number when the pool closes: the
# task returns, and its run ends as a one-shot call's does, with no signal to wait out.
CLOSE = "close"
BARRIERS = "call/barrier"
_BARRIER_POLL_S = 0.005


def result_path(run_dir: Path, attempt: int, task: str, call: int = 0) -> Path:
    """The result file of ``task`` (``worker-1``) in ``attempt`` for the pool's ``call`` (0: a
    one-shot run's): a restarted task's earlier outcome never stands for its latest."""
    name = f"{task}.pkl" if call == 0 else f"{task}.call-{call}.pkl"
    return run_dir / RESULTS / f"attempt-{attempt}" / name


def payload_path(run_dir: Path, call: int = 0) -> Path:
    """The payload of the pool's ``call`` (0: the first, and a one-shot run's)."""
    return run_dir / (PAYLOAD if call == 0 else f"call/payload-{call}.pkl")


def wake_path(run_dir: Path, task: str) -> Path:
    """The FIFO a serving ``task`` reads the number of its next call from."""
    return run_dir / WAKE / task


def done_path(run_dir: Path, task: str) -> Path:
    """The FIFO a serving ``task`` tells the caller on: ``open``, then each call it finished."""
    return run_dir / DONE / task


def type_name(kind: type) -> str:
    """A class's name as a traceback prints it: ``ValueError``, ``mymodule.MyError``."""
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def exit_status(exc: SystemExit) -> int:
    """The status a process exits with on ``exc``, as the interpreter computes it (None: 0; a
    message: 1)."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def main() -> None:
    """Run this task's call; see the module docstring."""
    run_dir = Path(os.environ[_RUN_DIR])
    task = f"{os.environ.get(_ROLE) or 'worker'}-{int(os.environ.get(_INDEX) or 0)}"
    attempt = int(os.environ.get(_ATTEMPT) or 0)
    if SERVE_ARG not in sys.argv[1:]:
        _call(payload_path(run_dir), result_path(run_dir, attempt, task), task, None)
        _end_if_threads_left()
        return
    # The function sees the argv a one-shot task has (a wrapped script's argparse would reject
    # --serve).
    argv = [a for a in sys.argv if a != SERVE_ARG]
    sys.argv[:] = argv
    wake = wake_path(run_dir, task)
    done = done_path(run_dir, task)
    for fifo in (wake, done):
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo, 0o600)
    # Read and write: opening never blocks, and the pipe never reads EOF while this task lives,
    # so the caller's write of a call number always finds a reader. The done FIFO likewise, and
    # this process is its only writer: when it ends, however, the caller reads EOF.
    told = os.open(done, os.O_RDWR)
    os.write(told, f"{OPEN}\n".encode())
    serving = _Serving(argv)
    with os.fdopen(os.open(wake, os.O_RDWR), "rb") as calls:
        number = 0
        while True:
            _call(
                payload_path(run_dir, number),
                result_path(run_dir, attempt, task, number),
                task,
                serving,
            )
            sys.stdout.flush()
            sys.stderr.flush()
            _end_partial_line()
            os.write(told, f"{number}\n".encode())
            line = calls.readline().decode().strip()
            if line == CLOSE:
                # Every call's result is written and its output flushed: nothing is left to do,
                # and TensorFlow's own exit (the coordination service's shutdown barrier, about
                # 0.7 s here) would only delay the caller's exit, which waits for the run's end.
                os._exit(0)
            number = int(line)
            _Barrier.arm(run_dir / BARRIERS, number)


class _Serving:
    """What a serving task restores before each call: the caller's environment of that call
    with what the launcher set for this task, the caller's working directory, the task's argv."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = list(argv)
        self.own: dict[str, str] | None = None  # what the launcher set, learnt at call 0
        self.dropped: set[str] = set()  # what the launcher removed from the caller's

    def enter(self, context: dict[str, Any]) -> None:
        """Make this task's process look as a one-shot task of this call would."""
        environ = context.get("environ")
        if environ is not None:
            if self.own is None:  # call 0: this environment is the caller's plus the launcher's
                self.own = {k: v for k, v in os.environ.items() if environ.get(k) != v}
                self.dropped = {k for k in environ if k not in os.environ}
            wanted = {k: v for k, v in environ.items() if k not in self.dropped}
            wanted.update(self.own)
            for key in [k for k in os.environ if k not in wanted]:
                del os.environ[key]
            os.environ.update(wanted)
        if context.get("cwd"):
            os.chdir(context["cwd"])
        sys.argv[:] = self.argv


def _end_partial_line() -> None:
    """End the call's last line if the function left it unfinished (``print(..., end="")``):
    the launcher echoes complete lines, and this one would otherwise wait for the next call's
    output (a one-shot task's end would have echoed it). Only where the output is the log file."""
    try:
        if not stat.S_ISREG(os.fstat(1).st_mode):
            return
        with open("/proc/self/fd/1", "rb") as log:
            if log.seek(0, os.SEEK_END) == 0:
                return
            log.seek(-1, os.SEEK_END)
            if log.read(1) != b"\n":
                os.write(1, b"\n")
    except OSError:
        pass


def _end_if_threads_left() -> None:
    """A one-shot task whose function returned (its result is written) ends now, as a script's
    last line would not if it left a thread running: the interpreter would wait for that thread
    forever. The exit handlers still run (TensorFlow's among them)."""
    main_thread = threading.main_thread()
    if not any(
        t.is_alive() and not t.daemon and t is not main_thread for t in threading.enumerate()
    ):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Barrier:
    """From call 1 on, each re-enable of collective ops waits for every task's (see the module
    docstring)."""

    folder: Path | None = None  # this call's barriers
    count = 0  # re-enables so far in this call

    @classmethod
    def arm(cls, folder: Path, number: int) -> None:
        """Call ``number`` starts: its re-enables wait on barriers under ``folder``; the first
        time TensorFlow is loaded here, wrap its re-enable."""
        cls.folder, cls.count = folder / str(number), 0
        context = sys.modules.get("tensorflow.python.eager.context")
        enable = getattr(getattr(context, "Context", None), "enable_collective_ops", None)
        if enable is None or getattr(enable, "distlaunch_barrier", False):
            return

        def enable_collective_ops(self: Any, server_def: Any) -> None:
            enable(self, server_def)
            cls.wait(server_def)

        enable_collective_ops.distlaunch_barrier = True  # type: ignore[attr-defined]
        context.Context.enable_collective_ops = enable_collective_ops  # type: ignore[union-attr]

    @classmethod
    def wait(cls, server_def: Any) -> None:
        """Mark this task's re-enable, then wait for every task of ``server_def``'s cluster."""
        if cls.folder is None:
            return
        folder = cls.folder.with_name(f"{cls.folder.name}.{cls.count}")
        cls.count += 1
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{server_def.job_name}-{server_def.task_index}").touch()
        peers = [
            folder / f"{job.name}-{index}" for job in server_def.cluster.job for index in job.tasks
        ]
        # Polled: it lasts only while a peer has not made its strategy yet (the function's own
        # work before it), and a peer that dies ends the run, and this task with it.
        while not all(p.exists() for p in peers):
            time.sleep(_BARRIER_POLL_S)


def _call(payload_file: Path, out: Path, task: str, serving: _Serving | None) -> None:
    """Run the call of ``payload_file``; write its outcome to ``out`` (see the module
    docstring); a failure ends the task."""
    with payload_file.open("rb") as stream:
        context = pickle.load(stream)
        # The caller's import path: a function of a module it imported (a test file, a package
        # beside its notebook) is pickled by reference and imported again here.
        sys.path.extend(p for p in context["sys_path"] if p not in sys.path)
        if serving is not None:
            serving.enter(context)
        fn, args, kwargs = cloudpickle.load(stream)
    try:
        value = fn(*args, **kwargs)
    except SystemExit as exc:
        _write(out, {"ok": False, "kind": "exit", "code": exit_status(exc)})
        raise
    except BaseException as exc:
        _write(out, _exception(exc))
        raise
    finally:
        del args, kwargs  # a large argument is not held while the task waits for the next call
    try:
        data = cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raised, it is reported as data
        kind = type_name(type(value))
        _write(out, {"ok": False, "kind": "result", "type": kind, "message": str(exc)})
        sys.stderr.write(
            f"distlaunch.run: {task} returned a {kind}, which cannot be pickled: {exc}\n"
        )
        sys.exit(1)
    _write(out, {"ok": True, "value": data})


def _exception(exc: BaseException) -> dict[str, Any]:
    try:
        pickled: bytes | None = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the caller then gets a TaskError with the text below
        pickled = None
    return {
        "ok": False,
        "kind": "exception",
        "type": type_name(type(exc)),
        "message": str(exc),
        # From the function's own frame: this module's is no news to the user.
        "traceback": "".join(
            traceback.format_exception(
                type(exc), exc, exc.__traceback__ and exc.__traceback__.tb_next
            )
        ),
        "exception": pickled,
    }


def _write(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically: the caller never reads half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(pickle.dumps(data))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
