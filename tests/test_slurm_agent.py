"""One agent per Slurm node: a run's tasks on a node all run in one job step, never one each.

Runs on the Slurm test cluster (tests/slurmcluster.py) under `flock /tmp/dl-slurm.lock`; skips
with the reason where slurmd cannot run here.
"""

from __future__ import annotations

import pytest

from conftest import only_run_dir
from slurmcluster import SlurmLab
from test_slurm import _launcher, _spec, lab

__all__ = ["lab"]  # a fixture of test_slurm, used here

# A task that needs no TensorFlow: it listens on its TF_CONFIG port (the launcher sees it join)
# and says which job step it runs in.
STAND_IN = """
import json, os, socket, time
cfg = json.loads(os.environ["TF_CONFIG"])
me = cfg["task"]
port = int(cfg["cluster"][me["type"]][me["index"]].rsplit(":", 1)[1])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", port))
server.listen()
print("step", os.environ["SLURM_JOB_ID"] + "." + os.environ["SLURM_STEP_ID"], flush=True)
time.sleep(3)
"""


@pytest.mark.integration
def test_the_tasks_of_a_node_run_in_one_step(lab: SlurmLab, tmp) -> None:
    (tmp / "task.py").write_text(STAND_IN)
    # Every CPU of the lab's two nodes: two tasks on each.
    spec = _spec(tmp, {"script": "task.py"}, {"worker": {"count": 4}})
    result = lab.run(
        ["salloc", "--nodes=2", "--ntasks-per-node=2", "--quiet", *_launcher("up", str(spec))],
        cwd=tmp,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    logs = only_run_dir(tmp / "runs") / "logs" / "attempt-0"
    steps = {}
    for i in range(4):
        said = [
            x for x in (logs / f"worker-{i}.log").read_text().splitlines() if x.startswith("step ")
        ]
        steps[f"worker-{i}"] = said[0].split()[1]
    # Two nodes, two steps: each node's two tasks share theirs.
    assert len(set(steps.values())) == 2, steps
