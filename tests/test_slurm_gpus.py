"""GPUs under Slurm: the tasks of one node each get their own of the GPUs the node's agent step
holds (launcher/host/gpu_share.py), on a real Slurm cluster (tests/slurmcluster.py) whose nodes
declare 4 GPUs as GRES over stand-in device files: Slurm allocates them and names them in the
step's CUDA_VISIBLE_DEVICES exactly as on a GPU node; nothing here opens a device.

Runs under `flock /tmp/dl-slurm.lock`; skips, with the reason, where slurmd cannot run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import only_run_dir, run_record
from slurmcluster import SlurmLab, unavailable_reason
from test_slurm import _launcher, _spec

GPUS_PER_NODE = 4
# Each task writes the GPU variables it was started with to RUN/gpus-ROLE-INDEX.json.
SEEN = """
import json, os
seen = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")}
name = "gpus-%s-%s.json" % (os.environ["DISTLAUNCH_ROLE"], os.environ["DISTLAUNCH_INDEX"])
with open(os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], name), "w") as f:
    json.dump(seen, f)
"""


@pytest.fixture(scope="module")
def gpu_lab():
    """A one-node Slurm cluster whose node declares GPUS_PER_NODE GPUs."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with SlurmLab(1, gpus_per_node=GPUS_PER_NODE) as cluster:
        yield cluster


@pytest.mark.integration
def test_two_tasks_of_a_node_each_see_their_own_two_gpus(gpu_lab: SlurmLab, tmp: Path) -> None:
    (tmp / "task.py").write_text(SEEN)
    spec = _spec(tmp, {"script": "task.py"}, {"worker": [{"gpus": 2}, {"gpus": 2}]})
    salloc = ["salloc", "--nodes=1", "--ntasks=2", f"--gpus={GPUS_PER_NODE}", "--quiet"]
    result = gpu_lab.run([*salloc, *_launcher("up", str(spec))], cwd=tmp, timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(tmp / "runs")
    tasks = run_record(run_dir)["plan"]["tasks"]
    assert len({t["host_name"] for t in tasks}) == 1  # one node, one agent step for both
    seen = [json.loads((run_dir / f"gpus-worker-{i}.json").read_text()) for i in (0, 1)]
    devices = [s["CUDA_VISIBLE_DEVICES"].split(",") for s in seen]
    assert all(len(d) == 2 for d in devices), seen
    assert not set(devices[0]) & set(devices[1]), seen  # two different devices each
    # Slurm's own list of the step's four GPUs, split between them, in its order.
    assert devices[0] + devices[1] == [str(i) for i in range(GPUS_PER_NODE)], seen
    assert all(s["GPU_DEVICE_ORDINAL"] == s["CUDA_VISIBLE_DEVICES"] for s in seen), seen
