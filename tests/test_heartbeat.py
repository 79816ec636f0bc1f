"""The launcher's one heartbeat (launcher/network/heartbeat.py), which the SSH and Slurm tasks'
helpers and the hosts' firewall guards all get: against the real remote helper, run here as a local
process."""

from __future__ import annotations

import json
import subprocess
import sys

from distlaunch.launcher.network.heartbeat import HEARTBEAT_S, Heartbeat, Pipe

HELPER = [sys.executable, "-m", "distlaunch.host.remote"]
# The helper's silence limit: past HEARTBEAT_S with room for a busy machine, and well below how
# long the task runs, so that without the heartbeat the helper would kill the task.
SILENCE_S = HEARTBEAT_S + 2
TASK_S = 2 * SILENCE_S


def _helper(request: dict) -> tuple[subprocess.Popen, Pipe]:
    proc = subprocess.Popen(
        HELPER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    return proc, Pipe(proc, json.dumps(request).encode() + b"\n")


def _output(proc: subprocess.Popen) -> bytes:
    """The task's output, once the helper has exited (its stdin is left as the test left it)."""
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(timeout=60)
    proc.stdout.close()
    return out


def test_the_heartbeat_keeps_a_helper_and_its_task_going_past_its_silence_limit() -> None:
    request = {"argv": ["sh", "-c", f"sleep {TASK_S}; echo done; exit 3"], "heartbeat_s": SILENCE_S}
    proc, pipe = _helper(request)
    heartbeat = Heartbeat("test-heartbeat")
    try:
        heartbeat.add(pipe)
        out = _output(proc)
    finally:
        heartbeat.close()
        pipe.close()
    # Killed for silence, the helper would relay 128+9 and the task would not finish.
    assert (proc.returncode, out) == (3, b"done\n")
    assert not pipe.open()


def test_a_closed_pipe_is_eof_to_the_helper_which_kills_its_task_at_once() -> None:
    proc, pipe = _helper({"argv": ["sleep", "600"], "heartbeat_s": SILENCE_S})
    pipe.send(b"\n")
    pipe.close()
    pipe.send(b"stop\n")  # after close: dropped, not written to a reused fd
    _output(proc)
    assert proc.returncode == 128 + 9
