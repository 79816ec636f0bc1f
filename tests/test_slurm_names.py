"""`distlaunch down RUN` under Slurm ends run RUN's steps and rules, and no other run's.

Against the real Slurm cluster of tests/slurmcluster.py (under ``flock /tmp/dl-slurm.lock``): runs
``ab`` and ``ab.x`` in one allocation, whose step names begin alike (``distlaunch.ab.``); `down ab`
leaves every step, rule and process of ``ab.x`` as it was.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import events, run_record, wait_for
from slurmcluster import SlurmLab
from test_firewall import _rules_left
from test_slurm import SERVER, _allocation, _launcher, _no_rules, _spec, lab

__all__ = ["lab"]  # a fixture of test_slurm, used here


def _steps_named(lab: SlurmLab, run_id: str) -> dict[str, str]:
    """The live steps of run ``run_id`` (``distlaunch.<run id>.<task or agent-node>``)."""
    head = f"distlaunch.{run_id}."
    return {
        i: name
        for i, name in lab.step_names().items()
        if name.startswith(head) and "." not in name[len(head) :].removeprefix("guard.")
    }


@pytest.mark.integration
def test_down_of_a_run_leaves_a_run_whose_id_begins_like_it_running(
    lab: SlurmLab, tmp: Path
) -> None:
    (tmp / "server.py").write_text(SERVER)
    spec = _spec(tmp, {"script": "server.py"}, {"worker": {"count": 2}})
    with _allocation(lab, tmp, "--nodes=2", "--ntasks-per-node=2") as env:
        launchers = {}
        try:
            for run_id in ("ab", "ab.x"):
                with open(tmp / f"{run_id}.out", "w") as out:
                    launchers[run_id] = subprocess.Popen(
                        lab.command(_launcher("up", "--run-id", run_id, str(spec))),
                        cwd=tmp,
                        env=env,
                        stdout=out,
                        stderr=out,
                    )
            for run_id, launcher in launchers.items():
                run_dir = tmp / "runs" / run_id
                wait_for(
                    lambda run_dir=run_dir: (
                        (run_dir / "run.json").is_file()
                        and sum(e["event"] == "joined" for e in events(run_dir)) == 2
                    ),
                    f"both tasks of {run_id} to join",
                    launcher=launcher,
                )
            other = _steps_named(lab, "ab.x")
            assert len(other) == 2, lab.step_names()  # two agents, which are the guards
            tables = {node.name: _rules_left(node.netns) for node in lab.nodes}
            assert all(len(t) == 2 for t in tables.values()), tables  # one per run and node

            down = lab.run(_launcher("down", str(tmp / "runs" / "ab")), cwd=tmp, env=env)
            assert down.returncode == 0, down.stderr
            launchers["ab"].wait(timeout=60)

            # ab.x runs on: its steps, its launcher, its tasks joined, its rules on every node.
            assert _steps_named(lab, "ab.x") == other, lab.step_names()
            assert launchers["ab.x"].poll() is None, (tmp / "ab.x.out").read_text()
            names = {
                h["name"] for h in run_record(tmp / "runs" / "ab.x")["network"]["hosts"].values()
            }
            for node in lab.nodes:
                left = _rules_left(node.netns)
                assert len(left) == 1 and any(n in left[0] for n in names), (node.name, left)
            assert run_record(tmp / "runs" / "ab.x")["state"] == "running"

            down = lab.run(_launcher("down", str(tmp / "runs" / "ab.x")), cwd=tmp, env=env)
            assert down.returncode == 0, down.stderr
            launchers["ab.x"].wait(timeout=60)
            assert _no_rules(lab)
            wait_for(lambda: not lab.steps(), "no step left", limit_s=60)
        finally:
            for launcher in launchers.values():
                if launcher.poll() is None:
                    launcher.kill()
                    launcher.wait()
