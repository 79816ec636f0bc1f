"""Where a task is: every thread's stack from py-spy, saved to the run dir and told in one line.

A stuck multi-worker job looks the same from outside whichever task is at fault: every task is
silent. Their stacks tell them apart: the task that is stuck in its own code (a sleep, a lock,
an endless loop) is the hung one; its peers wait inside TensorFlow (a collective all-reduce, the
coordination service, ``ClusterCoordinator.join``, ``tf.data`` input) for it.

Why py-spy: it reads a live interpreter's memory from outside (ptrace), needs nothing inside the
task, works while the GIL is held or the main thread sits in C++, and with ``--native`` shows the
C++ frames TensorFlow waits in. Hand-made ptrace or gdb scripts would be worse at all of that.

This module runs py-spy, parses its text and summarises it; it writes only the stacks files it
is asked to, and never stops a task. A capture goes where the task runs: each transport names
its tasks' source (`Transport.stacks`), which the supervisor and `distlaunch stacks` both ask.
The only signal ever sent is the faulthandler fallback's SIGUSR2, to the task's program itself
(never to an ssh, srun or compose client standing for it), once its handler is in place.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from distlaunch.launcher.core.errors import last_message
from distlaunch.launcher.record import rundir
from distlaunch.worker import contract

# py-spy pauses the task while it reads it; native unwinding of a TensorFlow process (hundreds of
# threads, a 1 GB library) takes seconds on a busy machine.
DUMP_TIMEOUT_S = 60.0
# How long a task may take to write its faulthandler dump after the signal.
SIGNAL_TIMEOUT_S = 5.0
# How long the remote helper may take to answer a stacks query: py-spy with native frames, then
# without, then the faulthandler, plus a connection or a job step to get there.
HELPER_TIMEOUT_S = 2 * DUMP_TIMEOUT_S + SIGNAL_TIMEOUT_S + 30
STACKS_DIR = "stacks"

# `Thread 30246 (idle): "MainThread"`
_THREAD = re.compile(
    r'^Thread (?P<id>0x[0-9a-fA-F]+|\d+) \((?P<state>[^)]*)\)(?:: "(?P<name>.*)")?$'
)
# faulthandler's: `Current thread 0x00007f (most recent call first):` and
# `  File "/x/task.py", line 22 in train`
_FH_THREAD = re.compile(
    r"^(?P<current>Current thread|Thread) (?P<id>0x[0-9a-fA-F]+) \(most recent call first\):$"
)
_FH_FRAME = re.compile(r'^\s+File "(?P<where>.*)", line (?P<line>\d+) in (?P<func>.+)$')
# `    f (file.py:12)` (Python); `    clock_nanosleep (libc.so.6)` (native)
_FRAME = re.compile(r"^\s+(?P<func>.+?) \((?P<where>[^()]*?)(?::(?P<line>\d+))?\)$")
# A frame in one of these is library code, not the user's program. py-spy shortens a file under
# a folder on the task's sys.path to the path below it (`tensorflow/python/eager/execute.py`), so
# library files are also recognised by the folders of this interpreter's stdlib and site-packages.
_LIBRARY = re.compile(r"site-packages|dist-packages|/lib/python3\.\d+/|^<frozen|^<built-in")

# What a task waits in, recognised by its stack; the first match wins. Each entry: the wait, a
# pattern of Python frames (`function file`) and one of native frames (symbol names).
WAITS: tuple[tuple[str, str, str], ...] = (
    (
        "ClusterCoordinator.join",
        r"^join .*cluster_coordinator|^wait .*cluster_coordinator|^_wait_on_closures",
        r"$^",
    ),
    (
        "ClusterCoordinator.fetch",
        r"^fetch .*cluster_coordinator|^_fetch .*cluster_coordinator",
        r"$^",
    ),
    (
        "a collective all-reduce",
        r"all_reduce|all_gather|batch_reduce|collective_ops|cross_device_ops",
        r"Collective|RingReducer|RingGatherer|AllReduce|NcclReducer|HierarchicalTree",
    ),
    (
        "the coordination service (a barrier or the cluster's join)",
        r"enable_collective_ops|configure_coordination|ensure_initialized|_initialize_multi_worker",
        r"CoordinationService|WaitAtBarrier|CoordinationServiceAgent",
    ),
    (
        "tf.data input",
        r"iterator_ops|dataset_ops|^get_next|^__next__ .*data/ops",
        r"IteratorGetNext|tf_data|IteratorResource",
    ),
    (
        "a checkpoint save or restore",
        r"checkpoint_management|/checkpoint/|saver\.py",
        r"SaveV2|RestoreV2",
    ),
    (
        "a TensorFlow function (graph execution)",
        r"^quick_execute|^_call_flat|^call_function|polymorphic_function",
        r"TFE_Py_Execute|EagerExecutor|FunctionLibraryRuntime",
    ),
)


class StackError(Exception):
    """py-spy could not read a task (not installed, no permission, the process is gone)."""


@dataclass(frozen=True)
class Frame:
    """One stack frame: a Python function and its file:line, or a native symbol and its library."""

    function: str
    where: str  # a file for Python frames, a shared library for native ones
    line: int | None  # None for native frames

    @property
    def native(self) -> bool:
        """Whether this is a C/C++ frame (py-spy --native shows them without a line)."""
        return self.line is None

    def __str__(self) -> str:
        return (
            f"{self.function} ({self.where}:{self.line})"
            if self.line
            else f"{self.function} ({self.where})"
        )


@dataclass(frozen=True)
class Thread:
    """One thread's stack, innermost frame first, as py-spy prints it."""

    ident: str
    name: str
    state: str  # py-spy's "idle", "active", "gil"...
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class Where:
    """Where a task is: the innermost frame of its own code, and the TensorFlow call it waits in."""

    user_frame: Frame | None
    waits_in: str | None  # an entry of WAITS; None: the task is in its own code
    thread: str

    def line(self) -> str:
        """``waits in a collective all-reduce, called from step (train.py:40)`` or ``in its own
        code at step (train.py:40)``."""
        at = f" at {_short(self.user_frame)}" if self.user_frame else ""
        if self.waits_in:
            called = at.replace(" at ", ", called from ", 1)
            return f"waits in {self.waits_in}{called}"
        return f"in its own code{at}" if at else "in no Python frame py-spy could read"


@dataclass(frozen=True)
class Capture:
    """One task's captured stacks: where they were written and the summary (or why none)."""

    task: str
    file: Path
    where: Where | None
    error: str = ""

    def line(self) -> str:
        """One summary line: ``worker-1: in its own code at step (task.py:12)``."""
        return f"{self.task}: {self.where.line() if self.where else 'no stacks: ' + self.error}"


def py_spy() -> str:
    """The py-spy executable: on PATH, or beside this interpreter (a venv without activation)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise StackError("py-spy is not installed (pip install py-spy)")
    return found


def dump_argv(pid: int, native: bool = True) -> list[str]:
    """The py-spy command line that dumps every thread of process ``pid``."""
    return [py_spy(), "dump", "--pid", str(pid), *(["--native"] if native else [])]


def dump(pid: int, native: bool = True, timeout: float = DUMP_TIMEOUT_S) -> str:
    """Every thread's stack of process ``pid`` as py-spy prints it; native frames when it can."""
    tries = [True, False] if native else [False]
    last = ""
    for with_native in tries:
        try:
            done = subprocess.run(
                dump_argv(pid, with_native),
                check=False,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            last = f"py-spy took longer than {timeout:g} s"
            continue
        if done.returncode == 0 and "Thread " in done.stdout:
            return done.stdout
        last = _first_error(done.stderr) or f"py-spy exited with {done.returncode}"
    raise StackError(last)


def parse(text: str) -> list[Thread]:
    """The threads in a py-spy (or faulthandler) dump, each with its frames innermost first."""
    threads: list[Thread] = []
    current: dict | None = None
    for raw in text.splitlines():
        spy, handler = _THREAD.match(raw.strip()), _FH_THREAD.match(raw.strip())
        if spy or handler:
            if current:
                threads.append(Thread(**{**current, "frames": tuple(current["frames"])}))
            if spy:
                name, state, ident = spy["name"] or "", spy["state"], spy["id"]
            else:
                # faulthandler names no thread; the one that ran its handler is the main thread
                # (CPython runs signal handlers there).
                main = handler["current"] == "Current thread"
                name, state, ident = ("MainThread" if main else ""), "", handler["id"]
            current = {"ident": ident, "name": name, "state": state, "frames": []}
            continue
        if current is None:
            continue
        fh_frame = _FH_FRAME.match(raw)
        frame = _FRAME.match(raw)
        if fh_frame:
            line = int(fh_frame["line"])
            current["frames"].append(Frame(fh_frame["func"].strip(), fh_frame["where"], line))
        elif frame:
            line = int(frame["line"]) if frame["line"] else None
            current["frames"].append(Frame(frame["func"].strip(), frame["where"], line))
    if current:
        threads.append(Thread(**{**current, "frames": tuple(current["frames"])}))
    return threads


def where(threads: Sequence[Thread]) -> Where | None:
    """Where the task is: its main thread's innermost own frame and the TensorFlow call it waits in.

    The main thread decides (the program's code runs there); when py-spy names none, the first
    thread with a Python frame does. A collective's native frames run on TensorFlow's own threads,
    so native patterns are looked for in every thread, after the main thread's Python frames.
    """
    with_python = [t for t in threads if any(not f.native for f in t.frames)]
    if not with_python:
        return None
    main = next((t for t in with_python if t.name == "MainThread"), with_python[0])
    python = [f for f in main.frames if not f.native]
    user = next((f for f in python if not _is_library(f.where)), None)
    # Only the frames inside the user's call count: what the user's code itself called.
    inner = python[: python.index(user)] if user else python
    keys = [f"{f.function} {f.where}" for f in inner]
    native = [f.function for t in threads for f in t.frames if f.native]
    for name, py_pattern, native_pattern in WAITS:
        if any(re.search(py_pattern, key) for key in keys):
            return Where(user, name, main.name)
    for name, _py, native_pattern in WAITS:
        if (
            native_pattern != "$^"
            and any(re.search(native_pattern, sym) for sym in native)
            and inner
        ):
            return Where(user, name, main.name)
    return Where(user, None, main.name)


# Where one task's dump comes from: a callable that returns py-spy's text or raises StackError.
# Each transport says where its tasks' come from (`Transport.stacks`): `local` for a program on
# this machine, `helper` for the remote helper run where the task runs (SSH, Slurm, a container).
Source = Callable[[], str]


def program_pid(pid: int) -> int:
    """The pid (as this machine sees it) of the program a local task runs, given the pid the
    launcher started: taskinit's keeper, above the PID namespace's init and the program (see
    launcher/transports/taskinit.py). The keeper's stack would only show it waiting for its
    child."""
    import psutil  # not at the top: the launcher's start does not wait for it

    current = pid
    try:
        for _ in range(3):  # keeper -> init -> program
            with open(f"/proc/{current}/cmdline", "rb") as f:
                if not any(part.endswith(b"taskinit.py") for part in f.read().split(b"\0")):
                    return current
            children = _children(current)
            if not children:
                return pid  # the program is not started yet: ask again later
            # The init also adopts the program's orphans: the program is its first child.
            current = children[0]
    except (OSError, ValueError, psutil.Error):
        pass
    return pid


def _children(pid: int) -> list[int]:
    """The children of single-threaded process ``pid``, the oldest first.

    From the kernel's list of the process's children (one small read; a child joins the end of
    it when it is forked or adopted). psutil's way reads every process's /proc entry, which the
    supervisor would pay once per task: quadratic in the task count. psutil only where the
    kernel keeps no such list (CONFIG_PROC_CHILDREN off).
    """
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            return []
    import psutil

    children = psutil.Process(pid).children()
    return [child.pid for child in sorted(children, key=lambda child: child.create_time())]


def local(pid: int, native: bool = True, fallback: Path | None = None) -> Source:
    """The source of a program running on this machine as ``pid`` (as this machine's /proc sees
    it); when py-spy cannot read it, the program's own faulthandler dump into ``fallback`` (if
    any). ``pid`` must be the task's program itself: it is the one signalled."""

    def source() -> str:
        try:
            return dump(pid, native)
        except StackError as exc:
            if fallback is None or not fallback.exists():
                raise
            return signalled(pid, fallback, str(exc))

    return source


def helper(argv: Sequence[str], run_id: str, task: str, native: bool, at: str) -> Source:
    """The source of ``task`` read where it runs by the remote helper that ``argv`` starts there
    (launcher/host/remote.py's stacks query: py-spy on that host, else the program's faulthandler).
    ``at`` (the host, node or container) heads the one line that says why there are none."""
    line = json.dumps({"stacks": {"run_id": run_id, "task": task, "native": native}}) + "\n"

    def source() -> str:
        try:
            done = subprocess.run(
                list(argv),
                input=line.encode(),
                capture_output=True,
                timeout=HELPER_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise StackError(f"{at}: no answer within {HELPER_TIMEOUT_S:g} s") from None
        except OSError as exc:
            raise StackError(f"{at}: {exc}") from None
        if done.returncode != 0:
            why = last_message(done.stderr.decode(errors="replace"))
            why = why.removeprefix("distlaunch.host.remote: ")
            raise StackError(f"{at}: {why or f'exit code {done.returncode}'}")
        return done.stdout.decode(errors="replace")

    return source


def signalled(pid: int, file: Path, why: str, timeout: float = SIGNAL_TIMEOUT_S) -> str:
    """Ask the task for its stacks with STACKS_SIGNAL_NAME (its faulthandler writes them to
    ``file``) and return what it wrote, headed by why py-spy was not used."""
    start = file.stat().st_size
    try:
        os.kill(pid, getattr(signal, contract.STACKS_SIGNAL_NAME))
    except OSError as exc:
        raise StackError(f"{why}; and the task cannot be signalled: {exc}") from exc
    deadline = time.monotonic() + timeout
    size = start
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = file.stat().st_size
        if now > start and now == size:
            break  # it wrote, and has stopped writing
        size = now
    with open(file, "rb") as f:
        f.seek(start)
        text = f.read().decode("utf-8", "replace")
    if not text.strip():
        raise StackError(f"{why}; and the task wrote no faulthandler dump within {timeout:g} s")
    return f"faulthandler dump (py-spy could not read the task: {why})\n\n{text}"


def capture(
    run_dir: Path, sources: Mapping[str, Source], stamp: str | None = None
) -> list[Capture]:
    """Dump every task in ``sources`` at once, write each to ``RUN/stacks/<stamp>/<task>.txt``
    and return what each shows (or why it could not)."""
    from concurrent.futures import ThreadPoolExecutor  # not at the top: see program_pid

    folder = stacks_folder(run_dir, stamp)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(sources)))) as pool:
        texts = dict(zip(sources, pool.map(_try, sources.values())))
    return [record(folder, name, text) for name, text in texts.items()]


def record(folder: Path, task: str, text: str | StackError) -> Capture:
    """Write one task's dump (or why there is none) to ``folder/<task>.txt``; summarise it."""
    file = folder / f"{task}.txt"
    if isinstance(text, StackError):
        rundir.create_file(file)
        file.write_text(f"no stacks: {text}\n")
        return Capture(task, file, None, str(text))
    rundir.create_file(file)
    file.write_text(text)
    found = where(parse(text))
    return Capture(task, file, found, "" if found else "py-spy showed no Python frame")


def stacks_folder(run_dir: Path, stamp: str | None = None) -> Path:
    """``RUN/stacks/<UTC time>/``, created (a second capture in the same second gets a suffix)."""
    stamp = stamp or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    base = run_dir / STACKS_DIR
    base.mkdir(mode=0o700, exist_ok=True)
    for n in range(100):
        folder = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            folder.mkdir(mode=0o700)
            return folder
        except FileExistsError:
            continue
    raise StackError(f"too many captures named {stamp} in {base}")


def hung(captures: Sequence[Capture], among: Collection[str] | None = None) -> list[Capture]:
    """The tasks stuck in their own code while others wait in TensorFlow for them; with ``among``
    (the tasks known to be silent), only those can be named: a task that still prints or beats
    is in its own code because it works.

    When every task waits in TensorFlow (a lost peer, a deadlock inside TensorFlow) none is named.
    """
    read = [c for c in captures if c.where is not None]
    own = [c for c in read if c.where.waits_in is None]
    if not (len(own) < len(read) or len(read) == 1):
        return []
    return [c for c in own if among is None or c.task in among]


def summary(
    captures: Sequence[Capture], silent: bool = False, among: Collection[str] | None = None
) -> list[str]:
    """The lines that say where every task is. When the tasks are known to be ``silent`` (the
    watchdog, a stale heartbeat; ``among``: which of them), the hung ones come first, marked
    ``hung``; a task of a healthy run is in its own code most of the time, so nothing else is
    called hung."""
    stuck = hung(captures, among) if silent else []
    lines = [f"hung: {c.line()}" for c in stuck]
    lines += [c.line() for c in captures if c not in stuck]
    return lines


def _try(source: Source) -> str | StackError:
    try:
        return source()
    except StackError as exc:
        return exc


def _is_library(file: str) -> bool:
    if _LIBRARY.search(file):
        return True
    return not file.startswith("/") and any((root / file).is_file() for root in _library_roots())


@functools.cache
def _library_roots() -> tuple[Path, ...]:
    """This interpreter's stdlib and site-packages folders, read at the first stack parsed.

    Not at import: every transport imports this module on the way to a run's first task, and
    sysconfig with its data takes ~1 ms to load (bench/startup.py).
    """
    import sysconfig

    return tuple(Path(p) for p in {sysconfig.get_paths()["stdlib"], *site.getsitepackages()} if p)


def _short(frame: Frame) -> str:
    return f"{frame.function} ({Path(frame.where).name}:{frame.line})"


def _first_error(stderr: str) -> str:
    for line in stderr.splitlines():
        if line.startswith("Error:"):
            return line.removeprefix("Error:").strip()
    return stderr.strip().splitlines()[0] if stderr.strip() else ""
