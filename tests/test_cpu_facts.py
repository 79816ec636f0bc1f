"""`cpus: auto` on cores with hyperthread siblings and under a cgroup's CPU quota
(launcher/plan/cpu_fit.py, launcher/host/cpu_facts.py).

The split is pure and tested over scripted topologies (this 2-CPU machine has no hyperthreads);
the readers read scripted /sys, /proc and cgroup trees, then this machine's own, and a real cgroup
v1 with a CPU quota made here (as root) for a real `distlaunch plan`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import write_spec
from distlaunch.host import cpu_facts
from distlaunch.launcher.plan.cpu_fit import Ask, Topology, split

# 4 cores of 2 threads, numbered as Linux numbers most x86 machines: siblings 4 apart.
APART = Topology(tuple(range(8)), siblings=((0, 4), (1, 5), (2, 6), (3, 7)))
# The same, numbered as some machines (and most ARM SMT) do: siblings side by side.
ADJACENT = Topology(tuple(range(8)), siblings=((0, 1), (2, 3), (4, 5), (6, 7)))


def _ids(asks: list, topo: Topology) -> list[tuple[int, ...]]:
    found = split("m", asks, topo)
    return [found[a.key].ids for a in asks]


def _autos(n: int) -> list[Ask]:
    return [Ask(("worker", i), "auto") for i in range(n)]


@pytest.mark.quick
def test_auto_tasks_get_physical_cores_and_siblings_only_when_they_outnumber_the_cores() -> None:
    assert _ids(_autos(2), APART) == [(0, 1), (2, 3)]
    assert _ids(_autos(2), ADJACENT) == [(0, 2), (4, 6)]  # never both threads of one core
    assert _ids(_autos(1), ADJACENT) == [(0, 2, 4, 6)]  # alone: every core, no sibling
    assert _ids(_autos(4), ADJACENT) == [(0,), (2,), (4,), (6,)]
    # More tasks than cores: siblings too, last, and every CPU once.
    found = _ids(_autos(6), ADJACENT)
    assert sorted(c for ids in found for c in ids) == list(range(8))
    # A count takes a core of its own first as well; the auto task the other cores.
    counted = [Ask(("ps", 0), 1), *_autos(1)]
    assert _ids(counted, ADJACENT) == [(6,), (0, 2, 4)]
    # Without siblings known: as before, every CPU counts.
    assert _ids(_autos(2), Topology(tuple(range(8)))) == [(0, 1, 2, 3), (4, 5, 6, 7)]


@pytest.mark.quick
def test_auto_tasks_take_no_more_cpus_than_the_quota_pays_for() -> None:
    limited = Topology(tuple(range(8)), quota=2.5)
    assert _ids(_autos(1), limited) == [(0, 1)]
    assert _ids(_autos(2), limited) == [(0,), (1,)]
    # At least one CPU each, of its own, even past the quota.
    assert _ids(_autos(4), limited) == [(0,), (1,), (2,), (3,)]
    # What a count uses is paid from the quota first.
    assert _ids([Ask(("ps", 0), 1), *_autos(1)], limited) == [(0,), (1,)]
    # Siblings and a quota together: the fewer of the two.
    both = Topology(APART.cpus, siblings=APART.siblings, quota=3)
    assert _ids(_autos(1), both) == [(0, 1, 2)]
    # The topology travels as the probe's JSON.
    data = {"cpus": [0, 1], "siblings": [[0, 1]], "quota": 1.5}
    assert Topology.from_json(data) == Topology((0, 1), siblings=((0, 1),), quota=1.5)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.mark.quick
def test_the_readers_over_scripted_sysfs_and_cgroup_trees(tmp: Path) -> None:
    cpus = tmp / "sys" / "devices" / "system" / "cpu"
    for cpu, siblings in enumerate(["0,4", "1,5", "2,6", "3,7", "0,4", "1,5", "2,6", "3,7"]):
        _write(cpus / f"cpu{cpu}" / "topology" / "thread_siblings_list", siblings)
    _write(cpus / "cpu8" / "topology" / "thread_siblings_list", "8")  # a core of one thread
    _write(cpus / "online", "0-8")  # not a CPU folder
    assert cpu_facts.siblings(str(tmp / "sys")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cpu_facts.siblings(str(tmp / "nothing")) == []
    # cgroup v2: the tightest of the process's cgroup and those above it.
    proc, v2 = tmp / "proc", tmp / "v2"
    _write(proc / "self" / "cgroup", "0::/machine/job/step")
    _write(v2 / "machine" / "cpu.max", "400000 100000")
    _write(v2 / "machine" / "job" / "cpu.max", "150000 100000")
    _write(v2 / "machine" / "job" / "step" / "cpu.max", "max 100000")
    assert cpu_facts.quota(str(proc), str(v2)) == 1.5
    (v2 / "machine" / "job" / "cpu.max").write_text("max 100000\n")
    assert cpu_facts.quota(str(proc), str(v2)) == 4.0
    # cgroup v1 (a hybrid machine: v2 at unified/ without the cpu controller).
    v1 = tmp / "v1"
    _write(proc / "self" / "cgroup", "4:cpu,cpuacct:/docker/abc\n0::/docker/abc")
    _write(v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "250000")
    _write(v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000")
    _write(v1 / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1")
    _write(v1 / "cpu,cpuacct" / "cpu.cfs_period_us", "100000")
    (v1 / "unified").mkdir()
    assert cpu_facts.quota(str(proc), str(v1)) == 2.5
    _write(v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "-1")
    assert cpu_facts.quota(str(proc), str(v1)) is None
    assert cpu_facts.quota(str(tmp / "noproc"), str(v1)) is None


@pytest.mark.quick
def test_this_machines_reading_agrees_with_lscpu() -> None:
    if shutil.which("lscpu") is None:
        pytest.skip("lscpu is not installed (util-linux)")
    listed = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True)
    cores: dict[tuple[str, str], list[int]] = {}
    for line in listed.stdout.splitlines():
        if line and not line.startswith("#"):
            cpu, core, socket = line.split(",")
            cores.setdefault((socket, core), []).append(int(cpu))
    assert cpu_facts.siblings() == sorted(g for g in cores.values() if len(g) > 1)


CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.fixture
def cpu_cgroup():
    """A cgroup v1 of this machine's cpu controller, removed afterwards; skips where none can
    be made (not root, no v1 cpu controller)."""
    if os.geteuid() != 0 or not (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
        pytest.skip("needs root and a cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    folder = CGROUP_V1_CPU / f"distlaunch-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here: {exc}")
    try:
        yield folder
    finally:
        folder.rmdir()  # empty again: its processes have exited


def _in_cgroup(folder: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``argv`` as a process of the cgroup ``folder`` (it joins before it execs)."""
    join = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    return subprocess.run(
        ["sh", "-c", join, str(folder), *argv], cwd=cwd, capture_output=True, text=True
    )


def test_a_real_cgroup_quota_is_read_and_bounds_a_real_plan(cpu_cgroup: Path, tmp: Path) -> None:
    (cpu_cgroup / "cpu.cfs_period_us").write_text("100000")
    (cpu_cgroup / "cpu.cfs_quota_us").write_text("100000")  # one CPU's worth
    code = "from distlaunch.host import cpu_facts; print(cpu_facts.quota())"
    read = _in_cgroup(cpu_cgroup, [sys.executable, "-c", code], tmp)
    assert read.stdout.strip() == "1.0", read.stderr
    (tmp / "task.py").write_text("")
    spec = write_spec(tmp, tasks={"worker": {"count": 1}}, isolation="off")
    plan = [sys.executable, "-m", "distlaunch.launcher", "plan", "--json", str(spec)]
    inside = _in_cgroup(cpu_cgroup, plan, tmp)
    outside = subprocess.run(plan, cwd=tmp, capture_output=True, text=True)
    assert inside.returncode == outside.returncode == 0, inside.stderr + outside.stderr
    counts = [json.loads(p.stdout)["tasks"][0]["cpus"]["count"] for p in (inside, outside)]
    mine = len(os.sched_getaffinity(0))
    assert counts == [1, mine]  # the quota's one CPU inside; every CPU outside (no quota here)
