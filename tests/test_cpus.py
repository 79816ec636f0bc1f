"""CPU placement: tasks that share a machine get CPUs of their own (launcher/plan/cpu_fit.py).

The split is a pure function, tested over scripted topologies (NUMA nodes, GPUs on nodes) that
this 2-CPU machine does not have; the sysfs readers read a scripted /sys. Then real TensorFlow
processes: each local task's affinity mask and thread settings are what `plan --json` says, a
user's own TF_NUM_INTRAOP_THREADS is kept, and a warm standby (which imports TensorFlow) is pinned
like its task; a PSS cluster of one-CPU TensorFlow tasks trains. Bad
`cpus` are one line, exit 2, nothing started. (SSH hosts: tests/test_ssh.py; Slurm nodes:
tests/test_slurm.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest
import standins

from conftest import (
    distlaunch,
    only_run_dir,
    run_record,
    wait_for,
    wait_for_run_dir,
    write_spec,
)
from distlaunch.launcher.plan.cpu_fit import (
    Ask,
    CpuHow,
    CpuMisfit,
    TaskCpus,
    Topology,
    cpulist,
    split,
)
from distlaunch.launcher.transports.local.cpus import seen_through
from distlaunch.worker import topology

# What this machine gives a run (a sandbox may give fewer CPUs than it has).
HERE = sorted(os.sched_getaffinity(0))
TWO_NODES = Topology(tuple(range(8)), ((0, 1, 2, 3), (4, 5, 6, 7)))


def _w(i: int, want, gpus=()) -> Ask:
    return Ask(("worker", i), want, tuple(gpus))


def _ids(found: dict) -> list[tuple[int, ...]]:
    return [found[k].ids for k in sorted(found)]


@pytest.mark.quick
def test_auto_tasks_split_the_machine_and_a_task_alone_keeps_it_all() -> None:
    two = Topology((0, 1))
    assert _ids(split("m", [_w(0, "auto"), _w(1, "auto")], two)) == [(0,), (1,)]
    assert split("m", [_w(0, "auto")], two)[("worker", 0)] == TaskCpus(CpuHow.AUTO, (0, 1), 2)
    # Uneven: sizes differ by at most one, and no CPU is given twice.
    found = _ids(split("m", [_w(i, "auto") for i in range(3)], Topology(tuple(range(8)))))
    assert sorted(map(len, found)) == [2, 3, 3]
    assert sorted(c for ids in found for c in ids) == list(range(8))


@pytest.mark.quick
def test_each_task_on_one_numa_node_and_a_gpu_task_on_its_gpus_node() -> None:
    found = _ids(split("m", [_w(i, "auto") for i in range(2)], TWO_NODES))
    assert found == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # GPUs 0 and 1 hang off node 1, GPUs 2 and 3 off node 0 (as /sys/bus/pci says).
    gpus = Topology(TWO_NODES.cpus, TWO_NODES.nodes, (1, 1, 0, 0))
    found = _ids(split("m", [_w(i, "auto", [i]) for i in range(4)], gpus))
    assert [set(ids) <= {4, 5, 6, 7} for ids in found] == [True, True, False, False]
    assert [len(ids) for ids in found] == [2, 2, 2, 2]
    # A count that fits no single node spans both; a small one stays on one.
    found = _ids(split("m", [_w(0, 6), _w(1, 2)], TWO_NODES))
    assert len(found[0]) == 6 and {TWO_NODES.node_of(c) for c in found[1]} in ({0}, {1})


@pytest.mark.quick
def test_lists_are_kept_counts_take_the_rest_and_all_is_not_pinned() -> None:
    found = split(
        "m", [_w(0, (0, 1)), _w(1, (1, 2)), _w(2, 2), _w(3, "auto"), _w(4, "all")], TWO_NODES
    )
    assert found[("worker", 0)] == TaskCpus(CpuHow.LISTED, (0, 1), 2)
    assert found[("worker", 1)].ids == (1, 2)  # the user listed CPU 1 twice: so be it
    counted, auto = found[("worker", 2)].ids, found[("worker", 3)].ids
    assert len(counted) == 2 and not set(counted) & {0, 1, 2} and len(auto) == 3
    assert not set(auto) & set(counted) and not set(auto) & {0, 1, 2}
    assert found[("worker", 4)] == TaskCpus(CpuHow.ALL) and not found[("worker", 4)].pinned


@pytest.mark.quick
def test_more_auto_tasks_than_cpus_share_them_and_slurm_gets_counts_only() -> None:
    found = split("m", [_w(i, "auto") for i in range(4)], Topology((0, 1)))
    assert {(c.ids, c.count, c.shared) for c in found.values()} == {((0, 1), 2, True)}
    slurm = Topology((0, 1, 2, 3), picks_ids=True)
    found = split("n", [_w(0, "auto"), _w(1, "auto"), _w(2, 1)], slurm)
    assert [(c.ids, c.count) for c in map(found.get, sorted(found))] == [((), 2), ((), 1), ((), 1)]
    # An SSH host before its probe: lists as written, the rest left to `up`.
    unknown = split("h", [_w(0, (5,)), _w(1, 3), _w(2, "auto")], None)
    assert [(c.how, c.ids, c.count) for c in map(unknown.get, sorted(unknown))] == [
        (CpuHow.LISTED, (5,), 1),
        (CpuHow.COUNT, (), 3),
        (CpuHow.AUTO, (), 0),
    ]


@pytest.mark.quick
@pytest.mark.parametrize(
    ("asks", "says"),
    [
        ([_w(0, (9,))], "gives worker:0 CPU 9, but m gives the run CPUs 0-3"),
        ([_w(0, 5)], "asks for 5 CPUs for worker:0, but m gives the run 4 CPUs"),
        ([_w(0, 3), _w(1, 2)], "leaves worker:1 no CPU of its own: m gives the run 4 CPUs"),
        ([_w(0, (0, 1, 2, 3)), _w(1, "auto")], "leaves worker:1 no CPU of its own"),
    ],
)
def test_what_does_not_fit_names_the_task(asks: list[Ask], says: str) -> None:
    with pytest.raises(CpuMisfit) as caught:
        split("m", asks, Topology((0, 1, 2, 3)))
    assert says in caught.value.message and "\n" not in caught.value.message


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.mark.quick
def test_the_sysfs_readers_over_a_scripted_machine(tmp: Path) -> None:
    nodes = tmp / "devices" / "system" / "node"
    _write(nodes / "node0" / "cpulist", "0-3,8-11")
    _write(nodes / "node1" / "cpulist", "4-7,12-15")
    _write(nodes / "possible", "0-1")  # not a node folder
    pci = tmp / "bus" / "pci" / "devices"
    for bus, vendor, klass, node in [
        ("0000:c1:00.0", "0x10de", "0x030200", "1"),  # GPU 1 in bus order
        ("0000:41:00.0", "0x10de", "0x030000", "0"),  # GPU 0
        ("0000:41:00.1", "0x10de", "0x040300", "0"),  # its HDMI audio: no GPU
        ("0000:00:02.0", "0x8086", "0x030000", "0"),  # an Intel display: no NVIDIA GPU
        ("0000:e1:00.0", "0x10de", "0x030200", "-1"),  # GPU 2, node unknown
    ]:
        for key, value in (("vendor", vendor), ("class", klass), ("numa_node", node)):
            _write(pci / bus / key, value)
    assert topology.numa_nodes(str(tmp)) == [
        [0, 1, 2, 3, 8, 9, 10, 11],
        [4, 5, 6, 7, 12, 13, 14, 15],
    ]
    assert topology.gpu_numa_nodes(str(tmp)) == [0, 1, -1]
    assert (
        topology.numa_nodes(str(tmp / "nothing")) == [] == topology.gpu_numa_nodes(str(tmp / "x"))
    )
    assert (
        topology.parse_cpulist("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
        and cpulist([0, 1, 2, 5]) == "0-2,5"
    )
    # A local task's GPU index counts within the launcher's CUDA_VISIBLE_DEVICES.
    assert seen_through((0, 1, -1), "1,0,GPU-ab") == (1, 0, -1) and seen_through((0, 1), None) == (
        0,
        1,
    )


@pytest.mark.quick
@pytest.mark.parametrize(
    ("tasks", "where", "says"),
    [
        ({"worker": [{"cpus": [max(HERE) + 1]}]}, "$.tasks.worker[0].cpus", "gives worker:0 CPU"),
        ({"worker": {"count": 1, "cpus": len(HERE) + 1}}, "$.tasks.worker.cpus", "asks for"),
        (
            {"worker": {"count": 2, "cpus": [HERE[0]]}},
            "$.tasks.worker.cpus",
            "a CPU list for several tasks on one host",
        ),
        (
            {"worker": [{"cpus": len(HERE)}, {"cpus": 1}]},
            "$.tasks.worker[1].cpus",
            "no CPU of its own",
        ),
        ({"worker": [{"cpus": "most"}]}, "$.tasks.worker[0].cpus", 'expected "auto", "all"'),
    ],
)
def test_bad_cpus_are_one_line_exit_2_and_nothing_started(
    tmp: Path, tasks: dict, where: str, says: str
) -> None:
    (tmp / "task.py").write_text("raise SystemExit('never started')\n")
    spec = write_spec(tmp, tasks=tasks)
    done = distlaunch("up", str(spec), cwd=tmp, timeout=60)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert line.startswith(f"distlaunch: error: {spec}: {where}: ") and says in line, line
    assert "\n" not in line and not (tmp / "runs").exists()


# What a task sees: its affinity mask and thread settings (what TensorFlow reads at its import),
# into the run dir. The launcher sets both whatever the program; the mask and the variables are
# the process's own, so no TensorFlow start (seconds of CPU per task) is needed to read them. The
# import below never runs: it is there for the launcher's reading of the source (a TensorFlow
# program gets standbys, which test_a_standby_is_pinned_like_its_task needs).
SEEN = """
import json, os
if os.environ.get("DISTLAUNCH_TEST_NEVER_SET"):
    import tensorflow
seen = {
    "affinity": sorted(os.sched_getaffinity(0)),
    "threads": {k: os.environ.get(k) for k in
                ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS")},
}
name = "seen-%s-%s.json" % (os.environ["DISTLAUNCH_ROLE"], os.environ["DISTLAUNCH_INDEX"])
with open(os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], name), "w") as f:
    json.dump(seen, f)
"""


def seen_by_tasks(run_dir: Path, plan: dict) -> list[tuple[dict, dict]]:
    """Each task of ``plan`` (`plan --json` data) with what it saw (SEEN's file)."""
    out = []
    for task in plan["tasks"]:
        seen = json.loads((run_dir / f"seen-{task['role']}-{task['index']}.json").read_text())
        out.append((task, seen))
    return out


@pytest.mark.quick
def test_local_tasks_run_on_the_cpus_plan_says_and_keep_the_users_threads(tmp: Path) -> None:
    (tmp / "task.py").write_text(SEEN)
    program = {"script": "task.py", "env": {"TF_NUM_INTRAOP_THREADS": "3"}}
    spec = write_spec(tmp, program=program)
    shown = distlaunch("plan", "--json", str(spec), cwd=tmp)
    assert shown.returncode == 0, shown.stderr
    plan = json.loads(shown.stdout)
    text = distlaunch("plan", str(spec), cwd=tmp).stdout
    assert "TF_NUM_INTRAOP_THREADS=3 (yours, kept)" in text
    done = distlaunch("up", str(spec), cwd=tmp)
    assert done.returncode == 0, done.stderr + done.stdout
    pairs = seen_by_tasks(only_run_dir(tmp / "runs"), plan)
    for task, seen in pairs:
        assert seen["affinity"] == task["cpus"]["ids"] and task["cpus"]["how"] == "auto"
        assert seen["threads"] == task["threads"]
        assert seen["threads"]["TF_NUM_INTRAOP_THREADS"] == "3" and task["threads_kept"] == [
            "TF_NUM_INTRAOP_THREADS"
        ]
        size = len(seen["affinity"])
        assert seen["threads"]["OMP_NUM_THREADS"] == str(size)
        # The inter-op pool is never one thread: a blocking op would hold it (a deadlock).
        assert seen["threads"]["TF_NUM_INTEROP_THREADS"] == str(max(size, 2))
    masks = [set(seen["affinity"]) for _, seen in pairs]
    if len(HERE) >= 2:  # two tasks on two CPUs or more: disjoint, all used, said by `up`
        assert not masks[0] & masks[1] and masks[0] | masks[1] == set(HERE)
        each = len(HERE) // 2
        word = "CPU" if each == 1 else "CPUs"
        assert f"cpus: 2 tasks on localhost, {each} {word} each (auto)" in done.stderr
    else:
        assert masks == [set(HERE)] * 2


# A task that holds its port (the cluster has settled: the launcher makes standbys) until the
# test lets it end.
STANDBY = (
    SEEN
    + standins.listening(standins.LOOPBACK)
    + standins.until_exists('os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], "release")')
)


def _standbys_ready(run_dir: Path) -> dict | None:
    standbys = run_record(run_dir).get("standbys") or {}
    return standbys if len(standbys) == 2 and all(s["ready"] for s in standbys.values()) else None


@pytest.mark.integration
def test_a_standby_is_pinned_like_its_task(tmp: Path, launch) -> None:
    (tmp / "task.py").write_text(STANDBY)
    restart = {"policy": "on-failure", "backoff": {"initial_s": 0, "max_s": 0}}
    launcher = launch(write_spec(tmp, restart=restart))
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    standbys = wait_for(lambda: _standbys_ready(run_dir), "both standbys ready", launcher=launcher)
    # Every process of each standby (taskinit's keeper, its init, the interpreter), read here:
    # the task's own PID namespace hides them from it.
    masks = {}
    for name, standby in standbys.items():
        keeper = psutil.Process(standby["pid"])
        masks[name] = {tuple(p.cpu_affinity()) for p in (keeper, *keeper.children(recursive=True))}
    # `status`: each task's CPU use against its CPUs (measured here for local tasks).
    shown = distlaunch("status", "--json", str(run_dir), cwd=tmp)
    table = {r["task"]: r for r in json.loads(shown.stdout)["tasks"]}
    text = distlaunch("status", str(run_dir), cwd=tmp).stdout
    (run_dir / "release").write_text("")
    assert launcher.wait(timeout=120) == 0
    assert "CPU USE" in text
    for name, row in table.items():
        assert isinstance(row["cpu_use"], float) and row["cpu_use"] >= 0
        assert f" of {row['cpus']['count']} " in text.split(f"\n  {name} ")[1].splitlines()[0]
    plan = run_record(run_dir)["plan"]
    for task, seen in seen_by_tasks(run_dir, plan):
        assert table[task["name"]]["cpus"] == task["cpus"]
        assert masks[task["name"]] == {tuple(seen["affinity"])}
        assert seen["affinity"] == task["cpus"]["ids"] == standbys[task["name"]]["cpus"]


@pytest.mark.quick
def test_containers_get_a_cpuset_and_pods_integer_cpus_with_thread_settings(tmp: Path) -> None:
    from distlaunch.launcher.export import k8s
    from distlaunch.launcher.spec.model import load_spec
    from distlaunch.launcher.transports.compose import file as compose

    (tmp / "task.py").write_text("")
    tasks = {"chief": {"cpus": 2}, "worker": {"count": 2, "cpus": 3}, "ps": {"cpus": "all"}}
    loaded = load_spec(write_spec(tmp, strategy="parameter_server", tasks=tasks))
    made = k8s.manifests(loaded, "t-1", "img", None, False)
    jobs = {o["metadata"]["name"]: o for o in made.objects if o["kind"] == "Job"}
    for role, cpus in (("chief", 2), ("worker", 3), ("ps", None)):
        (container,) = jobs[f"t-1-{role}"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        if cpus is None:
            assert "resources" not in container and "OMP_NUM_THREADS" not in env
            continue
        assert container["resources"] == {"requests": {"cpu": cpus}, "limits": {"cpu": cpus}}
        assert env["TF_NUM_INTRAOP_THREADS"] == env["OMP_NUM_THREADS"] == str(cpus)
    listed = write_spec(tmp, "listed.json", tasks={"worker": [{"cpus": [0]}]})
    done = distlaunch("k8s", str(listed), cwd=tmp)
    assert done.returncode == 2 and "$.tasks.worker[0].cpus: Kubernetes picks" in done.stderr
    # Compose: the Docker host's CPUs split like a local run's, each container pinned by cpuset.
    loaded = load_spec(write_spec(tmp, "c.json", tasks={"worker": {"count": 2}}))
    plan = compose.compose_plan(loaded, "t-1", tmp / "runs" / "t-1", cpus=Topology((0, 1, 2, 3)))
    services = compose.compose_file(loaded, plan, "img", "0:0")["services"]
    assert [services[n]["cpuset"] for n in ("worker-0", "worker-1")] == ["0,1", "2,3"]
    assert services["worker-0"]["environment"]["TF_NUM_INTEROP_THREADS"] == "2"


@pytest.mark.integration
def test_a_pss_cluster_of_one_cpu_tasks_trains(tmp: Path) -> None:
    """Chief, worker and ps pinned to one CPU each (here all to CPU 0, as listed): TensorFlow's
    inter-op pool sized 1 deadlocked the ps and worker (the chief never trained a step, the run
    hit run_s); it is never below 2. A few steps show it: the deadlock came before the first."""
    from conftest import distlaunch, example

    one = [{"cpus": [HERE[0]]}]
    spec = write_spec(
        tmp,
        strategy="parameter_server",
        program=example("mnist_mlp", 1, 5),
        tasks={"chief": one, "worker": one, "ps": one},
        timeouts={"grace_s": 2, "startup_s": 120, "run_s": 150},
    )
    done = distlaunch("up", str(spec), cwd=tmp, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "chief-0  | final loss" in done.stdout, done.stdout[-2000:]


@pytest.mark.quick
def test_a_slurm_task_takes_the_allocations_share_per_task_not_the_whole_node() -> None:
    """`salloc --ntasks-per-node=2` on 2-CPU nodes gives a task 1 CPU: a run of one task per node
    takes 1 CPU on each, so a second run in the same allocation starts beside it (with the whole
    node per task, its steps waited for the first run's to end)."""
    from distlaunch.launcher.transports.slurm import allocation as slurm

    nodes = {"a": 2, "b": 2}
    assert slurm.task_cpus({"SLURM_CPUS_PER_TASK": "4"}, nodes) == 4
    assert slurm.task_cpus({"SLURM_NTASKS_PER_NODE": "2"}, nodes) == 1
    assert slurm.task_cpus({}, nodes) is None  # the allocation says nothing: the run splits a node
    alloc = slurm.Allocation("7", ("a", "b"), nodes, submitted=False, task_cpus=1)
    one_per_node = {("worker", 0): "a", ("worker", 1): "b"}
    assert {n: len(t.cpus) for n, t in slurm.node_cpus(alloc, one_per_node).items()} == {
        "a": 1,
        "b": 1,
    }
    both_on_a = {("worker", 0): "a", ("worker", 1): "a"}
    assert len(slurm.node_cpus(alloc, both_on_a)["a"].cpus) == 2
    whole = slurm.Allocation("7", ("a", "b"), nodes, submitted=False)
    assert len(slurm.node_cpus(whole, one_per_node)["a"].cpus) == 2
    assert slurm.Allocation.from_json(alloc.to_json()) == alloc
