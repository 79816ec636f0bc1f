"""Shared test helpers: writing specs, running the real `distlaunch` CLI (in the foreground, or in
the background through the `launch` fixture, which kills what is left), waiting on a run,
finding stray processes; the SSH and Slurm labs as fixtures."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    """Give SIGINT back to Python's default handler where this pytest was started with it
    ignored: a command put in the background by a shell without job control (`cmd &` in a
    script, CI's `nohup pytest &`) starts with SIGINT ignored, Python then keeps it ignored, and
    so does every process the tests start. The Ctrl-C tests (a KeyboardInterrupt in this
    process, a caller program that gets SIGINT) failed so ("DID NOT RAISE KeyboardInterrupt",
    a caller not gone in 120 s); a user's terminal gives Ctrl-C to Python's handler, as this does.
    A handled signal is reset to its default in a child at exec, so children get it too."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if config.getoption("dist", "no") == "loadgroup" and config.getoption("numprocesses", 0):
        import xdist

        if pytest.version_tuple[:2] >= (9, 2) and xdist.__version__ in ("3.8.0",):
            raise pytest.UsageError(_GROUPS_LOST.format(pytest.__version__, xdist.__version__))


# Where xdist cannot carry the groups of conftest's labs (see pytest_collection_finish).
_GROUPS_LOST = (
    "pytest {} with pytest-xdist {} loses --dist loadgroup's groups (pytest-dev/pytest-xdist#1386),"
    " and the tests of a lab would spread over the workers: `pip install -e '.[test]'` installs"
    " the pytest pyproject allows (below 9.2), or run serially with -n 0"
)


def write_spec(folder: Path, name: str = "spec.json", **fields) -> Path:
    """Write a spec (fields merged over a 2-worker MWMS default) and return its path."""
    spec = {
        "name": "t",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py"},
        "tasks": {"worker": {"count": 2}},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
    }
    spec.update(fields)
    path = folder / name
    path.write_text(json.dumps(spec, indent=2))
    return path


def example(module: str = "mnist_mlp", epochs: int = 1, steps: int = 5, *more: str) -> dict:
    """The spec's ``program``: one of distlaunch.worker.examples, ``epochs`` of ``steps`` steps
    each, then ``more`` of its options (e.g. "--checkpoint-every", "5")."""
    return {
        "module": f"distlaunch.worker.examples.{module}",
        "args": ["--epochs", str(epochs), "--steps-per-epoch", str(steps), *more],
    }


# Arguments a program must get exactly as written: one with a space, one a shell would expand.
SELFCHECK_ARGS = ("--flag", "a b", "$(x)")


def selfcheck_program(tmp: Path, text: str, kind: str) -> dict:
    """Write ``text`` as tmp/work/selfcheck.py; return the spec's ``program`` that runs it with
    SELFCHECK_ARGS as a script (``kind`` "script": from the spec's folder, the default workdir)
    or as a module (from work/)."""
    work = tmp / "work"
    work.mkdir()
    (work / "selfcheck.py").write_text(text)
    if kind == "script":
        return {"script": "work/selfcheck.py", "args": list(SELFCHECK_ARGS)}
    return {"module": "selfcheck", "workdir": "work", "args": list(SELFCHECK_ARGS)}


def distlaunch(
    *args: str, cwd: Path | None = None, timeout: float = 300, **kw
) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "distlaunch.launcher", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def start_up(spec: Path, *args: str) -> subprocess.Popen:
    """Start the real `distlaunch up SPEC ARGS` in the background, its output going to stdout.txt
    and stderr.txt beside the spec (a pipe nobody reads would fill up and stall the launcher).
    Tests start it through the `launch` fixture, which makes sure it ends."""
    folder = spec.parent
    with open(folder / "stdout.txt", "w") as out, open(folder / "stderr.txt", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "distlaunch.launcher", "up", str(spec), *args],
            cwd=folder,
            stdout=out,
            stderr=err,
        )


def kill(launcher: subprocess.Popen) -> None:
    """SIGKILL ``launcher`` (resumed first, should the test have stopped it) and reap it; its
    tasks die with it."""
    if launcher.poll() is None:
        os.kill(launcher.pid, signal.SIGCONT)
        launcher.kill()
    launcher.wait()


@pytest.fixture
def launch():
    """`start_up` for one test: whatever it started is killed and reaped when the test ends,
    passed or failed, and the tail of its stderr.txt is printed (shown when the test fails)."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(spec: Path, *args: str) -> subprocess.Popen:
        launcher = start_up(spec, *args)
        started.append((launcher, spec.parent / "stderr.txt"))
        return launcher

    yield start
    for launcher, stderr in started:
        kill(launcher)
        if stderr.exists():
            print(f"--- {stderr} (exit {launcher.returncode})\n{stderr.read_text()[-5000:]}")


def all_running(run_dir: Path, count: int | None = None, attempt: int = 0) -> dict | None:
    """run.json when every task of the run (``count`` of them, when given) is running in attempt
    ``attempt`` or a later one, else None."""
    record = run_record(run_dir)
    tasks = (record.get("tasks") or {}).values()
    if count is not None and len(tasks) != count:
        return None
    if tasks and all(t.get("state") == "running" and t.get("attempt", 0) >= attempt for t in tasks):
        return record
    return None


def wait_for_run_dir(shared: Path, launcher: subprocess.Popen | None = None) -> Path:
    """Wait for the first run directory (one with a run.json) to appear under ``shared``; fail at
    once if ``launcher`` exits first."""
    found = wait_for(
        lambda: next(shared.glob("*/run.json"), None) if shared.exists() else None,
        f"a run dir under {shared}",
        launcher=launcher,
    )
    return found.parent


def processes_of_run(run_id: str) -> list[psutil.Process]:
    """Every live process whose environment names this run (tasks and anything they forked)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid():
                continue
            if (
                proc.environ().get("DISTLAUNCH_RUN_ID") == run_id
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def argv(proc: psutil.Process) -> list[str]:
    """``proc``'s command line; empty for one that is going (gone, or a zombie being reaped) or
    whose command line may not be read."""
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def cmdline(proc: psutil.Process) -> str:
    """``proc``'s command line as one string; empty for one that is going (see `argv`)."""
    return " ".join(argv(proc))


def up_piped(folder: Path) -> subprocess.Popen:
    """`distlaunch up spec.json` in ``folder``, its stdout and stderr piped (text) for the test."""
    return subprocess.Popen(
        [sys.executable, "-m", "distlaunch.launcher", "up", "spec.json"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_tasks_up(run_dir: Path, count: int, launcher: subprocess.Popen) -> None:
    """Wait until workers 0..count-1 of attempt 0 have logged their stand-in's ``up`` line."""
    logs = run_dir / "logs" / "attempt-0"
    files = [logs / f"worker-{i}.log" for i in range(count)]
    wait_for(
        lambda: all(f.exists() and "up " in f.read_text() for f in files),
        "every task up",
        launcher=launcher,
    )


def host_cmdlines(lab, host) -> str:
    """Every command line in an SSH test host's namespace (sshhosts.HostLab), one string."""
    return "\n".join(cmdline(proc) for proc in lab.processes(host))


def run_tables(host) -> list[str]:
    """The run tables (nftables) in an SSH test host's namespace; none where nft is missing (the
    run then had no firewall: the guard says why)."""
    from distlaunch.host import guard

    if shutil.which("nft") is None:
        return []
    listed = subprocess.run(
        ["ip", "netns", "exec", host.netns, "nft", "list", "tables"],
        check=True,
        capture_output=True,
        text=True,
    )
    return [line for line in listed.stdout.splitlines() if guard.TABLE_PREFIX in line]


def with_cmdline(
    *parts: str, name: str | None = None, among: Iterable[psutil.Process] | None = None
) -> list[psutil.Process]:
    """The processes of ``among`` (every process of this machine when None) whose command line
    holds each of ``parts``, and whose name is ``name`` when given; one that is going is none of
    them (its command line reads empty)."""
    found = []
    for proc in psutil.process_iter() if among is None else among:
        try:
            if name is not None and proc.name() != name:
                continue
        except psutil.Error:
            continue
        line = cmdline(proc)
        if line and all(part in line for part in parts):
            found.append(proc)
    return found


def wait_for(predicate, what: str, limit_s: float = 240, launcher: subprocess.Popen | None = None):
    """Poll ``predicate`` until it returns something truthy and return that; fail naming ``what``
    after ``limit_s``, or at once (with its output) if ``launcher`` exits first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if launcher is not None and launcher.poll() is not None:
            out, err = launcher.communicate()
            pytest.fail(
                f"launcher exited with {launcher.returncode} while waiting for {what}:\n{out}\n{err}"
            )
        time.sleep(0.05)
    pytest.fail(f"gave up after {limit_s} s waiting for {what}")


def run_record(run_dir: Path) -> dict:
    """The run's run.json."""
    return json.loads((run_dir / "run.json").read_text())


def events(run_dir: Path) -> list[dict]:
    """The run's events.jsonl, one dict per line (none before the first event)."""
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def only_run_dir(shared: Path) -> Path:
    """The single run directory under ``shared``."""
    runs = [p for p in shared.iterdir() if (p / "run.json").is_file()]
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture(scope="session")
def docker_lock():
    """Hold /tmp/dl-docker.lock from the first test that uses Docker to the end of the session:
    another pytest on this machine builds and runs the same image tag. One definition only: a
    second session fixture taking the same lock in this process would wait for itself."""
    with open("/tmp/dl-docker.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
        fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def ssh_lab():
    """Two SSH test hosts and an outsider (tests/sshhosts.py: network namespaces with an sshd
    each, sharing this filesystem as a cluster's common mount does) for one module's tests;
    removed (namespaces, sshd, keys) afterwards. Run under `flock /tmp/dl-ssh.lock`."""
    import sshhosts

    reason = sshhosts.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        made = sshhosts.HostLab()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot make test hosts here: {exc}")
    with made:
        yield made


@pytest.fixture(scope="module")
def slurm_lab():
    """A 2-node Slurm cluster (tests/slurmcluster.py) for one module's tests; removed (daemons,
    namespaces, files) afterwards. Run under `flock /tmp/dl-slurm.lock`.

    Skipped only where slurmd cannot run at all; a cluster that fails to come up is a failure.
    """
    from slurmcluster import SlurmLab, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with SlurmLab(2) as cluster:
        yield cluster


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """A temp dir to hold a spec, its script and its runs."""
    return tmp_path


# ---- one xdist worker per lab ----------------------------------------------------------------
#
# pyproject runs the suite on several xdist workers (`--dist loadgroup`). A lab (the SSH hosts,
# the Slurm cluster, the Docker engine and its image tag) is a machine-wide thing: two workers each
# making one would share names (the image tag, Slurm's state) and each other's stray processes
# would show up in "nothing left" checks. So every test that uses a lab is put in that lab's
# xdist_group, and a group runs on one worker. The lab is found from what the test and the
# fixtures it uses (all of them, however deep) name, so a new test file needs no marker.

# What in the source of a test or a fixture it uses means "this uses that lab".
_LAB_SIGNS = {
    "ssh-lab": ("HostLab(",),
    "slurm-lab": ("SlurmLab(",),
    "docker": ("docker_lock", "dockerd", "ensure_image("),
}


def _labs_of(item: pytest.Item) -> set[str]:
    """The labs ``item`` uses: those whose signs are in its function's source or in that of any
    fixture it requests (directly or through other fixtures)."""
    import inspect

    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    if info is not None:
        for name in item.fixturenames:
            for fixturedef in info.name2fixturedefs.get(name, ()):
                functions.append(fixturedef.func)
    labs = set()
    for function in functions:
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            continue
        labs |= {lab for lab, signs in _LAB_SIGNS.items() if any(s in source for s in signs)}
    return labs


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its hook has no order)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put each test that uses a lab in that lab's xdist_group (see above). A test that uses two
    labs joins their groups into one, so that each lab still has one worker."""
    found = {item: _labs_of(item) for item in items}
    # Join labs that a test uses together (union-find over the lab names).
    parent: dict[str, str] = {}

    def root(lab: str) -> str:
        while parent.setdefault(lab, lab) != lab:
            lab = parent[lab]
        return lab

    for labs in found.values():
        first, *rest = sorted(labs) or [""]
        for lab in rest:
            parent[root(lab)] = root(first)
        root(first)
    parent.pop("", None)
    for item, labs in found.items():
        if labs:
            group = "+".join(sorted(lab for lab in parent if root(lab) == root(min(labs))))
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker: fail the run where xdist did not carry the groups (an "@group" suffix
    on each grouped test's node id, which pytest 9.2's node ids no longer take with xdist 3.8:
    pytest-dev/pytest-xdist#1386); the tests of a lab would silently spread over the workers.
    pytest_configure says so in one line for the versions known to do it."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid:
            import xdist

            raise pytest.UsageError(_GROUPS_LOST.format(pytest.__version__, xdist.__version__))
