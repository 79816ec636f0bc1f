"""Placement decided once: each backend's table of where its tasks run, and the plan that reads it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from conftest import write_spec
from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.export import k8s
from distlaunch.launcher.plan import placement, ports
from distlaunch.launcher.plan.placement import IMAGE_PYTHON
from distlaunch.launcher.plan.plan import for_attempt, make_plan
from distlaunch.launcher.spec.model import load_spec
from distlaunch.launcher.transports.compose import file as compose_file
from distlaunch.launcher.transports.local import transport as local
from distlaunch.launcher.transports.slurm import transport as slurm
from distlaunch.worker import contract

pytestmark = pytest.mark.quick

LAUNCHER = Path(__file__).resolve().parent.parent / "launcher"
MIXED = {
    "strategy": "parameter_server",
    "program": {"script": "task.py"},
    "hosts": {
        "me": {"transport": "local", "address": "10.1.2.3"},
        "gpu1": {"address": "10.1.2.4", "python": "/opt/py/bin/python", "workdir": "/srv/w"},
        "gpu2": {},
    },
    "tasks": {
        "chief": [{"host": "me", "port": 2000, "gpus": 1}],
        "worker": [
            {"host": "gpu1", "gpus": 2},
            {"host": "gpu1", "gpus": [0]},
            {"host": "gpu2", "gpus": 1},
        ],
        "ps": [{"host": "gpu1", "port": 2222}],
    },
}


def test_the_local_backend_places_each_task_on_its_host_once(tmp: Path) -> None:
    (tmp / "task.py").write_text("")
    loaded = load_spec(write_spec(tmp, **MIXED))
    here = (TaskTransport.LOCAL, sys.executable, str(tmp))
    gpu1 = (TaskTransport.SSH, "/opt/py/bin/python", "/srv/w")
    gpu2 = (TaskTransport.SSH, "python3", "")
    rows = [
        (r.key, r.host_name, r.machine, r.address, r.port, r.gpus, (r.transport, r.python, r.cwd))
        for r in placement.on_hosts(loaded).rows
    ]
    assert rows == [
        (("chief", 0), "me", "10.1.2.3", "10.1.2.3", 2000, (0,), here),
        # A count takes the lowest GPUs no task on its machine names: gpu1's 0 is worker-1's.
        (("worker", 0), "gpu1", "10.1.2.4", "10.1.2.4", None, (1, 2), gpu1),
        (("worker", 1), "gpu1", "10.1.2.4", "10.1.2.4", None, (0,), gpu1),
        (("worker", 2), "gpu2", "gpu2", "gpu2", None, (0,), gpu2),
        (("ps", 0), "gpu1", "10.1.2.4", "10.1.2.4", 2222, (), gpu1),
    ]
    # Preflight asks each SSH host for exactly its rows' ports.
    requests = ports.remote_requests(placement.on_hosts(loaded))
    assert requests["gpu1"] == ports.HostPorts({("ps", 0): 2222}, (("worker", 0), ("worker", 1)))
    assert requests["gpu2"] == ports.HostPorts({}, (("worker", 2),))


def test_the_plan_reads_every_task_from_its_row(tmp: Path) -> None:
    (tmp / "task.py").write_text("import tensorflow as tf\ntf.distribute.Server\n")
    loaded = load_spec(write_spec(tmp, **MIXED))
    placed = placement.on_hosts(loaded)
    picked = ports.allocate(loaded, placed, private=True, remote={("worker", 0): 3000})
    placed = placed.with_ports(picked)
    plan = make_plan(loaded, placed, "r", tmp / "runs" / "r", visible_gpus="4,5,6")
    assert len(plan.tasks) == len(placed.rows)
    for task, row in zip(plan.tasks, placed.rows, strict=True):
        assert (task.role, task.index, task.host_name, task.host, task.port) == (
            row.role,
            row.index,
            row.host_name,
            row.address,
            row.port,
        )
        assert (task.gpus, task.transport, task.cwd, task.argv[0]) == (
            row.gpus,
            row.transport,
            row.cwd,
            row.python,
        )
    assert plan.task("worker-0").port == 3000
    # The launcher's CUDA_VISIBLE_DEVICES counts for this machine only.
    assert plan.task("chief-0").env["CUDA_VISIBLE_DEVICES"] == "4"
    assert plan.task("worker-0").env["CUDA_VISIBLE_DEVICES"] == "1,2"
    # Where the launcher's files are, the bootstrap runs by path; on an SSH host, as a module.
    assert plan.task("chief-0").argv[1].endswith("bootstrap.py")
    assert plan.task("worker-0").argv[1:3] == ("-m", "distlaunch.host.bootstrap")


def test_a_plan_needs_every_port_picked(tmp: Path) -> None:
    (tmp / "task.py").write_text("")
    loaded = load_spec(write_spec(tmp))
    with pytest.raises(ValueError, match="worker:0 has no port yet"):
        make_plan(loaded, placement.on_hosts(loaded), "r", tmp / "runs" / "r")


def test_containers_keep_the_tasks_and_change_where_they_are_reached(tmp: Path) -> None:
    (tmp / "task.py").write_text("")
    loaded = load_spec(write_spec(tmp))
    plan = compose_file.compose_plan(loaded, "r", tmp / "runs" / "r")
    assert [(t.host, t.port, t.transport, t.argv[0], t.cwd) for t in plan.tasks] == [
        (f"worker-{i}", compose_file.SERVICE_PORT, TaskTransport.COMPOSE, IMAGE_PYTHON, str(tmp))
        for i in range(2)
    ]
    # Kubernetes: the table names each pod's DNS name, which the role's cluster lists.
    made = k8s.manifests(loaded, "r1", "img", None, jobset=False)
    job = next(o for o in made.objects if o.get("kind") == "Job")
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    cluster = next(e["value"] for e in env if e["name"] == contract.CLUSTER)
    assert cluster == '{"worker":["r1-worker-0.r1:2222","r1-worker-1.r1:2222"]}'


def test_slurm_places_tasks_on_nodes_without_a_stand_in_spec(tmp: Path) -> None:
    (tmp / "task.py").write_text("")
    tasks = {"worker": [{"gpus": 1}, {"gpus": 1}, {"gpus": 1}, {}]}
    loaded = load_spec(write_spec(tmp, backend="slurm", tasks=tasks))
    nodes = {("worker", 0): "a", ("worker", 1): "b", ("worker", 2): "a", ("worker", 3): "b"}
    placed = placement.on_nodes(loaded, nodes)
    assert [(r.host_name, r.machine, r.address, r.gpus) for r in placed.rows] == [
        ("a", "a", "a", (0,)),
        ("b", "b", "b", (0,)),
        ("a", "a", "a", (1,)),  # GPUs are counted per node
        ("b", "b", "b", ()),
    ]
    assert {(r.transport, r.python, r.cwd) for r in placed.rows} == {
        (TaskTransport.SLURM, sys.executable, str(tmp))
    }
    plan = slurm.slurm_plan(loaded, nodes, {k: 4000 + k[1] for k in nodes}, "r", tmp / "r")
    assert [t.transport for t in plan.tasks] == [TaskTransport.SLURM] * 4 and not plan.standby
    assert [t.host_name for t in plan.tasks] == ["a", "b", "a", "b"]


def test_a_task_knows_its_attempt(tmp: Path) -> None:
    (tmp / "task.py").write_text("")
    loaded = load_spec(write_spec(tmp))
    placed = placement.on_hosts(loaded).with_ports({("worker", 0): 1, ("worker", 1): 2})
    plan = make_plan(loaded, placed, "r", tmp / "runs" / "r", attempt=2)
    again = for_attempt(plan, 5)
    assert {t.attempt for t in plan.tasks} == {2} and {t.attempt for t in again.tasks} == {5}
    assert again.task("worker-1").env[contract.ATTEMPT] == "5"
    assert local.signal_file(again.task("worker-1")) == contract.stacks_signal_path(
        tmp / "runs" / "r", 5, "worker", 1
    )


def _reads_attempt_from_env(node: ast.AST) -> bool:
    """``x[contract.ATTEMPT]`` read, or ``x.get(contract.ATTEMPT, ...)``."""

    def is_attempt(expr: ast.AST) -> bool:
        return isinstance(expr, ast.Attribute) and expr.attr == "ATTEMPT"

    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return is_attempt(node.slice)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "get" and bool(node.args) and is_attempt(node.args[0])
    return False


def test_the_launcher_never_reads_the_attempt_back_out_of_a_task_env() -> None:
    """The plan writes DISTLAUNCH_ATTEMPT for the task; the launcher reads TaskPlan.attempt."""
    found = [
        f"{path.relative_to(LAUNCHER)}:{node.lineno}"
        for path in sorted(LAUNCHER.rglob("*.py"))
        # launcher/host is the task's side (distlaunch.host): it reads its own attempt there
        if LAUNCHER / "host" not in path.parents
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if _reads_attempt_from_env(node)
    ]
    assert found == []


def test_no_free_port_left_is_one_line_naming_the_task(tmp: Path, monkeypatch) -> None:
    # Thousands of `auto` ports can exhaust what portpicker finds free; the plan then names the
    # task that got none instead of a traceback. Only portpicker's answer is scripted here.
    import portpicker

    from distlaunch.launcher.core.errors import SpecError

    (tmp / "task.py").write_text("")
    loaded = load_spec(write_spec(tmp))
    picks = iter([20001])

    def pick_unused_port() -> int:
        try:
            return next(picks)
        except StopIteration:
            raise portpicker.NoFreePortFoundError() from None

    monkeypatch.setattr(portpicker, "pick_unused_port", pick_unused_port)
    with pytest.raises(SpecError, match=r"tasks\.worker.*no free port left.*1 already taken"):
        ports.allocate(loaded, placement.on_hosts(loaded))
