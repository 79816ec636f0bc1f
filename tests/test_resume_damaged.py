"""A resume with a damaged checkpoint folder (issue 36): the newest whole checkpoint, said, or one
line naming the damage; never a silent start at step 0, never a checkpoint deleted.

`worker.resume.find` (standard library only) is checked on folders made by hand; one real
2-worker MWMS `dw.fit` run then resumes with its index garbled and its latest checkpoint's files
gone, and once more with nothing whole left.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import example, run_record, write_spec
from distlaunch.launcher.record import checkpoints
from distlaunch.worker import contract, resume


def _checkpoint(folder: Path, step: int, shards: int = 1, missing: int | None = None) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"ckpt-{step}.index").write_bytes(b"i")
    for k in range(shards):
        if k != missing:
            (folder / f"ckpt-{step}.data-{k:05d}-of-{shards:05d}").write_bytes(b"d")


def _index(folder: Path, step: int) -> None:
    (folder / "checkpoint").write_text(
        f'model_checkpoint_path: "ckpt-{step}"\nall_model_checkpoint_paths: "ckpt-{step}"\n'
    )


@pytest.mark.quick
def test_a_whole_index_is_trusted_and_a_fresh_folder_starts_at_zero(tmp):
    assert resume.find(tmp / "none") == resume.ResumePoint(None)
    assert resume.find(tmp) == resume.ResumePoint(None)
    _checkpoint(tmp, 20)
    _checkpoint(tmp, 40, shards=2)
    _index(tmp, 20)  # not the newest, but whole: what the run said is its latest
    assert resume.find(tmp) == resume.ResumePoint(tmp / "ckpt-20")


@pytest.mark.quick
def test_the_launcher_reads_a_resumes_step_from_the_index_or_the_keras3_backup(tmp):
    """What the launcher says a resume starts from (a resize's line, a notice's summary):
    TensorFlow's index, else the step distlaunch's Keras 3 layer writes into its backup's
    metadata; a backup without that step (Keras's own) or garbled names none."""
    assert checkpoints.resume_point(tmp) is None
    backup = contract.keras_backup_dir(tmp)
    backup.mkdir()
    metadata = backup / contract.KERAS_BACKUP_METADATA
    for text in ('{"epoch": 2, "batch": 0}', "{garbled", "[1]", '{"distlaunch_step": -1}'):
        metadata.write_text(text)
        assert checkpoints.resume_point(tmp) is None, text
    metadata.write_text(f'{{"epoch": 2, "batch": 0, "{contract.KERAS_BACKUP_STEP}": 50}}')
    assert checkpoints.resume_point(tmp) == checkpoints.Latest("backup", 50)
    _index(tmp, 20)
    assert checkpoints.resume_point(tmp) == checkpoints.Latest("ckpt-20", 20)


@pytest.mark.quick
@pytest.mark.parametrize("damage", ["missing", "garbled", "gone", "shard"])
def test_a_damaged_index_resumes_from_the_newest_whole_checkpoint_and_says_why(tmp, damage):
    _checkpoint(tmp, 20)
    _checkpoint(tmp, 40)
    _checkpoint(tmp, 60, shards=2, missing=1 if damage == "shard" else None)
    _index(tmp, 60)
    said = {
        "missing": f"{tmp}/checkpoint is missing",
        "garbled": f"{tmp}/checkpoint is garbled (it names no latest checkpoint)",
        "gone": f"{tmp}/checkpoint names ckpt-60, whose files are missing or incomplete",
        "shard": f"{tmp}/checkpoint names ckpt-60, whose files are missing or incomplete",
    }[damage]
    if damage == "missing":
        (tmp / "checkpoint").unlink()
    elif damage == "garbled":
        (tmp / "checkpoint").write_text("\x00\x17garbage {")
    elif damage == "gone":
        for path in tmp.glob("ckpt-60.*"):
            path.unlink()
    point = resume.find(tmp)
    # ckpt-60 is whole unless its files are the damage.
    newest = 60 if damage in ("missing", "garbled") else 40
    assert point.path == tmp / f"ckpt-{newest}"
    assert point.damage == f"{said}; resuming from ckpt-{newest}, the newest whole checkpoint"


@pytest.mark.quick
def test_nothing_whole_to_resume_from_fails_in_one_line(tmp):
    _checkpoint(tmp, 20, shards=2, missing=0)
    _index(tmp, 20)
    with pytest.raises(resume.CheckpointDamaged) as caught:
        resume.find(tmp)
    assert str(caught.value) == (
        f"cannot resume: {tmp}/checkpoint names ckpt-20, whose files are missing or incomplete, "
        "and no other checkpoint there is whole"
    )


# Steps per epoch, and a checkpoint at each epoch's end. Few: the run's outcomes are which
# checkpoints exist and which one a resume starts from, not how far it trained (each step is CPU
# spent by both workers).
EPOCH = 5


def _up(tmp: Path, epochs: int) -> subprocess.CompletedProcess:
    program = example("mnist_mlp", epochs, EPOCH, "--checkpoint-every", str(EPOCH))
    spec = write_spec(tmp, program=program)
    return subprocess.run(
        [sys.executable, "-m", "distlaunch.launcher", "up", "--run-id", "r", str(spec)],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _log(run_dir: Path, attempt: int) -> str:
    return (run_dir / "logs" / f"attempt-{attempt}" / "worker-0.log").read_text()


def test_a_real_resume_with_a_garbled_index_and_the_latest_gone_uses_the_newest_whole(tmp):
    first = _up(tmp, epochs=3)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp / "runs" / "r"
    folder = run_dir / "checkpoints"
    assert {p.name for p in folder.glob("ckpt-*.index")} == {
        f"ckpt-{EPOCH}.index",
        f"ckpt-{2 * EPOCH}.index",
        f"ckpt-{3 * EPOCH}.index",
    }
    (folder / "checkpoint").write_text("garbage {")
    for path in folder.glob(f"ckpt-{3 * EPOCH}.*"):
        path.unlink()

    second = _up(tmp, epochs=4)
    assert second.returncode == 0, second.stderr[-3000:]
    log = _log(run_dir, 1)
    assert (
        f"distlaunch: {folder}/checkpoint is garbled (it names no latest checkpoint); resuming "
        f"from ckpt-{2 * EPOCH}, the newest whole checkpoint; no checkpoint is deleted in this "
        "attempt"
    ) in log
    assert re.findall(r"resumed from \S+ at step (\d+)", log) == [str(2 * EPOCH)]
    # Trained on from epoch 2's end (not from 0): its checkpoints are epochs 3 and 4, and none of
    # the earlier ones was deleted or written again.
    steps = sorted(int(p.name[5:-6]) for p in folder.glob("ckpt-*.index"))
    assert steps == [EPOCH, 2 * EPOCH, 3 * EPOCH, 4 * EPOCH]
    assert "epoch 1/4" not in log and f"epoch 4/4 step {4 * EPOCH}" in log

    for path in folder.glob("ckpt-*.data-*"):
        path.unlink()
    third = _up(tmp, epochs=5)
    assert third.returncode == 1
    # The headline names the damage (shortened to fit); the task's log has the whole line.
    assert "CheckpointDamaged: cannot resume: " in third.stderr
    assert (
        f"CheckpointDamaged: cannot resume: {folder}/checkpoint names ckpt-{4 * EPOCH}, whose "
        "files are missing or incomplete, and no other checkpoint there is whole"
    ) in _log(run_dir, 2)
    assert run_record(run_dir)["state"] == "failed"
