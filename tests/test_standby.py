"""Warm standbys (launcher/transports/local/standby.py) with real processes: a restart through a
standby trains like a cold restart and leaves the same run dir, the program sees what a cold start
gives it, an unused standby leaves no file and no process, and none outlives a SIGKILLed launcher.

The programs wait for their standby (run.json lists it as ready) before they fail, so no test
depends on how fast anything is.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import standins

from conftest import (
    SELFCHECK_ARGS,
    distlaunch,
    events,
    only_run_dir,
    processes_of_run,
    run_record,
    selfcheck_program,
    wait_for,
    wait_for_run_dir,
    write_spec,
)
from distlaunch.host import bootstrap
from distlaunch.launcher.plan.placement import on_hosts
from distlaunch.launcher.plan.plan import for_attempt, make_plan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.spec.model import load_spec
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.local.standby import Standbys

pytestmark = pytest.mark.integration

ON_FAILURE = {"policy": "on-failure", "backoff": {"initial_s": 0, "max_s": 0}}

# Waits until run.json lists this task's standby for attempt WANT as ready (the program's own
# helper, standard library only).
WAIT_FOR_STANDBY = """
def wait_for_standby(want):
    import json, os, time
    run_json = os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], "run.json")
    name = os.environ["DISTLAUNCH_ROLE"] + "-" + os.environ["DISTLAUNCH_INDEX"]
    while True:
        try:
            standby = (json.load(open(run_json)).get("standbys") or {}).get(name) or {}
        except ValueError:
            standby = {}
        if standby.get("attempt") == want and standby.get("ready"):
            return
        time.sleep(0.1)
"""

# MWMS training of one worker, failing once after its first checkpoint: seeded and deterministic,
# so a warm and a cold restart must end with the same loss.
TRAIN = (
    WAIT_FOR_STANDBY
    + """
import os, sys
import keras
import tensorflow as tf
keras.utils.set_random_seed(0)
tf.config.experimental.enable_op_determinism()
from distlaunch.worker.examples.mnist_mlp import main

first = os.environ["DISTLAUNCH_ATTEMPT"] == "0"
args = ["--steps-per-epoch", "5", "--checkpoint-every", "5", "--global-batch-size", "32"]
main(["--epochs", "1" if first else "2", *args])
if first:
    if os.environ.get("STANDBY") == "on":
        wait_for_standby(1)
    sys.exit(1)
"""
)


def _tree(run_dir: Path) -> list[str]:
    """The run dir's paths, digits dropped (tensorboard file names hold a time)."""
    return sorted(re.sub(r"\d+", "N", str(p.relative_to(run_dir))) for p in run_dir.rglob("*"))


def _log_shape(log: Path, run_dir: Path) -> list[str]:
    """A log's lines with the run dir, numbers and hex ids blanked: its layout, not its values."""
    text = log.read_text().replace(str(run_dir), "RUN")
    return [re.sub(r"[0-9a-f]*\d[0-9a-f]*", "N", line) for line in text.splitlines()]


def test_a_restart_through_a_standby_trains_and_logs_like_a_cold_restart(tmp: Path) -> None:
    (tmp / "task.py").write_text(TRAIN)
    runs = {}
    for standby in ("on", "off"):
        spec = write_spec(
            tmp,
            name=f"spec-{standby}.json",
            program={"script": "task.py", "env": {"STANDBY": standby}},
            tasks={"worker": {"count": 1}},
            shared_dir=f"runs-{standby}",
            restart={**ON_FAILURE, "standby": standby == "on"},
        )
        done = distlaunch("up", str(spec), cwd=tmp)
        assert done.returncode == 0, done.stderr[-3000:]
        run_dir = only_run_dir(tmp / f"runs-{standby}")
        assert not processes_of_run(run_record(run_dir)["run_id"])
        runs[standby] = (done.stdout, run_dir)
    (warm_out, warm), (cold_out, cold) = runs["on"], runs["off"]
    restarted = {
        name: [e for e in events(run_dir) if e["event"] == "restarted"]
        for name, run_dir in (("warm", warm), ("cold", cold))
    }
    assert [e.get("standby") for e in restarted["warm"]] == [True]
    assert [e.get("standby") for e in restarted["cold"]] == [None]
    losses = [re.findall(r"final loss (\S+)", out) for out in (warm_out, cold_out)]
    assert losses[0] == losses[1] and len(losses[0]) == 2  # attempt 0's and attempt 1's
    resumed = [re.findall(r"resumed from \S+ at step (\d+)", out) for out in (warm_out, cold_out)]
    assert resumed[0] == resumed[1] == ["5"]
    assert _tree(warm) == _tree(cold)
    log = Path("logs") / "attempt-1" / "worker-0.log"
    assert _log_shape(warm / log, warm) == _log_shape(cold / log, cold)


# A TensorFlow program to the launcher, which reads the source (only those get standbys, and a
# standby imports TensorFlow before it is taken); the import itself never runs: the tests that use
# it read how a task was started, its standby and its processes, none of it TensorFlow's, and a
# TensorFlow start costs seconds of CPU per attempt.
NEVER_IMPORTED = 'if os.environ.get("DISTLAUNCH_TEST_NEVER_SET"):\n    import tensorflow\n'

# Everything a program can learn about how it was started, read at import time.
SELF = (
    WAIT_FOR_STANDBY
    + """
import json, os, sys
import __main__ as main
SEEN = {
    "argv": sys.argv, "name": __name__, "file": __file__, "cwd": os.getcwd(), "path0": sys.path[0],
    "main_file": main.__file__, "is_main": main.__dict__ is globals(),
    "spec": __spec__ and [__spec__.name, __spec__.origin], "mine": os.environ.get("MINE"),
    "attempt": os.environ["DISTLAUNCH_ATTEMPT"], "tf_config": json.loads(os.environ["TF_CONFIG"]),
    "error_file": os.environ["DISTLAUNCH_ERROR_FILE"],
}
print("SELF " + json.dumps(SEEN), flush=True)
"""
    + NEVER_IMPORTED
    + standins.listening(standins.LOOPBACK)  # joined: the launcher makes standbys once settled
    + """
attempt = int(SEEN["attempt"])
wait_for_standby(attempt + 1)  # attempt 1 leaves an unused standby (for attempt 2) behind
sys.exit(1 if attempt == 0 else 0)
"""
)


@pytest.mark.parametrize("kind", ["script", "module"])
def test_the_program_cannot_tell_it_was_started_through_a_standby(tmp: Path, kind: str) -> None:
    work, args = tmp / "work", SELFCHECK_ARGS
    program = selfcheck_program(tmp, SELF, kind)
    spec = write_spec(
        tmp,
        program={**program, "env": {"MINE": "set in the spec"}},
        tasks={"worker": {"count": 1}},
        restart=ON_FAILURE,
    )
    done = distlaunch("up", str(spec), cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = only_run_dir(tmp / "runs")
    cold, warm = [json.loads(line) for line in re.findall(r"SELF (.*)", done.stdout)]
    assert [e.get("standby") for e in events(run_dir) if e["event"] == "restarted"] == [True]
    # What `python SCRIPT` or `python -m MODULE` gives (test_descendants checks the cold start
    # against python itself), and the next attempt's own env.
    cwd = tmp if kind == "script" else work
    expected_start = {
        "argv": [str(work / "selfcheck.py"), *args],
        "name": "__main__",
        "file": str(work / "selfcheck.py"),
        "cwd": str(cwd),
        "path0": str(work),
        "main_file": str(work / "selfcheck.py"),
        "is_main": True,
    }
    assert {k: warm[k] for k in expected_start} == expected_start
    assert warm == {
        **cold,
        "attempt": "1",
        "error_file": str(run_dir / "errors" / "attempt-1" / "worker-0.json"),
    }
    assert warm["mine"] == "set in the spec" and warm["tf_config"]["task"] == {
        "type": "worker",
        "index": 0,
    }
    # The unused standby (made for attempt 2) left nothing: no file, no folder, no process.
    assert not [p for p in run_dir.rglob("*") if "attempt-2" in str(p)]
    assert "standbys" not in run_record(run_dir)
    assert not processes_of_run(run_record(run_dir)["run_id"])


@pytest.mark.quick
def test_a_program_without_tensorflow_gets_no_standby(tmp: Path) -> None:
    (tmp / "task.py").write_text("print('no TensorFlow here')\n")
    (tmp / "tf_task.py").write_text("from tensorflow import constant\n")
    plans = {}
    for script in ("task.py", "tf_task.py"):
        spec = write_spec(tmp, program={"script": script}, restart=ON_FAILURE)
        ports = {("worker", i): 20000 + i for i in range(2)}
        loaded = load_spec(spec)
        placed = on_hosts(loaded).with_ports(ports)
        plans[script] = make_plan(loaded, placed, "r1", tmp / "runs" / "r1")
    # A standby imports TensorFlow in advance: a program that never does would only pay for it.
    assert not plans["task.py"].standby and plans["tf_task.py"].standby


def test_no_standby_outlives_a_sigkilled_launcher(tmp: Path, launch) -> None:
    (tmp / "task.py").write_text(
        WAIT_FOR_STANDBY
        + standins.listening(standins.LOOPBACK)
        + NEVER_IMPORTED  # a TensorFlow program: it gets a standby
        + "wait_for_standby(1)\nprint('standby ready', flush=True)\ntime.sleep(300)\n"
    )
    spec = write_spec(tmp, tasks={"worker": {"count": 1}}, restart=ON_FAILURE)
    launcher = launch(spec)
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    record = wait_for(
        lambda: (
            (run_record(run_dir).get("standbys") or {}).get("worker-0", {}).get("ready")
            and run_record(run_dir)
        ),
        "the standby to be ready",
        launcher=launcher,
    )
    running = [
        p
        for p in processes_of_run(record["run_id"])
        if p.cmdline()[1:] == [bootstrap.__file__, str(tmp / "task.py")]
    ]
    # The standby's command line is the task's own; only its initial env tells them apart.
    standby = [p for p in running if "DISTLAUNCH_STANDBY" in p.environ()]
    task = [p for p in running if "DISTLAUNCH_STANDBY" not in p.environ()]
    assert len(standby) == len(task) == 1
    assert standby[0].cmdline() == task[0].cmdline()
    launcher.kill()
    launcher.wait()
    wait_for(
        lambda: not processes_of_run(record["run_id"]),
        "the task and its standby to die with the launcher",
        limit_s=30,
    )


@pytest.mark.quick
def test_plan_shows_whether_restarts_use_standbys(tmp: Path) -> None:
    (tmp / "task.py").write_text("import tensorflow\n")
    shown = {}
    for name, restart in (
        ("default", ON_FAILURE),
        ("off", {**ON_FAILURE, "standby": False}),
        ("never", {"policy": "never"}),
    ):
        spec = write_spec(tmp, name=f"{name}.json", restart=restart)
        done = distlaunch("plan", "--json", str(spec), cwd=tmp)
        assert done.returncode == 0, done.stderr
        shown[name] = json.loads(done.stdout)["standby"]
    assert shown == {"default": True, "off": False, "never": False}
    text = distlaunch("plan", str(tmp / "off.json"), cwd=tmp)
    assert "\nstandbys: off\n" in text.stdout


def test_a_standby_taken_before_its_imports_are_done_still_runs_the_task(tmp: Path) -> None:
    """A restart can come while the standby still imports TensorFlow: it gets go (and the
    launcher closes its end) before it could say ready; it must still run the program."""
    (tmp / "task.py").write_text("import sys\nprint('ran', sys.argv[1:], flush=True)\n")
    loaded = load_spec(
        write_spec(
            tmp, program={"script": "task.py", "args": ["x"]}, tasks={"worker": {"count": 1}}
        )
    )
    run_dir = tmp / "runs" / "r1"
    rundir.make_dirs(run_dir, 0)
    placed = on_hosts(loaded).with_ports({("worker", 0): 20000})
    task = for_attempt(make_plan(loaded, placed, "r1", run_dir), 1).tasks[0]
    standbys = Standbys()
    try:
        standbys.prepare([task])
        rundir.make_dirs(run_dir, 1)
        taken = standbys.take(task)  # at once: its imports take seconds
        assert taken is not None
        proc, tree = taken
        assert proc.wait(timeout=240) == 0
        assert procs.wait_tree(tree)
        os.close(tree)
    finally:
        standbys.close()
    assert "ran ['x']" in Path(task.log_file).read_text()
