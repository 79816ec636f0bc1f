"""Fault tolerance with real processes: kill -9 tasks mid-training and watch the run recover."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import standins

from conftest import (
    all_running,
    distlaunch,
    events,
    example,
    only_run_dir,
    processes_of_run,
    run_record,
    wait_for,
    wait_for_run_dir,
    write_spec,
)

pytestmark = pytest.mark.integration

INTERVAL = 5
ON_FAILURE = {"policy": "on-failure", "max_restarts": 3, "backoff": {"initial_s": 0.2, "max_s": 1}}


def latest_checkpoint_step(run_dir: Path) -> int:
    # The `checkpoint` state file is the commit point: CheckpointManager rewrites it atomically
    # after every file of ckpt-N is in place. A ckpt-N.index alone may belong to a save the kill
    # interrupts, and then the restart rightly resumes from the one before.
    state = run_dir / "checkpoints" / "checkpoint"
    m = (
        re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', state.read_text(), re.M)
        if state.exists()
        else None
    )
    return int(m.group(1)) if m else 0


def reported_step(run_dir: Path, task: str) -> int:
    status = json.loads((run_dir / "status" / f"{task}.json").read_text())
    return int(status.get("step", 0))


def test_mwms_worker_killed_twice_gang_restarts_and_finishes(tmp, launch):
    epochs, steps = 6, 20
    spec = write_spec(
        tmp,
        program=example("mnist_mlp", epochs, steps, "--checkpoint-every", str(INTERVAL)),
        restart=ON_FAILURE,
    )
    launcher = launch(spec)
    kills = []
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    for round_ in (1, 2):
        # Kill once a checkpoint of this incarnation exists and training is past it.
        floor = latest_checkpoint_step(run_dir)
        wait_for(
            lambda: (
                all_running(run_dir, attempt=round_ - 1) and latest_checkpoint_step(run_dir) > floor
            ),
            f"a checkpoint in round {round_}",
        )
        victim = "worker-1" if round_ == 1 else "worker-0"
        pid = run_record(run_dir)["tasks"][victim]["pid"]
        step_at_kill = reported_step(run_dir, victim)
        saved = latest_checkpoint_step(run_dir)
        os.kill(pid, signal.SIGKILL)
        kills.append((victim, pid, step_at_kill, saved))
        wait_for(
            lambda: sum(e["event"] == "restarted" for e in events(run_dir)) >= 2 * round_,
            f"the gang restart in round {round_}",
        )
    launcher.wait(timeout=300)
    assert launcher.returncode == 0
    rec = run_record(run_dir)
    assert rec["state"] == "succeeded"
    assert rec["attempt"] == 2 and {t["restarts"] for t in rec["tasks"].values()} == {2}
    # Each restart resumed both workers from the checkpoint saved before the kill: at most one
    # checkpoint interval of steps was lost.
    for attempt, (victim, _pid, step_at_kill, saved) in enumerate(kills, start=1):
        for task in ("worker-0", "worker-1"):
            log = (run_dir / "logs" / f"attempt-{attempt}" / f"{task}.log").read_text()
            restored = int(re.search(r"resumed from \S+ at step (\d+)", log).group(1))
            assert restored >= saved
            assert step_at_kill - restored <= INTERVAL
    metrics = json.loads((run_dir / "metrics" / "worker-0.json").read_text())
    assert metrics[-1]["step"] == epochs * steps
    # events.jsonl tells the story: the kill, the decision and why, the restarts.
    story = events(run_dir)
    decisions = [e for e in story if e.get("decision") == "restart"]
    assert [e["task"] for e in decisions] == [k[0] for k in kills]
    assert all(
        e["exit"] == "signal SIGKILL" and "restarting worker-0, worker-1" in e["reason"]
        for e in decisions
    )
    assert sum(e["event"] == "killed" for e in story) == 2  # each survivor stopped at once
    assert not processes_of_run(rec["run_id"])


NON_RETRYABLE = """
import os, sys
import distlaunch.worker as dw
if os.environ["DISTLAUNCH_INDEX"] == "1":
    import a_module_that_does_not_exist
print("worker 0 exits with", sys.argv[1], flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.quick
def test_non_retryable_failures_are_not_restarted(tmp):
    (tmp / "task.py").write_text(NON_RETRYABLE)
    spec = write_spec(tmp, program={"script": "task.py", "args": ["0"]}, restart=ON_FAILURE)
    result = distlaunch("up", str(spec), cwd=tmp)
    assert result.returncode == 1
    assert "ModuleNotFoundError" in result.stderr and "not retried" in result.stderr
    run_dir = only_run_dir(tmp / "runs")
    assert not any(e["event"] == "restarted" for e in events(run_dir))
    # A later `up` of the same spec notices the unfinished run and says how to resume it.
    again = distlaunch("up", str(spec), cwd=tmp)
    assert (
        f"run {run_dir.name} did not finish: starting a new run (`up --resume` continues it"
        in again.stderr
    )


@pytest.mark.quick
def test_budget_is_honored_and_backoff_grows(tmp):
    (tmp / "task.py").write_text("import sys; sys.exit(3)\n")
    spec = write_spec(
        tmp,
        tasks={"worker": {"count": 1}},
        restart={
            "policy": "on-failure",
            "max_restarts": 2,
            "backoff": {"initial_s": 0.3, "max_s": 5},
        },
    )
    result = distlaunch("up", str(spec), cwd=tmp)
    assert result.returncode == 1
    assert "restart budget exhausted (2 of 2 restarts used)" in result.stderr
    run_dir = only_run_dir(tmp / "runs")
    story = events(run_dir)
    assert sum(e["event"] == "restarted" for e in story) == 2
    exits = [e["time"] for e in story if e["event"] == "exited"]
    starts = [e["time"] for e in story if e["event"] == "restarted"]
    gaps = [start - exit_ for exit_, start in zip(exits, starts)]
    assert gaps[1] > gaps[0]  # the second restart waited longer: backoff doubled
    reasons = [e["reason"] for e in story if e.get("decision") == "restart"]
    assert [r.rsplit("(", 1)[1] for r in reasons] == ["restart 1 of 2)", "restart 2 of 2)"]
    assert run_record(run_dir)["tasks"]["worker-0"]["restarts"] == 2
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "attempt-0",
        "attempt-1",
        "attempt-2",
    ]


# Headroom beyond the three kills: a freshly restarted ClusterCoordinator now and then dies of a
# TensorFlow-internal error on its first steps (seen once in CI: the chief serialized an op whose
# device name was not valid UTF-8, the worker answered INTERNAL "Unable to parse request"). The
# policy rightly restarts it again; the test checks that this is the only kind of extra restart.
PSS_ON_FAILURE = {**ON_FAILURE, "max_restarts": 6}


def attempt_started_after(story: list[dict], decision: dict, task: str) -> int:
    """The attempt at which ``task`` was started again after the restart ``decision``."""
    later = story[story.index(decision) :]
    return next(e["attempt"] for e in later if e["event"] == "restarted" and e["task"] == task)


def test_pss_worker_then_ps_then_chief_killed_and_training_finishes(tmp, launch):
    epochs, steps = 10, 30
    spec = write_spec(
        tmp,
        strategy="parameter_server",
        tasks={"chief": {}, "worker": {"count": 2}, "ps": {}},
        program=example(
            "cnn_mnist",
            epochs,
            steps,
            "--checkpoint-every",
            str(INTERVAL),
            "--train-examples",
            "2000",
        ),
        restart=PSS_ON_FAILURE,
    )
    launcher = launch(spec)
    kills = []
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    for victim in ("worker-1", "ps-0", "chief-0"):
        floor = latest_checkpoint_step(run_dir)
        wait_for(
            lambda: all_running(run_dir) and latest_checkpoint_step(run_dir) > floor,
            f"a checkpoint before killing {victim}",
        )
        task = run_record(run_dir)["tasks"][victim]
        kills.append((victim, reported_step(run_dir, "chief-0"), latest_checkpoint_step(run_dir)))
        os.kill(task["pid"], signal.SIGKILL)
        wait_for(
            lambda: (
                run_record(run_dir)["tasks"][victim].get("attempt", 0) > task.get("attempt", 0)
                and all_running(run_dir)
            ),
            f"{victim} back",
        )
    launcher.wait(timeout=300)
    assert launcher.returncode == 0
    rec = run_record(run_dir)
    story = events(run_dir)
    decisions = [e for e in story if e.get("decision") == "restart"]
    by_kill = [e for e in decisions if e["exit"] == "signal SIGKILL"]
    on_its_own = [e for e in decisions if e not in by_kill]
    for e in on_its_own:
        print(
            f"chief-0 failed on its own at attempt {e['attempt']} ({e['exit']}) and was restarted: {e['reason']}"
        )
    # events.jsonl tells the story: each kill, the decision and why. Restarts other than the
    # kills' can only be the chief's own failures (see PSS_ON_FAILURE), and the chief alone restarts.
    assert [e["task"] for e in by_kill] == ["worker-1", "ps-0", "chief-0"]
    assert "restarting worker-1 (restart" in by_kill[0]["reason"]
    assert "restarting ps-0, chief-0 (restart" in by_kill[1]["reason"]
    assert "restarting chief-0 (restart" in by_kill[2]["reason"]
    assert all(
        e["task"] == "chief-0"
        and e["exit"].startswith("exit code")
        and "restarting chief-0 (restart" in e["reason"]
        for e in on_its_own
    )
    assert rec["state"] == "succeeded" and rec["attempt"] == 3 + len(on_its_own)
    restarts = {name: t["restarts"] for name, t in rec["tasks"].items()}
    assert restarts == {"chief-0": 2 + len(on_its_own), "worker-0": 0, "worker-1": 1, "ps-0": 1}
    # The worker came back alone and the chief carried on; after the ps and the chief died, the
    # chief restored from the checkpoint saved before the kill.
    worker_attempt = attempt_started_after(story, by_kill[0], "worker-1")
    assert (
        "resumed from"
        not in (run_dir / "logs" / f"attempt-{worker_attempt}" / "worker-1.log").read_text()
    )
    for decision, (victim, step_at_kill, saved) in zip(by_kill[1:], kills[1:]):
        attempt = attempt_started_after(story, decision, "chief-0")
        log = (run_dir / "logs" / f"attempt-{attempt}" / "chief-0.log").read_text()
        restored = int(re.search(r"resumed from \S+ at step (\d+)", log).group(1))
        assert restored >= saved and step_at_kill - restored <= INTERVAL, victim
    metrics = json.loads((run_dir / "metrics" / "chief-0.json").read_text())
    assert metrics[-1]["step"] == epochs * steps
    assert not processes_of_run(rec["run_id"])


# A stand-in for a worker that needs no TensorFlow: it listens on its TF_CONFIG port (so the
# launcher sees it join), then in attempt 0 exits 1 once the test says so; later attempts succeed.
BOTH_EXIT = (
    standins.listening(standins.LOOPBACK)
    + 'if os.environ["DISTLAUNCH_ATTEMPT"] != "0":\n    sys.exit(0)\n'
    + standins.until_exists("sys.argv[1]", poll_s=0.05)
    + "sys.exit(1)\n"
)


@pytest.mark.quick
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_two_workers_exiting_in_one_batch_gang_restart_once_and_succeed(tmp, launch, how):
    # Issue 14 item 1: both exits reach the launcher in one select() batch (it is stopped while
    # they exit or are killed), as MWMS peers that fail within milliseconds of each other do (it
    # crashed on a KeyError in supervisor.py). Stand-ins: the launcher's side is the same for
    # TensorFlow workers, and test_mwms_worker_killed_twice_... shows a real gang resuming.
    (tmp / "task.py").write_text(BOTH_EXIT)
    go = tmp / "go"
    spec = write_spec(tmp, program={"script": "task.py", "args": [str(go)]}, restart=ON_FAILURE)
    launcher = launch(spec)
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    wait_for(
        lambda: all_running(run_dir, 2),
        "both workers joined",
        launcher=launcher,
    )
    pids = [t["pid"] for t in run_record(run_dir)["tasks"].values()]
    os.kill(launcher.pid, signal.SIGSTOP)
    try:
        if how == "exit":
            go.touch()
        else:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(_ended(pid) for pid in pids), "both workers exited")
    finally:
        os.kill(launcher.pid, signal.SIGCONT)
    launcher.wait(timeout=120)
    assert launcher.returncode == 0
    record = run_record(run_dir)
    assert record["state"] == "succeeded" and record["attempt"] == 1
    assert {t["restarts"] for t in record["tasks"].values()} == {1}
    story = events(run_dir)
    assert sum(e["event"] == "restarted" for e in story) == 2
    assert sum(e.get("decision") == "restart" for e in story) == 1
    assert not processes_of_run(record["run_id"])


def _ended(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie its stopped parent has not reaped yet counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
