"""Hangs and failures diagnosed with real processes: stacks, the silence watchdog, the root cause
of a lost peer, OOM kills and crash loops."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import (
    distlaunch,
    events,
    only_run_dir,
    run_record,
    wait_for,
    wait_for_run_dir,
    write_spec,
)
from distlaunch.launcher.diagnosis import formation, oom, stacks

pytestmark = pytest.mark.integration

# MWMS: every step all-reduces a variable; worker 1 stops inside step 3 (sleeps, or waits to be
# killed by the test). Its peer then blocks in the step's collective all-reduce.
MWMS_STEPS = """
import os, sys, time
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
index = int(os.environ["DISTLAUNCH_INDEX"])
with strategy.scope():
    w = tf.Variable(1.0)


@tf.function
def train_step():
    def step():
        return tf.distribute.get_replica_context().all_reduce("sum", w * 2.0)
    return strategy.run(step)


def train(steps):
    for i in range(steps):
        if index == 1 and i == 3:
            print("worker 1 stops inside step", i, flush=True)
            time.sleep(100000)
        train_step()
        print("step", i, "done", flush=True)


train(10**9)
"""


def _log(run_dir: Path, task: str) -> str:
    path = run_dir / "logs" / "attempt-0" / f"{task}.log"
    return path.read_text() if path.exists() else ""


def _until_worker_1_stops(tmp: Path, launch, **fields) -> tuple[subprocess.Popen, Path]:
    """Start MWMS_STEPS (spec ``fields`` over write_spec's) through ``launch``; return the
    launcher and its run dir once worker-1 has stopped inside step 3."""
    (tmp / "task.py").write_text(MWMS_STEPS)
    launcher = launch(write_spec(tmp, **fields))
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    wait_for(
        lambda: "stops inside step" in _log(run_dir, "worker-1"),
        "worker-1 to stop",
        launcher=launcher,
    )
    return launcher, run_dir


@pytest.mark.timeout(400)
def test_hung_worker_is_found_by_the_watchdog_and_stacks_show_where_everyone_waits(tmp, launch):
    timeouts = {"grace_s": 2, "startup_s": 120, "silence_s": 30}
    launcher, run_dir = _until_worker_1_stops(tmp, launch, timeouts=timeouts)
    # `distlaunch stacks` on the running run: every task's stack, and where it is.
    shown = distlaunch("stacks", run_dir.name, "--no-native", "--full", cwd=tmp)
    print(shown.stdout, shown.stderr)
    assert shown.returncode == 0
    assert "worker-0 | Thread" in shown.stdout and "worker-1 | Thread" in shown.stdout
    assert "worker-1: in its own code at train (task.py:22)" in shown.stdout
    assert "worker-0: waits in" in shown.stdout
    launcher.wait(timeout=300)
    err = (tmp / "stderr.txt").read_text()
    print(err[-4000:])
    assert launcher.returncode == 1
    assert (
        f"run {run_dir.name} failed: worker-1 hung: no log output, heartbeat or CPU progress" in err
    )
    assert "| hung: worker-1: in its own code at train (task.py:22)" in err
    assert (
        "| worker-0: waits in a TensorFlow function (graph execution), called from train (task.py:23)"
        in err
    )
    # (signal-attempt-0/ holds the faulthandler files the bootstrap keeps open, unused here)
    captures = sorted(p for p in (run_dir / "stacks").iterdir() if not p.name.startswith("signal-"))
    assert len(captures) == 2  # the user's `distlaunch stacks`, then the watchdog's
    for folder in captures:
        assert sorted(p.name for p in folder.iterdir()) == [
            "worker-0.txt",
            "worker-1.txt",
        ]
        assert "quick_execute" in (folder / "worker-0.txt").read_text()
        assert "train (task.py:22)" in (folder / "worker-1.txt").read_text()
    hung = [e for e in events(run_dir) if e["event"] == "hung"]
    assert [e["task"] for e in hung] == ["worker-1"] and hung[0]["decision"] == "fail"


@pytest.mark.timeout(400)
def test_a_killed_worker_is_the_root_cause_not_the_survivors_unavailable_error(tmp, launch):
    launcher, run_dir = _until_worker_1_stops(tmp, launch)
    os.kill(run_record(run_dir)["tasks"]["worker-1"]["pid"], signal.SIGKILL)
    launcher.wait(timeout=300)
    err = (tmp / "stderr.txt").read_text()
    print(err[-4000:])
    assert launcher.returncode == 1
    assert f"run {run_dir.name} failed: worker-1 signal SIGKILL" in err
    assert "failed: worker-0" not in err


@pytest.mark.timeout(400)
def test_a_frozen_worker_named_lost_by_the_survivor_is_the_root_cause(tmp, launch):
    # SIGSTOP: worker-1's process stays, its heartbeats stop; worker-0's all-reduce is aborted with
    # an UnavailableError naming it. Before any task has died, the summary must name worker-1.
    launcher, run_dir = _until_worker_1_stops(tmp, launch)
    # The program itself, not the taskinit keeper the launcher started above it.
    pid = stacks.program_pid(run_record(run_dir)["tasks"]["worker-1"]["pid"])
    os.kill(pid, signal.SIGSTOP)
    launcher.wait(timeout=300)
    err = (tmp / "stderr.txt").read_text()
    print(err[-4000:])
    assert launcher.returncode == 1
    assert f"run {run_dir.name} failed: worker-1 stopped answering its peers" in err
    assert "worker-0 exit code 1 with a follow-on error: peer lost" in err
    assert "failed: worker-0" not in err


def _memory_cgroup(limit_bytes: int) -> Path | None:
    """A cgroup v2 or v1 memory cgroup limited to ``limit_bytes``, or None where none can be made."""
    name = f"distlaunch-test-{uuid.uuid4().hex[:8]}"
    for base, limit_file in (
        (Path("/sys/fs/cgroup"), "memory.max"),
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
    ):
        if not (base / limit_file).parent.exists() or (
            base == Path("/sys/fs/cgroup") and not (base / "cgroup.subtree_control").exists()
        ):
            continue
        try:
            (base / name).mkdir()
            (base / name / limit_file).write_text(str(limit_bytes))
            if (
                limit_file == "memory.limit_in_bytes"
                and (base / name / "memory.memsw.limit_in_bytes").exists()
            ):
                (base / name / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            return base / name
        except OSError:
            continue
    return None


HOG = """
import sys
# Join the memory-limited cgroup the test made (a task runs in the launcher's cgroup otherwise).
open(sys.argv[1] + "/cgroup.procs", "w").write("0")
chunks = []
while True:
    chunks.append(bytearray(16 << 20))
    chunks[-1][::4096] = b"x" * len(chunks[-1][::4096])
"""


@pytest.mark.quick
@pytest.mark.timeout(300)
def test_a_task_killed_by_the_oom_killer_is_named_so(tmp):
    # A real OOM kill: a memory cgroup limited to 400 MB (root only); no RLIMIT_AS stand-in here,
    # since that makes Python raise MemoryError instead of the kernel killing the task.
    cgroup = _memory_cgroup(400 << 20)
    if cgroup is None:
        pytest.skip(
            "cannot create a memory-limited cgroup here (needs root and a memory controller)"
        )
    try:
        (tmp / "task.py").write_text(HOG)
        spec = write_spec(
            tmp,
            program={"script": "task.py", "args": [str(cgroup)]},
            tasks={"worker": {"count": 1}},
        )
        result = distlaunch("up", str(spec), cwd=tmp)
    finally:
        wait_for(
            lambda: not (cgroup / "cgroup.procs").read_text().strip(),
            "the cgroup to empty",
        )
        cgroup.rmdir()
    print(result.stderr[-3000:])
    assert result.returncode == 1
    assert "failed: worker-0 killed by the OOM killer (RSS 0." in result.stderr
    assert "OOM" in run_record(only_run_dir(tmp / "runs"))["tasks"]["worker-0"]["exit"]


# MWMS where worker 1 cannot reach worker 0's coordination service (as behind a firewall: its
# connections to worker 0 go to a closed port). Both start their servers; without a formation
# deadline both would wait silently for TensorFlow's hour-long register timeout.
UNREACHABLE_LEADER = """
import json, os
config = json.loads(os.environ["TF_CONFIG"])
if config["task"]["index"] == 1:
    config["cluster"]["worker"][0] = "localhost:1"
    os.environ["TF_CONFIG"] = json.dumps(config)
import tensorflow as tf
tf.distribute.MultiWorkerMirroredStrategy()
print("the cluster formed", flush=True)
"""


@pytest.mark.timeout(300)
def test_a_cluster_that_never_forms_fails_naming_the_task_that_never_connected(tmp):
    (tmp / "task.py").write_text(UNREACHABLE_LEADER)
    spec = write_spec(tmp, timeouts={"grace_s": 2, "startup_s": 120, "formation_s": 5})
    result = distlaunch("up", str(spec), cwd=tmp)
    print(result.stderr[-3000:])
    run_dir = only_run_dir(tmp / "runs")
    assert result.returncode == 1
    leader = next(t for t in run_record(run_dir)["plan"]["tasks"] if t["name"] == "worker-0")
    assert (
        f"run {run_dir.name} failed: worker-1 never connected to the coordination service on "
        f"worker-0 ({leader['host']}:{leader['port']})"
    ) in result.stderr
    assert "1 of 2 tasks missing 5 s after every task started its server" in result.stderr
    assert "the cluster formed" not in (run_dir / "logs" / "attempt-0" / "worker-0.log").read_text()
    record = run_record(run_dir)
    assert record["failure"]["task"] == "worker-1"
    assert all(t["state"] != "running" for t in record["tasks"].values())


@pytest.mark.quick
def test_the_leaders_latest_count_and_stragglers_are_read_from_its_log(tmp):
    log = tmp / "worker-0.log"
    log.write_text(
        "I0000 coordination_service.cc:502] Waiting for 2/3 tasks to connect.\n"
        "I0000 coordination_service.cc:505] Example stragglers:\n"
        "/job:worker/replica:0/task:1\n/job:worker/replica:0/task:2\n"
        "I0000 coordination_service.h:529] /job:worker/replica:0/task:2 has connected to "
        "coordination service. Incarnation: 7\n"
        "I0000 coordination_service.cc:502] Waiting for 1/3 tasks to connect.\n"
        "I0000 coordination_service.cc:505] Example stragglers:\n"
        "/job:worker/replica:0/task:1\n"
        "I0000 coordination_service_agent.cc:245] Coordination agent has successfully connected.\n"
    )
    assert formation.latest(str(log)) == formation.Formation(1, 3, ("worker-1",))
    with log.open("a") as f:
        f.write("I0000 coordination_service.cc:502] Waiting for 0/3 tasks to connect.\n")
    assert formation.latest(str(log)) == formation.Formation(0, 3, ())
    log.write_text("epoch 1 loss 0.5\n")  # TF_CPP_MIN_LOG_LEVEL=1: nothing said
    assert formation.latest(str(log)) is None
    assert formation.latest(str(tmp / "missing.log")) is None
    assert formation.leader(["worker-0", "chief-0", "ps-0"]) == "chief-0"
    assert formation.leader(["worker-1", "worker-0"]) == "worker-0"


@pytest.mark.quick
def test_the_kernel_log_is_read_only_once_the_oom_kill_count_moved(monkeypatch):
    # Reading /dev/kmsg record by record costs tens of milliseconds per SIGKILL: it is skipped
    # while the kernel's OOM kill count stands where it stood when the run began.
    count = [7]
    reads = []
    monkeypatch.setattr(oom, "oom_kill_count", lambda: count[0])
    monkeypatch.setattr(oom, "kernel_log", lambda: reads.append(1) or "Killed process 42 (python)")
    kills = oom.OomKills()
    assert kills.kill_of(42, -signal.SIGKILL, 2e9) == "" and reads == []
    count[0] = 8  # one OOM kill somewhere on the machine
    assert kills.kill_of(43, -signal.SIGKILL, None) == "" and reads == [1]
    assert kills.kill_of(42, 128 + signal.SIGKILL, 2e9) == "killed by the OOM killer (RSS 2.0 GB)"
    assert kills.kill_of(42, 1, 2e9) == "" and len(reads) == 2  # not a SIGKILL: no read at all
    # Where the kernel keeps no count, every SIGKILL is looked up.
    monkeypatch.setattr(oom, "oom_kill_count", lambda: None)
    assert oom.OomKills().kill_of(42, -signal.SIGKILL, None) == "killed by the OOM killer"


@pytest.mark.quick
def test_a_crash_loop_stops_after_two_identical_tracebacks(tmp):
    (tmp / "task.py").write_text("import os\nraise ValueError('bad value in the config: 42')\n")
    spec = write_spec(
        tmp,
        tasks={"worker": {"count": 1}},
        restart={
            "policy": "on-failure",
            "max_restarts": 5,
            "backoff": {"initial_s": 0.1, "max_s": 0.2},
        },
    )
    result = distlaunch("up", str(spec), cwd=tmp)
    print(result.stderr[-3000:])
    assert result.returncode == 1
    assert "ValueError: bad value in the config: 42" in result.stderr
    assert (
        "the same traceback as before the last restart: a crash loop, not retried" in result.stderr
    )
    story = events(only_run_dir(tmp / "runs"))
    assert sum(e["event"] == "restarted" for e in story) == 1
    assert [e["decision"] for e in story if e["event"] == "exited"] == [
        "restart",
        "fail",
    ]


SLEEPS_IN_ITS_CODE = """
import time  # no distlaunch import: the bootstrap installs the faulthandler dump for any program



def wait_for_ever():
    print("waiting", flush=True)
    time.sleep(100000)


wait_for_ever()
"""


def _python_elsewhere(root: Path) -> Path:
    """This interpreter, with its packages, as ``root/bin/python``: a folder without py-spy.

    A link to a venv's python outside the venv is not that venv (Python finds its venv by the
    pyvenv.cfg beside or above the path it was started by): in a venv, ``root`` becomes a venv
    of the same packages (its pyvenv.cfg, and its lib linked to the venv's).
    """
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    if sys.prefix != sys.base_prefix:
        venv = Path(sys.prefix)
        shutil.copy(venv / "pyvenv.cfg", root / "pyvenv.cfg")
        for lib in ("lib", "lib64"):
            if (venv / lib).is_dir():
                (root / lib).symlink_to(venv / lib)
    return root / "bin" / "python"


@pytest.mark.quick
@pytest.mark.timeout(200)
def test_stacks_fall_back_to_the_tasks_faulthandler_when_py_spy_cannot_read_it(tmp, launch):
    (tmp / "task.py").write_text(SLEEPS_IN_ITS_CODE)
    spec = write_spec(
        tmp, tasks={"worker": {"count": 1}}, timeouts={"grace_s": 2, "startup_s": 120}
    )
    launcher = launch(spec)
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    wait_for(
        lambda: "waiting" in _log(run_dir, "worker-0"),
        "the task to wait",
        launcher=launcher,
    )
    # No py-spy on PATH nor beside the interpreter (a link to it in a folder of its own,
    # since py-spy may be installed beside the real one): the launcher cannot attach.
    bare = {**os.environ, "PATH": "/usr/bin:/bin"}
    shown = subprocess.run(
        [
            str(_python_elsewhere(tmp / "env")),
            "-m",
            "distlaunch.launcher",
            "stacks",
            run_dir.name,
            "--full",
        ],
        cwd=tmp,
        env=bare,
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(shown.stdout, shown.stderr)
    assert shown.returncode == 0
    assert (
        "worker-0 | faulthandler dump (py-spy could not read the task: py-spy is not installed"
        in shown.stdout
    )
    assert "worker-0: in its own code at wait_for_ever (task.py:8)" in shown.stdout
    assert "worker-0 | Thread" not in shown.stdout or "Current thread" in shown.stdout
    assert launcher.poll() is None  # the signal dumped the stacks; it did not stop the task
    assert distlaunch("down", run_dir.name, cwd=tmp).returncode == 0
    launcher.wait(timeout=60)
