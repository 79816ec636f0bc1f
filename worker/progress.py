"""What a task tells the outside about its progress: metrics file, TensorBoard scalars, heartbeat
and the "training done" marker.

Every writer here is a no-op when the launcher's variable for it is unset (a script run by hand
writes nothing behind the user's back). TensorFlow is imported only to write TensorBoard scalars.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from . import contract, runtime

# The "ready" heartbeat is refreshed at most this often (seconds).
HEARTBEAT_INTERVAL_S = 1.0


class MetricsLog:
    """A task's metrics file: a JSON list of entries, rewritten whole and atomically per entry."""

    def __init__(self, path: Path | None, keep_until_step: int) -> None:
        """Load the entries an earlier attempt wrote, keeping those at or before
        ``keep_until_step``: entries past the checkpoint a run resumed from describe lost work."""
        self._path = path
        entries = json.loads(path.read_text()) if path is not None and path.exists() else []
        self.entries: list[dict[str, Any]] = [e for e in entries if e["step"] <= keep_until_step]

    def append(self, entry: dict[str, Any]) -> None:
        """Record ``entry`` (it must have a ``step``) with the current time and rewrite the file."""
        self.entries.append({**entry, "time": time.time()})
        if self._path is not None:
            runtime.write_json_atomic(self._path, self.entries)


class Scalars:
    """TensorBoard scalars in ``<run dir>/tensorboard/<name>``; a no-op when ``enabled`` is false
    or DISTLAUNCH_RUN_DIR is unset."""

    def __init__(self, name: str, *, enabled: bool = True) -> None:
        run_dir = contract.env_path(contract.RUN_DIR)
        self._dir = contract.tensorboard_dir(run_dir) / name if enabled and run_dir else None
        self._writer: Any = None

    def write(self, step: int, values: dict[str, float]) -> None:
        """Write each of ``values`` as a scalar at ``step``, and flush: TensorBoard sees it now."""
        if self._dir is None:
            return
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2

        if self._writer is None:
            # Created on first use: creating it is a TF op, and callers may not have built
            # their strategy yet when they construct this object.
            self._writer = tf.summary.create_file_writer(str(self._dir))
        # tf.summary.scalar needs the `tensorboard` package, which TensorFlow no longer
        # installs; tf.summary.write with the scalars plugin's metadata writes the same record.
        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
            data_class=summary_pb2.DATA_CLASS_SCALAR,
        )
        with self._writer.as_default():
            for name, value in values.items():
                tf.summary.write(name, tf.constant(value, tf.float32), step=step, metadata=metadata)
        self._writer.flush()


class Heartbeat:
    """Refreshes the "ready" status with the current step, at most once per interval.

    Progress fields given to `update` (``total_steps``, ``loss``, ``checkpoint_step``) ride
    along with every later beat, and so does ``steps_per_s``, measured between beats: this is
    what `distlaunch status --watch` and the live line of `up` show.
    """

    def __init__(self, total_steps: int | None = None) -> None:
        self._next = 0.0
        self._fields: dict[str, Any] = {}
        if total_steps is not None:
            self._fields["total_steps"] = total_steps
        self._last: tuple[float, int] | None = None  # (monotonic time, step) of the last beat

    def update(self, **fields: Any) -> None:
        """Remember progress fields for the next beats (a None value removes the field)."""
        for key, value in fields.items():
            if value is None:
                self._fields.pop(key, None)
            else:
                self._fields[key] = value

    def due(self) -> bool:
        """Return whether the interval since the last beat has passed."""
        return time.monotonic() >= self._next

    def beat(self, step: int | None = None, *, force: bool = False) -> None:
        """Report "ready" (with ``step`` unless None) if due (or ``force``)."""
        if force or self.due():
            now = time.monotonic()
            fields = dict(self._fields)
            if step is not None:
                fields["step"] = step
                if self._last is not None and step > self._last[1] and now > self._last[0]:
                    rate = (step - self._last[1]) / (now - self._last[0])
                    # Smoothed: one slow step (a checkpoint) does not swing the ETA.
                    old = self._fields.get("steps_per_s")
                    smoothed = rate if old is None else 0.3 * rate + 0.7 * old
                    self._fields["steps_per_s"] = fields["steps_per_s"] = round(smoothed, 3)
                if self._last is None or step != self._last[1]:
                    self._last = (now, step)
            runtime.report(contract.STATE_READY, **fields)
            self._next = now + HEARTBEAT_INTERVAL_S


class BackgroundHeartbeat:
    """Refreshes the "ready" status (without a step) from a daemon thread, for a main thread that
    is blocked where it cannot beat: a server's join(), or tf_keras fit under PSS, which allows
    no batch-level callbacks."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distlaunch-heartbeat", daemon=True)

    def start(self) -> None:
        """Beat now and then every interval until `stop`."""
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (returns at once; the thread ends within one interval)."""
        self._stop.set()

    def _run(self) -> None:
        heartbeat = Heartbeat()
        while True:
            heartbeat.beat(force=True)
            if self._stop.wait(HEARTBEAT_INTERVAL_S):
                return


def mark_training_done(step: int) -> None:
    """Write the run's "training done" marker; call it on the chief after the final checkpoint.

    The marker carries this attempt's number so that an evaluator can tell it from the marker
    an earlier attempt of the same run left behind. A no-op without DISTLAUNCH_RUN_DIR.
    """
    run_dir = contract.env_path(contract.RUN_DIR)
    if run_dir is None:
        return
    marker = {"attempt": runtime.context().attempt, "step": step, "time": time.time()}
    runtime.write_json_atomic(contract.training_done_path(run_dir), marker)


def training_done(run_dir: Path, attempt: int) -> dict[str, Any] | None:
    """Return the run's "training done" marker if it was written by ``attempt`` or a later one.

    "Later" because a launcher may restart the chief alone under a new attempt number; an older
    marker belongs to a finished earlier attempt and says nothing about this one.
    """
    path = contract.training_done_path(run_dir)
    try:
        marker = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return marker if marker.get("attempt", -1) >= attempt else None
