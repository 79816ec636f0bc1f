"""Preemption: steps lost over stop notices at random times, and how fast a notice ends a run.

Five kinds of program, each a case (no periodic checkpoint in any: only a notice's save can
carry the steps over to the resume):

- ``mwms``: 2 MultiWorkerMirroredStrategy workers training `dw.fit`
  (distlaunch.worker.examples.mnist_mlp, one step per epoch, so that every completed step prints
  its ``epoch E/EPOCHS step S`` line);
- ``tf_keras``: 2 MWMS workers running a tf_keras ``model.fit`` script of the user's own, with its
  own ``BackupAndRestore(save_before_preemption=True)`` under ``dw.strategy()``; a callback of
  the script prints ``step S`` (the optimizer's iterations) after every batch, and the step
  ``fit`` starts from;
- ``keras3``: 2 MWMS workers running a Keras 3 ``model.fit`` script that never imports
  distlaunch (``"keras": "keras3"``: the layer of worker/keras3/), with its own
  ``BackupAndRestore`` (no ``save_before_preemption`` in Keras 3: the layer saves it on the
  notice); a callback prints ``step S`` after every batch, and the step ``fit`` starts from;
- ``handler``: 2 MWMS workers running a user's own loop around TensorFlow's
  ``PreemptionCheckpointHandler``; it prints ``step S`` (the handler's run counter, which its
  checkpoint holds) after every step, and the step it starts from;
- ``pss``: ParameterServerStrategy `dw.fit` (chief, 2 workers, 1 ps; 10 steps per epoch, so that
  steps are in flight on the workers when the notice comes); the chief prints the epoch lines
  and, on the notice, the step it saved once the steps in flight were done.

Each round starts the run (`up`, then `up --resume`), waits until every training task has
printed a step, then a random 0-3 s more, sends the stop notice and waits for the run to end.
Two more ways to send it (local backend): ``--double`` runs `distlaunch down` and a second
`distlaunch down` 0.5 s later, during the save (the second must join it, not cut it: both say
the step saved); ``--early`` sends it at a random time in the first 5 s of the attempt (from its
log folder's creation: TensorFlow's import, the strategy's build, the restore), when it must be
held until the tasks can take it.
Steps lost in a round: the last step any training task completed in that round (the latest step
line of its logs, or the step it saved) minus the step the next round's resume starts from
(``resumed from ... at step R`` on every training task; 0 when a task printed none: it started
over). Notice-to-stopped: from the notice to `up` exiting (every task gone).

    python bench/preemption.py [--case mwms|tf_keras|keras3|handler|pss|all] [--backend local|slurm]
        [--notices 20] [--double | --early]

prints one line per case and backend:
``local <case>: steps lost: N of 20 notices; median notice-to-stopped X s``. With ``--backend
slurm`` the rounds run on a real Slurm cluster made on this machine (tests/slurmcluster.py:
needs root), inside one 2-node allocation, each task a job step on a node (`run_slurm`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _common import DISTLAUNCH, REPO, median

EPOCHS = 100000  # never reached: every round ends with a notice
NEVER = "1000000"  # a checkpoint interval no round reaches
STEP_LINE = re.compile(r"^(?:epoch \d+/\d+ )?step (\d+)", re.M)
SAVED = re.compile(r"stop notice: saved step (\d+)")
RESUMED = re.compile(r"resumed from \S+ at step (\d+)")

# A tf_keras model.fit script as a user writes it: its own BackupAndRestore, saving on a notice.
TF_KERAS_SCRIPT = """
import os
import tensorflow as tf
import tf_keras
import distlaunch.worker as dw
from distlaunch.worker.examples import mnist_mlp

strategy = dw.strategy()
images, labels = mnist_mlp.load_data()
with strategy.scope():
    model = mnist_mlp.build_model(tf_keras)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = mnist_mlp.make_dataset(images, labels, 64).with_options(options)
backup = os.path.join(os.environ["DISTLAUNCH_CHECKPOINT_DIR"], "backup")


# Before BackupAndRestore in the callbacks: a batch's step is printed before a notice's save
# ends the process, and the first batch starts after BackupAndRestore's restore.
class Steps(tf_keras.callbacks.Callback):
    started = False

    def on_train_batch_begin(self, batch, logs=None):
        start = int(self.model.optimizer.iterations.numpy())
        if start and not self.started:
            print(f"resumed from {backup} at step {start}", flush=True)
        self.started = True

    def on_train_batch_end(self, batch, logs=None):
        print(f"step {int(self.model.optimizer.iterations.numpy())}", flush=True)


model.fit(
    dataset,
    epochs=100000,
    steps_per_epoch=10,
    verbose=0,
    callbacks=[
        Steps(),
        tf_keras.callbacks.BackupAndRestore(
            backup, save_freq=1000000, delete_checkpoint=False, save_before_preemption=True
        ),
    ],
)
"""

# A Keras 3 model.fit script as a user writes it for one process (no distlaunch import): its own
# BackupAndRestore, which the layer saves on a notice at the step the workers agree on.
KERAS3_SCRIPT = """
import os
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
import keras
import numpy as np

rng = np.random.default_rng(0)
images = rng.random((6400, 784), dtype=np.float32)
labels = rng.integers(0, 10, 6400)
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = (
    tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(64).with_options(options)
)
backup = os.path.join(os.environ["DISTLAUNCH_CHECKPOINT_DIR"], "backup")


class Steps(keras.callbacks.Callback):
    started = False

    def on_train_batch_begin(self, batch, logs=None):
        start = int(self.model.optimizer.iterations.numpy())
        if start and not self.started:
            print(f"resumed from {backup} at step {start}", flush=True)
        self.started = True

    def on_train_batch_end(self, batch, logs=None):
        print(f"step {int(self.model.optimizer.iterations.numpy())}", flush=True)


model.fit(
    dataset,
    epochs=100000,
    steps_per_epoch=10,
    verbose=0,
    callbacks=[
        Steps(),
        keras.callbacks.BackupAndRestore(backup, save_freq=1000000, delete_checkpoint=False),
    ],
)
"""

# A user's own loop with TensorFlow's PreemptionCheckpointHandler: it saves at a step the workers
# agree on and exits 42; its run counter (in its checkpoint) is the step.
HANDLER_SCRIPT = """
import os
import tensorflow as tf
import distlaunch.worker as dw

strategy = dw.strategy()
with strategy.scope():
    weights = tf.Variable(tf.zeros([64, 64]))
checkpoint = tf.train.Checkpoint(weights=weights)
directory = os.environ["DISTLAUNCH_CHECKPOINT_DIR"]
handler = tf.distribute.experimental.PreemptionCheckpointHandler(
    strategy.cluster_resolver, checkpoint, directory
)
if handler.total_run_calls:
    print(f"resumed from {directory} at step {handler.total_run_calls}", flush=True)


@tf.function
def train_step():
    def replica_fn():
        x = tf.random.normal([32, 64])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, weights) - x))
        grad = tape.gradient(loss, weights)
        grad = tf.distribute.get_replica_context().all_reduce("mean", grad)
        weights.assign_sub(0.01 * grad)

    strategy.run(replica_fn)


while True:
    handler.run(train_step)
    print(f"step {handler.total_run_calls}", flush=True)
"""


@dataclass(frozen=True)
class Case:
    """One kind of program: its spec and which tasks' logs show its steps."""

    name: str
    strategy: str
    program: dict
    tasks: dict
    trainer_logs: str  # the log files (glob) of the tasks that train and print steps
    trainers: int  # how many tasks that is
    scripts: dict[str, str] = field(default_factory=dict)  # file name -> source

    def write(self, folder: Path) -> Path:
        """Write the spec (and the case's scripts) into ``folder``; return the spec's path."""
        for name, source in self.scripts.items():
            (folder / name).write_text(source)
        spec = {
            "name": f"preempt-{self.name.replace('_', '-')}",
            "strategy": self.strategy,
            "program": self.program,
            "tasks": self.tasks,
            "shared_dir": "runs",
            "timeouts": {"grace_s": 5, "startup_s": 300, "save_s": 60},
        }
        path = folder / "spec.json"
        path.write_text(json.dumps(spec))
        return path


def _mnist_mlp(steps_per_epoch: int) -> dict:
    args = ["--epochs", str(EPOCHS), "--steps-per-epoch", str(steps_per_epoch)]
    return {
        "module": "distlaunch.worker.examples.mnist_mlp",
        "args": [*args, "--checkpoint-every", NEVER],
    }


TWO_WORKERS = {"worker": {"count": 2}}
CASES = {
    case.name: case
    for case in (
        Case("mwms", "multi_worker_mirrored", _mnist_mlp(1), TWO_WORKERS, "worker-*.log", 2),
        Case(
            "tf_keras",
            "multi_worker_mirrored",
            {"script": "task.py"},
            TWO_WORKERS,
            "worker-*.log",
            2,
            {"task.py": TF_KERAS_SCRIPT},
        ),
        Case(
            "keras3",
            "multi_worker_mirrored",
            {"script": "task.py", "keras": "keras3"},
            TWO_WORKERS,
            "worker-*.log",
            2,
            {"task.py": KERAS3_SCRIPT},
        ),
        Case(
            "handler",
            "multi_worker_mirrored",
            {"script": "task.py"},
            TWO_WORKERS,
            "worker-*.log",
            2,
            {"task.py": HANDLER_SCRIPT},
        ),
        Case(
            "pss",
            "parameter_server",
            _mnist_mlp(10),
            {"chief": {"count": 1}, "worker": {"count": 2}, "ps": {"count": 1}},
            "chief-*.log",
            1,
        ),
    )
}


@dataclass(frozen=True)
class Outcome:
    """What the notices of one case did on one backend."""

    lost_steps: int
    lost_rounds: int
    stopped_s: list[float]
    exit_codes: list[int]
    joined: int = 0  # --double: rounds whose `up` took the second notice as joining the save
    said_saving: int = 0  # --double: rounds whose second `down` said which save it joined


def _logs(case: Case, run_dir: Path, attempt: int) -> list[str]:
    folder = run_dir / "logs" / f"attempt-{attempt}"
    return [p.read_text(errors="replace") for p in sorted(folder.glob(case.trainer_logs))]


def _last_completed(logs: list[str]) -> int:
    """The last step any training task completed (or saved) in one round's logs."""
    steps = [0]
    for text in logs:
        steps += [int(s) for s in STEP_LINE.findall(text)] + [int(s) for s in SAVED.findall(text)]
    return max(steps)


def _resumed_at(logs: list[str]) -> int:
    """The step a round starts from: the lowest any training task resumed at (0: started over)."""
    starts = [int(m.group(1)) if (m := RESUMED.search(text)) else 0 for text in logs]
    return min(starts, default=0)


@dataclass(frozen=True)
class Round:
    """What one `up` and its notice did."""

    run_dir: Path
    stopped_s: float  # from the notice to `up` exiting
    exit_code: int
    joined: bool = False  # --double: `up` took the second notice as joining the save
    said_saving: bool = False  # --double: the second `down` said which save it joined


def _started(case: Case, run_dir: Path | None, attempt: int, how: str) -> bool:
    """Whether the round may send its notice: the attempt has begun (``early``), else every
    training task has printed a step."""
    if run_dir is None:
        return False
    if how == "early":
        return (run_dir / "logs" / f"attempt-{attempt}").is_dir()
    logs = _logs(case, run_dir, attempt)
    return len(logs) == case.trainers and all(STEP_LINE.search(text) for text in logs)


def _local_round(
    case: Case,
    spec: Path,
    attempt: int,
    wrap: Callable[[list[str]], list[str]] = list,
    env=None,
    how: str = "random",
) -> Round:
    """One `up` (a resume after the first) and a stop notice to it (``how``: "random", "double"
    or "early", see the module docstring). (``wrap``, ``env``: how `up` runs elsewhere, e.g. in
    a Slurm allocation.)"""
    args = wrap([*DISTLAUNCH, "up", *(["--resume"] if attempt else []), str(spec)])
    up_log = spec.parent / "up.log"
    before = up_log.stat().st_size if up_log.exists() else 0
    with open(up_log, "a") as log:
        up = subprocess.Popen(args, cwd=spec.parent, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            run_dir = None
            while not _started(case, run_dir, attempt, how):
                if up.poll() is not None:
                    raise SystemExit(f"up ended early ({up.returncode}); see {spec.parent}/up.log")
                time.sleep(0.05 if how == "early" else 0.2)
                runs = sorted((spec.parent / "runs").glob("*/run.json"))
                run_dir = runs[0].parent if runs else None
            assert run_dir is not None
            time.sleep(random.uniform(0, 5 if how == "early" else 3))
            sent = time.perf_counter()
            if how != "double":
                up.send_signal(signal.SIGTERM)
                code = up.wait(timeout=300)
                return Round(run_dir, time.perf_counter() - sent, code)
            down = [*DISTLAUNCH, "down", run_dir.name, "--shared-dir", str(run_dir.parent)]
            first = subprocess.Popen(down, stdout=subprocess.PIPE, text=True)
            time.sleep(0.5)
            second = subprocess.run(down, stdout=subprocess.PIPE, text=True, check=False)
            said = [first.communicate(timeout=300)[0], second.stdout]
            code = up.wait(timeout=300)
            with open(spec.parent / "down.log", "a") as out:
                out.write("".join(said))
            with open(up_log, errors="replace") as f:
                f.seek(before)
                joined = "stop notice again" in f.read()
            saving = "saving " in second.stdout and all("saved step" in s for s in said)
            return Round(run_dir, time.perf_counter() - sent, code, joined, saving)
        finally:
            up.kill()


def run_local(case: Case, notices: int, how: str = "random") -> Outcome:
    """``notices`` stop notices (SIGTERM to `up`, or `down`s) to one run of ``case``, each
    round resumed."""
    with tempfile.TemporaryDirectory(prefix=f"bench-preempt-{case.name}-") as tmp:
        return _rounds(case, case.write(Path(tmp)), notices, how=how)


def _rounds(
    case: Case,
    spec: Path,
    notices: int,
    wrap: Callable[[list[str]], list[str]] = list,
    env: dict[str, str] | None = None,
    how: str = "random",
) -> Outcome:
    """The rounds of one case (`_local_round`, with ``wrap``, ``env`` and ``how``): a start and
    ``notices`` resumes, each ended by a notice but the last; what each resume lost."""
    lost_rounds, lost_steps, times, codes, joined, said = 0, 0, [], [], 0, 0
    for attempt in range(notices + 1):
        done = _local_round(case, spec, attempt, wrap, env, how)
        run_dir, stopped_s, code = done.run_dir, done.stopped_s, done.exit_code
        if attempt:
            before = _last_completed(_logs(case, run_dir, attempt - 1))
            lost = before - _resumed_at(_logs(case, run_dir, attempt))
            lost_rounds += lost > 0
            lost_steps += max(lost, 0)
            print(f"  {case.name} notice {attempt}: {before} done, {lost} lost", flush=True)
        if attempt < notices:
            times.append(stopped_s)
            codes.append(code)
            joined += done.joined
            said += done.said_saving
    return Outcome(lost_steps, lost_rounds, times, codes, joined, said)


def run_slurm(case: Case, notices: int) -> Outcome:
    """`run_local`'s rounds with ``backend: slurm``, inside a 2-node allocation of a Slurm lab."""
    sys.path.insert(0, str(REPO / "tests"))
    from slurm_overhead import _allocation

    from slurmcluster import SlurmLab, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot run: {reason}")
    with (
        tempfile.TemporaryDirectory(prefix=f"bench-preempt-{case.name}-") as tmp,
        SlurmLab(2) as lab,
    ):
        spec = case.write(Path(tmp))
        data = json.loads(spec.read_text())
        data["backend"] = "slurm"
        data["program"]["python"] = sys.executable
        spec.write_text(json.dumps(data))
        # As many tasks on each node as the case has tasks over the 2 nodes (PSS: chief, 2
        # workers and a ps, 2 on each).
        tasks = sum(role["count"] for role in case.tasks.values())
        holder, env = _allocation(lab, Path(tmp), f"--ntasks-per-node={-(-tasks // 2)}")
        try:
            return _rounds(case, spec, notices, lab.command, env)
        finally:
            lab.run(["scancel", env["SLURM_JOB_ID"]])
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
            os.kill(int((Path(tmp) / "alloc.env.pid").read_text()), signal.SIGKILL)


# Backend name -> how it runs the notices of one case.
BACKENDS: dict[str, Callable[..., Outcome]] = {"local": run_local, "slurm": run_slurm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--backend", choices=[*BACKENDS], default="local")
    parser.add_argument("--notices", type=int, default=20)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--double", action="store_true", help="two `down`s, 0.5 s apart (local)")
    how.add_argument("--early", action="store_true", help="notices in an attempt's first 5 s")
    options = parser.parse_args()
    mode = "double" if options.double else "early" if options.early else "random"
    if mode != "random" and options.backend != "local":
        parser.error("--double and --early run on the local backend")
    cases = list(CASES.values()) if options.case == "all" else [CASES[options.case]]
    for case in cases:
        run = BACKENDS[options.backend]
        outcome = (
            run(case, options.notices, mode) if mode != "random" else run(case, options.notices)
        )
        name = f"{options.backend} {case.name}" + ("" if mode == "random" else f" --{mode}")
        print(
            f"{name}: exit codes {sorted(set(outcome.exit_codes))} "
            f"(75: preempted); notices that lost any step: {outcome.lost_rounds}",
            flush=True,
        )
        if mode == "double":
            print(
                f"{name}: second notices that joined the save: {outcome.joined}; second downs "
                f"that said which save they joined: {outcome.said_saving}",
                flush=True,
            )
        print(
            f"{name}: steps lost: {outcome.lost_steps} of "
            f"{options.notices} notices; median notice-to-stopped {median(outcome.stopped_s):.2f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
