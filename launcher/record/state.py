"""Run and task state: the enums, their allowed transitions, and run.json's one schema.

run.json is what every other shell reads (`status`, `logs`, `restart`, `down`, `collect`, a
resumed `up`), so it has one typed schema, `RunRecord` (with a `version`), read and written only
here. The launcher changes it through a `RunBook`: one `TaskLedger.change` call moves a task to
a new state, appends the event to events.jsonl and saves run.json, so the three never disagree.

Task states (`TaskState`), and who moves a task from one to the next:

    (new) -> starting          the transport started it
    starting -> running        its TensorFlow server listens (it joined the cluster)
    starting|running -> succeeded | failed      it exited on its own, 0 or not
    starting|running -> killed                  killed at once for a restart (of its gang)
    starting|running -> stopped                 stopped with a grace period: the run is ending,
                                                training is done, or `down` found it orphaned
    killed -> failed           a task that stopped making progress is killed, then counts failed
    succeeded|failed|killed|stopped -> starting     the next attempt (a restart, or `up --resume`)

Run states (`RunState`): running -> stopping (tearing tasks down) -> succeeded | failed |
interrupted, or from running straight to an end when nothing is left to stop. Only running and
stopping runs have live processes. A finished run runs again only as a new attempt (`up
--resume`), which writes a new record and keeps the old one in its `history`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distlaunch.launcher.core import backends
from distlaunch.launcher.core.errors import RecordError, UsageError
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.endings import EventKind

# Bumped when a field changes meaning; readers accept records without one (version 0).
# 2: the failure is typed: its `kind` (policy.EventKind) and the task's `exit_code`.
# (The `backend` key came later and changed no field's meaning: a record without it names its
# backend by the section it holds, `backends.recorded`.)
SCHEMA_VERSION = 2


class RunState(enum.StrEnum):
    """The state of a whole run, as run.json records it."""

    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    PREEMPTED = "preempted"  # every training task saved on a stop notice: resume continues there

    @property
    def live(self) -> bool:
        """Whether a launcher may still be running tasks of the run."""
        return self in (RunState.RUNNING, RunState.STOPPING)


class TaskState(enum.StrEnum):
    """The state of one task's latest incarnation (see the module docstring)."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    KILLED = "killed"
    STOPPED = "stopped"

    @property
    def live(self) -> bool:
        """Whether the task's process is meant to be running."""
        return self in (TaskState.STARTING, TaskState.RUNNING)


_ENDED = {TaskState.SUCCEEDED, TaskState.FAILED, TaskState.KILLED, TaskState.STOPPED}
TASK_TRANSITIONS: Mapping[TaskState | None, frozenset[TaskState]] = {
    None: frozenset({TaskState.STARTING}),
    TaskState.STARTING: frozenset({TaskState.RUNNING, *_ENDED}),
    TaskState.RUNNING: frozenset(_ENDED),
    TaskState.SUCCEEDED: frozenset({TaskState.STARTING}),
    TaskState.FAILED: frozenset({TaskState.STARTING}),
    TaskState.KILLED: frozenset({TaskState.STARTING, TaskState.FAILED}),
    TaskState.STOPPED: frozenset({TaskState.STARTING}),
}
_FINISHED = frozenset(
    {RunState.SUCCEEDED, RunState.FAILED, RunState.INTERRUPTED, RunState.PREEMPTED}
)
RUN_TRANSITIONS: Mapping[RunState, frozenset[RunState]] = {
    RunState.RUNNING: frozenset({RunState.STOPPING, *_FINISHED}),
    RunState.STOPPING: _FINISHED,
    RunState.SUCCEEDED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.INTERRUPTED: frozenset(),
    RunState.PREEMPTED: frozenset(),
}


class TransitionError(ValueError):
    """A state change the transition tables do not allow: a bug in the launcher."""


@dataclass
class TaskRecord:
    """run.json's entry for one task: its place in the plan and its latest incarnation."""

    role: str
    index: int
    port: int
    attempt: int = 0
    state: TaskState | None = None
    pid: int | None = None
    pgid: int | None = None
    started_at: float | None = None
    restarts: int = 0
    exit_code: int | None = None
    exit: str | None = None
    ended_at: float | None = None
    joined_after_s: float | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TaskRecord:
        """Read an entry (unknown keys are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        try:
            values["state"] = TaskState(values["state"]) if values.get("state") else None
        except ValueError:
            values["state"] = None  # a state this version does not know: shown as unknown
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """The entry as JSON data."""
        # Every field is a scalar: no deep copy (dataclasses.asdict) is needed, and run.json is
        # saved often, with one entry per task.
        return {name: getattr(self, name) for name in _TASK_FIELDS}


_TASK_FIELDS = tuple(f.name for f in dataclasses.fields(TaskRecord))


@dataclass(frozen=True)
class RunFailure:
    """run.json's root-cause failure: the task, how it ended (``kind``, ``exit_code``: negative
    for a signal) and the words shown (``how``, and ``summary``: the headline)."""

    task: str
    how: str
    summary: str
    kind: EventKind | None = None  # None: a record written before version 2 (only ``how``)
    exit_code: int | None = None

    @classmethod
    def from_json(cls, data: Any) -> RunFailure | None:
        """Read a record's failure (None: there is none); a kind this version does not know
        reads as None, as in an older record."""
        if not isinstance(data, Mapping):
            return None
        try:
            kind = EventKind(data["kind"]) if data.get("kind") else None
        except ValueError:
            kind = None
        code = data.get("exit_code")
        return cls(
            task=str(data.get("task", "")),
            how=str(data.get("how", "")),
            summary=str(data.get("summary", "")),
            kind=kind,
            exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
        )

    def to_json(self) -> dict[str, Any]:
        """The failure as JSON data."""
        kind = None if self.kind is None else self.kind.value
        return {**dataclasses.asdict(self), "kind": kind}


# Optional fields that only some backends or commands set; left out of run.json while None.
_OPTIONAL = (
    "netns_holder_pid", "network", "stopped_by", "standbys", "preempted", "notice", "world",
)  # fmt: skip


@dataclass
class RunRecord:
    """run.json: the run's identity, state, plan, tasks and earlier attempts."""

    run_id: str
    name: str = ""
    spec_file: str = ""
    spec: dict = field(default_factory=dict)  # the spec as written, secrets masked
    strategy: str = ""
    state: RunState = RunState.RUNNING
    attempt: int = 0
    launcher_pid: int | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    exit_code: int | None = None
    failure: RunFailure | None = None
    plan: dict = field(default_factory=dict)
    tasks: dict[str, TaskRecord] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # earlier attempts' outcomes
    netns_holder_pid: int | None = None
    network: dict | None = None  # the remote hosts' firewall (firewall.Protection.to_json)
    # The backend that ran it (launcher/core/backends.py) and its own section, which run.json keeps
    # under the backend's `section` key (the SSH hosts, the compose project, the Slurm job);
    # the backend reads it typed (its `Backend` class).
    backend: str = backends.DEFAULT
    section: dict | None = None
    stopped_by: str | None = None
    # the warm standbys now waiting (launcher/transports/local/standby.py)
    standbys: dict | None = None
    # A run stopped on a notice: the step its tasks saved and how long the save took (up.py).
    preempted: dict | None = None
    # The attempt's stop notice (supervisor.py): its signal, wall time and save_s; once it ended
    # other than preempted, ``stopped`` (why nothing was saved) or ``done`` (training was done).
    notice: dict | None = None
    # An elastic run's world (launcher/run/elastic.py `World.record`): its range, size, which
    # slot each worker holds, the places out and the sizes it had (`worlds`).
    world: dict | None = None
    version: int = SCHEMA_VERSION
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as they are

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunRecord:
        """Read a record; raise ValueError when it is not one."""
        if not isinstance(data, Mapping) or not isinstance(data.get("run_id"), str):
            raise ValueError("not a run record")
        typed = {"extra", "tasks", "state", "failure", "backend", "section"}
        known = {f.name for f in dataclasses.fields(cls)} - typed
        values = {k: v for k, v in data.items() if k in known}
        values.setdefault("version", 0)
        tasks = data.get("tasks") or {}
        backend = backends.recorded(data)
        key = _section_key(backend)
        section = data.get(key) if key else None
        return cls(
            **values,
            state=RunState(data.get("state", RunState.RUNNING)),
            tasks={name: TaskRecord.from_json(entry) for name, entry in tasks.items()},
            failure=RunFailure.from_json(data.get("failure")),
            backend=backend,
            section=section if isinstance(section, dict) else None,
            extra={k: v for k, v in data.items() if k not in known | typed | {key}},
        )

    def to_json(self) -> dict[str, Any]:
        """The record as JSON data."""
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("extra", "tasks", "section")
        }
        data["tasks"] = {name: task.to_json() for name, task in self.tasks.items()}
        data["failure"] = None if self.failure is None else self.failure.to_json()
        for name in _OPTIONAL:
            if data[name] is None:
                del data[name]
        key = _section_key(self.backend)
        if key and self.section is not None:
            data[key] = self.section
        return {**self.extra, **data}

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        """The record in ``run_dir``; UsageError when there is none."""
        path = run_dir / rundir.RUN_JSON
        try:
            return cls.from_json(rundir.read_json(path))
        except (ValueError, TypeError):
            raise UsageError(f"{path} is not a run record") from None

    @classmethod
    def find(cls, run_dir: Path) -> RunRecord | None:
        """The record in ``run_dir``, or None when there is none (or it cannot be read)."""
        try:
            return cls.from_json(rundir.read_json(run_dir / rundir.RUN_JSON))
        except (ValueError, TypeError):
            return None

    def save(self, run_dir: Path) -> None:
        """Write run.json atomically."""
        rundir.write_json(run_dir / rundir.RUN_JSON, self.to_json())

    def update(self, fields: Mapping[str, Any]) -> None:
        """Set record fields by name; a name this schema does not know goes to ``extra``."""
        known = {f.name for f in dataclasses.fields(self)} - {"extra"}
        for key, value in fields.items():
            if key in known:
                setattr(self, key, value)
            else:
                self.extra[key] = value

    def outcome(self) -> dict[str, Any]:
        """This attempt's outcome, as the next attempt keeps it in its `history`."""
        keys = ("attempt", "state", "started_at", "ended_at", "exit_code")
        failure = None if self.failure is None else self.failure.to_json()
        return {**{k: getattr(self, k) for k in keys}, "failure": failure}


def _section_key(backend: str) -> str | None:
    """The run.json key of ``backend``'s section; None for a backend not installed here (its
    section is then kept in ``extra``, as it is)."""
    try:
        return backends.entry(backend).section
    except backends.UnknownBackend:
        return None


def latest_unfinished(shared_dir: Path, name: str) -> Path | None:
    """The run dir of spec ``name``'s latest run if it did not succeed, else None.

    Every `up` asks, so it reads no run.json but the newest runs' (`rundir.runs_of`, by their
    ids): a run deleted by hand is simply not listed, and one whose run.json is missing or
    unreadable (a launcher creating it right now) is passed over for the one before it."""
    for _, group in itertools.groupby(rundir.runs_of(shared_dir, name), key=lambda run: run[0]):
        # Runs started within one second: their records say which is the latest.
        found = [(r.started_at, p, r) for _, p in group if (r := RunRecord.find(p)) is not None]
        found = [(started, path, r) for started, path, r in found if r.name == name]
        if found:
            _, path, record = max(found, key=lambda item: item[0])
            return None if record.state is RunState.SUCCEEDED else path
    return None


class RunBook:
    """The launcher's writer of one run's run.json and events.jsonl.

    With ``best_effort`` (set for teardown), a failed write of run.json (a full disk) is reported
    once through ``on_error`` and otherwise ignored: stopping the tasks matters more than
    recording that they stopped.
    """

    def __init__(
        self, run_dir: Path, record: RunRecord, on_error: Callable[[str], None] | None = None
    ) -> None:
        self.run_dir = run_dir
        self.record = record
        self.best_effort = False
        self._on_error = on_error
        self._batch = 0
        self._dirty = False
        self._failed = False
        self._encoder = _RecordEncoder()

    def ledger(self, name: str, role: str, index: int, port: int) -> TaskLedger:
        """The ledger of task ``name``, with a new entry in the record if it has none."""
        entry = self.record.tasks.setdefault(name, TaskRecord(role=role, index=index, port=port))
        return TaskLedger(self, name, entry)

    def set_state(self, state: RunState, **fields: Any) -> None:
        """Move the run to ``state`` (with record ``fields``) and save."""
        if state is not self.record.state and state not in RUN_TRANSITIONS[self.record.state]:
            raise TransitionError(f"run {self.record.run_id}: {self.record.state} -> {state}")
        self.record.state = state
        for key, value in fields.items():
            setattr(self.record, key, value)
        self.save()

    def event(self, task: str, event: str, attempt: int, **fields: Any) -> None:
        """Append one event line."""
        try:
            rundir.append_event(self.run_dir, task=task, event=event, attempt=attempt, **fields)
        except OSError as exc:
            self._failed_write(exc)

    def save(self) -> None:
        """Write run.json now, or at the end of the current `batch`."""
        if self._batch:
            self._dirty = True
            return
        try:
            rundir.write_text(self.run_dir / rundir.RUN_JSON, self._encoder.encode(self.record))
        except OSError as exc:
            self._failed_write(exc)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Save once at the end of the block instead of at every change in it.

        When the block raises, the save is best effort: a full disk must not replace a stop
        signal's Interrupted (its exit code) or the error that ended the block."""
        self._batch += 1
        try:
            yield
        except BaseException:
            self._batch -= 1
            with suppress(RecordError):
                self._save_dirty()
            raise
        self._batch -= 1
        self._save_dirty()

    def _save_dirty(self) -> None:
        if not self._batch and self._dirty:
            self._dirty = False
            self.save()

    def _failed_write(self, exc: OSError) -> None:
        message = f"could not record the run in {self.run_dir}: {exc}"
        if not self.best_effort:
            raise RecordError(message) from exc
        if not self._failed and self._on_error is not None:
            self._on_error(message)
        self._failed = True


class _RecordEncoder:
    """Encodes a record as `RunRecord.save` does, re-encoding only what changed since the last call.

    The plan and the spec do not change while a run goes on, and the plan is most of run.json:
    every task's TF_CONFIG lists every task, so it grows with the square of the task count (2.7 MB
    at 256 tasks). They are encoded once; each save encodes only the rest and splices them in.
    """

    _FIXED = ("plan", "spec")

    def __init__(self) -> None:
        # key -> (the value encoded, its text): the value is kept, so its id cannot be reused.
        self._cache: dict[str, tuple[Any, str]] = {}

    def encode(self, record: RunRecord) -> str:
        """``record`` as run.json's text (what json.dumps with indent=2 gives)."""
        data = record.to_json()
        texts = {}
        for key in self._FIXED:
            value = data[key]
            cached = self._cache.get(key)
            if cached is None or cached[0] is not value:
                # Indented one level deeper, as it sits inside the record.
                text = json.dumps(value, indent=2, default=str).replace("\n", "\n  ")
                cached = self._cache[key] = (value, text)
            data[key] = placeholder = f"\0distlaunch:{key}\0"
            texts[json.dumps(placeholder)] = cached[1]
        text = json.dumps(data, indent=2, default=str)
        if any(text.count(placeholder) != 1 for placeholder in texts):
            # A string of the record's own looks like a placeholder: encode it all, plainly.
            return json.dumps(record.to_json(), indent=2, default=str) + "\n"
        for placeholder, value_text in texts.items():
            text = text.replace(placeholder, value_text, 1)
        return text + "\n"


class TaskLedger:
    """One task's state in a `RunBook`: each change is recorded, logged and saved in one call."""

    def __init__(self, book: RunBook, name: str, entry: TaskRecord) -> None:
        self.book = book
        self.name = name
        self.entry = entry

    @property
    def state(self) -> TaskState | None:
        """The task's current state (None before its first start)."""
        return self.entry.state

    def change(
        self, state: TaskState, event: str, record: Mapping[str, Any] | None = None, **fields: Any
    ) -> None:
        """Move the task to ``state``, set ``record`` fields of its entry, append ``event`` with
        ``fields``, and save run.json."""
        if state not in TASK_TRANSITIONS[self.entry.state]:
            raise TransitionError(f"task {self.name}: {self.entry.state} -> {state}")
        self.entry.state = state
        for key, value in (record or {}).items():
            setattr(self.entry, key, value)
        self.note(event, **fields)

    def note(self, event: str, **fields: Any) -> None:
        """Append ``event`` (no state change) and save run.json."""
        self.book.event(self.name, event, self.entry.attempt, **fields)
        self.book.save()
