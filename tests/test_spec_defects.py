"""The nine defects of issue 37, each as the input that showed it: every one is now one line
(file, JSON path, the YAML line, what was expected; "(set by --set ...)" where an override
caused it), exit 2, and nothing built before the bounds are checked. In-process (click's
runner): no subprocess, no TensorFlow."""

from __future__ import annotations

import json
import resource
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from distlaunch.launcher.cli import cli, exit_code
from distlaunch.launcher.core.errors import LaunchError, SpecError
from distlaunch.launcher.spec.model import json_schema, load_spec
from distlaunch.launcher.spec.sources import SpecOptions

pytestmark = pytest.mark.quick

BASE = {
    "name": "t",
    "strategy": "multi_worker_mirrored",
    "program": {"module": "m"},
    "tasks": {"worker": {"count": 2}},
    "shared_dir": "runs",
}


def run(*args: str) -> tuple[int, str, str]:
    """The CLI in-process: (exit code, stdout, the error line as `main` prints it)."""
    result = CliRunner().invoke(cli, list(args))
    error = result.exception
    if isinstance(error, LaunchError):
        return exit_code(error), result.output, f"distlaunch: error: {error}"
    assert error is None or isinstance(error, SystemExit), repr(error)  # a traceback
    return result.exit_code, result.output, ""


def spec_file(tmp: Path, text: str, name: str = "spec.json") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def refused(tmp: Path, text: str, *more: str, name: str = "spec.json", cmd="validate") -> str:
    """The one error line of a spec that must be refused with exit 2."""
    code, _, line = run(cmd, str(spec_file(tmp, text, name)), *more)
    assert code == 2, line
    assert "\n" not in line and "Traceback" not in line
    return line


def test_1_per_host_is_bounded_before_it_is_spread(tmp):
    # Was: 23 s and 1.4 GB before "expected at most 4096 tasks"; 1e9 a MemoryError.
    spec = {**BASE, "hosts": {"a": {}, "b": {}}, "tasks": {"worker": {"per_host": 2_000_000}}}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    # 4 GiB of address space is room for the test run, not for 2 million tasks.
    done = threading.Event()
    try:
        resource.setrlimit(resource.RLIMIT_AS, (min(4 << 30, hard) if hard > 0 else 4 << 30, hard))
        line = refused(tmp, json.dumps(spec))
        done.set()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert done.is_set()
    assert "$.tasks.worker.per_host: expected an integer from 1 to 4096, got 2000000" in line
    line = refused(
        tmp, json.dumps({**spec, "tasks": {}}), "--set", "tasks.worker={per_host: 1000000000}"
    )
    assert "$.tasks.worker.per_host" in line and "(set by --set" in line
    # Within each bound, but their product is not: refused before a task is made.
    many = {f"h{i}": {} for i in range(100)}
    line = refused(tmp, json.dumps({**spec, "hosts": many, "tasks": {"worker": {"per_host": 50}}}))
    assert "per_host 50 on 100 hosts makes 5000 tasks; expected at most 4096" in line
    # A host file is bounded too.
    (tmp / "hosts.txt").write_text("".join(f"n{i}\n" for i in range(5000)))
    spec = {**BASE, "hostfile": "hosts.txt", "tasks": {"worker": {"per_host": 1}}}
    assert "expected at most 4096 hosts" in refused(tmp, json.dumps(spec))


def test_2_the_schema_takes_the_spec_as_written(tmp):
    import jsonschema

    validator = jsonschema.Draft202012Validator(json_schema())
    count_form = {**BASE, "tasks": {"worker": {"count": 2, "gpus": 1, "cpus": 2}}}
    list_form = {**BASE, "tasks": {"worker": [{"port": 2222}, {"gpus": [0], "cpus": [0, 1]}]}}
    per_host = {**BASE, "hosts": {"a": {}}, "tasks": {"worker": {"per_host": 2}}}
    for spec in (count_form, list_form, per_host):
        assert list(validator.iter_errors(spec)) == []
    # The internal model is not a spec.
    assert not validator.is_valid({**BASE, "tasks": {"worker": {"entries": [{}]}}})


@pytest.mark.parametrize(
    "change,path,expected",
    [
        ({"tasks": {"worker": {"count": 4097}}}, "$.tasks.worker.count", "from 1 to 4096"),
        ({"tasks": {"worker": [{"gpus": 1025}]}}, "$.tasks.worker[0].gpus", "GPU count"),
        ({"program": {"module": "a b"}}, "$.program.module", "dotted module name"),
        ({"program": {"script": "x.py", "module": "m"}}, "$.program.module", "exactly one of"),
        ({"program": {}}, "$.program.module", "exactly one of"),
        ({"program": {"module": "m", "env": {"": "x"}}}, '$.program.env[""]', "environment name"),
        (
            {"program": {"module": "m", "env": {"DISTLAUNCH_X": "1"}}},
            "$.program.env.DISTLAUNCH_X",
            "set by distlaunch",
        ),
        ({"program": {"module": "m", "args": ["a\0b"]}}, "$.program.args[0]", "NUL"),
        (
            {"hosts": {"n": {"ssh_options": ["batchmode=no"]}}},
            "$.hosts.n.ssh_options[0]",
            "set by distlaunch",
        ),
        ({"tasks": {"worker": {"count": 2, "port": 2222}}}, "$.tasks.worker.port", "fixed port"),
        ({"tasks": {"worker": {"count": 1}, "ps": {}}}, "$.tasks.ps", "parameter_server"),
    ],
)
def test_3_the_schema_states_what_validate_checks(tmp, change, path, expected):
    import jsonschema

    spec = {**BASE, **change}
    line = refused(tmp, json.dumps(spec))
    assert f": {path}: " in line and expected in line, line
    validator = jsonschema.Draft202012Validator(json_schema())
    assert validator.is_valid(BASE) and not validator.is_valid(spec)


YAML_BASE = "name: t\nstrategy: multi_worker_mirrored\nprogram: {module: m}\nshared_dir: runs\n"


@pytest.mark.parametrize(
    "body,expected",
    [
        ("base: &b {count: 1}\ntasks:\n  worker:\n    <<: *b\n", ":8: $.tasks.worker: merge keys"),
        ("tasks: {worker: {count: 1}}\nx: =\n", "unknown key 'x'"),
        ("tasks: {worker: {count: !local 1}}\n", "$.tasks.worker.count: unsupported YAML tag"),
        ("tasks: {worker: {count: !!int abc}}\n", "!!int 'abc': expected a YAML 1.2 int"),
        ("tasks: {worker: {count: 1}}\ntimeouts: {run_s: !!float x}\n", "!!float 'x'"),
        ("tasks: {worker: {count: 1}}\nshared_dir_is_shared: !!bool maybe\n", "!!bool 'maybe'"),
        (
            "tasks: {worker: {count: 1}}\nisolation: !!timestamp 2020-99-99\n",
            "unsupported YAML tag",
        ),
        (
            "%TAG !e! tag:example.com,2000:\n---\ntasks: {worker: {count: !e!x 1}}\n",
            "unsupported YAML tag",
        ),
        (
            "tasks: {worker: {count: 1}}\nforward_env: !!python/object/apply:os.system [ls]\n",
            "$.forward_env: unsupported YAML tag",
        ),
    ],
)
def test_4_yaml_a_loader_cannot_build_is_one_line(tmp, body, expected):
    directives, _, doc = body.rpartition("---\n")
    text = f"{directives}---\n{YAML_BASE}{doc}" if directives else YAML_BASE + body
    line = refused(tmp, text, name="spec.yaml")
    assert expected in line, line
    code, _, line = run(
        "validate",
        str(spec_file(tmp, YAML_BASE + "tasks: {worker: {count: 1}}\n", "ok.yaml")),
        "--set",
        "tasks.worker.count=!!int abc",
    )
    assert code == 2 and "!!int 'abc'" in line, line


def test_5_yaml_is_read_as_1_2(tmp):
    text = (
        YAML_BASE.replace("program: {module: m}\n", "")
        + "program:\n  module: m\n  args: [2024-03-01T08:00:00Z, 1:30:00]\n"
        + "tasks:\n  worker: [{port: 02222, gpus: [010]}]\n"
        + "timeouts: {run_s: 1e3}\n"
    )
    loaded = load_spec(spec_file(tmp, text, "spec.yaml"))
    assert loaded.spec.program.args == ("2024-03-01T08:00:00Z", "1:30:00")
    (entry,) = loaded.spec.tasks.by_role()["worker"]
    assert entry.port == 2222 and entry.gpus == (10,)
    assert loaded.spec.timeouts.run_s == 1000.0
    spec = spec_file(tmp, YAML_BASE + "tasks: {worker: {count: 1}}\n", "s.yaml")
    options = SpecOptions(overrides=("tasks.worker=[{port: 017}]", "timeouts.run_s=1e3"))
    loaded = load_spec(spec, options)
    assert loaded.spec.tasks.by_role()["worker"][0].port == 17
    assert loaded.spec.timeouts.run_s == 1000.0
    line = refused(
        tmp, "%YAML 1.1\n---\n" + YAML_BASE + "tasks: {worker: {count: 1}}\n", name="v.yaml"
    )
    assert "expected YAML 1.2, got %YAML 1.1" in line
    line = refused(
        tmp,
        YAML_BASE + "tasks: {worker: {count: 1}}\nisolation: !!binary aGVsbG8=\n",
        name="b.yaml",
    )
    assert "unsupported YAML tag" in line


def test_6_a_long_integer_is_no_string(tmp):
    digits = "1" + "0" * 120
    for text in (
        json.dumps({**BASE, "program": {"module": "m", "args": ["x"]}}).replace('"x"', digits),
        YAML_BASE + f"tasks: {{worker: {{count: 1}}}}\nisolation: {digits}\n",
    ):
        name = "spec.json" if text.startswith("{") else "spec.yaml"
        line = refused(tmp, text, name=name)
        assert "expected a number of at most 100 digits, got one of 121" in line, line


def test_7_no_traceback_for_long_names_or_list_hosts(tmp):
    long = "x" * 300
    for shared in (long, f"missing/{long}", f"{long}/runs"):
        line = refused(tmp, json.dumps({**BASE, "shared_dir": shared}))
        assert "$.shared_dir: expected path components of at most 255 characters" in line
    for command in ("compose", "k8s"):
        line = refused(tmp, json.dumps({**BASE, "shared_dir": f"missing/{long}"}), cmd=command)
        assert "$.shared_dir" in line
    spec = {
        **BASE,
        "hosts": {"a": {}, "b": {}},
        "tasks": {"worker": [{"host": ["a", "b"]}]},
    }
    for flag in ("--hosts", "--exclude"):
        line = refused(tmp, json.dumps(spec), flag, "a", cmd="plan")
        assert "$.tasks.worker[0].host: expected a string" in line, line


def test_8_numbers_in_the_exports_are_bounded(tmp):
    for change, path in (
        ({"timeouts": {"save_s": 1e308}}, "$.timeouts.save_s"),
        ({"timeouts": {"grace_s": 1e308}}, "$.timeouts.grace_s"),
        ({"kubernetes": {"ttl_s": 2**31}}, "$.kubernetes.ttl_s"),
        ({"restart": {"max_restarts": 2**31}}, "$.restart.max_restarts"),
        ({"timeouts": {"run_s": 2**63}}, "$.timeouts.run_s"),
    ):
        line = refused(tmp, json.dumps({**BASE, **change}), cmd="k8s")
        assert f": {path}: expected" in line and "2147483647" in line, line
    from distlaunch.launcher.run.up import build_plan, choose_run
    from distlaunch.launcher.transports.compose import file as compose

    spec = {**BASE, "timeouts": {"grace_s": 1234567, "save_s": 1}}
    loaded = load_spec(spec_file(tmp, json.dumps(spec)))
    target = choose_run(loaded, None, False)
    plan = compose.compose_plan(loaded, target.run_id, target.run_dir, target.attempt)
    data = compose.compose_file(loaded, plan, "img", "0:0")
    assert {s["stop_grace_period"] for s in data["services"].values()} == {"1234567s"}
    assert build_plan  # the plan the compose file is made from is the launcher's own


def test_9_messages_say_what_caused_them(tmp):
    path = spec_file(tmp, json.dumps(BASE))
    code, _, line = run("validate", str(path), "--set", "name.x=1")
    assert code == 2
    assert "$.name: --set name.x=1: cannot set a key in 't'" in line, line
    code, _, line = run("validate", str(path), "--set", "tasks.worker=[{port: x}]")
    assert "$.tasks.worker[0].port" in line and "(set by --set tasks.worker=[{port: x}])" in line
    # An error at a parent of the --set path names the override.
    yaml = spec_file(tmp, YAML_BASE + "tasks:\n  worker: {count: 2}\n", "s.yaml")
    code, _, line = run("validate", str(yaml), "--set", "tasks.worker.port=2222")
    assert "$.tasks.worker.port: a fixed port needs one task" in line
    assert "(set by --set tasks.worker.port=2222)" in line and "s.yaml:6" in line, line
    code, _, line = run(
        "validate", str(path), "--set", "forward_env=[x]", "--set", "forward_env.0=*"
    )
    assert code == 2 and "\\x00" not in line and "quote it" in line, line
    # per_host errors show JSON, not Python reprs.
    line = refused(
        tmp, json.dumps({**BASE, "hosts": {"a": {}}, "tasks": {"worker": {"per_host": True}}})
    )
    assert "got true" in line and "True" not in line
    line = refused(
        tmp, json.dumps({**BASE, "hosts": {"a": {}}, "tasks": {"worker": {"per_host": "2"}}})
    )
    assert 'got "2"' in line and "'2'" not in line
    # A count with a GPU list says what conflicts, not "GPU 0 is already given to" itself.
    line = refused(tmp, json.dumps({**BASE, "tasks": {"worker": {"count": 2, "gpus": [0]}}}))
    assert "$.tasks.worker.gpus: a GPU list for several tasks on one host" in line, line
    # Odd keys are quoted in paths.
    line = refused(tmp, json.dumps({**BASE, "hosts": {"bad name": {}}}))
    assert '$.hosts["bad name"]: expected a host name' in line, line
    line = refused(tmp, json.dumps({**BASE, "hosts": {"n\n": {}}}))
    assert '$.hosts["n\\n"]: expected a host name' in line, line
    line = refused(tmp, json.dumps({**BASE, "hosts": {"n.example.com": {"port": 0}}}))
    assert '$.hosts["n.example.com"].port: expected an integer' in line, line


def test_errors_are_typed_from_python(tmp):
    with pytest.raises(SpecError) as info:
        load_spec(spec_file(tmp, json.dumps({**BASE, "tasks": {"worker": {"per_host": 0}}})))
    assert info.value.json_path == "$.tasks.worker.per_host"


def test_a_yaml_error_leaves_the_next_read_alone(tmp):
    # The reader stopped inside 60 levels of nesting must not count them against the next text.
    from distlaunch.launcher.spec.sources import read_yaml

    for _ in range(3):
        with pytest.raises(SpecError):
            read_yaml("a: " + "[" * 60 + "*nope", "bad.yaml")
    assert read_yaml("a: [[[1]]]\n", "ok.yaml").raw == {"a": [[[1]]]}


def test_cpus_is_read_like_gpus(tmp):
    # Issue 38 reads `entry.cpus`: a count, a tuple of CPU ids, "all" or "auto" (the default).
    spec = {
        **BASE,
        "tasks": {"worker": [{"cpus": 2}, {"cpus": [0, 3]}, {"cpus": "all"}, {}]},
    }
    entries = load_spec(spec_file(tmp, json.dumps(spec))).spec.tasks.by_role()["worker"]
    assert [e.cpus for e in entries] == [2, (0, 3), "all", "auto"]
    for cpus, expected in (
        (0, "CPU count"),
        ([1, 1], "distinct CPU ids"),
        ("some", '"auto", "all"'),
        ([], "CPU count"),
    ):
        line = refused(tmp, json.dumps({**BASE, "tasks": {"worker": [{"cpus": cpus}]}}))
        assert "$.tasks.worker[0].cpus: expected" in line and expected in line, line
    line = refused(tmp, json.dumps({**BASE, "tasks": {"worker": {"count": 2, "cpus": [0]}}}))
    assert "$.tasks.worker.cpus: a CPU list for several tasks on one host" in line
    slurm = {**BASE, "backend": "slurm", "tasks": {"worker": [{"cpus": [0]}, {"cpus": 2}]}}
    line = refused(tmp, json.dumps(slurm))
    assert '$.tasks.worker[0].cpus: expected a CPU count, "auto" or "all" under Slurm' in line
