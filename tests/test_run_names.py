"""Runs that share an id, or ids that differ only in characters a name cannot take, stay apart.

A run's firewall rules on a host (nftables table, iptables chain) and its Kubernetes objects and
labels are named per run, so one run never replaces, deletes or admits another's: ``nightly`` in
two shared dirs, ``run-1`` and ``run.1``, ``exp.1``, ``Exp-1`` and ``exp_1``. Real runs on the SSH
test hosts of tests/sshhosts.py (under ``flock /tmp/dl-ssh.lock``): after the second of two such
runs ends, the outsider still cannot reach the first run's ports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import sshhosts
from conftest import distlaunch, run_record, wait_for, write_spec
from distlaunch.host import guard
from distlaunch.launcher.export import k8s
from distlaunch.launcher.network import firewall
from distlaunch.launcher.plan.plan import Plan, TaskPlan
from distlaunch.launcher.spec.model import load_spec
from test_firewall import (
    LISTENER,
    _rules_left,
    _shut_to_outsiders_open_to_peers,
    fw_lab,
    netns_name,
)
from test_ssh import _script, _spec

__all__ = ["fw_lab", "netns_name"]  # fixtures of test_firewall, used here


def _plan(run_id: str, run_dir: str) -> Plan:
    task = TaskPlan(
        "worker", 0, "10.0.0.1", 4000, (), {}, "", {}, (), "", host_name="node1", transport="ssh"
    )
    return Plan(run_id, run_dir, "multi_worker_mirrored", 0, (task,))


@pytest.mark.quick
def test_runs_that_share_an_id_or_its_spelling_get_rules_of_their_own() -> None:
    names = {
        firewall.plan_rules(_plan(run_id, run_dir))["node1"].name
        for run_id, run_dir in (
            ("nightly", "/home/a/runs/nightly"),
            ("nightly", "/home/b/runs/nightly"),
            ("run-1", "/runs/run-1"),
            ("run.1", "/runs/run.1"),
            ("run_1", "/runs/run_1"),
        )
    }
    assert len(names) == 5, names
    tables = {guard.table_name(n) for n in names}
    chains = {guard.chain_name(n) for n in names}
    assert len(tables) == len(chains) == 5
    assert all(len(c) <= 28 for c in chains)  # iptables' limit
    # A resumed run (the same run dir) replaces its own table, and two host names of one
    # machine do not share one.
    again = firewall.plan_rules(_plan("nightly", "/home/a/runs/nightly"))["node1"].name
    assert again in names
    assert firewall.rules_name("r", "/runs/r", "node1") != firewall.rules_name(
        "r", "/runs/r", "node1-alias"
    )
    longest = firewall.rules_name("a" * 128, "/runs/" + "a" * 128, "node1")
    assert guard.NAME.fullmatch(longest)


def _start_guard(netns: str, name: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "distlaunch.host.guard"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    request = {"run_id": "r", "name": name, "ports": [port], "allow": ["10.9.9.9"]}
    proc.stdin.write(json.dumps(request).encode() + b"\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["protected"]
    return proc


def _end(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()


def test_a_guard_ends_without_touching_the_table_a_later_guard_put_in_its_place(
    netns_name: str,
) -> None:
    """A resumed run's guard replaces what the earlier guard of its run and host left; the earlier
    guard, ending late, must not delete its successor's table (it deletes by its own handle)."""
    first = _start_guard(netns_name, "r_1a2b", 4000)
    second = _start_guard(netns_name, "r_1a2b", 4001)
    try:
        _end(first)
        left = _rules_left(netns_name)
        assert len(left) == 1 and guard.table_name("r_1a2b") in left[0], left
    finally:
        _end(second)
    assert _rules_left(netns_name) == []


@pytest.mark.quick
def test_kubernetes_names_and_labels_of_look_alike_run_ids_differ(tmp: Path) -> None:
    (tmp / "task.py").write_text("print('hi')\n")
    loaded = load_spec(write_spec(tmp))
    made = {
        run_id: k8s.manifests(loaded, run_id, "img", None, False)
        for run_id in ("exp.1", "Exp-1", "exp_1", "exp-1")
    }
    names = {m.name for m in made.values()}
    assert len(names) == 4, names
    for run_id, m in made.items():
        service, policy = m.objects[0], m.objects[1]
        assert policy["kind"] == "NetworkPolicy"
        admitted = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        assert admitted == policy["spec"]["podSelector"]["matchLabels"] == {k8s.RUN_LABEL: m.name}
        assert service["metadata"]["name"] == policy["metadata"]["name"] == m.name
        for job in m.objects[2:]:
            assert job["metadata"]["name"].startswith(f"{m.name}-"), run_id
            labels = job["spec"]["template"]["metadata"]["labels"]
            assert labels[k8s.RUN_LABEL] == m.name
    assert made["exp-1"].name == "exp-1"  # a run id that is a DNS label already is kept


# ---- real runs on the SSH test hosts -------------------------------------------------------


def _up(spec: Path, run_id: str) -> subprocess.Popen:
    folder = spec.parent
    with (
        open(folder / f"{run_id}.out", "w") as out,
        open(folder / f"{run_id}.err", "w") as err,
    ):
        return subprocess.Popen(
            [sys.executable, "-m", "distlaunch.launcher", "up", "--run-id", run_id, str(spec)],
            cwd=folder,
            stdout=out,
            stderr=err,
        )


def _holding(run_dir: Path, launcher: subprocess.Popen, count: int) -> list[tuple]:
    """Wait until the run's ``count`` tasks hold; return them as (name, host, address, port)."""

    def held() -> bool:
        logs = list((run_dir / "logs" / "attempt-0").glob("*.log"))
        return len(logs) == count and all("holding" in log.read_text() for log in logs)

    wait_for(lambda: (run_dir / "run.json").is_file(), f"{run_dir}/run.json", launcher=launcher)
    wait_for(held, f"the tasks of {run_dir.name} to hold", launcher=launcher)
    return [
        (t["name"], t["host_name"], t["host"], t["port"])
        for t in run_record(run_dir)["plan"]["tasks"]
    ]


def _release(launcher: subprocess.Popen, run_dir: Path) -> None:
    (run_dir / "release").write_text("")
    assert launcher.wait(timeout=300) == 0, (
        run_dir.parent.parent / f"{run_dir.name}.err"
    ).read_text()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("first", "second"),
    [(("a", "nightly"), ("b", "nightly")), (("a", "run-1"), ("a", "run.1"))],
    ids=["one-id-two-shared-dirs", "run-1-and-run.1"],
)
def test_the_end_of_one_run_leaves_the_other_runs_ports_shut(
    fw_lab: sshhosts.HostLab, tmp: Path, first: tuple[str, str], second: tuple[str, str]
) -> None:
    tasks = {"worker": [{"host": "node1"}, {"host": "node2"}]}
    runs, held = [], []
    try:
        for folder_name, run_id in (first, second):
            folder = tmp / folder_name
            folder.mkdir(exist_ok=True)
            spec = _spec(folder, fw_lab, _script(folder, LISTENER), tasks)
            launcher = _up(spec, run_id)
            run_dir = folder / "runs" / run_id
            runs.append((launcher, run_dir))
            held.append(_holding(run_dir, launcher, 2))
        (launcher_a, run_a), (launcher_b, run_b) = runs
        names = [
            {h.get("name") for h in run_record(r)["network"]["hosts"].values()} for _, r in runs
        ]
        assert not names[0] & names[1], names
        _release(launcher_b, run_b)
        # The first run's tables are all that is left, and its ports still shut the outsider out.
        for host in fw_lab.hosts:
            left = _rules_left(host.netns)
            assert len(left) == 1 and any(n in left[0] for n in names[0]), (host.name, left)
        _shut_to_outsiders_open_to_peers(fw_lab, held[0])
        status = distlaunch("status", str(run_a))
        assert status.stdout.count("protected (ports") == 2, status.stdout
        _release(launcher_a, run_a)
    finally:
        for launcher, run_dir in runs:
            if launcher.poll() is None:
                (run_dir / "release").write_text("")
                launcher.wait(timeout=300)
    assert all(_rules_left(h.netns) == [] for h in fw_lab.hosts)
