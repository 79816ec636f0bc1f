"""The Slurm backend against a real Slurm cluster on this machine (tests/slurmcluster.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import only_run_dir, processes_of_run, run_record, wait_for
from slurmcluster import SlurmLab, unavailable_reason


@pytest.fixture(scope="module")
def lab():
    """A 2-node Slurm cluster for the module's tests; removed (daemons, namespaces, files) afterwards.

    Skipped only where slurmd cannot run at all; a cluster that fails to come up is a failure.
    """
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with SlurmLab(2) as cluster:
        yield cluster


def test_the_lab_runs_a_step_on_both_nodes(lab: SlurmLab) -> None:
    done = lab.run(["srun", "-N2", "-n2", "-l", "hostname"])
    assert done.returncode == 0, done.stderr
    assert sorted(line.split(": ", 1)[1] for line in done.stdout.splitlines()) == [
        n.name for n in lab.nodes
    ]


MNIST = {
    "module": "distlaunch.worker.examples.mnist_mlp",
    "args": ["--epochs", "1", "--steps-per-epoch", "5"],
}


def _spec(folder: Path, program: dict, tasks: dict, **fields) -> Path:
    spec = {
        "name": "slurm",
        "strategy": "multi_worker_mirrored",
        "backend": "slurm",
        "program": {**program, "python": sys.executable},
        "tasks": tasks,
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
        **fields,
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


def _launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "distlaunch.launcher", *args]


def _nothing_left(lab: SlurmLab, run_id: str) -> bool:
    """No job step and no process (but the Slurm daemons) on any node; no local srun of the run."""
    if lab.steps() or any(lab.processes(node) for node in lab.nodes):
        return False
    return not processes_of_run(run_id)


@pytest.mark.integration
def test_mwms_across_two_nodes_inside_salloc(lab: SlurmLab, tmp: Path) -> None:
    spec = _spec(tmp, MNIST, {"worker": {"count": 2}})
    result = lab.run(
        ["salloc", "--nodes=2", "--quiet", *_launcher("up", str(spec))],
        cwd=tmp,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(tmp / "runs")
    record = run_record(run_dir)
    cluster = record["plan"]["tasks"][0]["tf_config"]["cluster"]["worker"]
    # Spread over the nodes, named by hostname.
    assert [a.split(":")[0] for a in cluster] == [n.name for n in lab.nodes]
    losses = sorted(line for line in result.stdout.splitlines() if "final loss" in line)
    assert len(losses) == 2
    assert losses[0].startswith(f"worker-0@{lab.nodes[0].name} ") and losses[
        1
    ].startswith(f"worker-1@{lab.nodes[1].name} ")
    assert losses[0].split("final loss")[1] == losses[1].split("final loss")[1]
    assert list((run_dir / "checkpoints").iterdir())
    wait_for(
        lambda: _nothing_left(lab, record["run_id"]),
        "no step or process left",
        limit_s=30,
    )
