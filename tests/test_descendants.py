"""Every process a task started dies with the task: children, setsid'd daemons, on every transport.

Real processes throughout (small Python scripts stand in for TensorFlow: what is tested is the
process tree, not training). Also here: the namespace is entered by descriptor and a dead holder
fails the run (issue 14 item 7), import and syntax errors are recorded through the bootstrap and
never retried (item 8), and no child is started with a preexec_fn (item 17).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import standins

from conftest import (
    SELFCHECK_ARGS,
    all_running,
    distlaunch,
    events,
    only_run_dir,
    processes_of_run,
    run_record,
    selfcheck_program,
    wait_for,
    wait_for_run_dir,
    write_spec,
)
from distlaunch.launcher.network import netns
from distlaunch.launcher.run.policy import NON_RETRYABLE_ERRORS
from distlaunch.launcher.transports import procs

CAPS = netns.probe()
ISOLATIONS = ["off", "auto"] if (CAPS.netns or CAPS.userns) else ["off"]

# A task that leaves descendants behind: a plain child, a child that called setsid, and a
# double-forked daemon (its parent exits at once, so it is nobody's child). It writes their pids
# (as it sees them) into the run dir once they exist, listens on its port (so the launcher sees it join), then does what argv[1] says.
FAMILY = (
    standins.listening(standins.LOOPBACK)
    + """
import subprocess
sleeper = subprocess.Popen(["sleep", "300"])
daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        time.sleep(300)
    os._exit(0)
double = int(os.read(r, 64))
name = os.environ["DISTLAUNCH_ROLE"] + "-" + os.environ["DISTLAUNCH_INDEX"]
pids = os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], f"pids-{name}.json")
with open(pids, "w") as f:
    json.dump([sleeper.pid, daemon.pid, double], f)
print("family started", flush=True)
time.sleep(float(sys.argv[1]))
"""
)


def _family(tmp: Path, isolation: str, linger_s: float, **fields) -> Path:
    (tmp / "family.py").write_text(FAMILY)
    return write_spec(
        tmp,
        program={"script": "family.py", "args": [str(linger_s)]},
        isolation=isolation,
        **fields,
    )


def _live(run_id: str) -> list[str]:
    return [" ".join(p.cmdline()) for p in processes_of_run(run_id)]


@pytest.mark.integration
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_nothing_a_task_started_survives_its_success(tmp: Path, isolation: str) -> None:
    spec = _family(tmp, isolation, 0.5)
    done = distlaunch("up", str(spec), cwd=tmp, timeout=120)
    assert done.returncode == 0, done.stderr
    run_dir = only_run_dir(tmp / "runs")
    assert len(list(run_dir.glob("pids-*.json"))) == 2  # both families were there
    # Not "soon": by the time `up` has returned, every descendant is gone.
    assert _live(run_record(run_dir)["run_id"]) == []


@pytest.mark.quick
@pytest.mark.integration
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_nothing_a_task_started_survives_a_sigkilled_launcher(
    tmp: Path, isolation: str, launch
) -> None:
    spec = _family(tmp, isolation, 300)
    launcher = launch(spec)
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    wait_for(
        lambda: len(list(run_dir.glob("pids-*.json"))) == 2,
        "both tasks to start their children",
        launcher=launcher,
    )
    run_id = run_record(run_dir)["run_id"]
    launcher.kill()
    launcher.wait()
    wait_for(
        lambda: not processes_of_run(run_id),
        f"every process of run {run_id} to die with its launcher",
        limit_s=30,
    )


RESTARTED = """
import json, os, socket, subprocess, sys, time
cfg = json.loads(os.environ["TF_CONFIG"])
port = int(cfg["cluster"]["worker"][0].rsplit(":", 1)[1])
if os.environ["DISTLAUNCH_ATTEMPT"] == "0":
    # A daemon of the first attempt takes the task's own port, then the task fails.
    holder = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(300)"
    subprocess.Popen([sys.executable, "-c", holder, str(port)], start_new_session=True)
    time.sleep(0.5)
    sys.exit(1)
server = socket.socket()
try:
    server.bind(("127.0.0.1", port))
except OSError as exc:
    print("port taken:", exc, flush=True)
    sys.exit(5)
print("got my port back", flush=True)
"""


@pytest.mark.integration
def test_a_restarted_task_never_meets_its_predecessors_child(tmp: Path) -> None:
    (tmp / "restarted.py").write_text(RESTARTED)
    spec = write_spec(
        tmp,
        program={"script": "restarted.py"},
        tasks={"worker": {"count": 1}},
        isolation="off",
        restart={
            "policy": "on-failure",
            "max_restarts": 1,
            "backoff": {"initial_s": 0.1, "max_s": 0.1},
        },
    )
    done = distlaunch("up", str(spec), cwd=tmp, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "got my port back" in done.stdout


HANG = standins.listen_and_sleep(300, standins.LOOPBACK)


@pytest.mark.quick
@pytest.mark.integration
def test_a_dead_namespace_holder_fails_the_run(tmp: Path, launch) -> None:
    if not (CAPS.netns or CAPS.userns):
        pytest.skip(f"no private network namespace here: {CAPS.detail}")
    (tmp / "hang.py").write_text(HANG)
    spec = write_spec(
        tmp,
        program={"script": "hang.py"},
        restart={
            "policy": "on-failure",
            "max_restarts": 3,
            "backoff": {"initial_s": 0.1, "max_s": 0.1},
        },
    )
    launcher = launch(spec)
    run_dir = wait_for_run_dir(tmp / "runs", launcher)
    record = wait_for(
        lambda: all_running(run_dir, 2), "both tasks to be running", launcher=launcher
    )
    os.kill(record["netns_holder_pid"], signal.SIGKILL)
    os.kill(record["tasks"]["worker-1"]["pid"], signal.SIGKILL)
    launcher.wait(timeout=120)
    out, err = (tmp / "stdout.txt").read_text(), (tmp / "stderr.txt").read_text()
    assert launcher.returncode == 1, out + err
    assert (
        f"holder of the run's private network namespace (pid {record['netns_holder_pid']}) has died"
        in err
    )
    # Nothing was started in a namespace it could not vouch for.
    assert not [e for e in events(run_dir) if e["event"] == "restarted"]
    assert _live(record["run_id"]) == []


@pytest.mark.quick
@pytest.mark.integration
@pytest.mark.parametrize(
    ("program", "files", "error"),
    [
        ({"script": "broken.py"}, {"broken.py": "def f(:\n    pass\n"}, "SyntaxError"),
        (
            {"script": "importer.py"},
            {"importer.py": "import distlaunch_no_such_module\n"},
            "ModuleNotFoundError",
        ),
        ({"module": "distlaunch_no_such_module"}, {}, "ImportError"),
    ],
    ids=["syntax", "import-in-script", "missing-module"],
)
def test_import_and_syntax_errors_are_recorded_and_never_retried(
    tmp: Path, program: dict, files: dict, error: str
) -> None:
    for name, text in files.items():
        (tmp / name).write_text(text)
    spec = write_spec(
        tmp,
        program=program,
        tasks={"worker": {"count": 1}},
        restart={
            "policy": "on-failure",
            "max_restarts": 3,
            "backoff": {"initial_s": 0.1, "max_s": 0.1},
        },
    )
    done = distlaunch("up", str(spec), cwd=tmp, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    run_dir = only_run_dir(tmp / "runs")
    recorded = json.loads((run_dir / "errors" / "attempt-0" / "worker-0.json").read_text())
    assert recorded["type"] == error and error in NON_RETRYABLE_ERRORS
    assert not [e for e in events(run_dir) if e["event"] == "restarted"]
    # What the task printed starts at the program's own frames, as plain `python` shows it.
    log = (run_dir / "logs" / "attempt-0" / "worker-0.log").read_text()
    assert "bootstrap.py" not in log and "runpy" not in log, log


SELF = """
import json, os, sys
main = sys.modules["__main__"]
print("SELF " + json.dumps({
    "argv": sys.argv, "name": __name__, "file": __file__, "cwd": os.getcwd(), "path0": sys.path[0],
    "main_file": main.__file__, "is_main": main.__dict__ is globals(), "spec": __spec__ and (__spec__.name, __spec__.origin),
}), flush=True)
"""


@pytest.mark.quick
@pytest.mark.integration
@pytest.mark.parametrize("kind", ["script", "module"])
def test_the_program_cannot_tell_it_was_bootstrapped(tmp: Path, kind: str) -> None:
    work, args = tmp / "work", SELFCHECK_ARGS
    program = selfcheck_program(tmp, SELF, kind)
    spec = write_spec(tmp, program=program, tasks={"worker": {"count": 1}})
    done = distlaunch("up", str(spec), cwd=tmp, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.split("SELF ", 1)[1].splitlines()[0])
    direct = [str(work / "selfcheck.py")] if kind == "script" else ["-m", "selfcheck"]
    cwd = tmp if kind == "script" else work  # the program's workdir: the spec's folder by default
    plain = subprocess.run(
        [sys.executable, *direct, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    assert seen == json.loads(plain.stdout.split("SELF ", 1)[1])


@pytest.mark.quick
def test_children_are_started_without_a_preexec_fn(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """preexec_fn runs between fork and exec while the launcher has other threads (SSH's
    heartbeat): a child can deadlock there. The parent-death signal is set after exec instead."""
    seen = []
    real = subprocess.Popen

    def recording(*args, **kwargs):
        seen.append(kwargs.get("preexec_fn"))
        return real(*args, **kwargs)

    monkeypatch.setattr(procs.subprocess, "Popen", recording)
    proc = procs.spawn(["true"], {}, str(tmp), str(tmp / "log"))
    contained, tree = procs.spawn_contained(["true"], {}, str(tmp), str(tmp / "log"))
    assert proc.wait() == 0 and contained.wait() == 0 and procs.wait_tree(tree)
    os.close(tree)
    assert seen == [None, None]


@pytest.mark.quick
def test_a_spawned_task_still_dies_with_its_parent(tmp: Path) -> None:
    """The parent-death signal, now set by taskinit after exec, still reaches the task."""
    driver = (
        "import sys, time\n"
        "from distlaunch.launcher.transports import procs\n"
        "p = procs.spawn(['sleep', '300'], {'DISTLAUNCH_RUN_ID': sys.argv[1]}, '.', 'log')\n"
        "q, t = procs.spawn_contained(['sleep', '301'], {'DISTLAUNCH_RUN_ID': sys.argv[1]}, '.', 'log')\n"
        "print('up', flush=True)\n"
        "time.sleep(300)\n"
    )
    run_id = f"pdeath-{os.getpid()}-{time.monotonic_ns()}"
    parent = subprocess.Popen(
        [sys.executable, "-c", driver, run_id],
        cwd=tmp,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout.readline() == "up\n"
    wait_for(
        lambda: {"sleep 300", "sleep 301"} <= set(_live(run_id)),
        "both sleeps to run",
        limit_s=30,
    )
    parent.kill()
    parent.wait()
    wait_for(
        lambda: not processes_of_run(run_id),
        "the tasks to die with their parent",
        limit_s=30,
    )


def test_a_killed_task_is_wholly_gone_once_its_tree_reads_eof(tmp: Path) -> None:
    """SIGKILL of the keeper (a restart, `kill -9`): the init empties the namespace itself before
    it exits. Left to the kernel, the tree pipe read EOF while a big task was still dying, and a
    warm standby restarted in its place found its port still held."""
    port = 23000 + os.getpid() % 1000
    program = (
        "import socket, time\n"
        "ballast = bytearray(600 * 2**20)\n"
        "for i in range(0, len(ballast), 4096): ballast[i] = 1\n"
        "s = socket.socket()\n"
        f"s.bind(('127.0.0.1', {port}))\n"
        "s.listen()\n"
        "time.sleep(300)\n"
    )
    for _ in range(3):
        keeper, tree = procs.spawn_contained(
            [sys.executable, "-c", program], {}, str(tmp), str(tmp / "log")
        )
        wait_for(lambda: procs.listening(os.getpid(), port), "the task to listen")
        procs.kill_groups([keeper])
        assert procs.wait_tree(tree)
        os.close(tree)
        assert not procs.listening(os.getpid(), port)
