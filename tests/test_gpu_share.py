"""Each task's own GPUs out of its agent's Slurm step (distlaunch.host.gpu_share): the share's
arithmetic, and a real agent handing two tasks their shares of the step's CUDA_VISIBLE_DEVICES.
The same on the Slurm test cluster with GRES GPUs: tests/test_slurm_gpus.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distlaunch.host import channel as wire
from distlaunch.host import gpu_share

SHOW = (
    f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {gpu_share.GPU_LISTS!r}}}))"
)


@pytest.mark.quick
def test_positions_are_a_tasks_places_among_the_nodes_gpus() -> None:
    node = [(0, 1), (2, 3)]
    assert gpu_share.positions((0, 1), node) == [0, 1]
    assert gpu_share.positions((2, 3), node) == [2, 3]
    # Indices with gaps still count in order: the step holds as many GPUs as the node's tasks.
    assert gpu_share.positions((5,), [(1,), (5,)]) == [1]
    assert gpu_share.positions((), node) == []


@pytest.mark.quick
def test_a_share_cuts_every_gpu_list_of_the_step_alike() -> None:
    environ = {
        "CUDA_VISIBLE_DEVICES": "3,5,6,7",
        "GPU_DEVICE_ORDINAL": "3,5,6,7",
        "ROCR_VISIBLE_DEVICES": "0,1",  # not the step's list (another length): left alone
    }
    request = {"argv": ["x"], "env": {"A": "1"}, gpu_share.SHARE: [2, 3]}
    shared = gpu_share.with_share(request, environ)
    assert shared == {
        "argv": ["x"],
        "env": {"A": "1", "CUDA_VISIBLE_DEVICES": "6,7", "GPU_DEVICE_ORDINAL": "6,7"},
    }
    assert request[gpu_share.SHARE] == [2, 3]  # the caller's request is not changed
    plain = {"argv": ["x"], "env": {}}
    assert gpu_share.with_share(plain, environ) is plain
    # UUIDs, as a cgroup-less node may name them, are devices like any other.
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}
    assert gpu_share.with_share({gpu_share.SHARE: [1]}, uuids)["env"] == {
        "CUDA_VISIBLE_DEVICES": "GPU-b"
    }


@pytest.mark.quick
@pytest.mark.parametrize(
    ("share", "environ", "said"),
    [
        ([0, 2], {"CUDA_VISIBLE_DEVICES": "0,1"}, "the step holds 2"),
        ([0], {}, "the step holds 0"),
        ("0", {"CUDA_VISIBLE_DEVICES": "0"}, "not a list of positions"),
        ([-1], {"CUDA_VISIBLE_DEVICES": "0"}, "not a list of positions"),
    ],
)
def test_a_share_the_step_does_not_hold_is_refused(share, environ, said) -> None:
    with pytest.raises(gpu_share.NoShare, match=said) as caught:
        gpu_share.with_share({"env": {}, gpu_share.SHARE: share}, environ)
    assert isinstance(caught.value, OSError)


def _agent_frames(environ: dict[str, str], starts: list[dict]) -> dict[int, tuple[str, int]]:
    """Run a real agent with ``environ`` (a step's), start each request, and return every
    task's output and exit code by number."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "distlaunch.host.agent"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **environ},
    )
    assert proc.stdin is not None and proc.stdout is not None
    hello = json.dumps({"agent": wire.PROTOCOL, "heartbeat_s": 60}).encode() + b"\n"
    commands = [wire.command("start", i + 1, request=r) for i, r in enumerate(starts)]
    proc.stdin.write(hello + b"".join(commands))
    proc.stdin.flush()
    assert proc.stdout.read(len(wire.hello())) == wire.hello()
    outputs: dict[int, bytes] = {}
    ends: dict[int, int] = {}
    while len(ends) < len(starts):
        kind, number, length = proc.stdout.readline().split()
        payload = proc.stdout.read(int(length) + 1)[:-1]
        if kind == b"o":
            outputs[int(number)] = outputs.get(int(number), b"") + payload
        if kind == b"x":
            ends[int(number)] = int(payload)
    proc.stdin.close()
    assert proc.wait(timeout=60) == 1  # its channel ended
    return {n: (outputs.get(n, b"").decode(), code) for n, code in ends.items()}


@pytest.mark.quick
def test_an_agent_gives_each_task_its_own_gpus_of_its_step() -> None:
    step = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "GPU_DEVICE_ORDINAL": "4,5,6,7"}
    show = [sys.executable, "-c", SHOW]
    ended = _agent_frames(
        step,
        [
            {"argv": show, "env": {}, gpu_share.SHARE: [0, 1]},
            {"argv": show, "env": {}, gpu_share.SHARE: [2, 3]},
            {"argv": show, "env": {"CUDA_VISIBLE_DEVICES": ""}},  # a CPU task: as planned
            {"argv": show, "env": {}, gpu_share.SHARE: [4]},  # more than the step holds
        ],
    )
    seen = {n: json.loads(out) for n, (out, code) in ended.items() if code == 0}
    assert seen[1]["CUDA_VISIBLE_DEVICES"] == seen[1]["GPU_DEVICE_ORDINAL"] == "4,5"
    assert seen[2]["CUDA_VISIBLE_DEVICES"] == seen[2]["GPU_DEVICE_ORDINAL"] == "6,7"
    assert seen[3]["CUDA_VISIBLE_DEVICES"] == ""
    out, code = ended[4]
    assert code == 126 and "the step holds 4" in out, ended[4]
