"""One agent per remote host (distlaunch.host.agent): on its own (its lines and frames, its
keepers, its death), then a run of 32 stand-in tasks on the two SSH test hosts through one ssh
session per host.

Host tests skip, with the reason, where the machine cannot make the hosts (not root, no sshd).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import standins

import sshhosts
from conftest import (
    cmdline,
    events,
    host_cmdlines,
    run_tables,
    up_piped,
    wait_for,
    wait_for_run_dir,
    wait_tasks_up,
    with_cmdline,
)
from distlaunch.host import agent, remote
from distlaunch.host import channel as wire

AGENT = [sys.executable, "-m", "distlaunch.host.agent"]
# A task that needs no TensorFlow: it listens on its TF_CONFIG port (the launcher sees it join),
# says so, and exits 0 once the test's go-file exists.
STAND_IN = (
    standins.listening(standins.ANY)
    + 'print("up", os.getpid(), flush=True)\n'
    + standins.until_exists("sys.argv[1]", limit_s=300)
)
SLEEPER = "import os, time\nprint('up', os.getpid(), flush=True)\ntime.sleep(600)\n"


class _Channel:
    """The launcher's end of an agent run here: commands in, frames out (after the hello)."""

    def __init__(self, heartbeat_s: float = 60) -> None:
        self.proc = subprocess.Popen(AGENT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.started: dict[int, bytes] = {}
        self.write(json.dumps({"agent": wire.PROTOCOL, "heartbeat_s": heartbeat_s}).encode())
        assert self.proc.stdout is not None
        assert self.proc.stdout.read(len(wire.hello())) == wire.hello()

    def write(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.rstrip(b"\n") + b"\n")
        self.proc.stdin.flush()

    def send(self, op: str, number: int = 0, **fields: object) -> None:
        self.write(wire.command(op, number, **fields))

    def frame(self) -> tuple[bytes, int, bytes]:
        assert self.proc.stdout is not None
        header = self.proc.stdout.readline()
        kind, number, length = header.split()
        payload = self.proc.stdout.read(int(length) + 1)  # and the newline that ends a frame
        return kind, int(number), payload[:-1]

    def until_end(self, number: int) -> tuple[bytes, int]:
        """The task's output and its exit code, from the frames up to its end (its ``s`` frame's
        payload goes to `started`)."""
        output = b""
        while True:
            kind, got, payload = self.frame()
            if kind == b"s":
                self.started[got] = payload
            if got == number and kind == b"o":
                output += payload
            if got == number and kind == b"x":
                return output, int(payload)


def _start(channel: _Channel, number: int, code: str) -> None:
    channel.send("start", number, request={"argv": [sys.executable, "-c", code], "env": {}})


def test_agent_and_helper_speak_one_protocol() -> None:
    assert wire.PROTOCOL == remote.PROTOCOL


def test_agent_runs_tasks_side_by_side_and_relays_each_end() -> None:
    channel = _Channel()
    _start(channel, 1, "import sys; print('one'); sys.exit(3)")
    _start(channel, 2, "import os, signal; print('two', flush=True); os.kill(os.getpid(), 9)")
    ends: dict[int, tuple[bytes, int]] = {}
    outputs: dict[int, bytes] = {1: b"", 2: b""}
    while len(ends) < 2:
        kind, number, payload = channel.frame()
        if kind == b"o":
            outputs[number] += payload
        elif kind == b"x":
            ends[number] = (outputs[number], int(payload))
    assert ends[1] == (b"one\n", 3)
    assert ends[2][1] == 128 + 9 and remote.ended_by(ends[2][0], 9)
    assert channel.proc.stdin is not None
    channel.proc.stdin.close()
    assert channel.proc.wait(timeout=30) == 1  # the launcher's channel ended


@pytest.mark.quick
def test_a_bad_command_is_answered_with_an_error_frame_and_ends_nothing() -> None:
    channel = _Channel()
    _start(channel, 1, "import time; time.sleep(600)")
    bad = [
        b"not json at all",
        b"[1, 2]",
        json.dumps({"v": wire.PROTOCOL, "op": "fly", "id": 1}).encode(),
        json.dumps({"v": wire.PROTOCOL - 1, "op": "kill", "id": 1}).encode(),
        json.dumps({"v": wire.PROTOCOL, "op": "stop", "id": -1}).encode(),
        json.dumps({"v": wire.PROTOCOL, "op": "start", "id": 2, "request": "argv"}).encode(),
        json.dumps({"stop": 1}).encode(),  # the old, untyped form
    ]
    for line in bad:
        channel.write(line)
    errors, ended = [], []
    while len(errors) < len(bad):
        kind, number, payload = channel.frame()
        if kind == b"e":
            errors.append(json.loads(payload))
        ended += [number] if kind == b"x" else []
    assert [e["line"] for e in errors] == [line.decode() for line in bad]
    assert all(e["error"] for e in errors) and ended == []
    # Task 1 was neither stopped nor killed by any of them: it ends when told to, normally.
    channel.send("stop", 1)
    assert channel.until_end(1)[1] == 128 + 15


def test_an_agent_of_another_protocol_says_so_and_starts_nothing() -> None:
    done = subprocess.run(
        AGENT, input=b'{"agent": 1, "heartbeat_s": 20}\n', capture_output=True, timeout=60
    )
    assert done.returncode == agent.EXIT_PROTOCOL
    assert b"protocol" in done.stderr


@pytest.mark.parametrize("how", ["eof", "sigkill"])
def test_no_task_outlives_its_agent(tmp: Path, how: str) -> None:
    script = tmp / "sleeper.py"
    script.write_text(SLEEPER)
    channel = _Channel()
    for number in (1, 2):
        channel.send("start", number, request={"argv": [sys.executable, str(script)], "env": {}})
    outputs = {1: b"", 2: b""}
    while not all(b"\n" in out for out in outputs.values()):
        kind, number, payload = channel.frame()
        if kind == b"o":
            outputs[number] += payload
    pids = [int(out.split()[1]) for out in outputs.values()]
    if how == "eof":
        assert channel.proc.stdin is not None
        channel.proc.stdin.close()
    else:
        channel.proc.kill()
    channel.proc.wait(timeout=30)
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), "the tasks to be gone", 60)


# ---- the SSH test hosts ---------------------------------------------------------------------


def _agents(lab: sshhosts.HostLab, host: sshhosts.TestHost) -> list[psutil.Process]:
    return with_cmdline("distlaunch.host.agent", among=lab.processes(host))


@pytest.mark.integration
def test_32_tasks_on_two_hosts_run_through_one_ssh_session_each(ssh_lab, tmp: Path) -> None:
    lab: sshhosts.HostLab = ssh_lab
    (tmp / "task.py").write_text(STAND_IN)
    go = tmp / "go"
    tasks = [{"host": h.name} for h in lab.hosts for _ in range(16)]
    spec = {
        "name": "agents",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py", "args": [str(go)]},
        "hosts": {h.name: lab.host_entry(h) for h in lab.hosts},
        "tasks": {"worker": tasks},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 240},
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
        logs = run_dir / "logs" / "attempt-0"

        def all_up() -> bool:
            files = [logs / f"worker-{i}.log" for i in range(32)]
            return all(f.exists() and "up " in f.read_text() for f in files)

        wait_for(all_up, "every task up", launcher=launcher)
        children = psutil.Process(launcher.pid).children()
        clients = [cmdline(p) for p in with_cmdline(name="ssh", among=children)]
        assert sum("distlaunch.host.agent" in c for c in clients) == 2, clients
        assert not any("distlaunch.host.remote" in c for c in clients), clients
        assert [len(_agents(lab, h)) for h in lab.hosts] == [1, 1]
        go.write_text("go")
        out, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, err
    started = [e for e in events(run_dir) if e.get("event") == "started"]
    assert len(started) == 32
    wait_for(lambda: not any(lab.processes(h) for h in lab.hosts), "the hosts to be empty", 60)


def _hosts_spec(folder: Path, lab: sshhosts.HostLab, hosts: dict, tasks: list, **fields) -> Path:
    spec = {
        "name": "agents",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py"},
        "hosts": hosts,
        "tasks": {"worker": tasks},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
        **fields,
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec))
    return path


@pytest.mark.integration
def test_a_host_with_an_older_distlaunch_is_one_line_and_nothing_starts(ssh_lab, tmp: Path) -> None:
    lab: sshhosts.HostLab = ssh_lab
    old = tmp / "old" / "distlaunch" / "host"
    old.mkdir(parents=True)
    for name in ("distlaunch/__init__.py", "distlaunch/host/__init__.py"):
        (tmp / "old" / name).write_text("")
    for name in ("agent.py", "remote.py"):
        (old / name).write_text("PROTOCOL = 3\n")
    python = tmp / "oldpython"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp / "old"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (tmp / "task.py").write_text(SLEEPER)
    node1, node2 = lab.hosts
    hosts = {
        node1.name: lab.host_entry(node1, python=str(python)),
        node2.name: lab.host_entry(node2),
    }
    _hosts_spec(tmp, lab, hosts, [{"host": node1.name}, {"host": node2.name}])
    launcher = up_piped(tmp)
    out, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 2, err
    problems = [line for line in err.splitlines() if "protocol" in line]
    assert len(problems) == 1 and problems[0].strip().startswith(f"{node1.name} ("), err
    assert f"speaks protocol 3, this launcher {remote.PROTOCOL}" in problems[0]
    assert not list((tmp / "runs").glob("*/logs/*/*.log"))
    assert not any(lab.processes(h) for h in lab.hosts)


@pytest.mark.integration
def test_an_agent_killed_on_its_host_ends_its_tasks_and_the_run_names_the_host(
    ssh_lab, tmp: Path
) -> None:
    lab: sshhosts.HostLab = ssh_lab
    (tmp / "task.py").write_text(SLEEPER)
    node1, node2 = lab.hosts
    hosts = {h.name: lab.host_entry(h) for h in lab.hosts}
    tasks = [{"host": node1.name}, {"host": node1.name}, {"host": node2.name}]
    _hosts_spec(tmp, lab, hosts, tasks)
    launcher = up_piped(tmp)
    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        wait_tasks_up(run_dir, 3, launcher)
        (killed,) = _agents(lab, node1)
        killed.kill()
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 1, err
    log = (run_dir / "logs" / "attempt-0" / "worker-0.log").read_text()
    assert f"lost the agent on {node1.name} (" in log
    assert f"{node1.name}" in err and "failed: worker-" in err, err
    wait_for(lambda: not any(lab.processes(h) for h in lab.hosts), "the hosts to be empty", 60)


@pytest.fixture(scope="module")
def four_hosts():
    """Four SSH test hosts (tests/sshhosts.py) for the link-cut test."""
    reason = sshhosts.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with sshhosts.HostLab(4) as made:
        yield made


@pytest.mark.integration
def test_a_cut_link_is_named_and_leaves_nothing_on_its_host(four_hosts, tmp: Path) -> None:
    lab: sshhosts.HostLab = four_hosts
    (tmp / "task.py").write_text(SLEEPER)
    hosts = {h.name: lab.host_entry(h) for h in lab.hosts}
    _hosts_spec(tmp, lab, hosts, [{"host": h.name} for h in lab.hosts])
    cut = lab.hosts[2]
    leg = f"{cut.netns}v"  # the host's end of its cable to the switch (tests/netlab.py)
    launcher = up_piped(tmp)
    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        wait_tasks_up(run_dir, 4, launcher)
        # One distlaunch process per host: the agent, which holds the host's firewall rules too.
        assert [len(_agents(lab, h)) for h in lab.hosts] == [1] * 4
        assert not any("distlaunch.host.guard" in host_cmdlines(lab, h) for h in lab.hosts)
        if shutil.which("nft") is not None:
            assert all(run_tables(h) for h in lab.hosts)
        subprocess.run(["ip", "-n", cut.netns, "link", "set", leg, "down"], check=True)
        cut_at = time.time()
        try:
            out, err = launcher.communicate(timeout=120)
            # The host's agent heard nothing for its heartbeat timeout: it killed its task.
            wait_for(lambda: not lab.processes(cut), "the cut host to be empty", 60)
        finally:
            subprocess.run(["ip", "-n", cut.netns, "link", "set", leg, "up"], check=True)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 1, err
    log = (run_dir / "logs" / "attempt-0" / "worker-2.log").read_text()
    assert f"lost the agent on {cut.name} (" in log, log
    assert "failed: worker-2" in err, err
    ended = [e for e in events(run_dir) if e.get("task") == "worker-2" and "exit" in e]
    # A figure, not an assertion (bench/ holds the timed checks): how soon the cut was named.
    print(f"link cut named after {ended[0]['time'] - cut_at:.1f} s")
    wait_for(lambda: not any(lab.processes(h) for h in lab.hosts), "every host to be empty", 60)
    # Nor are the run's firewall rules: each agent held its host's and removed them as it ended,
    # the cut host's on the launcher's silence.
    assert {h.name: run_tables(h) for h in lab.hosts} == {h.name: [] for h in lab.hosts}
