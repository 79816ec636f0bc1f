"""`distlaunch stacks` on a task's host: the keeper's module (`remote.py`) answers a first line
``{"stacks": {"run_id": ..., "task": ..., "native": ...}}`` with this module's `answer`.

It finds that task's program on this host (its environment names the run and the task), prints
every thread's stack as `py-spy dump` shows it, and exits 0 (1: no such task here, or no stacks;
the reason is on stderr). Where py-spy cannot read the program (not installed, no ptrace rights
in a container), it asks the program itself: SIGUSR2 makes the bootstrap's faulthandler append
its stacks to the task's file in RUN/stacks/signal-attempt-N/, which is printed instead. That
signal goes to the program alone, and only when that file shows the handler is in place. It
starts nothing. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

# How long py-spy may take (it pauses a TensorFlow process with hundreds of threads), and how
# long the program may take to write its faulthandler dump after SIGUSR2.
DUMP_TIMEOUT_S = 60.0
SIGNAL_TIMEOUT_S = 5.0


def answer(query: dict[str, Any], say: Callable[[str], None]) -> int:
    """Print the stacks of the task ``query`` names: py-spy's dump of its program on this host, or,
    where py-spy cannot read it, the program's own faulthandler dump. Only that program is ever
    signalled, and only once its faulthandler is in place."""
    run_id, task = str(query.get("run_id", "")), str(query.get("task", ""))
    found = _program_of(run_id, task)
    if found is None:
        say(f"no process of task {task} of run {run_id} on this host")
        return 1
    pid, env = found
    why = _spy(pid, bool(query.get("native")))
    if why is None:
        return 0
    # The file the bootstrap's faulthandler writes to (contract.stacks_signal_path), from the
    # program's own environment: on a host that does not share the run dir it is on this disk.
    file = os.path.join(
        env_value(env, b"DISTLAUNCH_RUN_DIR"),
        "stacks",
        f"signal-attempt-{int(env_value(env, b'DISTLAUNCH_ATTEMPT') or 0)}",
        f"{task}.txt",
    )
    if not env_value(env, b"DISTLAUNCH_RUN_DIR") or not os.path.isfile(file):
        # No handler in place: SIGUSR2's default action would end the program.
        say(f"{why}; and the task has no faulthandler to ask")
        return 1
    text = _signalled(pid, file)
    if not text.strip():
        say(f"{why}; and the task wrote no faulthandler dump within {SIGNAL_TIMEOUT_S:g} s")
        return 1
    sys.stdout.write(f"faulthandler dump (py-spy could not read the task: {why})\n\n{text}")
    return 0


def _program_of(run_id: str, task: str) -> tuple[int, set[bytes]] | None:
    """The task's program on this host and its environment: a process whose environment names
    the run and the task, preferring a process group leader (the helper starts the program as
    one; what it forks inherits the environment), never this query itself (in a container,
    `docker exec` gives it the task's environment) nor a container's init (PID 1, docker-init,
    which only passes signals on)."""
    wanted = b"DISTLAUNCH_RUN_ID=" + run_id.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = set(f.read().split(b"\0"))
            pid = int(entry)
            leader = os.getpgid(pid) == pid
        except OSError:
            continue
        role, index = env_value(env, b"DISTLAUNCH_ROLE"), env_value(env, b"DISTLAUNCH_INDEX")
        if wanted in env and f"{role}-{index}" == task:
            found.append(((pid == 1, not leader, pid), env))
    if not found:
        return None
    key, env = min(found, key=lambda item: item[0])
    return key[2], env


def _spy(pid: int, native: bool) -> str | None:
    """Print py-spy's dump of ``pid`` (with native frames if asked and it can); None when it
    did, else why not (one line)."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return "py-spy is not installed on this host (pip install py-spy)"
    why = "py-spy failed"
    for with_native in (True, False) if native else (False,):
        argv = [spy, "dump", "--pid", str(pid), *(["--native"] if with_native else [])]
        try:
            done = subprocess.run(
                argv, check=False, capture_output=True, text=True, timeout=DUMP_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            why = f"py-spy took longer than {DUMP_TIMEOUT_S:g} s"
            continue
        if done.returncode == 0 and "Thread " in done.stdout:
            sys.stdout.write(done.stdout)
            return None
        errors = [x for x in done.stderr.splitlines() if x.startswith("Error:")]
        why = errors[0].removeprefix("Error:").strip() if errors else why
    return why


def _signalled(pid: int, file: str) -> str:
    """Send the program SIGUSR2 (its faulthandler appends its stacks to ``file``) and return what
    it wrote within SIGNAL_TIMEOUT_S ("" if nothing)."""
    start = os.path.getsize(file)
    try:
        os.kill(pid, signal.SIGUSR2)
    except OSError:
        return ""
    deadline, size = time.monotonic() + SIGNAL_TIMEOUT_S, start
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = os.path.getsize(file)
        if now > start and now == size:
            break  # it wrote, and has stopped writing
        size = now
    with open(file, "rb") as f:
        f.seek(start)
        return f.read().decode("utf-8", "replace")


def env_value(env: set[bytes], name: bytes) -> str:
    """The value of variable ``name`` in a set of ``NAME=value`` entries ("" when absent)."""
    prefix = name + b"="
    return next(
        (e[len(prefix) :].decode(errors="replace") for e in env if e.startswith(prefix)), ""
    )
