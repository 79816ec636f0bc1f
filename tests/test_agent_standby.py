"""Warm standbys on SSH hosts (launcher/transports/agent_standby.py): each host's agent keeps one
per task, a gang restart there starts from them (the restarted program finds TensorFlow imported),
and nothing of them is left on the hosts after the run, the unused ones included.

The program imports a stand-in ``tensorflow`` (and ``keras``) that says who imported it, so the
test needs no real TensorFlow; it waits for its standby (run.json lists it as ready) before it
fails, so no test depends on how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import standins

import sshhosts
from conftest import events, wait_for, wait_for_run_dir, with_cmdline
from test_agent import _Channel

pytestmark = pytest.mark.integration

STAND_IN_IMPORT = 'import os\nprint("tensorflow imported by", os.getpid(), flush=True)\n'
# Attempt 0: worker-0 fails once both standbys of attempt 1 are ready. Attempt 1: each task waits
# for its standby of attempt 2 (never used), then succeeds.
PROGRAM = (
    """
import os, sys
print("preloaded", "tensorflow" in sys.modules, os.getpid(), flush=True)
import tensorflow
"""
    + standins.listening(standins.ANY)
    + """
me = cfg["task"]
attempt = int(os.environ["DISTLAUNCH_ATTEMPT"])
run_json = os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], "run.json")
while True:
    try:
        standbys = json.load(open(run_json)).get("standbys") or {}
    except ValueError:
        standbys = {}
    if len(standbys) == 2 and all(
        s["attempt"] == attempt + 1 and s["ready"] for s in standbys.values()
    ):
        break
    time.sleep(0.1)
if attempt == 0 and me["index"] == 0:
    sys.exit(1)
if attempt == 0:
    time.sleep(600)  # the gang restart stops it
"""
)


def _fake_tensorflow(folder: Path) -> Path:
    for name in ("tensorflow", "keras"):
        (folder / "fake" / name).mkdir(parents=True)
        (folder / "fake" / name / "__init__.py").write_text(STAND_IN_IMPORT)
    return folder / "fake"


def test_an_agents_standby_becomes_the_task_and_an_unused_or_dead_one_leaves_nothing(
    tmp: Path,
) -> None:
    """The agent's own lines: a used standby's held output is the task's, and its env writes are
    undone; a discarded one is killed with its group; a dead one means a cold start; EOF kills
    the standbys still waiting."""
    (tmp / "prog.py").write_text(
        "import os, sys\n"
        "print('preloaded', 'tensorflow' in sys.modules, os.environ.get('WRITTEN'), flush=True)\n"
        "import tensorflow\n"
    )
    request = {
        "argv": [sys.executable, "-m", "distlaunch.host.bootstrap", str(tmp / "prog.py")],
        "env": {"PYTHONPATH": str(_fake_tensorflow(tmp))},
        "cwd": str(tmp),
    }
    channel = _Channel()
    writes = [["set", "WRITTEN", "before the import"]]
    for number in (1, 2, 3):
        channel.send("prepare", number, request=request, writes=writes)
    said = [channel.frame()[:2] for _ in range(6)]
    assert sorted(said) == [(b"r", 1), (b"r", 2), (b"r", 3), (b"s", 1), (b"s", 2), (b"s", 3)]
    channel.send("start", 10, request=request, standby=1)
    output, code = channel.until_end(10)
    # Imported while a standby (its output held until now), then the program found it imported.
    assert output.startswith(b"tensorflow imported by ") and code == 0, output
    assert b"preloaded True None\n" in output, output
    assert channel.started[10].endswith(b" warm")  # the launcher records a warm restart
    channel.send("discard", 2)
    # Its control socket closed (it exits) and its group SIGKILLed; its output is dropped.
    assert channel.until_end(2)[0] == b""
    channel.send("start", 11, request=request, standby=2)  # gone: a cold start
    output, code = channel.until_end(11)
    assert output.startswith(b"preloaded False None\n") and code == 0, output
    # A cold start, and the agent says so: the launcher records no standby for it.
    assert channel.started[11].isdigit(), channel.started
    assert channel.proc.stdin is not None
    channel.proc.stdin.close()
    assert channel.proc.wait(timeout=30) == 1
    # Standby 3 was never used: it went with its agent.
    wait_for(lambda: not with_cmdline(str(tmp / "prog.py")), "no standby left", 30)


def test_a_gang_restart_on_ssh_hosts_starts_from_the_agents_standbys(ssh_lab, tmp: Path) -> None:
    lab: sshhosts.HostLab = ssh_lab
    fake = _fake_tensorflow(tmp)
    (tmp / "task.py").write_text(PROGRAM)
    spec = {
        "name": "standbys",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py", "env": {"PYTHONPATH": str(fake)}},
        "hosts": {h.name: lab.host_entry(h) for h in lab.hosts},
        "tasks": {"worker": [{"host": h.name} for h in lab.hosts]},
        "shared_dir": "runs",
        "restart": {"policy": "on-failure", "backoff": {"initial_s": 0, "max_s": 0}},
        "timeouts": {"grace_s": 2, "startup_s": 120},
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "distlaunch.launcher", "up", "spec.json"],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        out, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, err
    restarted = [e for e in events(run_dir) if e["event"] == "restarted"]
    assert sorted((e["task"], e.get("standby")) for e in restarted) == [
        ("worker-0", True),
        ("worker-1", True),
    ]
    for task in ("worker-0", "worker-1"):
        cold = (run_dir / "logs" / "attempt-0" / f"{task}.log").read_text()
        warm = (run_dir / "logs" / "attempt-1" / f"{task}.log").read_text()
        assert "preloaded False" in cold, cold
        # The standby's own output (its import) is the attempt's, held by the agent until then.
        imported_by = warm.split("tensorflow imported by ", 1)[1].split()[0]
        assert f"preloaded True {imported_by}" in warm, warm
    # The standbys of attempt 2 were never used: they went with the run, as the agents did.
    wait_for(lambda: not any(lab.processes(h) for h in lab.hosts), "the hosts to be empty", 60)
