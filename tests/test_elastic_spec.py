"""An elastic run's spec (issue 49): the `elastic` section, its typed `Spec.elastic`, the one-line
refusals of `validate`, `plan` and `up` (the same line from Python), the range `plan` shows with
the first world, and the Python API's ``workers=(MIN, MAX)``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import distlaunch
from conftest import distlaunch as cli
from distlaunch.launcher.api import call
from distlaunch.launcher.api.call import cluster_spec
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.run.options import LaunchOptions
from distlaunch.launcher.spec import schema
from distlaunch.launcher.spec.model import Elastic, Spec, load_spec

# Three SSH hosts, one worker slot each (plan and validate contact no host).
HOSTS = {"a": {"address": "10.0.0.5"}, "b": {"address": "10.0.0.6"}, "c": {"address": "10.0.0.7"}}
BASE = {
    "name": "t",
    "strategy": "multi_worker_mirrored",
    "program": {"script": "task.py"},
    "hosts": HOSTS,
    "tasks": {"worker": {"per_host": 1}},
    "shared_dir": "runs",
    "network": {"protect": "off"},
    "elastic": {"workers": "2:3"},
}


def _spec(tmp: Path, **changes) -> Path:
    """A spec beside a task.py: BASE with top-level ``changes`` (None removes a key)."""
    (tmp / "task.py").write_text("print('hi')\n")
    data = {**json.loads(json.dumps(BASE)), **changes}
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp / "spec.json"
    path.write_text(json.dumps(data))
    return path


def _elastic(**keys) -> dict:
    return {"elastic": {"workers": "2:3", **keys}}


BAD = [
    (
        "MIN above MAX",
        _elastic(workers="3:2"),
        "$.elastic.workers",
        'expected MIN <= MAX, got "3:2"',
    ),
    (
        "MAX above the slots",
        _elastic(workers="2:4"),
        "$.elastic.workers",
        "MAX 4 is more than tasks.worker's 3 tasks, the slots a world is chosen from (1 on a, 1 "
        "on b, 1 on c); expected MAX <= 3, or more worker tasks",
    ),
    (
        "MIN above what the hosts hold",
        _elastic(workers="4:"),
        "$.elastic.workers",
        "MIN 4 is more workers than the hosts can hold: tasks.worker has 3 tasks (1 on a, 1 on "
        "b, 1 on c); expected MIN <= 3",
    ),
    (
        "MIN above the hosts with MAX written",
        _elastic(workers="4:5"),
        "$.elastic.workers",
        "MIN 4 is more workers than the hosts can hold",
    ),
    (
        "no size in the range",
        _elastic(sizes=[1, 4]),
        "$.elastic.sizes",
        "expected at least one size within 2..3 (elastic.workers), got [1, 4]",
    ),
    (
        "compose cannot resize",
        {**_elastic(), "hosts": None, "tasks": {"worker": {"count": 3}}, "backend": "compose"},
        "$.elastic",
        "the compose backend cannot resize a run (each container's TF_CONFIG is fixed in the "
        "compose file when it starts); run it on the local backend (SSH hosts) or slurm, or "
        "remove elastic",
    ),
    (
        "not a range",
        _elastic(workers="2-3"),
        "$.elastic.workers",
        'expected a range "MIN:MAX" or "MIN:" of worker counts (MIN >= 1), like "2:3", got "2-3"',
    ),
    ("a number", _elastic(workers=3), "$.elastic.workers", 'like "2:3", got 3'),
    ("MIN zero", _elastic(workers="0:3"), "$.elastic.workers", 'like "2:3", got "0:3"'),
    ("three parts", _elastic(workers="1:2:3"), "$.elastic.workers", 'got "1:2:3"'),
    ("no workers key", {"elastic": {"batch": "global"}}, "$.elastic.workers", "required key"),
    ("unknown key", _elastic(min=2), "$.elastic.min", "unknown key 'min'"),
    ("bad batch", _elastic(batch="local"), "$.elastic.batch", '"global" or "per_worker"'),
    ("zero probe", _elastic(probe_s=0), "$.elastic.probe_s", "0"),
    (
        "cooldown cap below its start",
        _elastic(cooldown_s=60, cooldown_max_s=30),
        "$.elastic.cooldown_max_s",
        "expected at least elastic.cooldown_s (60), got 30",
    ),
    (
        "no worker role",
        {**_elastic(workers="1:"), "hosts": None, "tasks": {"chief": {}}},
        "$.elastic",
        "an elastic run ranges over the worker role's tasks; expected tasks.worker",
    ),
]


@pytest.mark.quick
@pytest.mark.parametrize("case,changes,path,expected", BAD, ids=[c[0] for c in BAD])
def test_a_bad_range_is_one_line_from_validate_plan_and_up(tmp, case, changes, path, expected):
    spec = _spec(tmp, **changes)
    lines = set()
    for command in ("validate", "plan", "up"):
        result = cli(command, str(spec), cwd=tmp)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"distlaunch: error: {spec}: {path}: "), line
        assert expected in line, line
        lines.add(line)
    assert len(lines) == 1  # the three commands refuse alike
    assert not (tmp / "runs").exists()  # nothing started, nothing written
    # From Python: the typed exception with the same line.
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    assert f"distlaunch: error: {info.value}" == lines.pop()
    assert info.value.json_path == path


@pytest.mark.quick
def test_up_backend_compose_and_the_exports_refuse_an_elastic_spec(tmp):
    spec = _spec(tmp, hosts=None, tasks={"worker": {"count": 3}})
    for args in (["up", "--backend", "compose"], ["compose"], ["k8s"]):
        result = cli(*args, str(spec), cwd=tmp)
        assert result.returncode == 2, (args, result.stderr)
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"distlaunch: error: {spec}: $.elastic: "), line
        assert "cannot resize a run" in line
    assert "needs a controller that watches the pods, re-forms TF_CONFIG" in line
    assert not (tmp / "runs").exists()


@pytest.mark.quick
def test_the_typed_section_fills_max_from_the_slots(tmp):
    loaded = load_spec(_spec(tmp, **_elastic(workers="1:", sizes=[3, 1], interval_s=5)))
    elastic = loaded.spec.elastic
    assert elastic == Elastic(min_workers=1, max_workers=3, sizes=(3, 1), interval_s=5.0)
    assert isinstance(elastic.interval_s, float) and elastic.accepted() == (1, 3)
    assert elastic.range_text == "1:3"
    assert load_spec(_spec(tmp, elastic=None)).spec.elastic is None
    # A parameter-server run ranges over its workers; a Slurm one is checked at `up` for nodes.
    pss = _spec(
        tmp, strategy="parameter_server", hosts=None, elastic={"workers": "1:2"},
        tasks={"chief": {}, "ps": {}, "worker": {"count": 2}},
    )  # fmt: skip
    assert cli("validate", str(pss)).stdout.endswith(
        "ok (parameter_server; 1 chief, 2 worker, 1 ps; elastic 1:2)\n"
    )
    slurm = _spec(tmp, hosts=None, tasks={"worker": {"count": 3}}, backend="slurm")
    assert load_spec(slurm).spec.elastic.max_workers == 3


@pytest.mark.quick
def test_the_schema_defaults_are_the_elastic_models():
    node = schema.document()["properties"]["elastic"]["properties"]
    fields = {f.name: f.default for f in dataclasses.fields(Elastic)}
    defaults = {k: p["default"] for k, p in node.items() if "default" in p}
    assert set(defaults) == set(fields) - {"min_workers", "max_workers"}
    for name, default in defaults.items():
        assert fields[name] == default, name
    assert Spec.__dataclass_fields__["elastic"].default is None


@pytest.mark.quick
def test_plan_shows_the_range_and_the_first_world(tmp):
    spec = _spec(tmp, **_elastic(workers="1:2", sizes=[2, 4]))
    result = cli("plan", str(spec))
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("elastic:"))
    assert line == (
        "elastic: workers 1:2 (sizes 2), first world: worker-0 on a, worker-1 on b, "
        "spare: worker-2 on c; batch global"
    )
    data = json.loads(cli("plan", "--json", str(spec)).stdout)["elastic"]
    assert (data["min_workers"], data["max_workers"], data["accepted"]) == (1, 2, [2])
    assert data["first_world"] == ["worker-0", "worker-1"]
    assert [(s["task"], s["host_name"], s["host"]) for s in data["slots"]] == [
        ("worker-0", "a", "10.0.0.5"),
        ("worker-1", "b", "10.0.0.6"),
        ("worker-2", "c", "10.0.0.7"),
    ]
    assert (data["batch"], data["resizes"], data["settle_s"]) == ("global", 10, 10.0)
    # A fixed run says nothing of it, and its JSON says null.
    fixed = _spec(tmp, elastic=None)
    assert "elastic:" not in cli("plan", str(fixed)).stdout
    assert json.loads(cli("plan", "--json", str(fixed)).stdout)["elastic"] is None


@pytest.mark.quick
def test_a_range_of_workers_makes_an_elastic_section_with_defaults():
    spec = cluster_spec("run-f", (2, 3), 0, 0, 0, "multi_worker_mirrored")
    assert spec["tasks"]["worker"] == {"count": 3}
    assert spec["elastic"] == {"workers": "2:3"}
    assert Spec.model_validate(spec).elastic == Elastic(min_workers=2, max_workers=3)
    assert "elastic" not in cluster_spec("run-f", 2, 0, 0, 0, "multi_worker_mirrored")
    assert LaunchOptions(workers=(2, 3)).workers == (2, 3)
    for bad in ((0, 2), (1, 2, 3), (1, True), ("1", 2)):
        with pytest.raises(ValueError, match=r"workers= expected a count or a range \(MIN, MAX\)"):
            cluster_spec("run-f", bad, 0, 0, 0, "multi_worker_mirrored")


def _noop() -> None:  # never runs: every call below is refused before anything starts
    raise AssertionError("started")


@pytest.mark.quick
def test_run_refuses_a_bad_range_before_anything_starts(tmp, monkeypatch):
    monkeypatch.chdir(tmp)
    with pytest.raises(SpecError) as info:
        distlaunch.run(_noop, workers=(3, 2), quiet=True)
    assert str(info.value) == '<spec>: $.elastic.workers: expected MIN <= MAX, got "3:2"'
    # With a spec, the range is over the spec's worker role (3 slots here), not a count.
    spec = _spec(tmp, elastic=None, hosts=None, tasks={"worker": {"count": 3}})
    with pytest.raises(SpecError) as info:
        call.start(_noop, workers=(1, 4), spec=str(spec), quiet=True)
    assert "$.elastic.workers: MAX 4 is more than tasks.worker's 3 tasks" in str(info.value)
    assert not (tmp / "runs").exists()


def _world() -> str:
    import os

    return os.environ["TF_CONFIG"]


def test_a_range_with_a_spec_keeps_the_specs_elastic_settings(tmp, monkeypatch):
    """A real run (no TensorFlow in the function): the range replaces the spec's own
    elastic.workers, its other settings stay, and the first world is the first MAX slots."""
    monkeypatch.chdir(tmp)
    spec = _spec(
        tmp,
        hosts=None,
        tasks={"worker": {"count": 2}},
        elastic={"workers": "2:", "batch": "per_worker"},
    )
    values = distlaunch.run(_world, workers=(1, 2), spec=str(spec), quiet=True)
    assert sorted(values) == ["worker-0", "worker-1"]
    [run_dir] = (tmp / "runs").iterdir()
    record = json.loads((run_dir / "run.json").read_text())
    written = json.dumps(record)
    assert '"workers": "1:2"' in written and '"batch": "per_worker"' in written
