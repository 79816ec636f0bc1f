"""A run's story as the report draws it, read from its run dir: one bar per task attempt (how it
ended), the markers (restarts, stop notices, saves, hangs, the root cause) and each task's loss
and steps/s over time.

Nothing here writes. Every file is read as it may be found: a run still running (events.jsonl
cut mid-line, a task's metrics file being replaced), an older or damaged record. What cannot be
read becomes a note in the story, never an exception; only a run dir without a readable run.json
is refused (UsageError: there is nothing to draw).
"""

from __future__ import annotations

import bisect
import enum
import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from distlaunch.launcher.control.status import LOST, run_state
from distlaunch.launcher.core.errors import UsageError
from distlaunch.launcher.diagnosis.summary import preempted_line
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import RunRecord, RunState
from distlaunch.worker import contract

# The task name events.jsonl gives events of the whole run (a stop notice).
RUN_TASK = "run"
# At most this many unreadable lines of one file are named in a note; the rest are counted.
_NAMED_LINES = 3


class Ending(enum.StrEnum):
    """How one attempt of a task ended: the colour of its bar."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"  # saved on a stop notice and stopped
    KILLED = "killed"  # killed at once for a restart (of its gang)
    STOPPED = "stopped"  # stopped with a grace period: the run was ending
    HUNG = "hung"  # stopped making progress (heartbeat_s, silence_s)
    RUNNING = "running"  # no end yet: the run still runs
    UNKNOWN = "unknown"  # no end recorded, and the run is over


class MarkerKind(enum.StrEnum):
    """What a marker on the timeline stands for."""

    RESTART = "restart"
    NOTICE = "notice"
    SAVE = "save"
    HANG = "hang"
    ROOT_CAUSE = "root-cause"
    RESIZE = "resize"  # an elastic run's world changed (a ``resized`` event)


@dataclass(frozen=True)
class Bar:
    """One attempt of one task: from its start to its end (times in seconds since the epoch)."""

    task: str
    attempt: int
    start: float
    end: float
    ending: Ending
    detail: str  # how it ended, in the launcher's words


@dataclass(frozen=True)
class Marker:
    """A moment of the run; ``task`` None: of the whole run (drawn across every row)."""

    kind: MarkerKind
    time: float
    task: str | None
    text: str


class Point(NamedTuple):
    """One reading of a task's training: its step, loss and steps/s (None: not known then).

    A NamedTuple, typed and immutable as a frozen dataclass is, and made several times faster:
    a run of 256 tasks holds tens of thousands of readings."""

    time: float
    step: int
    loss: float | None
    steps_per_s: float | None
    attempt: int | None  # the attempt whose bar spans its time; a line breaks between attempts


@dataclass(frozen=True)
class Story:
    """Everything the report shows of one run."""

    run_id: str
    state: str  # as `status` shows it: a RunState value, or "lost"
    summary: str  # the run's summary line
    live: bool  # the run still runs: the story so far
    start: float
    end: float
    tasks: tuple[str, ...]
    bars: tuple[Bar, ...]
    markers: tuple[Marker, ...]
    series: Mapping[str, tuple[Point, ...]]
    notes: tuple[str, ...]  # what could not be read


def read_story(run_dir: Path, now: float | None = None) -> Story:
    """The story of the run in ``run_dir``; UsageError when it holds no readable run.json."""
    now = time.time() if now is None else now
    record = _record(run_dir)
    state = run_state(record)
    live = record.state.live and state != LOST
    notes: list[str] = []
    events = _events(run_dir, notes)
    tasks = list(record.tasks)
    tasks += sorted({e["task"] for e in events} - set(tasks) - {RUN_TASK})
    ends = [e["time"] for e in events] + [record.started_at or 0.0, record.ended_at or 0.0]
    end = now if live else max(ends)
    bars, markers = _bars_and_markers(events, end, live)
    markers += _root_cause(record, bars)
    spans: dict[str, list[Bar]] = {name: [] for name in tasks}
    for bar in bars:
        spans.setdefault(bar.task, []).append(bar)
    series = {name: _series(run_dir, name, spans[name], notes) for name in tasks}
    start = min([e["time"] for e in events] + [record.started_at or end])
    if not events:
        notes.append(f"{rundir.EVENTS}: no events recorded: the timeline is empty")
    return Story(
        run_id=record.run_id,
        state=state,
        summary=_summary(record, state),
        live=live,
        start=start,
        end=max(end, start),
        tasks=tuple(tasks),
        bars=tuple(bars),
        markers=tuple(markers),
        series=series,
        notes=tuple(notes),
    )


def _record(run_dir: Path) -> RunRecord:
    path = run_dir / rundir.RUN_JSON
    if not path.is_file():
        raise UsageError(f"no run in {run_dir}: expected a run directory holding {rundir.RUN_JSON}")
    data = rundir.read_json(path)
    try:
        return RunRecord.from_json(data)
    except Exception:  # noqa: BLE001 - any damage to a file from outside is one line, not a crash
        raise UsageError(f"{path} is not a run record distlaunch can read") from None


def _summary(record: RunRecord, state: str) -> str:
    """The run's summary line, as `up` and `status` print it."""
    if record.failure is not None and record.failure.summary:
        return record.failure.summary
    if state == RunState.PREEMPTED and isinstance(record.preempted, dict):
        return preempted_line(record.run_id, record.preempted, record.spec_file)
    if state == RunState.SUCCEEDED and record.ended_at and record.started_at:
        return f"run {record.run_id} succeeded in {record.ended_at - record.started_at:.1f} s"
    if state == LOST:
        return f"run {record.run_id}: its launcher (pid {record.launcher_pid}) is gone"
    return f"run {record.run_id}: {state} (attempt {record.attempt})"


def _events(run_dir: Path, notes: list[str]) -> list[dict[str, Any]]:
    """events.jsonl's readable events, in order; a note names the lines that are not."""
    path = run_dir / rundir.EVENTS
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        notes.append(f"{rundir.EVENTS} could not be read: {exc.strerror}")
        return []
    events, bad = [], []
    lines = data.split(b"\n")
    try:
        # One parse for the whole file (a hundredfold fewer calls at 256 tasks x 50 attempts);
        # a file with a bad line is read line by line, to name it.
        parsed = json.loads(b"[" + b",".join(line for line in lines if line.strip()) + b"]")
    except ValueError:
        parsed = None
    for number, line in enumerate(lines, 1) if parsed is None else ():
        if not line.strip():
            continue
        event = _event(_json_or_none(line))
        if event is None:
            cut = number == len(lines) and not data.endswith(b"\n")
            bad.append(f"{number} (cut mid-line)" if cut else str(number))
        else:
            events.append(event)
    for number, item in enumerate(parsed or (), 1):
        event = _event(item)
        if event is None:
            bad.append(f"{number} (of the non-empty lines)")
        else:
            events.append(event)
    if bad:
        named = ", ".join(bad[:_NAMED_LINES]) + (
            f" and {len(bad) - _NAMED_LINES} more" if len(bad) > _NAMED_LINES else ""
        )
        notes.append(
            f"{rundir.EVENTS}: {len(bad)} line(s) could not be read and are left out: line {named}"
        )
    events.sort(key=lambda e: e["time"])
    return events


def _json_or_none(line: bytes) -> Any:
    """``line`` as JSON, or None when it is not JSON."""
    try:
        return json.loads(line)
    except ValueError:
        return None


def _event(event: Any) -> dict[str, Any] | None:
    """An event line's data, or None when it is not an event (garbled, or missing a field)."""
    if not isinstance(event, dict):
        return None
    ok = (
        _is_number(event.get("time"))
        and isinstance(event.get("task"), str)
        and isinstance(event.get("event"), str)
        and isinstance(event.get("attempt"), int)
    )
    return event if ok else None


# A number in JSON data: int or float, not bool (type() is exact: a bool is not an int here).
_NUMBERS = (int, float)


def _is_number(value: Any) -> bool:
    return type(value) in _NUMBERS


def _is_time(value: Any) -> bool:
    """A number that can stand on the time axis: not NaN or Infinity."""
    return _is_number(value) and math.isfinite(value)


# The events that end an attempt of a task (the launcher's TaskState changes), and their colour.
_ENDINGS = {
    "killed": Ending.KILLED,
    "stopped": Ending.STOPPED,
    "hung": Ending.HUNG,
    "failed": Ending.FAILED,
    "succeeded": Ending.SUCCEEDED,
}


def _bars_and_markers(
    events: Iterable[dict[str, Any]], end: float, live: bool
) -> tuple[list[Bar], list[Marker]]:
    """One bar per (task, attempt) that started, and the markers of restarts, notices, saves
    and hangs; an attempt with no end is running (``live``) or of unknown end at ``end``."""
    bars: list[Bar] = []
    markers: list[Marker] = []
    open_: dict[tuple[str, int], float] = {}
    noticed: set[int] = set()  # attempts that got a stop notice
    # (attempt, "restarted" or "started": a resumed run) -> (time, task) of each task's new start
    restarts: dict[tuple[int, str], list[tuple[float, str]]] = {}
    for e in events:
        task, kind, attempt, at = e["task"], e["event"], e["attempt"], e["time"]
        if task == RUN_TASK:
            if kind == "notice":
                noticed.add(attempt)
                within = e.get("save_s")
                save = f", save within {within:g} s" if _is_number(within) else ""
                what = f"save before the resize ({e['resize']})" if e.get("resize") else ""
                text = what or f"stop notice ({e.get('signal', 'signal')}){save}"
                markers.append(Marker(MarkerKind.NOTICE, at, None, text))
            elif kind == "resized":
                markers.append(Marker(MarkerKind.RESIZE, at, None, _resized_text(e)))
            continue
        if kind in ("started", "restarted"):
            open_[(task, attempt)] = at
            if kind == "restarted" or attempt > 0:  # a first start past attempt 0: a resume
                restarts.setdefault((attempt, kind), []).append((at, task))
            continue
        if kind != "exited" and kind not in _ENDINGS:
            continue
        start = open_.pop((task, attempt), None)
        ending = _ending(e, attempt in noticed)
        detail = "; ".join(str(e[k]) for k in ("exit", "reason") if e.get(k))
        if start is not None:
            bars.append(Bar(task, attempt, start, at, ending, detail))
        if _is_number(e.get("saved_step")):
            took = e.get("save_s")
            took_text = f" in {took:.2f} s" if _is_number(took) else ""
            text = f"{task} saved step {e['saved_step']}{took_text}"
            markers.append(Marker(MarkerKind.SAVE, at, task, text))
        if kind == "hung":
            markers.append(Marker(MarkerKind.HANG, at, task, f"{task} hung: {detail}"))
    markers += _restart_markers(restarts)
    for (task, attempt), start in open_.items():
        ending = Ending.RUNNING if live else Ending.UNKNOWN
        detail = "still running" if live else "no end recorded"
        bars.append(Bar(task, attempt, start, max(start, end), ending, detail))
    return bars, markers


def _resized_text(event: Mapping[str, Any]) -> str:
    """A ``resized`` event in words: ``world 3 -> 2 on h1, h2 from step 50: h3 lost (...)``."""
    hosts = event.get("hosts")
    on = f" on {', '.join(map(str, hosts))}" if isinstance(hosts, list) and hosts else ""
    step = event.get("step")
    at = f" from step {step}" if _is_step(step) else ""
    why = event.get("reason")
    world = f"world {event.get('old')} -> {event.get('new')}"
    if isinstance(why, str) and ": " in why:
        why = why.split(": ", 1)[1]  # the reason repeats the sizes
    return f"{world}{on}{at}" + (f": {why}" if why else "")


# Restarts of one attempt this close in time are one restart of a gang.
_GANG_S = 2.0


def _restart_markers(restarts: Mapping[tuple[int, str], list[tuple[float, str]]]) -> list[Marker]:
    """One marker per restart or resume: on its task's row, or, for tasks restarted together
    (a gang, a resumed run), one across every row (256 markers in a column say less than one
    line)."""
    out = []
    for (attempt, kind), started in restarts.items():
        groups: list[list[tuple[float, str]]] = []
        for at, task in sorted(started):
            if not groups or at - groups[-1][0][0] > _GANG_S:
                groups.append([])
            groups[-1].append((at, task))
        for group in groups:
            names = [task for _, task in group]
            if kind == "started":
                what = f"resumed (up --resume): attempt {attempt}"
            elif len(group) == 1:
                what = f"{names[0]} restarted: attempt {attempt}"
            else:
                what = f"gang restart: attempt {attempt}"
            if len(group) == 1:
                out.append(Marker(MarkerKind.RESTART, group[0][0], names[0], what))
                continue
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            out.append(Marker(MarkerKind.RESTART, group[0][0], None, f"{what} of {shown}"))
    return out


def _ending(event: Mapping[str, Any], noticed: bool) -> Ending:
    """How the attempt that ``event`` ends ended."""
    kind = event["event"]
    if kind in _ENDINGS:
        return _ENDINGS[kind]
    code = event.get("exit_code")
    if not isinstance(code, int):
        return Ending.FAILED
    meaning = contract.exit_meaning(code, noticed)
    if meaning is contract.ExitMeaning.DONE:
        return Ending.SUCCEEDED
    if meaning is contract.ExitMeaning.PREEMPTED:
        return Ending.PREEMPTED
    return Ending.FAILED


def _root_cause(record: RunRecord, bars: list[Bar]) -> list[Marker]:
    """The marker of a failed run's root cause: at the end of its task's last attempt."""
    failure = record.failure
    if failure is None or not failure.task:
        return []
    ended = [b for b in bars if b.task == failure.task and b.ending is not Ending.RUNNING]
    if ended:
        at = max(ended, key=lambda b: (b.attempt, b.end)).end
    elif record.ended_at:
        at = record.ended_at
    else:
        return []
    return [Marker(MarkerKind.ROOT_CAUSE, at, failure.task, failure.summary or failure.how)]


def _series(run_dir: Path, task: str, bars: list[Bar], notes: list[str]) -> tuple[Point, ...]:
    """``task``'s training over time: its metrics entries, then its latest heartbeat; where an
    entry has no steps/s, the rate since the entry before it in the same attempt."""
    role, _, index = task.rpartition("-")
    if not index.isdigit():
        return ()
    readings: list[tuple[float, int, Any, Any]] = []  # time, step, loss, steps/s
    path = contract.metrics_path(run_dir, role, int(index))
    entries = _json_file(path, run_dir, notes)
    if entries is not None and not isinstance(entries, list):
        notes.append(f"{_relative(path, run_dir)}: not a list of metrics entries; left out")
        entries = None
    skipped = 0
    for entry in entries or ():
        if type(entry) is dict and _is_time(entry.get("time")) and _is_step(entry.get("step")):
            readings.append(
                (entry["time"], entry["step"], entry.get("loss"), entry.get("steps_per_s"))
            )
        else:
            skipped += 1
    if skipped:
        notes.append(
            f"{_relative(path, run_dir)}: {skipped} entries without a time or step left out"
        )
    beat = _json_file(contract.status_path(run_dir, role, int(index)), run_dir, notes)
    if isinstance(beat, dict) and _is_time(beat.get("time")) and _is_step(beat.get("step")):
        if not readings or beat["time"] > readings[-1][0]:
            readings.append((beat["time"], beat["step"], beat.get("loss"), beat.get("steps_per_s")))
    readings.sort(key=_first)
    bars = sorted(bars, key=lambda b: b.start)
    starts = [b.start for b in bars]
    points: list[Point] = []
    last = Point(0.0, 0, None, None, -1)  # before any reading: no attempt is -1
    for at, step, loss, rate in readings:
        # The bar that started last at or before this reading, if it still ran then.
        found = bisect.bisect_right(starts, at) - 1
        attempt = bars[found].attempt if found >= 0 and at <= bars[found].end else None
        if type(rate) not in _NUMBERS:
            same = last.attempt == attempt and step > last.step and at > last.time
            rate = (step - last.step) / (at - last.time) if same else None
        last = Point(at, step, loss if type(loss) in _NUMBERS else None, rate, attempt)
        points.append(last)
    # A diverged loss (NaN, or Infinity: JSON as Python writes it) is exactly when people open
    # the report: such readings stay in the series and the charts leave a gap there.
    odd = [p.step for p in points if not all(_finite(v) for v in (p.loss, p.steps_per_s))]
    if odd:
        steps = f"step {odd[0]}" if len(odd) == 1 else f"steps {min(odd)}-{max(odd)}"
        notes.append(
            f"{task}: {len(odd)} reading(s) with a loss or steps/s of NaN or Infinity "
            f"({steps}): drawn as gaps in the charts"
        )
    return tuple(points)


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def _first(reading: tuple) -> Any:
    return reading[0]


def _is_step(value: Any) -> bool:
    return type(value) is int


def _json_file(path: Path, run_dir: Path, notes: list[str]) -> Any:
    """A JSON file's data; None when it is absent, or (with a note) cannot be read."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        notes.append(f"{_relative(path, run_dir)} could not be read: {exc.strerror}")
        return None
    try:
        return json.loads(text)
    except ValueError:
        notes.append(f"{_relative(path, run_dir)}: not valid JSON (cut or garbled); left out")
        return None


def _relative(path: Path, run_dir: Path) -> str:
    return str(path.relative_to(run_dir))
