"""The agent's firewall job (distlaunch.host.wall), run here as a local process: an install that
hangs is answered at its own deadline while the agent's loop goes on beating; where the rules
cannot be installed and protection is required, no task starts there; and the launcher's side
ends such an agent (a restarted one included), naming why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distlaunch.host import channel, timeouts
from distlaunch.launcher.transports import agent as hub
from distlaunch.launcher.transports.agent import wait_ended
from test_agent_fuzz import DEADLINE_S, HELLO, STAND_IN, F, _StandIns, _task

REQUEST = {"run_id": "w", "name": "w_1a2b", "ports": [4000], "allow": ["10.9.9.9"]}


def _agent(env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "distlaunch.host.agent"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdin is not None and proc.stdout is not None
    hello = {"agent": channel.PROTOCOL, "heartbeat_s": 60, "beat_s": 1}
    proc.stdin.write(json.dumps(hello).encode() + b"\n")
    proc.stdin.flush()
    assert proc.stdout.read(len(channel.hello())) == channel.hello()
    return proc


def _frames_until(
    proc: subprocess.Popen, kind: bytes, number: int
) -> list[tuple[bytes, int, bytes]]:
    assert proc.stdout is not None
    got = []
    while True:
        header = proc.stdout.readline()
        assert header, "the agent ended"
        k, n, size = header.split()
        got.append((k, int(n), proc.stdout.read(int(size) + 1)[:-1]))
        if (k, int(n)) == (kind, number):
            return got


def test_a_hanging_install_is_answered_at_its_deadline_while_the_agent_beats_on(tmp: Path) -> None:
    fake = tmp / "bin"
    fake.mkdir()
    (fake / "nft").write_text("#!/bin/sh\nexec sleep 600\n")
    (fake / "nft").chmod(0o755)
    proc = _agent({"PATH": f"{fake}:{os.environ['PATH']}"})
    try:
        assert proc.stdin is not None
        proc.stdin.write(channel.command("guard", request=REQUEST))
        proc.stdin.flush()
        frames = _frames_until(proc, b"g", 0)
        answer = json.loads(frames[-1][2])
        assert answer["protected"] is False
        # The tool's own limit, or the install's deadline: whichever comes first says so.
        assert answer["why"] in (
            f"nft did not answer within {timeouts.TOOL_TIMEOUT_S:g} s",
            f"the firewall was not installed within {timeouts.FIREWALL_S:g} s",
        ), answer
        # The loop went on while the install hung: its beats came before the answer.
        assert sum(k == b"h" for k, _, _ in frames) >= 2
    finally:
        proc.kill()
        proc.wait()


def test_where_protection_is_required_and_cannot_be_had_no_task_starts() -> None:
    """Root in a user namespace of its own: no CAP_NET_ADMIN over this network, so no rules."""
    proc = _agent(prefix=("unshare", "--user", "--map-root-user"))
    try:
        assert proc.stdin is not None
        proc.stdin.write(channel.command("guard", request={**REQUEST, "required": True}))
        request = {"argv": [sys.executable, "-c", "print('ran')"], "env": {}}
        proc.stdin.write(channel.command("start", 7, request=request))
        proc.stdin.flush()
        frames = _frames_until(proc, b"x", 7)
        answer = json.loads(next(p for k, _, p in frames if k == b"g"))
        assert answer["protected"] is False, answer
        output = b"".join(p for k, n, p in frames if (k, n) == (b"o", 7))
        assert b'network.protect is "required"' in output and b"ran" not in output
        assert frames[-1] == (b"x", 7, b"126")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.quick
def test_the_launcher_ends_an_agent_that_cannot_hold_required_rules(tmp: Path) -> None:
    (tmp / "standin.py").write_text(STAND_IN)
    unprotected = F(b"g", 0, json.dumps({"protected": False, "why": "no nft here"}).encode())
    spec = {"chunks": [(HELLO + unprotected).hex()], "stay": True, "pause": 0}
    (tmp / "n1.json").write_text(json.dumps(spec))
    with _StandIns(tmp) as transport:
        # As a restarted agent is made its host's guard again (`link_of`), then given a task.
        transport.guards["n1"] = {**REQUEST, "required": True}
        handle = transport.start(_task(tmp, "n1"))
        assert wait_ended([handle], DEADLINE_S) == []
    assert handle.code == hub.LOST_EXIT
    log = Path(handle.task.log_file).read_text()
    assert 'lost the agent on host n1: network.protect is "required"' in log, log
    assert "no nft here" in log
