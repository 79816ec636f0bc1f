"""Training progress of a run as people read it: the `status --watch` screen and the live line
of `up`, both from the heartbeats distlaunch.worker writes into the run dir's status files.

Nothing here writes: it reads run.json's record (given) and ``status/<task>.json``, so it works
from any shell that sees the run dir (an SSH run's too, when its run dir is shared).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distlaunch.launcher.record.state import RunRecord
from distlaunch.worker import contract


@dataclass(frozen=True)
class TaskProgress:
    """One task's row: its state in run.json and its last heartbeat."""

    task: str
    state: str
    attempt: int
    step: int | None
    total_steps: int | None
    steps_per_s: float | None
    loss: float | None
    checkpoint_step: int | None
    heartbeat_age_s: float | None

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current rate; None when unknown."""
        if None in (self.step, self.total_steps, self.steps_per_s) or not self.steps_per_s:
            return None
        return max(0, self.total_steps - self.step) / self.steps_per_s  # type: ignore[operator]


def read_heartbeat(run_dir: Path, task: str) -> dict[str, Any]:
    """The task's status file as written by distlaunch.worker; {} when absent or unreadable."""
    role, _, index = task.rpartition("-")
    try:
        path = contract.status_path(run_dir, role, int(index))
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def task_progress(run_dir: Path, record: RunRecord, now: float | None = None) -> list[TaskProgress]:
    """One TaskProgress per task of the run's ``record``, in its order."""
    now = time.time() if now is None else now
    rows = []
    for name, task in record.tasks.items():
        beat = read_heartbeat(run_dir, name)
        # A heartbeat of an earlier attempt says nothing about this one.
        if beat.get("attempt", task.attempt) != task.attempt:
            beat = {}
        beat_time = beat.get("time")
        rows.append(
            TaskProgress(
                task=name,
                state=task.state.value if task.state is not None else "?",
                attempt=task.attempt,
                step=_number(beat.get("step"), int),
                total_steps=_number(beat.get("total_steps"), int),
                steps_per_s=_number(beat.get("steps_per_s"), float),
                loss=_number(beat.get("loss"), float),
                checkpoint_step=_number(beat.get("checkpoint_step"), int),
                heartbeat_age_s=now - beat_time if isinstance(beat_time, (int, float)) else None,
            )
        )
    return rows


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


def format_duration(seconds: float | None) -> str:
    """``75`` as ``1m15s``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def screen(record: RunRecord, state: str, run_dir: Path, rows: Iterable[TaskProgress]) -> list[str]:
    """The lines of one `status --watch` frame (``state``: the run's, as `status` shows it)."""
    lines = [
        f"run {record.run_id}: {state} (attempt {record.attempt}) in {run_dir}",
        "",
        f"  {'TASK':<12} {'STATE':<10} {'ATT':>3} {'STEP':>13} {'STEPS/S':>8} {'LOSS':>10}"
        f" {'CKPT':>7} {'ETA':>7} {'BEAT':>6}",
    ]
    for row in rows:
        step = "-" if row.step is None else str(row.step)
        if row.step is not None and row.total_steps:
            step = f"{row.step}/{row.total_steps}"
        lines.append(
            f"  {row.task:<12} {row.state:<10} {row.attempt:>3} {step:>13}"
            f" {_fmt(row.steps_per_s, '.2f'):>8} {_fmt(row.loss, '.4g'):>10}"
            f" {_fmt(row.checkpoint_step, 'd'):>7} {format_duration(row.eta_s):>7}"
            f" {format_duration(row.heartbeat_age_s):>6}"
        )
    if record.failure and record.failure.summary:
        lines += ["", f"  {record.failure.summary}"]
    return lines


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def live_line(rows: Iterable[TaskProgress]) -> str | None:
    """The one-line summary `up` keeps at the bottom of a terminal: the most advanced training
    task's step/total, loss, rate and ETA; None until a task reports a step."""
    reporting = [row for row in rows if row.step is not None]
    if not reporting:
        return None
    best = max(reporting, key=lambda row: row.step or 0)
    total = f"/{best.total_steps}" if best.total_steps else ""
    parts = [f"step {best.step}{total}"]
    if best.total_steps:
        done = min(best.step or 0, best.total_steps)
        parts[0] += f" ({100 * done // best.total_steps}%)"
    if best.loss is not None:
        parts.append(f"loss {best.loss:.4g}")
    if best.steps_per_s:
        parts.append(f"{best.steps_per_s:.2f} steps/s")
    if best.eta_s is not None:
        parts.append(f"ETA {format_duration(best.eta_s)}")
    return "distlaunch: " + ", ".join(parts)
