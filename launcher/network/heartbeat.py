"""The launcher's heartbeat to the processes it keeps on other machines over a local client's stdin.

A host's agent (`distlaunch.host.agent`, behind an ssh or srun client, whose thread in
launcher/transports/agent.py beats on its own) and a host's firewall guard
(`distlaunch.host.guard`) both read their launcher's stdin: one request line, then lines that
say the launcher lives. Both end what they hold when that stdin reaches EOF or stays silent for
HEARTBEAT_TIMEOUT_S (a network that vanished without a reset). One `Heartbeat` thread per guard
set writes an empty line every HEARTBEAT_S to each `Pipe` it was given, until the pipe is closed
or its client has exited.
"""

from __future__ import annotations

import os
import subprocess
import threading

HEARTBEAT_S = 2.0
# Sent in each request: a helper or guard whose launcher has been silent this long ends what it
# holds (the task, the rules).
HEARTBEAT_TIMEOUT_S = 20.0


class Pipe:
    """The stdin of a local client whose far end is a helper or a guard; safe from any thread.

    ``first`` (the request) is written whole, waiting if it must; every later write never waits:
    a client that reads nothing (a stalled connection) must not stall the launcher, and a line
    the pipe has no room for is dropped (a heartbeat is only a sign of life).
    """

    def __init__(self, proc: subprocess.Popen, first: bytes) -> None:
        assert proc.stdin is not None
        self.proc = proc
        self._fd: int | None = proc.stdin.fileno()
        # The heartbeat thread writes while another thread may close: an fd closed under a writer
        # could be reused by another file and written to.
        self._lock = threading.Lock()
        self.send(first)
        os.set_blocking(self._fd, False)

    def send(self, line: bytes) -> None:
        """Write ``line``; a client that is gone is not an error here (its exit is)."""
        with self._lock:
            if self._fd is None:
                return
            try:
                os.write(self._fd, line)
            except (BrokenPipeError, BlockingIOError):
                pass

    def close(self) -> None:
        """Close the pipe: the far end reads EOF (safe to call more than once)."""
        with self._lock:
            if self._fd is not None:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self._fd = None

    def open(self) -> bool:
        """Whether the pipe is still open and its client still running."""
        return self._fd is not None and self.proc.poll() is None


class Heartbeat:
    """One thread that writes an empty line every HEARTBEAT_S to each open pipe it was given."""

    def __init__(self, name: str) -> None:
        self.name = name  # the thread's name, for people reading a thread dump
        self._pipes: set[Pipe] = set()
        self._lock = threading.Lock()
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, pipe: Pipe) -> None:
        """Keep ``pipe`` alive from now on (the thread starts with the first pipe)."""
        with self._lock:
            self._pipes.add(pipe)
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name=self.name, daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop the thread; the pipes stay as they are (their owners close them)."""
        self._quit.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self) -> None:
        while not self._quit.wait(HEARTBEAT_S):
            with self._lock:
                self._pipes = {p for p in self._pipes if p.open()}
                live = list(self._pipes)
            for pipe in live:
                pipe.send(b"\n")
