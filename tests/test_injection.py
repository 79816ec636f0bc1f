"""Spec values are inert data: whatever a string in the spec holds reaches the task unchanged and
runs nothing; secrets in the spec's env are never printed or stored in the clear; and a run's
files are private unless the spec says otherwise.

Every payload below would run `touch "$DL_CANARY"` if any shell ever interpreted it (the launcher
is started with DL_CANARY in its environment, which the tasks inherit too); the canary file must
never exist. A tiny task echoes what it received (argv, env, cwd, its own path) as JSON.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from conftest import distlaunch, only_run_dir, write_spec
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec.model import load_spec

pytestmark = pytest.mark.quick

PAYLOADS = [
    '; touch "$DL_CANARY"',
    '&& touch "$DL_CANARY"',
    '|| touch "$DL_CANARY" |',
    '$(touch "$DL_CANARY")',
    '`touch "$DL_CANARY"`',
    "'; touch \"$DL_CANARY\"; '",
    '"; touch "$DL_CANARY"; "',
    'new\nline\ntouch "$DL_CANARY"\n',
    '> "$DL_CANARY" <',
    "$DL_CANARY ${DL_CANARY} $$ $0 * ? [a-z] ~ !! #",
    "two  spaces and\ttab",
    "back\\slash \\n \\' \\\"",
    "ünïcødé ☃ 日本語 🙂",
    "--flag=value",
    "-c",
    "%s %n {} {0} %(x)s",
    "",
]
# Payloads usable as a file name component and as an environment name.
PATH_PAYLOADS = [p for p in PAYLOADS if p]
NAME_PAYLOADS = [p for p in PAYLOADS if p and "=" not in p]

ECHO = """
import json, os, sys
out = {out!r}
record = {{"orig_argv": sys.orig_argv, "argv": sys.argv, "file": __file__, "cwd": os.getcwd(), "env": dict(os.environ)}}
with open(os.path.join(out, os.environ["DISTLAUNCH_ROLE"] + ".json"), "w", encoding="utf-8") as f:
    json.dump(record, f)
"""


def _rename(spec: Path, name: str) -> None:
    """Set the spec's `name` (write_spec's own `name` is the file's)."""
    data = json.loads(spec.read_text())
    spec.write_text(json.dumps({**data, "name": name}))


def chain(root: Path) -> Path:
    """A directory whose path holds every payload, one per level, created."""
    path = root.joinpath(*PATH_PAYLOADS)
    path.mkdir(parents=True)
    return path


@pytest.mark.integration
@pytest.mark.parametrize("isolation", ["auto", "off"])
def test_every_spec_string_reaches_the_task_unchanged(
    tmp: Path, isolation: str, capsys: pytest.CaptureFixture
) -> None:
    canary = tmp / "canary"
    out = tmp / "out"
    out.mkdir()
    workdir = chain(tmp / "w")
    script = chain(tmp / "s") / "echo.py"
    script.write_text(ECHO.format(out=str(out)))
    python = chain(tmp / "py") / "python"
    python.symlink_to(sys.executable)
    shared = tmp / "r" / Path(*PATH_PAYLOADS)
    env = {f"P{i}": p for i, p in enumerate(PAYLOADS)}
    env.update({f"N{i} {name}": name for i, name in enumerate(NAME_PAYLOADS)})
    spec = write_spec(
        tmp,
        isolation=isolation,
        tasks={"worker": {"count": 1}},
        shared_dir=str(shared.relative_to(tmp)),
        program={
            "script": str(script.relative_to(tmp)),
            "args": PAYLOADS,
            "env": env,
            "workdir": str(workdir.relative_to(tmp)),
            "python": str(python),
        },
    )
    _rename(spec, "inj.case-1_x")
    launcher_env = {**os.environ, "DL_CANARY": str(canary)}

    plan = distlaunch("plan", "--json", str(spec), env=launcher_env)
    assert plan.returncode == 0, plan.stderr
    task = json.loads(plan.stdout)["tasks"][0]
    # python, the bootstrap (by path), then the program exactly as the spec names it
    assert task["argv"][0] == str(python) and task["argv"][1].endswith("bootstrap.py")
    assert task["argv"][2:] == [str(script), *PAYLOADS]
    assert distlaunch("plan", str(spec), env=launcher_env).returncode == 0

    done = distlaunch("up", str(spec), env=launcher_env)
    assert done.returncode == 0, done.stderr
    got = json.loads((out / "worker.json").read_text(encoding="utf-8"))
    run_dir = only_run_dir(shared)
    # The process ran python, the bootstrap, then the script: sys.argv is the program's own.
    assert got["orig_argv"][0] == str(python) and got["orig_argv"][2:] == [str(script), *PAYLOADS]
    assert got["argv"] == [str(script), *PAYLOADS]
    assert got["file"] == str(script)
    assert got["cwd"] == str(workdir.resolve())
    assert {k: got["env"].get(k) for k in env} == env
    assert got["env"]["DISTLAUNCH_RUN_DIR"] == str(run_dir)
    assert got["env"]["DISTLAUNCH_RUN_ID"] == run_dir.name and run_dir.name.startswith(
        "inj.case-1_x-"
    )
    assert not canary.exists(), "a payload was run by a shell"

    fields = {
        "program.args": len(PAYLOADS),
        "program.env values": len(PAYLOADS),
        "program.env names": len(NAME_PAYLOADS),
        "program.workdir": len(PATH_PAYLOADS),
        "program.script": len(PATH_PAYLOADS),
        "program.python": len(PATH_PAYLOADS),
        "shared_dir": len(PATH_PAYLOADS),
        "name": 1,
    }
    with capsys.disabled():
        print(
            f"\ninjection (isolation {isolation}): {len(fields)} fields x up to {len(PAYLOADS)} payloads "
            f"= {sum(fields.values())} values passed through plan and up: all arrived unchanged, none ran"
        )


@pytest.mark.parametrize(
    ("where", "program", "top", "path"),
    [
        ("name", {}, {"name": 'x; touch "$DL_CANARY"'}, "$.name"),
        ("module", {"module": 'os; touch "$DL_CANARY"', "script": None}, {}, "$.program.module"),
        ("NUL in an arg", {"args": ["a\0b"]}, {}, "$.program.args[0]"),
        ("NUL in an env value", {"env": {"K": "a\0b"}}, {}, "$.program.env.K"),
        ("= in an env name", {"env": {"A=B": "x"}}, {}, '$.program.env["A=B"]'),
        ("NUL in workdir", {"workdir": "a\0b"}, {}, "$.program.workdir"),
        ("NUL in shared_dir", {}, {"shared_dir": "a\0b"}, "$.shared_dir"),
    ],
)
def test_values_a_process_cannot_carry_are_spec_errors(
    tmp: Path, where: str, program: dict, top: dict, path: str
) -> None:
    (tmp / "task.py").write_text("")
    merged = {k: v for k, v in {"script": "task.py", **program}.items() if v is not None}
    spec = write_spec(tmp, program=merged, **{k: v for k, v in top.items() if k != "name"})
    if "name" in top:
        _rename(spec, top["name"])
    with pytest.raises(SpecError) as caught:
        load_spec(spec)
    assert caught.value.json_path == path, where


def test_a_rejected_value_is_one_line_and_exit_2(tmp: Path) -> None:
    (tmp / "task.py").write_text("")
    spec = write_spec(tmp, program={"script": "task.py", "args": ["a\0b"]})
    canary = tmp / "canary"
    done = distlaunch("up", str(spec), env={**os.environ, "DL_CANARY": str(canary)})
    assert done.returncode == 2
    assert "$.program.args[0]" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp / "runs").exists() and not canary.exists()


# ---------------------------------------------------------------- secrets


# Secret by name (shown as ***) and by being a URL's password (only the password is hidden).
SECRETS = {
    "API_TOKEN": "tok-1234567",
    "DB_PASSWORD": "pw-7654321",
    "AWS_SECRET_ACCESS_KEY": "ak-999888",
    "DB_PASS": "pw-aaa111",
    "MYSQL_PWD": "pw-bbb222",
    "X_AUTH_HEADER": "Bearer zzz999",
    "HTTPS_PROXY": "http://bob:s3cr3t@proxy.example:3128",
    "DATABASE_URL": "postgres://u:pa55word@db.example/x",
}
HIDDEN = (
    "tok-1234567",
    "pw-7654321",
    "ak-999888",
    "pw-aaa111",
    "pw-bbb222",
    "zzz999",
    "s3cr3t",
    "pa55word",
)
# Exits 3 only when the task itself did receive every secret, so the failure summary is printed.
SECRET_TASK = """
import os, sys
secrets = {secrets!r}
print("task sees", ",".join(sorted(secrets)), flush=True)
sys.exit(3 if all(os.environ.get(k) == v for k, v in secrets.items()) else 5)
"""


@pytest.mark.integration
def test_secrets_are_masked_everywhere_the_launcher_prints_or_stores_env(tmp: Path) -> None:
    (tmp / "task.py").write_text(SECRET_TASK.format(secrets=SECRETS))
    spec = write_spec(
        tmp,
        tasks={"worker": {"count": 1}},
        program={"script": "task.py", "env": {**SECRETS, "PLAIN": "visible-1"}},
    )
    shown = []
    for args in (("plan", str(spec)), ("plan", "--json", str(spec))):
        done = distlaunch(*args)
        assert done.returncode == 0, done.stderr
        assert "visible-1" in done.stdout and "***" in done.stdout
        assert "proxy.example:3128" in done.stdout  # the rest of a URL stays
        shown.append(done.stdout + done.stderr)
    up = distlaunch("up", str(spec))
    assert up.returncode == 1, up.stderr
    assert "worker-0 exit code 3" in up.stderr  # the task got the real values
    shown.append(up.stdout + up.stderr)
    run_dir = only_run_dir(tmp / "runs")
    for args in (("status", str(run_dir)), ("status", "--json", str(run_dir))):
        done = distlaunch(*args)
        assert done.returncode == 0, done.stderr
        shown.append(done.stdout + done.stderr)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["spec"]["program"]["env"] == {
        **{k: "***" for k in SECRETS if k not in ("HTTPS_PROXY", "DATABASE_URL")},
        "HTTPS_PROXY": "http://bob:***@proxy.example:3128",
        "DATABASE_URL": "postgres://u:***@db.example/x",
        "PLAIN": "visible-1",
    }
    shown += [(run_dir / "run.json").read_text(), (run_dir / "events.jsonl").read_text()]
    for text in shown:
        for value in HIDDEN:
            assert value not in text


# ---------------------------------------------------------------- file modes


# Writes a file in its working dir and in the run's checkpoint dir: what a program creates.
WRITER_TASK = """
import os, pathlib
pathlib.Path("made-by-task.txt").write_text("x")
pathlib.Path(os.environ["DISTLAUNCH_CHECKPOINT_DIR"], "made-by-task.ckpt").write_text("x")
"""


@pytest.mark.integration
@pytest.mark.parametrize("permissions", ["private", "shared"])
def test_run_files_are_private_unless_shared(tmp: Path, permissions: str) -> None:
    (tmp / "task.py").write_text(WRITER_TASK)
    spec = write_spec(tmp, permissions=permissions, tasks={"worker": {"count": 1}})
    # A usual umask: "shared" follows it, "private" must not.
    done = distlaunch("up", str(spec), umask=0o022)
    assert done.returncode == 0, done.stderr
    run_dir = only_run_dir(tmp / "runs")
    made = [p for p in run_dir.rglob("*")] + [run_dir, tmp / "made-by-task.txt"]
    names = {p.relative_to(tmp).as_posix() for p in made}
    for expected in (
        "logs/attempt-0/worker-0.log",
        "errors/attempt-0",
        "status",
        "metrics",
        "run.json",
        "events.jsonl",
        "checkpoints/made-by-task.ckpt",
    ):
        assert any(n.endswith(expected) for n in names), expected
    for path in made:
        mode = stat.S_IMODE(path.stat().st_mode)
        if permissions == "private":
            assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
        else:
            assert mode & 0o044 == 0o044, f"{path} is {oct(mode)}"
