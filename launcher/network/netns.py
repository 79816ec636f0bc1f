"""Network isolation for local runs: every task of a run shares one private network namespace.

TensorFlow's gRPC servers take work from anyone who reaches their port, and listen on every
interface whatever TF_CONFIG says. The only way to keep a local cluster's ports to itself is the
OS: a network namespace that holds nothing but a loopback interface, shared by the run's tasks.

How (util-linux and iproute2, nothing persistent):
- a *holder* process per run, `unshare --net sh -c 'ip link set lo up ...'`, owns the namespace;
  an unprivileged user gets the same inside a new user namespace (`unshare --user --map-root-user`)
  where the kernel allows it;
- once the holder says its loopback is up, the launcher opens the namespace by file descriptor
  (/proc/HOLDER/ns/net, after a pidfd on the holder, checked again afterwards, proves the pid was
  not reused) and every task enters it through that descriptor (`setns`, in taskinit): a pid is
  never used to enter it again. A dead holder fails the run at the next start of a task;
- a namespace lives exactly as long as a process is in it, and nothing is bind-mounted (no
  `ip netns add`): when the run's processes are gone, so is the namespace.

The decision is a pure function of the spec and the machine's capabilities, which are probed once
per process; `distlaunch plan` shows it.
"""

from __future__ import annotations

import functools
import os
import select
import selectors
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from distlaunch.launcher.core.errors import LaunchError
from distlaunch.launcher.plan.isolation import NETNS, USERNS, Capabilities, Isolation, choose
from distlaunch.worker import contract

if TYPE_CHECKING:  # only for annotations: this module imports nothing heavy
    from distlaunch.launcher.plan.placement import Placements
    from distlaunch.launcher.spec.model import LoadedSpec

# The holder must report its loopback up within this; it takes milliseconds.
READY_TIMEOUT_S = 10.0
# How long a holder may take to exit once its lifeline pipe is closed.
CLOSE_TIMEOUT_S = 5.0
_PROBE_TIMEOUT_S = 10.0


class SandboxError(LaunchError):
    """The private network namespace a run was planned with could not be created."""


class SandboxLost(LaunchError):
    """The run's namespace holder died while the run went on: the run fails (a setup error comes
    before anything starts; this one ends a run that was already training)."""


def decide(
    loaded: LoadedSpec, placed: Placements, find: Callable[[], Capabilities] | None = None
) -> Isolation:
    """`choose` with this machine's capabilities, probed only when the spec asks for isolation:
    by ``find`` where given (`up`: `hold_or_probe`), else by `probe`."""
    if loaded.spec.isolation != "auto":
        return choose(loaded, placed, None)
    return choose(loaded, placed, (find or probe)())


def hold_or_probe(run_id: str) -> tuple[Sandbox | None, Capabilities]:
    """What `probe` finds, found by starting run ``run_id``'s holder in a network namespace of its
    own: where that works, the holder is returned for `sandbox` to use, and a run's start makes
    one namespace instead of two (a probe's is ~5 ms of it, bench/startup.py). Where it fails,
    `probe` says what else this machine allows, and no holder is left."""
    try:
        return _open(NETNS, run_id), Capabilities(True, False, "")
    except (SandboxError, OSError):
        return None, probe()


@functools.cache
def probe() -> Capabilities:
    """Find out, once per process, whether this user can create network namespaces here.

    It runs exactly what a holder runs (minus the waiting), so a yes here means runs work.
    """
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        return Capabilities(
            False, False, f"{', '.join(missing)} not found (util-linux and iproute2 provide them)"
        )
    lo_up = [shutil.which("ip") or "ip", "link", "set", "lo", "up"]
    netns_ok, netns_err = _try(_holder_argv(NETNS, lo_up))
    if netns_ok:
        return Capabilities(True, False, "")
    userns_ok, userns_err = _try(_holder_argv(USERNS, lo_up))
    if userns_ok:
        return Capabilities(False, True, "")
    return Capabilities(
        False, False, f"unshare --net: {netns_err}; unshare --user --net: {userns_err}"
    )


def _try(argv: list[str]) -> tuple[bool, str]:
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return done.returncode == 0, last


def _holder_argv(mode: str, command: list[str]) -> list[str]:
    """``command`` run in a fresh network namespace of the given mode."""
    unshare = shutil.which("unshare") or "unshare"
    if mode == USERNS:
        # Root inside the new user namespace is what may bring its loopback up.
        return [unshare, "--user", "--map-root-user", "--net", "--", *command]
    return [unshare, "--net", "--", *command]


class Sandbox:
    """A run's private network namespace, held open by one small process for the run's length.

    The holder lives as long as the launcher keeps its stdin pipe open: `close` closes it, and the
    kernel closes it when the launcher dies however it dies (SIGKILL included), so a holder never
    outlives its launcher. It runs in a session of its own so that a terminal's Ctrl-C reaches
    only the launcher, which then stops the tasks before the namespace.
    """

    def __init__(self, mode: str, proc: subprocess.Popen) -> None:
        self.mode = mode
        self.proc = proc
        self._pidfd: int | None = None
        self._fds: dict[str, int] = {}

    @property
    def pid(self) -> int:
        """The holder's pid: /proc/PID/net shows the namespace's sockets while `alive`."""
        return self.proc.pid

    def hold(self) -> None:
        """Open the holder's namespaces by descriptor; SandboxError if the holder is gone."""
        self._pidfd = os.pidfd_open(self.pid)
        # Entering the user namespace first is what grants the right to enter its network one.
        kinds = ("user", "net") if self.mode == USERNS else ("net",)
        try:
            self._fds = {
                kind: os.open(f"/proc/{self.pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
                for kind in kinds
            }
        except OSError:
            pass
        # Alive after the opens: the files were the holder's, not a later process's with its pid.
        if len(self._fds) != len(kinds) or not self.alive():
            raise SandboxError(self.dead_message())

    def alive(self) -> bool:
        """Whether the holder still runs (its pidfd turns readable when it exits)."""
        return self._pidfd is not None and not select.select([self._pidfd], [], [], 0)[0]

    def dead_message(self) -> str:
        """What failed, when the holder is gone."""
        return (
            f"the holder of the run's private network namespace (pid {self.pid}) has died: "
            "the run cannot go on isolated"
        )

    def namespaces(self) -> dict[str, int]:
        """Descriptors of the namespaces a task enters, in order (``user`` first, then ``net``)."""
        return dict(self._fds)

    def close(self) -> None:
        """End the holder (tasks must be stopped first) and reap it."""
        for fd in [*self._fds.values(), *([self._pidfd] if self._pidfd is not None else [])]:
            os.close(fd)
        self._fds, self._pidfd = {}, None
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def sandbox(
    isolation: Isolation, run_id: str, held: Sandbox | None = None
) -> Iterator[Sandbox | None]:
    """The private namespace of run ``run_id`` for the block (None when not isolated), then gone.

    ``held``: the run's holder, started already (`hold_or_probe`); used where it is alive and of
    the isolation's mode, else ended. Raises SandboxError when the namespace cannot be made.
    """
    if held is not None and not (
        isolation.private and held.mode == isolation.mode and held.alive()
    ):
        held.close()
        held = None
    if not isolation.private:
        yield None
        return
    held = held or _open(isolation.mode, run_id)
    try:
        yield held
    finally:
        held.close()


def _open(mode: str, run_id: str) -> Sandbox:
    """Start a holder and wait until its namespace's loopback is up.

    The holder carries the run's DISTLAUNCH_RUN_ID in its environment, like the tasks, so that
    `distlaunch down` finds it.
    """
    ip = shutil.which("ip") or "ip"
    # Bring loopback up, say so, then wait for EOF on stdin: the launcher's lifeline.
    script = f"{shlex.quote(ip)} link set lo up && echo ready && read -r _"
    proc = subprocess.Popen(
        _holder_argv(mode, ["sh", "-c", script]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, contract.RUN_ID: run_id},
        start_new_session=True,
    )
    held = Sandbox(mode, proc)
    try:
        output = _read_until_ready(proc)
    except BaseException:  # Ctrl-C while waiting: the holder must not wait for the launcher's exit
        held.close()
        raise
    if output is not None:
        held.close()
        raise SandboxError(
            f"could not create the run's private network namespace ({output or 'no output'}); "
            'set "isolation": "off" in the spec to run without it'
        )
    try:
        held.hold()
    except BaseException:
        held.close()
        raise
    return held


def _read_until_ready(proc: subprocess.Popen) -> str | None:
    """Wait for the holder's "ready" line; None when it came, else what the holder printed."""
    assert proc.stdout is not None
    seen = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in seen and time.monotonic() < deadline:
            if sel.select(deadline - time.monotonic()):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                seen += chunk
    proc.stdout.close()
    if seen == b"ready\n":
        return None
    return seen.decode(errors="replace").strip() or (
        f"timed out after {READY_TIMEOUT_S:g} s" if proc.poll() is None else ""
    )
