"""Whether a task still makes progress, for any program: log output, heartbeat or CPU time.

`timeouts.heartbeat_s` works only for programs that import `distlaunch.worker`. A hung task of any
program shows the same three signs instead: its log stops growing, its heartbeat (if it has one)
stops, and it burns no CPU (a blocked all-reduce, a deadlock, a sleep). A task that shows none of
the three for `timeouts.silence_s` is silent; the supervisor then captures every task's stacks.

The samples come from the supervisor's periodic check (one `stat`, one status file read and one
psutil call per task: cheap); this module only keeps per-task state and does the arithmetic, so
scripted samples test it. It also keeps each task's last RSS, which the OOM verdict reports.
"""

from __future__ import annotations

from dataclasses import dataclass

# A task whose CPU time grows by more than this share of the wall time since its last progress is
# working (a long compute step without output). Idle TensorFlow processes burn a little CPU in
# their runtime threads (gRPC polling), far below this.
BUSY_CPU_SHARE = 0.10


@dataclass(frozen=True)
class Sample:
    """What one periodic check saw of a task."""

    log_bytes: int
    heartbeat: float | None  # the status file's heartbeat time, if the task writes one
    cpu_s: float | None  # user + system CPU seconds of the task's process (None: unreadable)
    rss_bytes: int | None = None


@dataclass
class _Track:
    since: float  # when the task last made progress
    last: Sample
    cpu_at_progress: float | None


class Watchdog:
    """Tracks each task's last progress; `observe` says how long a task has been silent."""

    def __init__(self) -> None:
        self._tracks: dict[str, _Track] = {}
        self.rss: dict[str, int] = {}

    def reset(self, name: str) -> None:
        """Forget ``name`` (it was started again): its next sample starts a fresh track."""
        self._tracks.pop(name, None)
        self.rss.pop(name, None)

    def silent_for(self, name: str, now: float) -> float:
        """Seconds since ``name`` last made progress, as its samples so far show (0: none yet)."""
        track = self._tracks.get(name)
        return now - track.since if track is not None else 0.0

    def observe(self, name: str, now: float, sample: Sample) -> float:
        """Record ``sample`` of ``name`` taken at ``now``; return seconds since its progress."""
        # A dying process reads as RSS 0: the last size worth reporting is the one before.
        if sample.rss_bytes:
            self.rss[name] = sample.rss_bytes
        track = self._tracks.get(name)
        if track is None:
            self._tracks[name] = _Track(now, sample, sample.cpu_s)
            return 0.0
        wrote = sample.log_bytes != track.last.log_bytes or sample.heartbeat != track.last.heartbeat
        busy = (
            sample.cpu_s is not None
            and track.cpu_at_progress is not None
            and sample.cpu_s - track.cpu_at_progress > BUSY_CPU_SHARE * max(now - track.since, 1.0)
        )
        track.last = sample
        if wrote or busy:
            track.since = now
            track.cpu_at_progress = sample.cpu_s
        return now - track.since
