"""The Slurm backend against a real Slurm cluster on this machine (tests/slurmcluster.py)."""

from __future__ import annotations

import pytest
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
