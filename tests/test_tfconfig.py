"""TF_CONFIG for every role mix, and the plan built around it."""

from __future__ import annotations

import json

import pytest

from conftest import distlaunch, write_spec
from distlaunch.launcher.plan import tfconfig
from distlaunch.launcher.plan.placement import on_hosts
from distlaunch.launcher.plan.plan import make_plan
from distlaunch.launcher.spec.model import load_spec

pytestmark = pytest.mark.quick

W = ["h:1", "h:2"]


def test_workers_only():
    config = tfconfig.tf_config({"worker": W}, "worker", 1)
    assert config == {"cluster": {"worker": W}, "task": {"type": "worker", "index": 1}}


def test_chief_and_workers():
    addresses = {"chief": ["h:0"], "worker": W}
    assert tfconfig.tf_config(addresses, "chief", 0) == {
        "cluster": {"chief": ["h:0"], "worker": W},
        "task": {"type": "chief", "index": 0},
    }
    assert tfconfig.tf_config(addresses, "worker", 0)["cluster"] == {"chief": ["h:0"], "worker": W}


def test_parameter_server_cluster():
    addresses = {"chief": ["h:0"], "worker": W, "ps": ["h:9"]}
    for role, index in (("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)):
        config = tfconfig.tf_config(addresses, role, index)
        assert config["cluster"] == {"chief": ["h:0"], "worker": W, "ps": ["h:9"]}
        assert config["task"] == {"type": role, "index": index}


def test_evaluator_gets_its_own_cluster_and_training_never_sees_it():
    addresses = {"chief": ["h:0"], "worker": W, "ps": ["h:9"], "evaluator": ["h:7"]}
    assert tfconfig.tf_config(addresses, "evaluator", 0) == {
        "cluster": {"evaluator": ["h:7"]},
        "task": {"type": "evaluator", "index": 0},
    }
    for role in ("chief", "worker", "ps"):
        assert "evaluator" not in tfconfig.tf_config(addresses, role, 0)["cluster"]


def test_unknown_task_raises():
    with pytest.raises(ValueError):
        tfconfig.tf_config({"worker": W}, "worker", 2)


def _plan(tmp, **fields):
    (tmp / "task.py").write_text("")
    loaded = load_spec(write_spec(tmp, **fields))
    roles = loaded.spec.tasks.by_role()
    ports = {(r, i): 20000 + 10 * n + i for n, r in enumerate(roles) for i in range(len(roles[r]))}
    placed = on_hosts(loaded).with_ports(ports)
    return make_plan(loaded, placed, "run-1", tmp / "runs" / "run-1", attempt=2)


def test_plan_env_names_every_file_and_uses_loopback(tmp):
    plan = _plan(
        tmp,
        tasks={"worker": {"count": 2, "host": "localhost"}},
        program={
            "script": "task.py",
            "args": ["--x", "a b"],
            "env": {"API_TOKEN": "s3cret", "FOO": "bar"},
        },
    )
    w1 = plan.task("worker:1")
    # The program starts through the bootstrap (it records import errors), then runs as written.
    assert w1.argv[1].endswith("bootstrap.py")
    assert w1.argv[2:] == (str((tmp / "task.py").resolve()), "--x", "a b")
    assert json.loads(w1.env["TF_CONFIG"]) == {
        "cluster": {"worker": ["127.0.0.1:20000", "127.0.0.1:20001"]},
        "task": {"type": "worker", "index": 1},
    }
    assert w1.env["DISTLAUNCH_ATTEMPT"] == "2"
    assert w1.env["DISTLAUNCH_ERROR_FILE"].endswith("errors/attempt-2/worker-1.json")
    assert w1.log_file.endswith("logs/attempt-2/worker-1.log")
    assert w1.env["CUDA_VISIBLE_DEVICES"] == ""  # no gpus: CPU only
    assert w1.env["FOO"] == "bar"
    shown = plan.to_json()["tasks"][1]["env"]
    assert shown["API_TOKEN"] == "***" and shown["FOO"] == "bar"


def test_gpus_never_shared_on_a_host(tmp):
    plan = _plan(tmp, tasks={"chief": [{"gpus": [1]}], "worker": {"count": 2, "gpus": 2}})
    assert plan.task("chief-0").gpus == (1,)
    assert plan.task("worker-0").gpus == (0, 2)
    assert plan.task("worker-1").gpus == (3, 4)
    assert plan.task("worker-1").env["CUDA_VISIBLE_DEVICES"] == "3,4"


def test_pss_env(tmp):
    plan = _plan(
        tmp,
        strategy="parameter_server",
        tasks={"chief": {}, "worker": {"count": 2}, "ps": {}},
        program={"script": "task.py", "keras": "tf_keras"},
    )
    for task in plan.tasks:
        assert task.env["GRPC_FAIL_FAST"] == "use_caller"
        assert task.env["TF_USE_LEGACY_KERAS"] == "1"


def test_tfconfig_command(tmp):
    (tmp / "task.py").write_text("")
    spec = write_spec(
        tmp,
        strategy="parameter_server",
        tasks={"chief": {}, "worker": {"count": 2}, "ps": {}, "evaluator": {}},
    )
    result = distlaunch("tfconfig", str(spec), "worker:1")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert config["task"] == {"type": "worker", "index": 1}
    assert set(config["cluster"]) == {"chief", "worker", "ps"}
    result = distlaunch("tfconfig", str(spec), "worker:5")
    assert (
        result.returncode == 2
        and "expected one of: chief:0, worker:0, worker:1, ps:0, evaluator:0" in result.stderr
    )


def test_plan_json_is_a_dry_run(tmp):
    (tmp / "task.py").write_text("")
    spec = write_spec(tmp)
    result = distlaunch("plan", "--json", str(spec))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [t["name"] for t in data["tasks"]] == ["worker-0", "worker-1"]
    assert not (tmp / "runs").exists()
