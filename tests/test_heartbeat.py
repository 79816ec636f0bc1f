"""The heartbeats of a host's agent link, as the agent (distlaunch.host.agent) lives them, run
here as a local process: the launcher's beats keep it going past its silence limit; without them
it ends its tasks and exits on its own; and it does so even when the launcher reads nothing of
what it writes (a link that stalls without a reset: its writes never block its loop).

(launcher/network/heartbeat.py's Pipe and Heartbeat, which only these tests used, are gone: the
agents' links beat from the launcher's hub, launcher/transports/agent.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from conftest import wait_for
from distlaunch.host import channel

AGENT = [sys.executable, "-m", "distlaunch.host.agent"]
# The agent's silence limit here: past a beat's period with room for a busy machine, and below
# how long the task runs, so that without the beats the agent would end the task.
SILENCE_S = 3.0
TASK_S = 3 * SILENCE_S


def _agent(stdout: int | None = subprocess.PIPE) -> subprocess.Popen:
    proc = subprocess.Popen(AGENT, stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None
    hello = {"agent": channel.PROTOCOL, "heartbeat_s": SILENCE_S}
    proc.stdin.write(json.dumps(hello).encode() + b"\n")
    proc.stdin.flush()
    return proc


def _start(proc: subprocess.Popen, code: str) -> None:
    assert proc.stdin is not None
    request = {"argv": [sys.executable, "-c", code], "env": {}}
    proc.stdin.write(channel.command("start", 1, request=request))
    proc.stdin.flush()


def _frames(proc: subprocess.Popen) -> list[tuple[bytes, int, bytes]]:
    """Every frame the agent sent until it exited."""
    assert proc.stdout is not None
    data = proc.stdout.read()
    proc.wait(timeout=60)
    assert data.startswith(channel.hello())
    data, frames = data[len(channel.hello()) :], []
    while data:
        header, _, data = data.partition(b"\n")
        kind, number, size = header.split()
        frames.append((kind, int(number), data[: int(size)]))
        data = data[int(size) + 1 :]
    return frames


def test_the_launchers_beats_keep_an_agent_and_its_task_going_past_its_silence_limit() -> None:
    proc = _agent()
    _start(proc, f"import time, sys; time.sleep({TASK_S}); print('done'); sys.exit(3)")
    stop = threading.Event()

    def beat() -> None:
        assert proc.stdin is not None
        while not stop.wait(SILENCE_S / 3):
            proc.stdin.write(b"\n")
            proc.stdin.flush()
        proc.stdin.close()

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        ends = []
        assert proc.stdout is not None
        while not ends:  # up to the task's end; then the test closes the channel
            header = proc.stdout.readline()
            if header.startswith(b"x 1 "):
                ends.append(proc.stdout.readline().strip())
    finally:
        stop.set()
        beater.join()
    # Ended for silence, the agent would have killed the task: no "done", 128+9.
    assert ends == [b"3"]
    assert proc.wait(timeout=60) == 1


@pytest.mark.quick
def test_a_silent_launcher_ends_the_agent_and_its_task() -> None:
    proc = _agent()
    _start(proc, "import os, time; print(os.getpid(), flush=True); time.sleep(600)")
    frames = _frames(proc)  # the agent exits on its own: no EOF, no beat
    assert proc.returncode == 1
    pid = next(int(p) for k, _, p in frames if k == b"o")
    wait_for(lambda: not psutil.pid_exists(pid), "the task to be gone", 30)


@pytest.mark.quick
def test_an_agent_whose_launcher_reads_nothing_still_ends_on_its_silence(tmp: Path) -> None:
    """A link that stalls without a reset: the agent's stdout fills (nobody reads it) while its
    task prints on; its loop must still see the launcher's silence, end the task and exit."""
    read_end, write_end = os.pipe()  # never read: the agent's writes find it full
    try:
        proc = _agent(stdout=write_end)
        os.close(write_end)
        _start(proc, "import os\nprint(os.getpid(), flush=True)\nwhile True: print('x' * 4096)\n")
        assert proc.wait(timeout=120) == 1, "the agent blocked on its full channel"
        wait_for(
            lambda: (
                not [
                    p
                    for p in psutil.process_iter(["cmdline"])
                    if "while True: print('x' * 4096)" in " ".join(p.info["cmdline"] or [])
                ]
            ),
            "the task to be gone",
            30,
        )
    finally:
        os.close(read_end)
