"""Stop notices where tasks run elsewhere (issue 26): SSH hosts and containers.

The remote helper on its own first: ``notice`` sends SIGTERM to the task's program alone. Then
real 2-worker MWMS `dw.fit` runs on the SSH lab's two hosts (tests/sshhosts.py): SIGTERM to `up`
and `distlaunch down` each end the run preempted (75) with one saved step, read from the status
files the tasks wrote to the shared run dir, and `up --resume` goes on from exactly that step.

SSH-lab tests: run under `flock /tmp/dl-ssh.lock`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import sshhosts
from conftest import distlaunch, events, run_record, wait_for
from distlaunch.worker import contract
from test_preemption import ARGS, _resumed_steps, _saved_steps, _training
from test_ssh import _nothing_left

HELPER = [sys.executable, "-m", "distlaunch.worker.remote"]

# A data-loader child that notes a SIGTERM reaching it while its parent, the program, still runs:
# the helper sends what the program left behind SIGTERM once the program has exited (the child is
# then the helper's), which is no notice.
CHILD = """
import os, signal, sys, time
parent = os.getppid()
def noted(signum, frame):
    if os.getppid() == parent:
        open(sys.argv[1], "w").write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, noted)
open(sys.argv[1] + ".started", "w").write(str(os.getpid()))
while True:
    time.sleep(1)
"""

# dw.fit (tests/test_preemption.py's ARGS) with such a child.
FIT_WITH_CHILD = f"""
import os, subprocess, sys
import distlaunch.worker as dw
marker = os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], f"child-{{dw.context().name}}")
subprocess.Popen([sys.executable, "-c", {CHILD!r}, marker])
from distlaunch.worker.examples.mnist_mlp import main
main(sys.argv[1:])
"""

# Exits 143 on its notice, as a program's own SIGTERM handler does, once its child has started.
NOTED = f"""
import os, signal, subprocess, sys, time
marker = sys.argv[1]
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
subprocess.Popen([sys.executable, "-c", {CHILD!r}, marker])
while not os.path.exists(marker + ".started"):
    time.sleep(0.05)
print("up", flush=True)
time.sleep(600)
"""


# ---- the remote helper, on this machine -------------------------------------------------------


@pytest.mark.timeout(120)
def test_helper_notice_reaches_the_program_alone_and_the_helper_keeps_watching(tmp: Path) -> None:
    script = tmp / "noted.py"
    script.write_text(NOTED)
    child = tmp / "child"
    request = {"argv": [sys.executable, str(script), str(child)], "env": {}, "grace_s": 5}
    helper = subprocess.Popen(
        HELPER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        helper.stdin.write(json.dumps(request).encode() + b"\n")
        helper.stdin.flush()
        assert helper.stdout.readline() == b"up\n"
        helper.stdin.write(b"notice\n")
        helper.stdin.flush()
        out = helper.stdout.read()
        err = helper.stderr.read()
        helper.wait(timeout=60)
    finally:
        helper.kill()
        helper.wait()
    # The program's own handler ran and its exit code is relayed; its child never got the
    # notice (the helper then ended it, as it ends whatever a task leaves behind).
    assert helper.returncode == 143, (out, err)
    assert (tmp / "child.started").is_file()
    assert not child.exists()
    assert b"stopping the task" not in err  # a notice is no stop


# ---- real runs on the SSH lab -----------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(ssh_lab):
    """The module's SSH test hosts (conftest's ssh_lab)."""
    return ssh_lab


def _ssh_spec(folder: Path, lab: sshhosts.HostLab) -> Path:
    (folder / "task.py").write_text(FIT_WITH_CHILD)
    spec = {
        "name": "sshpre",
        "strategy": contract.MWMS,
        "program": {"script": "task.py", "args": ARGS},
        "hosts": {h.name: lab.host_entry(h) for h in lab.hosts},
        "tasks": {"worker": [{"host": h.name} for h in lab.hosts]},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_ssh_notice_saves_one_step_and_resume_and_down_continue_from_it(
    lab: sshhosts.HostLab, tmp: Path, launch
) -> None:
    spec = _ssh_spec(tmp, lab)
    launcher = launch(spec)
    run_dir = _training(tmp)
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=240)
    err = (tmp / "stderr.txt").read_text()
    assert launcher.returncode == contract.EXIT_PREEMPTED, err[-3000:]
    saved = _saved_steps(run_dir, 0)
    assert len(saved) == 2 and saved[0] == saved[1] > 25
    step = saved[0]
    # The step comes from the status files the remote tasks wrote into the shared run dir.
    record = run_record(run_dir)
    assert record["state"] == "preempted" and record["preempted"]["step"] == step
    assert f"run {record['run_id']} preempted at step {step}, saved in " in err
    assert {t["exit_code"] for t in record["tasks"].values()} == {contract.EXIT_PREEMPTED}
    assert [e["saved_step"] for e in events(run_dir) if e["event"] == "exited"] == [step, step]
    # The data-loader children on the hosts ran, and the notice never reached them.
    for task in ("worker-0", "worker-1"):
        assert (run_dir / f"child-{task}.started").is_file()
        assert not (run_dir / f"child-{task}").exists()
    wait_for(lambda: _nothing_left(lab, record["run_id"]), "nothing of the run left on the hosts")

    # `up --resume` starts at exactly that step on both hosts; `distlaunch down` is a notice too.
    resumed = launch(spec, "--resume")
    _training(tmp, attempt=1, past_step=step)
    down = distlaunch("down", record["run_id"], "--shared-dir", str(tmp / "runs"))
    resumed.wait(timeout=240)
    assert down.returncode == 0, down.stderr
    assert resumed.returncode == contract.EXIT_PREEMPTED, (tmp / "stderr.txt").read_text()[-3000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs" / "attempt-1").glob("worker-*.log"))
    assert _resumed_steps(logs) == [step, step]
    again = _saved_steps(run_dir, 1)
    assert len(again) == 2 and again[0] == again[1] > step
    assert f"its tasks saved step {again[0]}" in down.stdout
    assert run_record(run_dir)["preempted"]["step"] == again[0]
    wait_for(lambda: _nothing_left(lab, record["run_id"]), "nothing of the run left on the hosts")
