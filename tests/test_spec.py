"""Spec validation: every malformed spec is one line with the file, the JSON path and what is expected."""

from __future__ import annotations

import json
import socket

import pytest

from conftest import distlaunch, write_spec
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec.model import json_schema, load_spec

GOOD = {
    "name": "t",
    "strategy": "multi_worker_mirrored",
    "program": {"script": "task.py"},
    "tasks": {"worker": {"count": 2}},
}


def _spec(tmp, text: str):
    (tmp / "task.py").write_text("print('hi')\n")
    path = tmp / "spec.json"
    path.write_text(text)
    return path


def _with(**changes) -> str:
    spec = json.loads(json.dumps(GOOD))
    for dotted, value in changes.items():
        node = spec
        *parents, last = dotted.split("__")
        for key in parents:
            node = node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return json.dumps(spec)


_DELETE = object()

BAD = [
    ("bad JSON", '{"name": "t",', "$", "invalid JSON at line 1"),
    ("not an object", "[1, 2]", "$", "expected a JSON object"),
    ("unknown key", _with(colour="red"), "$.colour", "unknown key 'colour'"),
    (
        "unknown nested key",
        _with(program__scirpt="x.py"),
        "$.program.scirpt",
        "unknown key 'scirpt'",
    ),
    (
        "unknown task key",
        _with(tasks__worker=[{"prot": 1}]),
        "$.tasks.worker[0].prot",
        "unknown key 'prot'",
    ),
    (
        "wrong type",
        _with(tasks__worker={"count": "2"}),
        "$.tasks.worker.count",
        'expected an integer, got "2"',
    ),
    (
        "wrong type in list",
        _with(program__args=[1]),
        "$.program.args[0]",
        "expected a string, got 1",
    ),
    (
        "bad strategy",
        _with(strategy="mirrored"),
        "$.strategy",
        '"multi_worker_mirrored" or "parameter_server", got "mirrored"',
    ),
    ("missing name", _with(name=_DELETE), "$.name", "required key is missing"),
    (
        "duplicate ports",
        _with(tasks__worker=[{"port": 5000}, {"port": 5000}]),
        "$.tasks.worker[1].port",
        "port 5000 is already used",
    ),
    (
        "fixed port for many",
        _with(tasks__worker={"count": 2, "port": 5000}),
        "$.tasks.worker.port",
        "a fixed port needs one task",
    ),
    (
        "port out of range",
        _with(tasks__worker=[{"port": 70000}]),
        "$.tasks.worker[0].port",
        '"auto" or a port number',
    ),
    (
        "missing script",
        _with(program__script="nope.py"),
        "$.program.script",
        "expected an existing script file",
    ),
    (
        "script and module",
        _with(program__module="m"),
        "$.program.module",
        'exactly one of "script" or "module"',
    ),
    (
        "unknown role",
        _with(tasks={"master": {"count": 1}}),
        "$.tasks.master",
        "unknown key 'master'; expected one of: chief, worker, ps, evaluator",
    ),
    (
        "zero workers",
        _with(tasks__worker={"count": 0}),
        "$.tasks.worker.count",
        "expected an integer from 1 to 4096, got 0",
    ),
    ("no tasks", _with(tasks={}), "$.tasks", "expected at least one worker"),
    (
        "ps under MWMS",
        _with(tasks={"worker": {"count": 1}, "ps": {"count": 1}}),
        "$.tasks.ps",
        "need strategy parameter_server",
    ),
    (
        "PS without ps",
        _with(strategy="parameter_server", tasks={"chief": {}, "worker": {"count": 2}}),
        "$.tasks.ps",
        "needs at least one ps",
    ),
    (
        "PS without chief",
        _with(strategy="parameter_server", tasks={"ps": {}, "worker": {"count": 2}}),
        "$.tasks.chief",
        "needs a chief",
    ),
    (
        "two evaluators",
        _with(tasks={"worker": {"count": 1}, "evaluator": {"count": 2}}),
        "$.tasks.evaluator.count",
        "expected 1 (the role has one task), got 2",
    ),
    (
        "evaluator listed twice",
        '{"name": "t", "strategy": "multi_worker_mirrored", "program": {"script": "task.py"}, '
        '"tasks": {"worker": {"count": 1}, "evaluator": {}, "evaluator": {}}}',
        "$.tasks.evaluator",
        "appears twice",
    ),
    (
        "gpu overlap",
        _with(tasks__worker=[{"gpus": [0, 1]}, {"gpus": [1]}]),
        "$.tasks.worker[1].gpus",
        "never share a GPU",
    ),
    ("bad gpus", _with(tasks__worker=[{"gpus": "all"}]), "$.tasks.worker[0].gpus", "GPU count"),
    (
        "negative timeout",
        _with(timeouts={"startup_s": -1}),
        "$.timeouts.startup_s",
        "greater than 0",
    ),
    (
        "reserved env",
        _with(program__env={"TF_CONFIG": "{}"}),
        "$.program.env.TF_CONFIG",
        "set by distlaunch",
    ),
    (
        "unknown host",
        _with(tasks__worker=[{"host": "node7"}]),
        "$.tasks.worker[0].host",
        "unknown host 'node7'; expected one of: localhost",
    ),
]


@pytest.mark.quick
@pytest.mark.parametrize("case,text,path,expected", BAD, ids=[c[0] for c in BAD])
def test_bad_spec_is_one_line_with_path_and_exit_2(tmp, case, text, path, expected):
    spec = _spec(tmp, text)
    for command in (["validate"], ["plan"], ["up"]):
        result = distlaunch(*command, str(spec), cwd=tmp)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith(f"distlaunch: error: {spec}: {path}: "), lines[0]
        assert expected in lines[0], lines[0]
        assert "Traceback" not in result.stderr
    # Nothing was started and nothing was written.
    assert not (tmp / "runs").exists()


@pytest.mark.quick
def test_port_in_use_is_a_spec_error(tmp):
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    try:
        # Isolated runs get a private network namespace where every port is free: this check
        # is for runs on the host's network.
        spec = _spec(tmp, _with(tasks__worker=[{"port": busy.getsockname()[1]}], isolation="off"))
        result = distlaunch("up", str(spec), cwd=tmp)
    finally:
        busy.close()
    assert result.returncode == 2
    assert "$.tasks.worker[0].port: port" in result.stderr and "is in use" in result.stderr
    assert not (tmp / "runs").exists()


@pytest.mark.quick
def test_missing_file(tmp):
    result = distlaunch("validate", str(tmp / "nope.json"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"distlaunch: error: {tmp / 'nope.json'}: $: no such file"


@pytest.mark.quick
def test_relative_paths_resolve_against_the_spec_folder(tmp):
    (tmp / "sub").mkdir()
    (tmp / "sub" / "task.py").write_text("")
    spec = write_spec(
        tmp / "sub", program={"script": "task.py", "workdir": "."}, shared_dir="../out"
    )
    loaded = load_spec(spec)
    assert loaded.script == (tmp / "sub" / "task.py").resolve()
    assert loaded.workdir == (tmp / "sub").resolve()
    assert loaded.shared_dir == (tmp / "out").resolve()


@pytest.mark.quick
def test_good_spec_validates(tmp):
    spec = _spec(tmp, json.dumps(GOOD))
    result = distlaunch("validate", str(spec))
    assert result.returncode == 0
    assert "ok (multi_worker_mirrored; 2 worker)" in result.stdout


@pytest.mark.quick
def test_spec_error_is_typed(tmp):
    with pytest.raises(SpecError) as info:
        load_spec(_spec(tmp, _with(tasks__worker={"count": 0})))
    assert info.value.json_path == "$.tasks.worker.count"


@pytest.mark.quick
def test_schema_is_published():
    result = distlaunch("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert schema == json_schema()
    assert {"name", "strategy", "program", "tasks"} <= set(schema["required"])
    assert schema["additionalProperties"] is False


def test_every_example_spec_validates():
    from conftest import REPO

    for spec in sorted((REPO / "cluster_specs").glob("*.json")):
        result = distlaunch("validate", str(spec))
        assert result.returncode == 0, (spec, result.stderr)


@pytest.mark.quick
def test_values_are_checked_as_written(tmp):
    # A number field shows the value as written; a pattern's "$" ends the text (a trailing
    # newline does not match); an integral float is the integer JSON Schema says it is; no
    # number is infinite; a key must be a string.
    cases = [
        (
            _with(timeouts={"startup_s": 0}),
            "$.timeouts.startup_s: expected a number greater than 0 and at most 2147483647, got 0",
        ),
        (
            _with(name="t\n"),
            "$.name: expected a name of letters, digits, '.', '-', '_' (at most 64 characters), "
            'got "t\\n"',
        ),
        (
            _with(timeouts={"grace_s": float("inf")}),
            "$.timeouts.grace_s: expected a finite number, got Infinity",
        ),
    ]
    for text, expected in cases:
        spec = _spec(tmp, text)
        with pytest.raises(SpecError) as info:
            load_spec(spec)
        assert str(info.value) == f"{spec}: {expected}"
    loaded = load_spec(_spec(tmp, _with(restart={"max_restarts": 2.0})))
    assert loaded.spec.restart.max_restarts == 2
    assert type(loaded.spec.restart.max_restarts) is int
    yaml_spec = tmp / "spec.yaml"
    yaml_spec.write_text(
        "name: t\nstrategy: multi_worker_mirrored\nprogram: {script: task.py}\n"
        "tasks: {worker: {count: 1}}\nhosts: {1: {}}\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(yaml_spec)
    assert "expected string keys, got 1" in str(info.value)
