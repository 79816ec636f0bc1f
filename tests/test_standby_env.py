"""A warm standby imports TensorFlow under the env the program gives it
(launcher/plan/program_env.py): the program's env writes before its import are repeated for the
standby's imports and undone, or, where they cannot be, the program restarts cold and `plan` says
why. Real processes: a standby's TensorFlow must see what a cold start's sees."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import standins

from conftest import distlaunch, events, only_run_dir, wait_for, write_spec
from distlaunch.launcher.plan import program_env
from distlaunch.launcher.plan.placement import on_hosts
from distlaunch.launcher.plan.plan import Plan, for_attempt, make_plan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.spec.model import load_spec
from distlaunch.launcher.transports.local.standby import Standbys
from test_standby import ON_FAILURE, WAIT_FOR_STANDBY

pytestmark = pytest.mark.integration


def _env(source: str) -> program_env.StandbyEnv:
    return program_env.before_tensorflow(ast.parse(source), "t.py")


@pytest.mark.quick
def test_plain_writes_before_the_import_are_repeated_in_order() -> None:
    found = _env(
        "import os\nfrom os import environ as E, putenv\n"
        'os.environ["A"] = "0"\nos.environ.setdefault("B", "1")\nputenv("C", "2")\n'
        'E.update({"D": "3"}, )\nos.environ.update(F="4")\ndel os.environ["G"]\n'
        'os.environ.pop("H", None)\n'
        'if __name__ == "__main__":\n    os.environ["I"] = "5"\n    import tensorflow as tf\n'
        'os.environ["AFTER"] = "not repeated: the import has run"\n'
    )
    assert not found.cold
    assert [(w.op, w.name, w.value) for w in found.writes] == [
        ("set", "A", "0"),
        ("setdefault", "B", "1"),
        ("putenv", "C", "2"),
        ("set", "D", "3"),
        ("set", "F", "4"),
        ("unset", "G", ""),
        ("unset", "H", ""),
        ("set", "I", "5"),
    ]


@pytest.mark.quick
@pytest.mark.parametrize(
    ("source", "cold"),
    [
        ('import os\nos.environ["X"] = str(1)\nimport tensorflow\n', "t.py:2 sets"),
        ('import os\nif flag:\n    os.environ["X"] = "1"\nimport keras\n', "t.py:3 sets"),
        ('import os\ndef f():\n    os.environ["X"] = "1"\nf()\nimport tensorflow\n', "t.py:3"),
        ("import os\nos.environ.clear()\nfrom distlaunch import worker\n", "t.py:2 sets"),
        # the import in a function: whether it runs before the write is not in the source
        (
            'import os\ndef main():\n    import tensorflow\nos.environ["X"] = "1"\nmain()\n',
            "first imported in a function (t.py:3)",
        ),
    ],
)
def test_writes_a_standby_cannot_repeat_make_restarts_cold(source: str, cold: str) -> None:
    assert cold in _env(source).cold


@pytest.mark.quick
def test_writes_after_a_top_level_import_or_without_tensorflow_do_not_matter() -> None:
    assert _env('import tensorflow\nimport os\nos.environ["X"] = str(1)\n') == (
        program_env.StandbyEnv()
    )
    assert _env('import os\nos.environ["X"] = str(1)\n') == program_env.StandbyEnv()


# A TensorFlow program that turns oneDNN off before its import, as TensorFlow's own message
# advises. TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, at import: a standby that imported it
# under other settings would run the restarted program with oneDNN on.
ONEDNN = (
    WAIT_FOR_STANDBY
    + """
import ctypes, json, os, sys
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
START = {  # as the program starts: nothing of the standby's writes is left
    name: [os.environ.get(name), libc.getenv(name.encode()) and libc.getenv(name.encode()).decode()]
    for name in ("TF_ENABLE_ONEDNN_OPTS", "ONLY_PUTENV", "DISTLAUNCH_STANDBY")
}
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.putenv("ONLY_PUTENV", "1")
import tensorflow as tf
from tensorflow.python.util import _pywrap_util_port
SEEN = {
    "start": START,
    "onednn": _pywrap_util_port.IsMklEnabled(),
    "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\\0"),
    "orig_argv": sys.orig_argv,
}
print("SEEN " + json.dumps(SEEN), flush=True)
"""
    + standins.listening(standins.LOOPBACK)  # joined: the launcher makes standbys once settled
    + """
if os.environ["DISTLAUNCH_ATTEMPT"] == "0":
    wait_for_standby(1)
    sys.exit(1)
"""
)


def test_a_warm_restart_imports_tensorflow_with_the_programs_env(tmp: Path) -> None:
    (tmp / "task.py").write_text(ONEDNN)
    spec = write_spec(tmp, tasks={"worker": {"count": 1}}, restart=ON_FAILURE)
    done = distlaunch("up", str(spec), cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = only_run_dir(tmp / "runs")
    assert [e.get("standby") for e in events(run_dir) if e["event"] == "restarted"] == [True]
    cold, warm = [json.loads(line) for line in re.findall(r"SEEN (.*)", done.stdout)]
    assert cold["onednn"] is False  # TensorFlow honoured the program's setting
    assert warm == cold  # also the command line: the standby's is the task's own
    assert cold["start"] == {name: [None, None] for name in cold["start"]}
    assert cold["cmdline"][-1] == "" and cold["cmdline"][-2].endswith("task.py")
    shown = distlaunch("plan", str(spec), cwd=tmp)
    assert (
        "standbys: on" in shown.stdout
        and "TensorFlow: ONLY_PUTENV, TF_ENABLE_ONEDNN_OPTS;" in shown.stdout
    )


@pytest.mark.quick
def test_a_program_whose_writes_cannot_be_repeated_restarts_cold(tmp: Path) -> None:
    (tmp / "task.py").write_text('import os\nos.environ["X"] = str(1)\nimport tensorflow\n')
    spec = write_spec(tmp, tasks={"worker": {"count": 1}}, restart=ON_FAILURE)
    plan = _plan(spec, {("worker", 0): 20000}, "r1", tmp / "runs" / "r1")
    assert not plan.standby
    shown = distlaunch("plan", str(spec), cwd=tmp)
    assert f"standbys: off (restarts are cold: {tmp / 'task.py'}:2 sets the environment" in (
        shown.stdout
    )
    # And the local transport's standbys, which also serve PSS servers, make none for it.
    standbys = Standbys()
    try:
        standbys.prepare(for_attempt(plan, 1).tasks)
        assert standbys.record() == {}
    finally:
        standbys.close()


@pytest.mark.quick
def test_a_module_of_its_own_that_sets_the_environment_first_makes_restarts_cold(
    tmp: Path,
) -> None:
    (tmp / "settings.py").write_text('import os\nos.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"\n')
    (tmp / "quiet.py").write_text("LEVEL = 2\n")
    (tmp / "task.py").write_text("import json, quiet\nimport settings\nimport tensorflow\n")
    (tmp / "later.py").write_text("import json, quiet\nimport tensorflow\nimport settings\n")
    plans = {}
    for script in ("task.py", "later.py"):
        spec = write_spec(
            tmp, name=f"{script}.json", program={"script": script}, restart=ON_FAILURE
        )
        plans[script] = _plan(spec, {("worker", 0): 1, ("worker", 1): 2}, "r", tmp)
    assert plans["task.py"].program.standby_env.cold == (
        f"{tmp / 'task.py'}:2 imports settings, which sets the environment "
        f"({tmp / 'settings.py'}:2) before TensorFlow is imported ({tmp / 'task.py'}:3)"
    )
    assert not plans["task.py"].standby
    assert plans["later.py"].standby  # imported after TensorFlow: it changes nothing there


def test_pss_servers_keep_their_standbys_when_the_program_restarts_cold(tmp: Path) -> None:
    """Under PSS the ps and worker tasks run distlaunch's server, not the program: their
    standbys (the server through the bootstrap) stay, only the chief's program restarts cold."""
    (tmp / "task.py").write_text('import os\nos.environ["X"] = str(1)\nimport tensorflow\n')
    spec = write_spec(
        tmp,
        strategy="parameter_server",
        tasks={"chief": {}, "worker": {}, "ps": {}},
        restart=ON_FAILURE,
    )
    shown = distlaunch("plan", str(spec), cwd=tmp)
    assert "standbys: on for the servers; the program restarts cold: " in shown.stdout
    ports = {("chief", 0): 20000, ("worker", 0): 20001, ("ps", 0): 20002}
    run_dir = tmp / "runs" / "r1"
    plan = _plan(spec, ports, "r1", run_dir)
    assert plan.standby
    rundir.make_dirs(run_dir, 0)
    standbys = Standbys()
    try:
        standbys.prepare(for_attempt(plan, 1).tasks)
        assert set(standbys.record()) == {"worker-0", "ps-0"}

        def ready() -> bool:
            standbys.poll()
            record = standbys.record()
            return set(record) == {"worker-0", "ps-0"} and all(s["ready"] for s in record.values())

        wait_for(ready, "the servers' standbys to import TensorFlow")
    finally:
        standbys.close()


def _plan(spec: Path, ports: dict[tuple[str, int], int], run_id: str, run_dir: Path) -> Plan:
    """The plan of ``spec`` with its tasks where the local backend puts them, at ``ports``."""
    loaded = load_spec(spec)
    return make_plan(loaded, on_hosts(loaded).with_ports(ports), run_id, run_dir)
