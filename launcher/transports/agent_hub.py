"""The hub: the one thread that reads every agent link's frames and sends their heartbeats, and
the links' ends side by side (launcher/transports/agent.py has the whole picture).

Any failure serving a link (a log on a full disk, a bug) ends that machine's agent alone, named,
through the same lost-agent ending as a cut channel (no new event kind: the supervisor sees
LOST_EXIT and the log's line).
"""

from __future__ import annotations

import functools
import os
import select
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from distlaunch.host.timeouts import HEARTBEAT_S
from distlaunch.launcher.transports.agent_link import AgentLink


def _raise(exc: Exception) -> None:
    raise exc


def end_all(links: Sequence[AgentLink]) -> None:
    """End ``links``' agents side by side: each is told (EOF) before any is waited for, so that
    their ends (each removing its host's firewall rules) overlap, not one host after another."""
    for link in links:
        link.hang_up()
    for link in links:
        link.end()


class Hub:
    """The one thread that reads every link's frames and sends every link's heartbeats.

    Nothing a link does ends the thread: an exception while serving one link (a log that cannot
    be written: a full disk; a bug) ends that link's agent with the error as the reason, named
    by its machine in its tasks' logs, and the thread goes on with the others."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._by_fd: dict[int, tuple[AgentLink, bool]] = {}
        self._new: list[AgentLink] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._poll.register(self._wake_r, select.POLLIN)
        self._quit = False
        self._thread: threading.Thread | None = None
        self._links: list[AgentLink] = []

    def add(self, link: AgentLink) -> None:
        """Watch ``link`` from now on (the thread starts with the first)."""
        with self._lock:
            self._new.append(link)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agents", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"w")

    def close(self) -> None:
        """Stop the thread (the links are closed already)."""
        self._quit = True
        os.write(self._wake_w, b"q")
        if self._thread is not None:
            self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        next_beat = time.monotonic() + HEARTBEAT_S
        while not self._quit:
            try:
                next_beat = self._serve_all(next_beat)
            except Exception as exc:  # noqa: BLE001 - no link's: every agent ends, named
                for link in list(self._links):
                    self._guarded(link, functools.partial(_raise, exc))

    def _serve_all(self, next_beat: float) -> float:
        """One round: new links, what is readable, and the beats when due; the next beat's time."""
        with self._lock:
            for link in self._new:
                self._links.append(link)
                for fd, is_out in ((link.out, True), (link.err, False)):
                    self._by_fd[fd] = (link, is_out)
                    self._poll.register(fd, select.POLLIN)
            self._new.clear()
        for fd, _ in self._poll.poll(max(0.0, next_beat - time.monotonic()) * 1000):
            if fd == self._wake_r:
                os.read(fd, 512)
                continue
            if fd not in self._by_fd:  # its link ended earlier in this batch
                continue
            link, is_out = self._by_fd[fd]
            self._guarded(link, lambda: self._serve(link, fd, is_out))
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + HEARTBEAT_S
            for link in list(self._links):
                self._guarded(link, lambda: (link.silent(), link.heartbeat()))
        return next_beat

    def _guarded(self, link: AgentLink, work: Callable[[], object]) -> None:
        """Do ``work`` for ``link``; whatever it raises ends that link's agent, not the hub."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - any failure here is the link's end, named
            why = f"the launcher could not serve its channel: {type(exc).__name__}: {exc}"
            with link.lock:
                for handle in link.tasks.values():
                    handle.say(f"distlaunch: {link.target}: {why}\n{traceback.format_exc()}")
            link.fail(why)
            self._drop(link)

    def _serve(self, link: AgentLink, fd: int, is_out: bool) -> None:
        if link.read_frames() if is_out else link.read_errors():
            return
        self._poll.unregister(fd)
        del self._by_fd[fd]
        if is_out:
            if link.err in self._by_fd:  # what ssh said last, before naming the loss
                self._drain_errors(link)
            self._drop(link)

    def _drop(self, link: AgentLink) -> None:
        """Stop watching ``link`` and end its tasks (its client is ending or has ended)."""
        for fd in (link.out, link.err):
            if fd in self._by_fd:
                self._poll.unregister(fd)
                del self._by_fd[fd]
        if link in self._links:
            self._links.remove(link)
        link.end()

    def _drain_errors(self, link: AgentLink) -> None:
        self._poll.unregister(link.err)
        del self._by_fd[link.err]
        poller = select.poll()
        poller.register(link.err, select.POLLIN)
        while poller.poll(1000) and link.read_errors():
            pass
