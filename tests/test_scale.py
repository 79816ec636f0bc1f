"""Many tasks at once: a real `distlaunch up` of 64 trivial tasks, under a low open-file limit,
and the one read of a namespace's socket table that tells all of them whether they joined.

The tasks are bench/scale.py's tiny program (no TensorFlow): it listens on its task port, as a
TensorFlow server would, and waits. No timing is asserted here (bench/scale.py measures it):
only that all of them start, join and are torn down, with nothing left behind.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, events, processes_of_run, run_record, wait_for, write_spec
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.local.transport import ListeningPorts

sys.path.insert(0, str(REPO / "bench"))
from scale import PROGRAM  # noqa: E402

TASKS = 64
# Below what 64 tasks need in the launcher (a pidfd, a tree pipe and a log per task).
LOW_SOFT_LIMIT = 64
# Each task prints the soft limit it got, which must be the user's, not the launcher's.
REPORT_LIMIT = "import resource\nprint('nofile', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"


def _low_fd_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW_SOFT_LIMIT, hard))


@pytest.mark.integration
def test_64_tasks_start_join_and_leave_nothing_behind_under_a_low_fd_limit(tmp: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4 * TASKS:
        pytest.skip(f"the hard open-file limit ({hard}) is too low for {TASKS} tasks")
    (tmp / "task.py").write_text(REPORT_LIMIT + PROGRAM)
    spec = write_spec(
        tmp,
        program={"script": "task.py", "args": [str(tmp / "stop"), "600"]},
        tasks={"worker": {"count": TASKS}},
        timeouts={"grace_s": 5, "startup_s": 600},
    )
    with open(tmp / "stdout.txt", "w") as out, open(tmp / "stderr.txt", "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "distlaunch.launcher", "up", str(spec)],
            cwd=tmp,
            stdout=out,
            stderr=err,
            preexec_fn=_low_fd_limit,
        )
    try:
        run_json = wait_for(lambda: next((tmp / "runs").glob("*/run.json"), None), "the run")
        run_dir = run_json.parent
        wait_for(
            lambda: sum(e["event"] == "joined" for e in events(run_dir)) == TASKS,
            f"all {TASKS} tasks to join",
            limit_s=600,
            launcher=launcher,
        )
        assert len(processes_of_run(run_dir.name)) >= TASKS
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=300) == 128 + signal.SIGTERM
    finally:
        (tmp / "stop").touch()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert processes_of_run(run_dir.name) == []
    record = run_record(run_dir)
    assert {t["state"] for t in record["tasks"].values()} == {"stopped"}
    assert len(record["tasks"]) == TASKS
    logs = sorted((run_dir / "logs" / "attempt-0").glob("worker-*.log"))
    assert len(logs) == TASKS
    assert {log.read_text().splitlines()[0] for log in logs} == {f"nofile {LOW_SOFT_LIMIT}"}
    stdout = (tmp / "stdout.txt").read_text()
    assert f"worker-{TASKS - 1} | nofile {LOW_SOFT_LIMIT}" in stdout


@pytest.mark.quick
def test_the_socket_table_shows_a_server_come_and_go() -> None:
    ports = ListeningPorts()
    ports.MAX_AGE_S = ports.MAX_STALE_S = 0  # read the table at every call
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        assert port not in ports.of(os.getpid())
        server.listen()
        assert port in ports.of(os.getpid())
    assert port not in ports.of(os.getpid())


@pytest.mark.quick
def test_the_socket_table_is_read_again_only_when_the_socket_count_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Scripted: the namespace's TCP socket counts, and the tables a read would find.
    counts = iter([(1, 0), (1, 0), (2, 0), (2, 0)])
    tables = iter([{20000}, {20000, 20001}])
    monkeypatch.setattr(procs, "tcp_sockets_in_use", lambda pid: next(counts))
    monkeypatch.setattr(procs, "listening_ports", lambda pid: next(tables))
    ports = ListeningPorts()
    ports.MAX_AGE_S = 0
    ports.MAX_STALE_S = 3600
    assert ports.of(1) == {20000}  # the first read
    assert ports.of(1) == {20000}  # same count: the table is not read again
    assert ports.of(1) == {20000, 20001}  # a new socket: read again
    assert ports.of(1) == {20000, 20001}
