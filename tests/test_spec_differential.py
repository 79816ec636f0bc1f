"""`validate` against `distlaunch schema` read by the reference validator (the `jsonschema`
library), on thousands of generated specs: a few valid bases with each value set to wrong
ones, unknown keys at every level, keys removed, YAML 1.1/1.2 scalars, tags, merge keys and
directives, and `--set` values.

For every spec: no traceback; the compiled checker and `jsonschema` agree exactly; `validate`
refuses what the schema refuses, and what it refuses beyond the schema is a rule no schema can
state (the listed cross-field and file checks). Every accepted spec goes through `plan --json`,
`tfconfig`, the compose file and the k8s manifests in-process, and every manifest passes
kubernetes-validate with its integers in the API server's int32/int64 ranges. The counts are
printed (`pytest -s` shows them).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner

from distlaunch.launcher.cli import cli
from distlaunch.launcher.core.errors import LaunchError, SpecError, UsageError
from distlaunch.launcher.export import k8s
from distlaunch.launcher.plan import tfconfig
from distlaunch.launcher.run.up import build_plan, choose_run
from distlaunch.launcher.spec import files, model, typed
from distlaunch.launcher.spec.sources import SpecOptions, apply_overrides
from distlaunch.launcher.transports.compose import file as compose
from test_k8s import validate as k8s_validate

# What `validate` may refuse beyond the schema: rules no JSON Schema can state.
BEYOND_SCHEMA = re.compile(
    "|".join(
        [
            r"unknown host ",  # a task's host must be a key of `hosts`
            r"is already used by",  # one port per machine
            r"never share a GPU",  # GPU lists of tasks on one machine
            r"tasks in all",  # the sum over roles
            r"expected one (chief|evaluator) task",  # after per_host spread them
            r"per_host needs hosts",
            r"tasks do not fit on",
            r"makes \d+ tasks",
            r"a fixed port needs one task; use",  # per_host over several hosts
            r"expected an existing",  # files and folders
            r"expected an executable interpreter",
            r"cannot reach a task on",  # loopback tasks beside SSH tasks
            r"runs tasks on the allocation's nodes",  # Slurm and `hosts`
            r"under Slurm",
            r"has slots=",
            # An elastic range against the worker role's tasks, and the backend that runs it.
            r"expected MIN <= MAX",
            r"more workers than the hosts can hold",
            r"is more than tasks\.worker's",
            r"expected at least one size within",
            r"cannot resize a run",
            r"an elastic run ranges over the worker role's tasks",
            r"expected at least elastic\.cooldown_s",  # the cooldown's cap below its start
        ]
    )
)

BASES: list[dict[str, Any]] = [
    {
        "name": "count",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py", "args": ["--epochs", "1"], "env": {"A": "1"}},
        "tasks": {"worker": {"count": 2, "gpus": 0, "cpus": "auto"}},
        "shared_dir": "runs",
        "timeouts": {"startup_s": 60, "grace_s": 2, "run_s": 600},
        "forward_env": ["NCCL_*"],
    },
    {
        "name": "lists",
        "strategy": "parameter_server",
        "program": {"module": "pkg.train", "keras": "tf_keras"},
        "hosts": {
            "me": {"transport": "local", "address": "10.0.0.1"},
            "n1.example": {"address": "10.0.0.2", "user": "u", "port": 22, "ssh_options": ["A=b"]},
        },
        "tasks": {
            "chief": [{"host": "me", "port": 2222}],
            "worker": [{"host": "n1.example", "gpus": [0, 1], "cpus": [0, 1]}, {"host": "me"}],
            "ps": {"count": 1, "host": "n1.example"},
            "evaluator": {"host": "me"},
        },
        "shared_dir": "runs",
        "restart": {"policy": "on-failure", "max_restarts": 2, "backoff": {"max_s": 5}},
    },
    {
        "name": "perhost",
        "strategy": "multi_worker_mirrored",
        "program": {"module": "m"},
        "hosts": {"a": {"address": "10.0.0.3"}, "b": {"address": "10.0.0.4"}},
        "tasks": {"worker": {"per_host": 2, "gpus": 1}},
        "shared_dir": "runs",
        "network": {"protect": "off"},
    },
    {
        "name": "k8s",
        "strategy": "multi_worker_mirrored",
        "program": {"module": "m"},
        "tasks": {"chief": {}, "worker": {"count": 3}},
        "shared_dir": "runs",
        "kubernetes": {"namespace": "ml", "ttl_s": 600, "cpu": "2", "memory": "8Gi"},
        "restart": {"policy": "on-failure", "non_retryable_exit_codes": [2, 3]},
        "timeouts": {"save_s": 10, "run_s": 3600.5},
    },
    {
        "name": "elastic",
        "strategy": "multi_worker_mirrored",
        "program": {"module": "m"},
        "hosts": {"a": {"address": "10.0.0.5"}, "b": {"address": "10.0.0.6"}, "c": {}},
        # A list: per_host 1025 over three hosts would pick 3075 ports (the perhost base's).
        "tasks": {"worker": [{"host": "a"}, {"host": "b"}, {"host": "c"}]},
        "shared_dir": "runs",
        "elastic": {
            "workers": "2:3",
            "sizes": [2, 3],
            "batch": "per_worker",
            "resizes": 4,
            "lost_after_s": 5,
            "settle_s": 0,
            "interval_s": 10.5,
            "cooldown_s": 1,
            "cooldown_max_s": 60,
            "probe_s": 2,
        },
    },
]

WRONG: list[Any] = [
    None,
    True,
    0,
    -1,
    2.0,
    2.5,
    1025,
    4097,
    65536,
    2**31,
    2**63,
    1e308,
    "",
    "all",
    "a b",
    "a\0b",
    "t\n",
    "x" * 300,
    [],
    [0, 0],
    {"zz": 1},
]

# YAML scalars as written, read as YAML 1.2 (or refused): each replaces one value of a base.
YAML_SCALARS = [
    "0222",  # YAML 1.2: decimal 222 (YAML 1.1: octal); 1025 (WRONG) is the big cluster exported
    "0o17",
    "0x10",
    "010",
    "1:30:00",
    "2024-03-01T08:00:00Z",
    "yes",
    "off",
    "~",
    ".inf",
    ".nan",
    "1e3",
    "+5",
    "1_000",
    "0b101",
    "=",
    "!!str 5",
    "!!int 5",
    "!!int abc",
    "!!float x",
    "!!bool maybe",
    "!!binary aGk=",
    "!!timestamp 2020-99-99",
    "!local x",
    "!!python/object/apply:os.system [ls]",
    "&a 5",
    "*nope",
    "'5'",
    "[1, 010]",
    "{count: 2.0}",
    "1" + "0" * 120,
]

OVERRIDES = [
    "tasks.worker.count=3",
    "tasks.worker.count=4097",
    "tasks.worker={per_host: 3}",
    "tasks.worker.port=017",
    "tasks.worker.gpus=[0]",
    "name.x=1",
    "name=[1]",
    "timeouts.run_s=1e3",
    "timeouts.grace_s=.inf",
    "forward_env=[A]",
    "program.env.B=2",
    "program.env.TF_CONFIG=x",
    "program.args=[--x, '1']",
    "kubernetes.ttl_s=2147483648",
    "restart.max_restarts=-1",
    "hosts.zz={}",
    "tasks.ps=null",
    "strategy=parameter_server",
    "program.script=!!binary aGk=",
    "backend=nope",
    "backend=slurm",
    "backend=compose",
    "elastic.workers=3:2",
    "elastic.workers=1:4",
    "elastic.workers='4:'",
    "elastic.workers='1:'",
    "elastic.sizes=[5]",
    "elastic=null",
    "tasks.worker={count: 2}",
]


def _ecma_pattern(validator, pattern, instance, schema):
    """JSON Schema's `pattern` with ECMA-262's `$` (the end of the text), as the spec says:
    Python's `$` also matches before a final newline, which the reference library keeps."""
    if isinstance(instance, str) and not re.search(pattern.replace("$", r"\Z"), instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


REFERENCE = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {"pattern": _ecma_pattern}
)


def _paths(node: Any, loc: tuple = ()) -> list[tuple]:
    out = [loc] if loc else []
    if isinstance(node, dict):
        for key, child in node.items():
            out += _paths(child, (*loc, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            out += _paths(child, (*loc, i))
    return out


def _set(spec: Any, loc: tuple, value: Any) -> Any:
    out = copy.deepcopy(spec)
    node = out
    for part in loc[:-1]:
        node = node[part]
    node[loc[-1]] = value
    return out


def _remove(spec: Any, loc: tuple) -> Any:
    out = copy.deepcopy(spec)
    node = out
    for part in loc[:-1]:
        node = node[part]
    del node[loc[-1]]
    return out


def _cases() -> list[tuple[str, Any, tuple[str, ...]]]:
    """(kind, content, overrides): kind "json" (data) or "yaml" (text)."""
    cases: list[tuple[str, Any, tuple[str, ...]]] = []
    for base in BASES:
        cases.append(("json", base, ()))
        for loc in _paths(base):
            for value in WRONG:
                cases.append(("json", _set(base, loc, value), ()))
            cases.append(("json", _remove(base, loc), ()))
        for loc in [(), *_paths(base)]:
            node = base
            for part in loc:
                node = node[part]
            if isinstance(node, dict):
                cases.append(("json", _set(base, (*loc, "zz_unknown"), 1), ()))
        for text in OVERRIDES:
            cases.append(("json", base, (f"{text}",)))
        # YAML: the base as YAML's JSON subset, one value written as a YAML scalar.
        leaves = [loc for loc in _paths(base) if not isinstance(_get(base, loc), dict | list)]
        for loc, scalar in itertools.product(leaves[:5], YAML_SCALARS):
            marker = "@@scalar@@"
            text = json.dumps(_set(base, loc, marker), indent=1).replace(f'"{marker}"', scalar)
            cases.append(("yaml", text, ()))
        body = json.dumps(base, indent=1)
        cases += [
            ("yaml", "%YAML 1.2\n---\n" + body, ()),
            ("yaml", "%YAML 1.1\n---\n" + body, ()),
            ("yaml", "%TAG !e! tag:e.com,2000:\n---\n" + body, ()),
            ("yaml", "anchor: &a {x: 1}\n" + body, ()),
            ("yaml", body[:-1] + ', "<<": {"name": "y"}}', ()),
            ("yaml", "x: &a {b: 1}\ny: {<<: *a}\n", ()),
            ("yaml", body.replace('"name"', "? name"), ()),
        ]
    return cases


def _get(node: Any, loc: tuple) -> Any:
    for part in loc:
        node = node[part]
    return node


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    error = result.exception
    if isinstance(error, LaunchError):
        return 2 if isinstance(error, SpecError | UsageError) else 1, result.output, str(error)
    assert error is None or isinstance(error, SystemExit), (args, repr(error))  # a traceback
    return result.exit_code, result.output, ""


def _ints_in_range(node: Any, where: str = "") -> None:
    """Every integer of a manifest fits the API server's fields: int64 for the durations, else
    int32."""
    if isinstance(node, dict):
        for key, child in node.items():
            _ints_in_range(child, key)
    elif isinstance(node, list):
        for child in node:
            _ints_in_range(child, where)
    elif isinstance(node, int) and not isinstance(node, bool):
        wide = where in ("activeDeadlineSeconds", "terminationGracePeriodSeconds")
        bound = 2**63 if wide else 2**31
        assert -bound <= node < bound, (where, node)


@pytest.mark.timeout(900)
def test_validate_and_the_schema_agree_on_generated_specs(tmp):
    (tmp / "task.py").write_text("")
    schema = model.json_schema()
    reference = REFERENCE(schema)
    counts: Counter[str] = Counter()
    beyond: Counter[str] = Counter()
    manifests_seen: set[str] = set()
    cases = _cases()
    for n, (kind, content, overrides) in enumerate(cases):
        path = tmp / f"spec{n % 7}.{kind}"
        path.write_text(json.dumps(content) if kind == "json" else content)
        sets = [arg for text in overrides for arg in ("--set", text)]
        code, _, line = _run("validate", str(path), *sets)
        assert code in (0, 2), (content, overrides, line)
        assert "\n" not in line.strip() and "Traceback" not in line
        counts["specs"] += 1
        counts["accepted" if code == 0 else "refused"] += 1
        # The data the schema is about: the spec as read, with its overrides.
        try:
            source = files.read(path, str(path))
            apply_overrides(source, overrides, str(path))
        except (SpecError, UsageError):
            assert code == 2
            counts["refused while reading (YAML, JSON, --set)"] += 1
            continue
        data = source.raw
        theirs = reference.is_valid(data)
        try:
            typed.check_schema(copy.deepcopy(data), str(path))
            ours = True
        except SpecError:
            ours = False
        assert ours == theirs, (kind, content, overrides, line)
        if not theirs:
            assert code == 2, (content, overrides)
            counts["refused by the schema (both)"] += 1
            continue
        if code == 2:
            assert BEYOND_SCHEMA.search(line), (content, overrides, line)
            beyond[BEYOND_SCHEMA.search(line).group(0)] += 1
            counts["refused beyond the schema (cross-field, files)"] += 1
            continue
        _exports(path, sets, counts, manifests_seen)
    print(f"\n{dict(counts)}\nbeyond the schema: {dict(beyond)}")
    assert counts["specs"] >= 2000
    assert counts["accepted"] >= 200 and counts["refused by the schema (both)"] >= 1000


def _exports(path: Path, sets: list[str], counts: Counter, seen: set[str]) -> None:
    """An accepted spec through plan --json, tfconfig, compose and k8s: no traceback; the
    manifests valid for Kubernetes."""
    code, out, line = _run("plan", "--json", str(path), *sets)
    counts[f"plan --json exit {code}"] += 1
    options = SpecOptions(overrides=tuple(sets[1::2]))
    loaded = model.load_spec(path, options)
    if code == 0:
        first = json.loads(out)["tasks"][0]["name"]
        if sets:  # `tfconfig` takes no --set: its functions, as the command calls them
            the_plan = build_plan(loaded, choose_run(loaded, None, False))
            json.loads(tfconfig.dumps(the_plan.task(first).tf_config))
        else:
            code, _, line = _run("tfconfig", str(path), first.replace("-", ":"))
            assert code == 0, line
        counts["tfconfig ok"] += 1
    try:
        target = choose_run(loaded, "diff-1", False)
        plan = compose.compose_plan(loaded, target.run_id, target.run_dir, target.attempt)
        compose.compose_file(loaded, plan, "img", "0:0")
        counts["compose ok"] += 1
    except LaunchError:
        counts["compose refused (one line)"] += 1
    try:
        made = k8s.manifests(loaded, "diff-1", "img:1", None, False)
    except LaunchError:
        counts["k8s refused (one line)"] += 1
        return
    counts["k8s ok"] += 1
    for obj in made.objects:
        _ints_in_range(obj)
        key = json.dumps(obj, sort_keys=True)
        if key not in seen:  # identical manifests are validated once
            seen.add(key)
            k8s_validate(obj)
            counts["k8s objects validated"] += 1
