"""run.json's schema and the state machines: one call records, logs and saves a change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import events
from distlaunch.launcher.api import reads as api_reads
from distlaunch.launcher.core.errors import UsageError
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.record.state import (
    SCHEMA_VERSION,
    RunBook,
    RunFailure,
    RunRecord,
    RunState,
    TaskState,
    TransitionError,
)

pytestmark = pytest.mark.quick


def test_a_record_round_trips_and_keeps_keys_it_does_not_know(tmp_path: Path) -> None:
    record = RunRecord(run_id="r", name="t", launcher_pid=7, started_at=1.5)
    record.update({"ssh": {"hosts": {}}, "from_a_newer_version": [1]})
    record.save(tmp_path)
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["version"] == SCHEMA_VERSION and data["state"] == "running"
    assert data["from_a_newer_version"] == [1] and "compose" not in data
    again = RunRecord.load(tmp_path)
    assert again.to_json() == data


def test_a_record_without_a_version_is_version_0_and_garbage_is_refused(tmp_path: Path) -> None:
    old = {
        "run_id": "r",
        "state": "failed",
        "tasks": {"worker-0": {"role": "worker", "index": 0, "port": 1}},
    }
    (tmp_path / "run.json").write_text(json.dumps(old))
    record = RunRecord.load(tmp_path)
    assert record.version == 0 and record.state is RunState.FAILED
    assert record.tasks["worker-0"].state is None
    (tmp_path / "run.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match="not a run record"):
        RunRecord.load(tmp_path)


def test_one_change_sets_the_state_appends_the_event_and_saves(tmp_path: Path) -> None:
    book = RunBook(tmp_path, RunRecord(run_id="r"))
    task = book.ledger("worker-0", "worker", 0, 2222)
    task.change(TaskState.STARTING, "started", {"pid": 42, "attempt": 0}, pid=42)
    task.change(TaskState.RUNNING, "joined", {"joined_after_s": 0.5}, port=2222)
    saved = json.loads((tmp_path / "run.json").read_text())["tasks"]["worker-0"]
    assert saved["state"] == "running" and saved["pid"] == 42 and saved["joined_after_s"] == 0.5
    assert [(e["event"], e["task"], e["attempt"]) for e in events(tmp_path)] == [
        ("started", "worker-0", 0),
        ("joined", "worker-0", 0),
    ]


def test_transitions_outside_the_tables_are_refused(tmp_path: Path) -> None:
    book = RunBook(tmp_path, RunRecord(run_id="r"))
    task = book.ledger("worker-0", "worker", 0, 2222)
    with pytest.raises(TransitionError):
        task.change(TaskState.RUNNING, "joined")  # never started
    task.change(TaskState.STARTING, "started")
    task.change(TaskState.SUCCEEDED, "exited")
    with pytest.raises(TransitionError):
        task.change(TaskState.KILLED, "killed")  # it has already ended
    book.set_state(RunState.SUCCEEDED)
    with pytest.raises(TransitionError):
        book.set_state(RunState.RUNNING)  # a finished run runs again only as a new record


def test_a_batch_saves_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    book = RunBook(tmp_path, RunRecord(run_id="r"))
    saves = []
    monkeypatch.setattr(rundir, "write_text", lambda path, text: saves.append(path))
    with book.batch():
        for i in range(3):
            book.ledger(f"worker-{i}", "worker", i, 1).change(TaskState.STARTING, "started")
    assert len(saves) == 1


def test_saves_after_the_first_write_what_json_dumps_writes(tmp_path: Path) -> None:
    # The plan and spec are encoded once and spliced into later saves: the file must not tell.
    plan = {"tasks": [{"env": {"TF_CONFIG": '{"cluster": 1}'}, "argv": ["a\nb"]}]}
    record = RunRecord(run_id="r", spec={"name": "x", "nested": [1, {"a": None}]}, plan=plan)
    book = RunBook(tmp_path, record)
    book.ledger("worker-0", "worker", 0, 1).change(TaskState.STARTING, "started")
    book.ledger("worker-0", "worker", 0, 1).change(TaskState.RUNNING, "joined")
    text = (tmp_path / rundir.RUN_JSON).read_text()
    assert text == json.dumps(record.to_json(), indent=2) + "\n"
    assert RunRecord.load(tmp_path).tasks["worker-0"].state is TaskState.RUNNING


def test_the_failure_is_stored_typed_and_a_version_1_record_still_loads(tmp_path: Path) -> None:
    record = RunRecord(run_id="r", state=RunState.FAILED)
    record.failure = RunFailure(
        "worker-1", "signal SIGKILL", "run r failed: ...", EventKind.EXITED, -9
    )
    record.save(tmp_path)
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["version"] == SCHEMA_VERSION == 2
    assert data["failure"] == {
        "task": "worker-1",
        "how": "signal SIGKILL",
        "summary": "run r failed: ...",
        "kind": "exited",
        "exit_code": -9,
    }
    assert RunRecord.load(tmp_path).failure == record.failure
    # Version 1 wrote the failure as prose only: it loads, its kind unknown (None).
    old = {"run_id": "r", "version": 1, "state": "failed", "tasks": {}}
    old["failure"] = {"task": "worker-1", "how": "hung: no log output", "summary": "s"}
    (tmp_path / "run.json").write_text(json.dumps(old))
    loaded = RunRecord.load(tmp_path)
    assert loaded.version == 1 and loaded.failure == RunFailure(
        "worker-1", "hung: no log output", "s"
    )
    assert api_reads.failure_of(tmp_path, loaded).kind == "hang"  # told by its words, as before
    # Version 2's kind is what the API reads, whatever the words say.
    loaded.failure = RunFailure("worker-1", "words", "s", EventKind.FORMATION)
    assert api_reads.failure_of(tmp_path, loaded).kind == "formation"


def test_a_backend_section_is_read_typed_and_a_previous_version_record_still_loads(
    tmp_path: Path,
) -> None:
    from distlaunch.launcher.transports.compose.transport import ComposeBackend, ComposeProject
    from distlaunch.launcher.transports.slurm.allocation import Allocation
    from distlaunch.launcher.transports.slurm.transport import SlurmBackend

    # The previous version wrote no `backend`: its section tells it, and nothing is `extra`.
    job = {"job_id": "12", "nodes": ["n1", "n2"], "cpus": {"n1": 2, "n2": 2}, "submitted": True}
    network = {"protect": "auto", "hosts": {}}
    old = {"run_id": "r", "version": 2, "tasks": {}, "slurm": job, "network": network}
    (tmp_path / "run.json").write_text(json.dumps(old))
    loaded = RunRecord.load(tmp_path)
    assert (loaded.backend, loaded.network, loaded.extra) == ("slurm", network, {})
    assert SlurmBackend().section(loaded) == Allocation(
        "12", ("n1", "n2"), {"n1": 2, "n2": 2}, True
    )
    assert ComposeBackend().section(loaded) is None  # another backend's run
    loaded.save(tmp_path)  # written back under the same keys: the previous version reads it
    again = json.loads((tmp_path / "run.json").read_text())
    assert again["slurm"] == job and again["network"] == network and again["backend"] == "slurm"

    compose = {"project": "dl-r", "file": "/runs/r/docker-compose.yml", "command": ["docker"]}
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r", "compose": compose}))
    project = ComposeBackend().section(RunRecord.load(tmp_path))
    assert project == ComposeProject("dl-r", Path("/runs/r/docker-compose.yml"), ("docker",))
    assert project.to_json() == compose

    # A record of a backend not installed here keeps its section as it is.
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r", "backend": "gone", "x": {}}))
    gone = RunRecord.load(tmp_path)
    assert (gone.backend, gone.section, gone.extra) == ("gone", None, {"x": {}})
    assert gone.to_json()["x"] == {} and gone.to_json()["backend"] == "gone"
