"""The only contract between the launcher and a task: environment names and run-dir layout.

The launcher writes these variables into every task's environment and reads the files a task
writes. This module imports nothing heavy (no TensorFlow) because the launcher imports it too.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

# Environment variables set by the launcher for every task.
TF_CONFIG = "TF_CONFIG"
RUN_ID = "DISTLAUNCH_RUN_ID"
RUN_DIR = "DISTLAUNCH_RUN_DIR"
ROLE = "DISTLAUNCH_ROLE"
INDEX = "DISTLAUNCH_INDEX"
ATTEMPT = "DISTLAUNCH_ATTEMPT"
STRATEGY = "DISTLAUNCH_STRATEGY"
KERAS = "DISTLAUNCH_KERAS"
ERROR_FILE = "DISTLAUNCH_ERROR_FILE"
STATUS_FILE = "DISTLAUNCH_STATUS_FILE"
CHECKPOINT_DIR = "DISTLAUNCH_CHECKPOINT_DIR"
METRICS_FILE = "DISTLAUNCH_METRICS_FILE"

# An elastic run (the spec's "elastic" section), in every training task of a world: how the
# program's batch follows the world size (ELASTIC_BATCH: "global" or "per_worker", worker/elastic.py;
# unset: the run is not elastic), the workers of this world (WORLD_SIZE), the workers the program's
# batch numbers were written for (BASE_WORKERS: the range's MAX) and the world as `status` names it
# (WORLD, e.g. "2 of 2:3"). The checkpoint does not depend on the world: any size resumes it.
ELASTIC_BATCH = "DISTLAUNCH_ELASTIC_BATCH"
WORLD_SIZE = "DISTLAUNCH_WORLD_SIZE"
BASE_WORKERS = "DISTLAUNCH_BASE_WORKERS"
WORLD = "DISTLAUNCH_WORLD"
ELASTIC_BATCH_RULES = ("global", "per_worker")

# Kubernetes: the training cluster of a task's role (TF_CONFIG's "cluster", JSON), from which
# distlaunch.host.k8s_entry builds TF_CONFIG with the index Kubernetes gives the pod.
CLUSTER = "DISTLAUNCH_CLUSTER"
JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes in every pod of an Indexed Job
# Parameter-server ps and worker tasks that no launcher stops (Kubernetes Jobs, a compose file run
# by hand): they end with the chief's result (distlaunch.worker.chief_result; JSON: the chief's
# retries and final exit codes). Unset, a server serves until it is stopped.
END_WITH_CHIEF = "DISTLAUNCH_END_WITH_CHIEF"

# Values of STRATEGY and KERAS.
MWMS = "multi_worker_mirrored"
PSS = "parameter_server"
KERAS3 = "keras3"
TF_KERAS = "tf_keras"

# Roles a task can have (TF_CONFIG's task types).
CHIEF = "chief"
WORKER = "worker"
PS = "ps"
EVALUATOR = "evaluator"  # a sidecar: not part of the training cluster

# Task states a task reports in its status file.
STATE_STARTING = "starting"
STATE_READY = "ready"  # the strategy is built: the task has joined its cluster
# Saved on a stop notice and stopping; its status also holds SAVED_STEP and SAVE_S.
STATE_PREEMPTED = "preempted"
SAVED_STEP = "saved_step"  # the step of the checkpoint saved on the notice
SAVE_S = "save_s"  # seconds from the notice to the end of that save


class ExitMeaning(enum.StrEnum):
    """What a task's exit code tells the launcher (the table EXIT_CODES)."""

    DONE = "done"  # finished its work
    PREEMPTED = "preempted"  # saved on a stop notice and stopped: resume continues from there
    RESTARTABLE = "restartable"  # failed; another attempt may succeed (restart.policy decides)
    FATAL = "fatal"  # the program is wrong: no attempt can succeed


# The exit-code contract between every task and the launcher, on every backend: one table, also
# in the docs (docs/preemption.md). A task that saved on a stop notice exits EXIT_PREEMPTED (sysexits'
# EX_TEMPFAIL: "try again later"). TensorFlow's PreemptionCheckpointHandler exits 42 by default,
# and a program's own SIGTERM handler often exits 143: after a notice those mean preempted too,
# before one they are failures. Death by SIGTERM itself (-15) means the program did not handle the
# notice, so it saved nothing: that stops the run as before. EXIT_FATAL is the default of the
# spec's restart.non_retryable_exit_codes.
EXIT_PREEMPTED = 75
EXIT_FATAL = 2
TF_HANDLER_EXIT = 42
SIGTERM_EXIT = 143
EXIT_CODES: tuple[tuple[str, ExitMeaning, str], ...] = (
    ("0", ExitMeaning.DONE, "the task finished"),
    (str(EXIT_PREEMPTED), ExitMeaning.PREEMPTED, "it saved on a stop notice (dw.fit) and stopped"),
    (
        f"{TF_HANDLER_EXIT} or {SIGTERM_EXIT} after a notice",
        ExitMeaning.PREEMPTED,
        "TensorFlow's PreemptionCheckpointHandler, or a program's own SIGTERM handler",
    ),
    (str(EXIT_FATAL), ExitMeaning.FATAL, "the program is wrong (restart.non_retryable_exit_codes)"),
    ("any other", ExitMeaning.RESTARTABLE, "a failure: restart.policy decides"),
)


def exit_meaning(code: int, noticed: bool, fatal: tuple[int, ...] = (EXIT_FATAL,)) -> ExitMeaning:
    """What exit ``code`` (negative: killed by that signal) means, by EXIT_CODES; ``noticed``:
    the task was sent a stop notice; ``fatal``: the spec's non-retryable codes."""
    if code == 0:
        return ExitMeaning.DONE
    if code == EXIT_PREEMPTED or noticed and code in (TF_HANDLER_EXIT, SIGTERM_EXIT):
        return ExitMeaning.PREEMPTED
    return ExitMeaning.FATAL if code in fatal else ExitMeaning.RESTARTABLE


def task_name(role: str, index: int) -> str:
    """Return the name a task goes by in logs and files, e.g. ``worker-1``."""
    return f"{role}-{index}"


def log_path(run_dir: Path, attempt: int, role: str, index: int) -> Path:
    """Return the file a task's merged stdout/stderr goes to for one attempt."""
    return run_dir / "logs" / f"attempt-{attempt}" / f"{task_name(role, index)}.log"


def error_path(run_dir: Path, attempt: int, role: str, index: int) -> Path:
    """Return the file a task's uncaught exception is recorded in (JSON) for one attempt."""
    return run_dir / "errors" / f"attempt-{attempt}" / f"{task_name(role, index)}.json"


def status_path(run_dir: Path, role: str, index: int) -> Path:
    """Return the file a task writes its state, step and heartbeat time to (JSON)."""
    return run_dir / "status" / f"{task_name(role, index)}.json"


# The signal on which every task (through distlaunch.host.bootstrap) dumps every thread's stack
# (faulthandler) into `stacks_signal_path`: the launcher's fallback where py-spy cannot attach.
STACKS_SIGNAL_NAME = "SIGUSR2"


def stacks_signal_path(run_dir: Path, attempt: int, role: str, index: int) -> Path:
    """Return the file a task's faulthandler writes its stacks to on STACKS_SIGNAL_NAME; it
    exists once the handler is installed."""
    return run_dir / "stacks" / f"signal-attempt-{attempt}" / f"{task_name(role, index)}.txt"


def stop_now_path(run_dir: Path, attempt: int) -> Path:
    """Return the marker the launcher writes before it stops an attempt's tasks at once (Ctrl-C,
    `down --now`, a failed run): a SIGTERM is then not a stop notice, and nothing is saved."""
    return run_dir / "control" / f"stop-now-attempt-{attempt}"


def metrics_path(run_dir: Path, role: str, index: int) -> Path:
    """Return the file a task writes its per-epoch metrics to (a JSON list)."""
    return run_dir / "metrics" / f"{task_name(role, index)}.json"


def checkpoint_dir(run_dir: Path) -> Path:
    """Return the run's checkpoint directory (the chief's, or worker 0's, checkpoints land here)."""
    return run_dir / "checkpoints"


def keras_backup_dir(checkpoint_dir: Path) -> Path:
    """Return where ``keras_callbacks``' ``BackupAndRestore`` backs up inside a checkpoint dir."""
    return checkpoint_dir / "backup"


# Keras 3's BackupAndRestore metadata file, and the key distlaunch's layer adds to it: the
# optimizer's step the backup holds (the launcher reads it; a Keras 3 backup has no index).
KERAS_BACKUP_METADATA = "training_metadata.json"
KERAS_BACKUP_STEP = "distlaunch_step"


def training_done_path(run_dir: Path) -> Path:
    """Return the marker (JSON: attempt, step, time) the chief writes once training has finished
    and its final checkpoint is saved; the evaluator stops after evaluating that checkpoint."""
    return run_dir / "training_done.json"


def tensorboard_dir(run_dir: Path) -> Path:
    """Return the run's TensorBoard log dir: the chief writes ``train/``, an evaluator ``eval/``."""
    return run_dir / "tensorboard"


def env_path(name: str) -> Path | None:
    """Return the path held in environment variable ``name``, or None when unset."""
    value = os.environ.get(name)
    return Path(value) if value else None
