"""How every task's program starts: the error hook, then the script or module, as Python would.

The launcher runs ``PYTHON .../distlaunch/launcher/host/bootstrap.py SCRIPT ARGS...`` (by path, so that
any interpreter works, also one without distlaunch installed) or, where distlaunch is installed
(SSH hosts, containers), ``PYTHON -m distlaunch.host.bootstrap -m MODULE ARGS...``.

A warm standby (launcher/transports/local/standby.py) runs the task's own command, with the env, cwd
and output of the task's next attempt and one more variable, DISTLAUNCH_STANDBY: the socket FD it
talks on and the env writes the program makes before its TensorFlow import
(launcher/plan/program_env.py). It removes that variable, sets ``sys.argv`` and ``sys.path[0]`` as
below, makes those writes, imports TensorFlow and the plan's Keras (so they read the env at import
as in a cold start), undoes the writes, writes ``r`` (ready) on FD and blocks on it. ``g`` (go)
closes FD and goes on exactly as a cold start does from there; EOF (the launcher discards it) or a
failed import ends it quietly, and its output, never linked into the run dir, vanishes with it. Its
command line (``/proc/PID/cmdline``, ``sys.orig_argv``) is a cold start's; only its initial
environment (``/proc/PID/environ``) still names DISTLAUNCH_STANDBY.

Before a line of the program runs, an excepthook is in place that writes an uncaught exception to
DISTLAUNCH_ERROR_FILE. So an import or syntax error in the entry script or module is recorded too,
also for scripts that never import ``distlaunch.worker``, and the launcher never retries it.

The program cannot tell it was started this way: ``sys.argv``, ``__main__``, ``__name__``,
``__file__``, ``sys.path[0]`` and the working directory are what ``python SCRIPT`` or ``python -m
MODULE`` give, and the traceback Python prints starts at the program's own frames. This file uses
the standard library only (it may run where distlaunch is not importable); the error file has the
format of `distlaunch.worker.runtime`'s hook, which leaves this hook in place.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType

# The names of worker/contract.py, spelled out: this file imports nothing of distlaunch.
_ERROR_FILE, _ROLE, _INDEX, _ATTEMPT, _RUN_DIR = (
    "DISTLAUNCH_ERROR_FILE",
    "DISTLAUNCH_ROLE",
    "DISTLAUNCH_INDEX",
    "DISTLAUNCH_ATTEMPT",
    "DISTLAUNCH_RUN_DIR",
)
# contract.STACKS_SIGNAL_NAME and contract.stacks_signal_path's layout.
_STACKS_SIGNAL = "SIGUSR2"
_KERAS, _TF_KERAS = "DISTLAUNCH_KERAS", "tf_keras"  # contract.KERAS, contract.TF_KERAS
# contract.STRATEGY, contract.MWMS, contract.KERAS3: where the Keras 3 layer goes in.
_STRATEGY, _MWMS, _KERAS3 = "DISTLAUNCH_STRATEGY", "multi_worker_mirrored", "keras3"
# A standby's only difference from its task: {"fd": control socket, "env": [[op, name, value]]}
# (op: program_env's set, setdefault, putenv, unset).
STANDBY_ENV = "DISTLAUNCH_STANDBY"
READY, GO = b"r", b"g"
_stack_file = None  # kept open for the life of the task: faulthandler writes to its fd
# Frames of these files come before the program's own in a traceback and are left out of it.
_OWN_FILES = {
    os.path.abspath(__file__),
    os.path.abspath(runpy.__file__),
    "<frozen runpy>",
}


def main(args: list[str]) -> None:
    """Run ``SCRIPT ARGS...`` or ``-m MODULE ARGS...`` as ``python`` would, the hook installed;
    as a standby, only once the launcher says go (see the module docstring)."""
    standby = os.environ.pop(STANDBY_ENV, None)
    if not args or args[:1] == ["-m"] and len(args) < 2:
        sys.exit("usage: bootstrap.py SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # argv[0] becomes the module's file, as with `python -m`
        sys.path[0] = os.getcwd()
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
    if standby is not None:
        order = json.loads(standby)
        wait_as_standby(order["fd"], order["env"])
    install_error_hook()
    install_stack_dump()
    install_keras3_layer()
    if args[0] == "-m":
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(args[0], run_name="__main__")


def wait_as_standby(fd: int, writes: list[list[str]]) -> None:
    """With the program's env ``writes`` made, import TensorFlow and the plan's Keras, undo the
    writes, say ready on socket ``fd``, and return on go; exit quietly on anything else (a failed
    import: the task then restarts cold, and fails there the way the program would)."""
    try:
        undo = _write_env(writes)
        import tensorflow  # noqa: F401

        __import__(_TF_KERAS if os.environ.get(_KERAS) == _TF_KERAS else "keras")
        undo()
    except BaseException:  # noqa: BLE001 - whatever it was, a cold start does it better
        os._exit(1)
    try:
        os.write(fd, READY)
    except OSError:
        pass  # the launcher said go before the imports were done, and closed its end
    try:
        go = os.read(fd, 1)  # a go sent before the launcher closed its end is still there
    except OSError:
        go = b""
    os.close(fd)
    if go != GO:
        os._exit(0)


def _write_env(writes: list[list[str]]) -> Callable[[], None]:
    """Make the program's env ``writes``; return what puts every name they touch back as it was
    (in os.environ and in the C environment both), leaving all else as the imports left it."""
    before = {name: os.environ.get(name) for _, name, _ in writes}
    for op, name, value in writes:
        if op == "set":
            os.environ[name] = value
        elif op == "setdefault":
            os.environ.setdefault(name, value)
        elif op == "putenv":  # the C environment only, as os.putenv leaves os.environ alone
            os.putenv(name, value)
        elif op == "unset":
            os.environ.pop(name, None)
        else:
            raise ValueError(f"unknown env write {op!r}")

    def undo() -> None:
        for name, value in before.items():
            if value is not None:
                os.environ[name] = value
            else:
                os.environ.pop(name, None)
                os.unsetenv(name)  # also what putenv wrote, which os.environ never saw

    return undo


def install_keras3_layer() -> None:
    """Where the plan runs Keras 3 under MWMS, put distlaunch.worker.keras3's post-import hook
    in place: it patches Keras once the program imports it (nothing is imported now). Where
    distlaunch is not importable here, that import of keras stops the task in one line."""
    if os.environ.get(_KERAS) != _KERAS3 or os.environ.get(_STRATEGY) != _MWMS:
        return
    try:
        from distlaunch.worker.keras3 import install
    except ImportError:
        sys.meta_path.insert(0, _NoLayer())
        return
    install()


class _NoLayer:
    """Stops an ``import keras`` where the layer cannot be imported (no distlaunch here)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == "keras":
            print(
                f"distlaunch: Keras 3 under MultiWorkerMirroredStrategy needs distlaunch "
                f"installed for {sys.executable} (its Keras 3 layer); install it there or set "
                '"keras": "tf_keras"',
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(2)


def install_error_hook() -> None:
    """Wrap sys.excepthook: write an uncaught exception to DISTLAUNCH_ERROR_FILE, then print it
    without the bootstrap's own frames."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        while tb is not None and _own(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        exc.__traceback__ = tb
        try:
            _write_error_file(exc_type, exc, tb)
        except Exception as error:  # noqa: BLE001 - the original error must still be printed
            print(
                f"distlaunch: could not write the error file: {error!r}",
                file=sys.stderr,
            )
        previous(exc_type, exc, tb)

    hook._distlaunch_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def install_stack_dump() -> None:
    """On SIGUSR2, dump every thread's stack (faulthandler: also while the main thread is stuck
    in C code) into RUN/stacks/signal-attempt-N/<task>.txt: the launcher's fallback where py-spy
    cannot read the task. The file exists once the handler is in place."""
    global _stack_file
    run_dir = os.environ.get(_RUN_DIR)
    if not run_dir or not hasattr(faulthandler, "register"):
        return
    name = f"{os.environ.get(_ROLE) or 'worker'}-{int(os.environ.get(_INDEX) or 0)}.txt"
    folder = os.path.join(run_dir, "stacks", f"signal-attempt-{int(os.environ.get(_ATTEMPT) or 0)}")
    try:
        os.makedirs(folder, exist_ok=True)
        # Kept open for the task's life: faulthandler writes to its fd.
        _stack_file = open(os.path.join(folder, name), "a")  # noqa: SIM115
    except OSError:
        return  # a task without the fallback still runs
    faulthandler.register(getattr(signal, _STACKS_SIGNAL), file=_stack_file, all_threads=True)


def _own(filename: str) -> bool:
    return filename in _OWN_FILES or os.path.abspath(filename) in _OWN_FILES


def _write_error_file(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    path = os.environ.get(_ERROR_FILE)
    if not path:
        return
    module = exc_type.__module__
    record = {
        "type": exc_type.__qualname__
        if module == "builtins"
        else f"{module}.{exc_type.__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
        "time": time.time(),
        "pid": os.getpid(),
        "role": os.environ.get(_ROLE) or "worker",
        "index": int(os.environ.get(_INDEX) or 0),
        "attempt": int(os.environ.get(_ATTEMPT) or 0),
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    main(sys.argv[1:])
