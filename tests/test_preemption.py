"""Preemption without loss (issue 26): a stop notice becomes one checkpoint at an agreed step.

Real 2-worker MWMS runs of `dw.fit` on the local backend: SIGTERM to `up` and `distlaunch down`
each make every worker save the same step and exit "preempted"; `up --resume` goes on from
exactly that step; `down --now` skips the save; a data-loader child never gets the notice. A
save that misses timeouts.save_s stops the run as before and names the tasks, and a program that
cannot save is stopped at once (both on stand-ins serving on their ports: the launcher's side).
The policy's and the exit-code table's decisions are checked with scripted inputs.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import standins

from conftest import (
    distlaunch,
    events,
    processes_of_run,
    run_record,
    wait_for,
    write_spec,
)
from distlaunch.launcher.record.endings import EventKind
from distlaunch.launcher.run.policy import (
    Action,
    Cluster,
    History,
    RestartPolicy,
    RestartRules,
    TaskEvent,
)
from distlaunch.worker import contract

# Checkpoints only at the end (or on a notice): the notice's checkpoint is the only one a resume
# can start from, so "resumed at step N" shows that nothing trained before the notice was lost.
ARGS = ["--epochs", "400", "--steps-per-epoch", "25", "--checkpoint-every", "100000"]
EXAMPLE = {"module": "distlaunch.worker.examples.mnist_mlp", "args": ARGS}

# A program with a data-loader child (as tf.data services or multiprocessing loaders have): the
# child notes any SIGTERM it gets in a file of its own; the notice must reach the program alone.
WITH_CHILD = """
import os, subprocess, sys
import distlaunch.worker as dw
child = '''
import os, signal, sys, time
def noted(signum, frame):
    open(sys.argv[1], "w").write("SIGTERM")
signal.signal(signal.SIGTERM, noted)
open(sys.argv[1] + ".started", "w").write(str(os.getpid()))
while True:
    time.sleep(1)
'''
marker = os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], f"child-{dw.context().name}")
subprocess.Popen([sys.executable, "-c", child, marker])
from distlaunch.worker.examples.mnist_mlp import main
main(sys.argv[1:])
"""

# Stand-ins of the two programs below (no TensorFlow: what is tested there is the launcher's
# deadline and its reading of the program, and a TensorFlow start costs seconds): each serves
# on its task port as a TensorFlow server would (the launcher holds a notice until a task's
# server is up), then prints "serving" and waits.
SERVES = "import signal\n" + standins.listening(standins.ANY)
WAITS = """
print("serving", flush=True)
while True:
    time.sleep(1)
"""

# A program that takes the notice and never saves: the launcher's deadline must stop it. It
# imports distlaunch.worker (whose dw.fit saves on a notice: the launcher waits save_s for it).
NEVER_SAVES = (
    "import distlaunch.worker\n"
    + SERVES
    + 'signal.signal(signal.SIGTERM, lambda signum, frame: print("notice ignored", flush=True))\n'
    + WAITS
)


# A user's own loop with TensorFlow's PreemptionCheckpointHandler (it takes SIGTERM over from
# dw.strategy(), saves at a step the workers agree on, and exits 42).
TF_HANDLER = """
import os
import tensorflow as tf
import distlaunch.worker as dw
strategy = dw.strategy()
with strategy.scope():
    total = tf.Variable(0.0)
checkpoint = tf.train.Checkpoint(total=total)
handler = tf.distribute.experimental.PreemptionCheckpointHandler(
    strategy.cluster_resolver, checkpoint, os.environ["DISTLAUNCH_CHECKPOINT_DIR"]
)
print("resumed at run", handler.total_run_calls, flush=True)

@tf.function
def train_step():
    def replica_fn():
        one = tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))
        total.assign_add(one)
    strategy.run(replica_fn)

while handler.total_run_calls < 100000:
    handler.run(train_step)
    if handler.total_run_calls % 50 == 0:
        print("run", handler.total_run_calls, flush=True)
"""


# dw.fit whose save on the notice never ends, its data file half written and the checkpoint
# index not yet updated (a save cut short by the deadline: what a slow disk leaves).
# (The save on the notice is the one fit makes in _save_and_stop: a worker's own notice may not
# have arrived yet when the workers agree on one.)
SLOW_SAVE = """
import inspect, os, sys, time
import tensorflow as tf
save = tf.train.CheckpointManager.save

def slow_save(self, checkpoint_number=None, **kwargs):
    if not any(frame.function == "_save_and_stop" for frame in inspect.stack()):
        return save(self, checkpoint_number=checkpoint_number, **kwargs)
    os.makedirs(self.directory, exist_ok=True)  # a non-chief's copy goes after each save
    path = os.path.join(self.directory, f"ckpt-{checkpoint_number}.data-00000-of-00001")
    with open(path, "wb") as f:
        f.write(bytes(100))
    print("saving slowly", flush=True)
    while True:
        time.sleep(1)

tf.train.CheckpointManager.save = slow_save
from distlaunch.worker.examples.mnist_mlp import main
main(sys.argv[1:])
"""


def _start(spec: Path, *args: str) -> subprocess.Popen:
    folder = spec.parent
    with open(folder / "stdout.txt", "a") as out, open(folder / "stderr.txt", "a") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "distlaunch.launcher", "up", *args, str(spec)],
            cwd=folder,
            stdout=out,
            stderr=err,
        )


def _run_dir(tmp: Path) -> Path:
    """The run dir of the one run under ``tmp``, once its run.json exists."""
    return wait_for(
        lambda: (
            next((p.parent for p in (tmp / "runs").glob("*/run.json")), None)
            if (tmp / "runs").exists()
            else None
        ),
        "the run dir",
    )


def _both_print(run_dir: Path, text: str, what: str) -> None:
    """Wait until both tasks of attempt 0 have printed ``text`` to their logs."""
    logs = run_dir / "logs" / "attempt-0"
    wait_for(
        lambda: (
            len(found := list(logs.glob("*.log"))) == 2
            and all(text in p.read_text() for p in found)
        ),
        what,
    )


def _training(tmp: Path, attempt: int = 0, past_step: int = 25) -> Path:
    """The run dir once both workers have logged an epoch line past ``past_step`` in ``attempt``."""

    def trained() -> Path | None:
        runs = list((tmp / "runs").glob("*/logs")) if (tmp / "runs").exists() else []
        if not runs:
            return None
        logs = list((runs[0] / f"attempt-{attempt}").glob("worker-*.log"))
        steps = [
            [int(s) for s in re.findall(r"^epoch \d+/\d+ step (\d+)", log.read_text(), re.M)]
            for log in logs
        ]
        if len(steps) == 2 and all(s and s[-1] > past_step for s in steps):
            return runs[0].parent
        return None

    return wait_for(trained, f"both workers to train past step {past_step}")


def _saved_steps(run_dir: Path, attempt: int) -> list[int]:
    logs = sorted((run_dir / "logs" / f"attempt-{attempt}").glob("worker-*.log"))
    return [
        int(s)
        for log in logs
        for s in re.findall(r"stop notice: saved step (\d+)", log.read_text())
    ]


def _resumed_steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", text)]


# worker-1 holds off SIGTERM until the test says go (loading data, say), then builds its strategy;
# worker-0 meanwhile waits for it inside its own strategy's build, under TensorFlow's handler.
LATE_WORKER = """
import os, signal, sys, time
import distlaunch.worker as dw
if dw.context().index == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
dw.strategy()
from distlaunch.worker.examples.mnist_mlp import main
main(sys.argv[2:])
"""


def test_a_notice_during_the_strategys_build_is_kept(tmp):
    (tmp / "task.py").write_text(LATE_WORKER)
    go = tmp / "go"
    spec = write_spec(
        tmp,
        program={"script": "task.py", "args": [str(go), *ARGS]},
        timeouts={"grace_s": 2, "startup_s": 120, "save_s": 120},
    )
    launcher = _start(spec)
    try:
        run_dir = _run_dir(tmp)
        # worker-0's server is up: TensorFlow's notifier holds SIGTERM; the cluster is not formed.
        wait_for(
            lambda: run_record(run_dir)["tasks"].get("worker-0", {}).get("state") == "running",
            "worker-0 to start its server",
        )
        launcher.send_signal(signal.SIGTERM)
        wait_for(lambda: any(e["event"] == "notice" for e in events(run_dir)), "the notice")
        go.touch()
        launcher.wait(timeout=240)
    finally:
        go.touch()
        launcher.kill()
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    saved = _saved_steps(run_dir, 0)
    assert len(saved) == 2 and saved[0] == saved[1]


@dataclass(frozen=True)
class Stop:
    """One attempt of the chain run, stopped one way: what the test saw right after it ended."""

    returncode: int
    err: str  # the launcher's stderr of this attempt alone
    record: dict
    saved: list[int]  # the steps the workers said they saved in this attempt
    logs: str  # the workers' logs of this attempt
    left: list  # the run's processes still alive once it ended
    down: subprocess.CompletedProcess | None = None  # the `distlaunch down` that stopped it


@dataclass(frozen=True)
class Chain:
    """One run of the program with data-loader children, stopped four ways in turn, each a
    resume of the last: SIGTERM to `up`, `distlaunch down`, `Run.stop()` from Python, and `down
    --now`. Every stop but the last saves a step the next attempt resumes at; one run of
    TensorFlow starts where each way had its own (each start and first steps cost seconds of
    CPU)."""

    spec: Path
    run_dir: Path
    sigterm: Stop
    notices: list[str]  # the notice events' signals after the SIGTERM
    exited: list[dict]  # the exit events after the SIGTERM
    children_started: list[bool]
    children_noticed: list[bool]
    status: str  # `distlaunch status` after the SIGTERM
    down: Stop
    python: Stop
    now: Stop
    checkpoint: str  # TensorFlow's checkpoint state file after `down --now`


def _stop_by(tmp: Path, run_dir: Path | None, attempt: int, stop, *args: str) -> Stop:
    """Start `up ARGS` (a resume: ``attempt`` > 0), wait for both workers to train past the
    step the last attempt saved (25 for the first), then ``stop(launcher, run_id)``; what it
    returns is the `down` it ran, if any."""
    past = _saved_steps(run_dir, attempt - 1)[0] if attempt else 25
    before = (tmp / "stderr.txt").read_text() if (tmp / "stderr.txt").exists() else ""
    launcher = _start(tmp / "spec.json", *args)
    try:
        run_dir = _training(tmp, attempt=attempt, past_step=past)
        down = stop(launcher, run_dir.name)
        launcher.wait(timeout=240)
    finally:
        launcher.kill()
    record = run_record(run_dir)
    return Stop(
        launcher.returncode,
        (tmp / "stderr.txt").read_text()[len(before) :],
        record,
        _saved_steps(run_dir, attempt),
        _logs_of(run_dir, attempt),
        processes_of_run(record["run_id"]),
        down,
    )


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    import distlaunch as api

    tmp = tmp_path_factory.mktemp("chain")
    (tmp / "task.py").write_text(WITH_CHILD)
    spec = write_spec(tmp, program={"script": "task.py", "args": ARGS})
    shared = tmp / "runs"

    def down(*options: str):
        return lambda launcher, run_id: distlaunch(
            "down", *options, run_id, "--shared-dir", str(shared)
        )

    sigterm = _stop_by(tmp, None, 0, lambda launcher, run_id: launcher.send_signal(signal.SIGTERM))
    run_dir = next(shared.glob("*/run.json")).parent
    run_id = run_dir.name
    after = events(run_dir)
    tasks = ("worker-0", "worker-1")
    status = distlaunch("status", run_id, "--shared-dir", str(shared)).stdout
    children_started = [(run_dir / f"child-{t}.started").is_file() for t in tasks]
    children_noticed = [(run_dir / f"child-{t}").exists() for t in tasks]
    by_down = _stop_by(tmp, run_dir, 1, down(), "--resume")

    # The same resume from Python: `Run.stop()` (save=True by default) is `down`.
    with contextlib.chdir(tmp):
        run = api.launch(str(spec), resume=True, console=None)
        try:
            _training(tmp, attempt=2, past_step=by_down.saved[0])
            result = run.stop()
        finally:
            run.stop(save=False)
    python = Stop(
        result.exit_code,
        "",
        {"state": result.state, "run_id": run.run_id},
        _saved_steps(run_dir, 2),
        _logs_of(run_dir, 2),
        processes_of_run(run_id),
    )

    now = _stop_by(tmp, run_dir, 3, down("--now"), "--resume")
    return Chain(
        spec,
        run_dir,
        sigterm,
        [e["signal"] for e in after if e["event"] == "notice"],
        [e for e in after if e["event"] == "exited"],
        children_started,
        children_noticed,
        status,
        by_down,
        python,
        now,
        (run_dir / "checkpoints" / "checkpoint").read_text(),
    )


_CHAIN = pytest.mark.xdist_group("preemption-chain")  # one worker runs the chain, once


@_CHAIN
def test_sigterm_to_up_saves_one_step_and_resume_loses_none(chain: Chain):
    stop = chain.sigterm
    err = stop.err
    assert stop.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    saved = stop.saved
    # Both workers saved, and the same step: the one the notice was agreed on.
    assert len(saved) == 2 and saved[0] == saved[1] > 25
    step = saved[0]
    record = stop.record
    assert record["state"] == "preempted" and record["exit_code"] == contract.EXIT_PREEMPTED
    assert record["preempted"]["step"] == step and record["preempted"]["save_s"] >= 0
    line = f"run {record['run_id']} preempted at step {step}, saved in "
    assert line in err and f"`distlaunch up {chain.spec} --resume` continues" in err
    assert "failed" not in err
    assert {t["exit_code"] for t in record["tasks"].values()} == {contract.EXIT_PREEMPTED}
    assert {t["state"] for t in record["tasks"].values()} == {"stopped"}
    assert [e["saved_step"] for e in chain.exited] == [step, step]
    assert all(e["decision"] in ("continue", "preempted") for e in chain.exited)
    assert chain.notices == ["SIGTERM"]
    # The data-loader children ran, and the notice never reached them.
    assert chain.children_started == [True, True]
    assert chain.children_noticed == [False, False]
    assert not stop.left
    assert f"run {record['run_id']}: preempted" in chain.status
    assert f"preempted at step {step}, saved in " in chain.status

    # The resumed run starts at exactly that step on both workers; a second notice in the same
    # run dir (`down`'s, here) saves again.
    again = chain.down
    assert _resumed_steps(again.logs) == [step, step]
    assert again.returncode == contract.EXIT_PREEMPTED
    assert len(again.saved) == 2 and again.saved[0] == again.saved[1] > step


@_CHAIN
def test_down_saves_by_default_and_down_now_does_not(chain: Chain):
    stop = chain.down
    assert stop.down.returncode == 0, stop.down.stderr
    assert stop.returncode == contract.EXIT_PREEMPTED
    saved = stop.saved
    assert len(saved) == 2 and saved[0] == saved[1]
    assert f"its tasks saved step {saved[0]}" in stop.down.stdout
    assert stop.record["state"] == "preempted"

    # `down --now` of the run resumed from the last save (Run.stop()'s: see below).
    now = chain.now
    last = chain.python.saved[0]
    assert now.down.returncode == 0, now.down.stderr
    assert now.returncode == 128 + signal.SIGINT
    assert now.record["state"] == "interrupted"
    assert _resumed_steps(now.logs) == [last, last]
    assert "stop notice" not in now.logs  # --now: no notice, no save
    assert f'model_checkpoint_path: "ckpt-{last}"' in chain.checkpoint
    assert not now.left


@_CHAIN
def test_run_stop_from_python_saves_by_default_and_not_with_save_false(
    chain: Chain, tmp, monkeypatch
):
    import distlaunch

    stop = chain.python
    assert stop.record["state"] == "preempted" and stop.returncode == contract.EXIT_PREEMPTED
    saved = stop.saved
    assert len(saved) == 2 and saved[0] == saved[1]

    # save=False is `down --now`: stopped at once, no notice, no save. Shown on a stand-in that
    # takes notices as dw.fit does (distlaunch.worker.preempt) and would say so.
    monkeypatch.chdir(tmp)
    spec = json.loads(write_spec(tmp, program=EXAMPLE).read_text())
    (tmp / "steps.py").write_text(STEPS)
    steps = {**spec, "program": {"script": "steps.py"}, "shared_dir": str(tmp / "now" / "runs")}
    now = distlaunch.launch(steps, console=None)
    try:
        _training(tmp / "now")
        result = now.stop(save=False)
    finally:
        now.stop(save=False)
    assert result.state == "interrupted" and result.exit_code == 128 + signal.SIGINT
    logs = "".join(p.read_text() for p in (now.run_dir / "logs" / "attempt-0").glob("*.log"))
    assert "stop notice" not in logs
    assert not processes_of_run(now.run_id)


def test_a_save_that_misses_its_deadline_stops_the_run_and_names_the_tasks(tmp):
    (tmp / "task.py").write_text(NEVER_SAVES)
    spec = write_spec(tmp, timeouts={"grace_s": 1, "startup_s": 120, "save_s": 1})
    launcher = _start(spec)
    try:
        run_dir = _run_dir(tmp)
        _both_print(run_dir, "serving", "both tasks to take over SIGTERM")
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
    finally:
        launcher.kill()
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert (
        "worker-0 did not save within 1 s of the stop notice (timeouts.save_s); "
        "not saved: worker-0, worker-1: stopping the run"
    ) in err
    record = run_record(run_dir)
    assert record["state"] == "interrupted"
    assert "notice ignored" in (run_dir / "logs" / "attempt-0" / "worker-1.log").read_text()
    assert not processes_of_run(record["run_id"])


# A stand-in for dw.fit's side of a notice: it logs a step every 20 ms and takes SIGTERM as a
# notice as dw.fit does (preempt.watch: not when the launcher stops the attempt at once), and on
# one says it saved and exits 75.
STEPS = (
    "from distlaunch.worker import preempt\n"
    + SERVES
    + """preempt.watch()
for step in range(1, 10**6):
    time.sleep(0.02)
    print(f"epoch 1/1 step {step}", flush=True)
    if preempt.noticed():
        preempt.stop(step, 0.0)
"""
)


# A plain MWMS script: no distlaunch, no handler of TensorFlow's or Keras's, so nothing in it can
# save on a notice; it swallows SIGTERM as TensorFlow's own handler does (a stand-in, above).
PLAIN = SERVES + "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + WAITS


def test_a_program_that_cannot_save_is_stopped_at_once_as_before(tmp):
    # program_scan finds no way to save in it: the notice is no notice, the run is torn down at
    # once (TERM, grace, KILL) and recorded interrupted; a save_s of 600 s is never waited for.
    (tmp / "task.py").write_text(PLAIN)
    spec = write_spec(tmp, timeouts={"grace_s": 1, "startup_s": 120, "save_s": 600})
    launcher = _start(spec)
    try:
        run_dir = _run_dir(tmp)
        _both_print(run_dir, "serving", "both tasks to build their strategy")
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
    finally:
        launcher.kill()
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stop notice" not in err
    record = run_record(run_dir)
    assert record["state"] == "interrupted"
    assert record["plan"]["program"]["saves_on_notice"] is False
    assert not processes_of_run(record["run_id"])


def _chief_log(tmp: Path, attempt: int) -> str:
    logs = list((tmp / "runs").glob(f"*/logs/attempt-{attempt}/chief-0.log"))
    return logs[0].read_text() if logs else ""


def test_pss_chief_stops_scheduling_joins_and_saves(tmp):
    tasks = {"chief": {"count": 1}, "worker": {"count": 2}, "ps": {"count": 1}}
    spec = write_spec(tmp, strategy=contract.PSS, tasks=tasks, program=EXAMPLE)
    launcher = _start(spec)
    try:
        wait_for(lambda: "step 50 " in _chief_log(tmp, 0), "the chief to train 50 steps")
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=240)
    finally:
        launcher.kill()
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    saved = [int(s) for s in re.findall(r"stop notice: saved step (\d+)", _chief_log(tmp, 0))]
    assert len(saved) == 1 and saved[0] >= 50
    run_dir = next((tmp / "runs").glob("*/run.json")).parent
    record = run_record(run_dir)
    assert record["state"] == "preempted" and record["preempted"]["step"] == saved[0]
    # Only the chief got the notice; its servers ran its last steps, then were stopped.
    assert record["tasks"]["chief-0"]["exit_code"] == contract.EXIT_PREEMPTED
    assert [e["task"] for e in events(run_dir) if e["event"] == "exited"] == ["chief-0"]
    assert all(record["tasks"][n]["state"] == "stopped" for n in ("ps-0", "worker-0", "worker-1"))
    assert not processes_of_run(record["run_id"])

    resumed = _start(spec, "--resume")
    try:
        wait_for(lambda: "resumed from" in _chief_log(tmp, 1), "the chief to resume")
        resumed.send_signal(signal.SIGTERM)
        resumed.wait(timeout=240)
    finally:
        resumed.kill()
    assert _resumed_steps(_chief_log(tmp, 1)) == [saved[0]]


def test_a_save_cut_short_by_the_deadline_is_never_resumed_from(tmp):
    (tmp / "task.py").write_text(SLOW_SAVE)
    args = ["--epochs", "400", "--steps-per-epoch", "25", "--checkpoint-every", "25"]
    timeouts = {"grace_s": 1, "startup_s": 120, "save_s": 2}
    spec = write_spec(tmp, program={"script": "task.py", "args": args}, timeouts=timeouts)
    launcher = _start(spec)
    try:
        run_dir = _training(tmp, past_step=50)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
    finally:
        launcher.kill()
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "not saved: worker-0, worker-1: stopping the run" in err
    assert run_record(run_dir)["state"] == "interrupted"
    index = (run_dir / "checkpoints" / "checkpoint").read_text()
    latest = int(re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', index, re.M).group(1))
    half = [p.name for p in (run_dir / "checkpoints").glob("ckpt-*.data-*")]
    cut = [int(re.match(r"ckpt-(\d+)", n).group(1)) for n in half]
    assert max(cut) > latest >= 50  # the half-written save is the newest file, not the latest

    resumed = _start(spec, "--resume")
    try:
        wait_for(lambda: len(_resumed_steps(_logs_of(run_dir, 1))) == 2, "both workers to resume")
        resumed.send_signal(signal.SIGINT)
        resumed.wait(timeout=120)
    finally:
        resumed.kill()
    assert _resumed_steps(_logs_of(run_dir, 1)) == [latest, latest]


def _logs_of(run_dir: Path, attempt: int) -> str:
    folder = run_dir / "logs" / f"attempt-{attempt}"
    return "".join(p.read_text() for p in sorted(folder.glob("worker-*.log")))


def test_tf_keras_fit_with_keras_callbacks_saves_on_the_notice(tmp):
    program = {**EXAMPLE, "keras": "tf_keras"}
    spec = write_spec(tmp, program=program)
    launcher = _start(spec)
    try:
        run_dir = _training(tmp)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=240)
    finally:
        launcher.kill()
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    record = run_record(run_dir)
    assert record["state"] == "preempted"
    # TensorFlow's handler saved; the task said the step and exited as every distlaunch task does.
    assert {t["exit_code"] for t in record["tasks"].values()} == {contract.EXIT_PREEMPTED}
    saved = _saved_steps(run_dir, 0)
    # No backup but the notice's: checkpoint_every (BackupAndRestore's save_freq) is never reached.
    resumed = _start(spec, "--resume")
    try:
        wait_for(lambda: len(_resumed_steps(_logs_of(run_dir, 1))) == 2, "both workers to resume")
        resumed.send_signal(signal.SIGINT)
        resumed.wait(timeout=120)
    finally:
        resumed.kill()
    steps = _resumed_steps(_logs_of(run_dir, 1))
    assert len(steps) == 2 and steps[0] == steps[1] > 25
    assert saved == steps  # the step each worker said it saved is the one both resume at


# A tf_keras model.fit script of the user's own: its own BackupAndRestore(save_before_preemption=True),
# tf_keras imported after dw.strategy(), and the spec's "keras" set to keras3 (auto would pick
# tf_keras for it: the save must not depend on that setting). It prints the step fit starts from
# and an epoch line.
OWN_BACKUP = """
import os, sys
import distlaunch.worker as dw
strategy = dw.strategy()
import tensorflow as tf
import tf_keras
from distlaunch.worker.examples import mnist_mlp
images, labels = mnist_mlp.load_data()
with strategy.scope():
    model = mnist_mlp.build_model(tf_keras)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dataset = mnist_mlp.make_dataset(images, labels, 64).with_options(options)
backup = os.path.join(os.environ["DISTLAUNCH_CHECKPOINT_DIR"], "backup")

class Steps(tf_keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        print(f"resumed from {backup} at step {self.model.optimizer.iterations.numpy()}", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        step = self.model.optimizer.iterations.numpy()
        print(f"epoch {epoch + 1}/400 step {step}", flush=True)

backup_and_restore = tf_keras.callbacks.BackupAndRestore(
    backup, save_freq=100000, delete_checkpoint=False, save_before_preemption=True
)
model.fit(dataset, epochs=400, steps_per_epoch=25, verbose=0, callbacks=[backup_and_restore, Steps()])
"""


def test_a_tf_keras_script_with_its_own_backup_and_restore_saves_on_the_notice(tmp):
    (tmp / "task.py").write_text(OWN_BACKUP)
    spec = write_spec(tmp, program={"script": "task.py", "keras": "keras3"})
    launcher = _start(spec)
    try:
        run_dir = _training(tmp)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=240)
    finally:
        launcher.kill()
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    record = run_record(run_dir)
    assert record["plan"]["program"]["keras"] == "keras3"  # as the spec says
    assert record["state"] == "preempted"
    assert {t["exit_code"] for t in record["tasks"].values()} == {contract.EXIT_PREEMPTED}
    saved = _saved_steps(run_dir, 0)
    done = max(int(s) for s in re.findall(r"^epoch \d+/\d+ step (\d+)", _logs_of(run_dir, 0), re.M))
    resumed = _start(spec, "--resume")
    try:
        wait_for(lambda: len(_resumed_steps(_logs_of(run_dir, 1))) == 2, "both workers to resume")
        resumed.send_signal(signal.SIGINT)
        resumed.wait(timeout=120)
    finally:
        resumed.kill()
    # The notice's backup (the only one: save_freq is never reached) holds every step trained.
    steps = _resumed_steps(_logs_of(run_dir, 1))
    assert len(steps) == 2 and steps[0] == steps[1] >= done > 25
    assert saved == steps


def test_a_script_with_tensorflows_own_handler_counts_as_preempted(tmp):
    (tmp / "task.py").write_text(TF_HANDLER)
    spec = write_spec(tmp)
    launcher = _start(spec)
    try:
        run_dir = _run_dir(tmp)
        logs = run_dir / "logs" / "attempt-0"
        wait_for(
            lambda: len([p for p in logs.glob("*.log") if "run 50" in p.read_text()]) == 2,
            "both workers to run 50 steps",
        )
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=240)
    finally:
        launcher.kill()
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    record = run_record(run_dir)
    assert record["state"] == "preempted"
    assert {t["exit_code"] for t in record["tasks"].values()} == {contract.TF_HANDLER_EXIT}
    assert f"run {record['run_id']} preempted on the notice; " in err
    assert (run_dir / "checkpoints" / "checkpoint").is_file()  # the handler's own save


@pytest.mark.quick
def test_save_s_is_checked_like_the_other_timeouts(tmp):
    spec = write_spec(tmp, timeouts={"save_s": 0})
    result = distlaunch("up", str(spec), cwd=tmp)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"distlaunch: error: {spec}: $.timeouts.save_s: expected a number greater than 0 and at most 2147483647, got 0"
    ]
    assert not (tmp / "runs").exists()


# ---- decisions, with scripted inputs -------------------------------------------------------

MWMS = Cluster(contract.MWMS, {"worker": ["worker-0", "worker-1"], "evaluator": ["evaluator-0"]})
ON_FAILURE = RestartRules(policy="on-failure")


def _after_notice(name: str, code: int, exited: dict[str, int]) -> Action:
    event = TaskEvent(name, name.split("-")[0], code, kind=EventKind.PREEMPTED)
    return RestartPolicy(MWMS, ON_FAILURE).decide(event, exited, History(), 0.0).action


@pytest.mark.quick
def test_after_a_notice_the_run_is_preempted_once_every_training_task_saved():
    assert _after_notice("worker-0", 75, {"worker-0": 75}) is Action.CONTINUE
    assert _after_notice("worker-1", 75, {"worker-0": 75, "worker-1": 75}) is Action.PREEMPTED
    # TensorFlow's handler's 42 and a handler's 143 mean preempted after a notice, ...
    assert _after_notice("worker-1", 42, {"worker-0": 143, "worker-1": 42}) is Action.PREEMPTED
    # ... a failure, or death by the SIGTERM (nobody handled it: nothing saved), does not, nor
    # restarts anything: the run stops, naming the task.
    assert _after_notice("worker-1", 1, {"worker-0": 75, "worker-1": 1}) is Action.STOP
    assert _after_notice("worker-0", -15, {"worker-0": -15}) is Action.STOP
    assert _after_notice("evaluator-0", -15, {"evaluator-0": -15}) is Action.CONTINUE
    deadline = TaskEvent("worker-0", "worker", None, kind=EventKind.SAVE_TIMEOUT, detail="late")
    decision = RestartPolicy(MWMS, ON_FAILURE).decide(deadline, {}, History(), 0.0)
    assert (decision.action, decision.reason) == (Action.STOP, "worker-0 late")


@pytest.mark.quick
def test_the_exit_code_table():
    meaning = contract.exit_meaning
    assert meaning(0, noticed=False) is contract.ExitMeaning.DONE
    assert meaning(75, noticed=False) is contract.ExitMeaning.PREEMPTED
    assert meaning(42, noticed=False) is contract.ExitMeaning.RESTARTABLE
    assert meaning(143, noticed=False) is contract.ExitMeaning.RESTARTABLE
    assert meaning(143, noticed=True) is contract.ExitMeaning.PREEMPTED
    assert meaning(-15, noticed=True) is contract.ExitMeaning.RESTARTABLE
    assert meaning(2, noticed=True) is contract.ExitMeaning.FATAL
    assert meaning(1, noticed=True) is contract.ExitMeaning.RESTARTABLE
