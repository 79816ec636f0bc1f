"""One agent per Slurm node: a run's tasks on a node all run in one job step, never one each.

Runs on the Slurm test cluster (tests/slurmcluster.py) under `flock /tmp/dl-slurm.lock`; skips
with the reason where slurmd cannot run here.
"""

from __future__ import annotations

import subprocess

import pytest

from conftest import events, only_run_dir, run_record, wait_for, wait_for_run_dir
from slurmcluster import SlurmLab
from test_firewall import LISTENER, _rules_left
from test_slurm import _allocation, _launcher, _no_rules, _nothing_left, _spec, lab

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


def _one_agent_holding_the_rules(lab: SlurmLab, run_dir) -> None:
    """Each node has one step, its agent's, one distlaunch process beside its task's keeper (the
    agent), and the run's rules, which shut the outsider out of the node's task port."""
    from distlaunch.host import agent
    from distlaunch.launcher.transports.slurm import steps as slurm

    run_id = run_dir.name
    assert sorted(lab.step_names().values()) == sorted(
        slurm.agent_step_name(run_id, node.name) for node in lab.nodes
    )
    for node in lab.nodes:
        running = [" ".join(p.cmdline()) for p in lab.processes(node)]
        keepers = [c for c in running if c.startswith("distlaunch.host.remote: keeper of task ")]
        tasks = [c for c in running if c.endswith("listener.py")]
        assert len(keepers) == len(tasks) == 1, running  # the node's one task's
        others = [c for c in running if c not in keepers + tasks]
        assert len(others) == 1 and agent.__file__ in others[0], running
        assert len(_rules_left(node.netns)) == 1
    by_name = {n.name: n for n in lab.nodes}
    for task in run_record(run_dir)["plan"]["tasks"]:
        home = by_name[task["host_name"]]
        assert not lab.connects(lab.outsider, home.address, task["port"])
        assert lab.connects(home, home.address, task["port"])


@pytest.mark.integration
def test_a_node_runs_one_distlaunch_process_its_agent_holding_the_rules_until_a_kill_9(
    lab: SlurmLab, tmp
) -> None:
    """The node's agent is its firewall guard: no guard step, no probe gone on as one, in every
    attempt (a gang restart's new agents hold the rules again). `kill -9` of the launcher: its
    sruns pass the EOF on, the agents kill their tasks and remove their rules, and nothing of
    the run is left."""
    (tmp / "listener.py").write_text(LISTENER)
    spec = _spec(tmp, {"script": "listener.py"}, {"worker": {"count": 2}})
    with _allocation(lab, tmp, "--nodes=2") as env:
        with open(tmp / "out.txt", "w") as out:
            launcher = subprocess.Popen(
                lab.command(_launcher("up", str(spec))), cwd=tmp, env=env, stdout=out, stderr=out
            )
        try:
            run_dir = wait_for_run_dir(tmp / "runs", launcher)
            for joined in (2, 4):
                wait_for(
                    lambda joined=joined: (
                        sum(e["event"] == "joined" for e in events(run_dir)) == joined
                    ),
                    f"{joined} joins",
                    launcher=launcher,
                )
                _one_agent_holding_the_rules(lab, run_dir)
                if joined == 2:  # a gang restart: the next attempt's agents
                    restart = lab.run(
                        _launcher("restart", str(run_dir), "worker-1"), cwd=tmp, env=env
                    )
                    assert restart.returncode == 0, restart.stderr
            launcher.kill()
            launcher.wait()
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        wait_for(lambda: _no_rules(lab), "every run table to leave every node")
        wait_for(lambda: _nothing_left(lab, run_dir.name), "no step or process left", limit_s=60)
        assert lab.jobs() == [env["SLURM_JOB_ID"]]  # the allocation itself lives on
