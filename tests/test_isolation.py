"""Network isolation: a local run's TensorFlow ports cannot be reached from outside the run, and
nothing of a run (process, namespace) outlives it, however it ends.

The TensorFlow tests run the real example (`distlaunch.worker.examples.mnist_mlp`) in a real
2-worker MultiWorkerMirroredStrategy cluster; the teardown tests use a small socket script in its
place (TensorFlow takes seconds to import; what is tested there is the launcher, not TF).
Where this machine cannot make network namespaces, the tests that need one skip and say why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
import standins

from conftest import (
    REPO,
    distlaunch,
    processes_of_run,
    run_record,
    wait_for,
    wait_for_run_dir,
    write_spec,
)
from distlaunch.launcher.core.console import Console
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.network import netns
from distlaunch.launcher.plan import isolation, ports
from distlaunch.launcher.plan.placement import on_hosts
from distlaunch.launcher.spec.model import load_spec
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.base import UpOptions
from distlaunch.launcher.transports.local.routing import LocalBackend

CAPS = netns.probe()
DEADLINE_S = 180  # generous: two TensorFlow imports on a busy 2-core machine
MNIST = {
    "module": "distlaunch.worker.examples.mnist_mlp",
    "args": ["--epochs", "1", "--steps-per-epoch", "5"],
}

# A stand-in task: listens on its TF_CONFIG port on every interface (as TensorFlow's server does),
# prints the network namespace it is in, then does what argv[1] says: "peers" connects to every
# task of the cluster over loopback, waits until every task has connected to it, and exits 0;
# "fail" exits 3 (worker 1); "hang" sleeps; "fork" starts a child that outlives it, then sleeps.
TASK = (
    standins.listening(standins.ANY)
    + """
import subprocess
print("in", os.readlink("/proc/self/ns/net"), flush=True)
what = sys.argv[1]
if what == "peers":
    for address in cfg["cluster"]["worker"]:
        host, port = address.rsplit(":", 1)
        for _ in range(600):
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            sys.exit(4)
    for _ in cfg["cluster"]["worker"]:
        server.accept()
    print("reached every peer", flush=True)
    sys.exit(0)
if what == "fail" and cfg["task"]["index"] == 1:
    time.sleep(1)
    sys.exit(3)
if what == "fork":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(600)
"""
)


@pytest.fixture
def needs_netns(capsys: pytest.CaptureFixture) -> None:
    """Skip, saying why on the terminal, where this machine cannot make a private namespace."""
    if not (CAPS.netns or CAPS.userns):
        why = f"this machine cannot make a private network namespace for this user: {CAPS.detail}"
        with capsys.disabled():
            print(f"\nskipping isolation test: {why}")
        pytest.skip(why)


# ---------------------------------------------------------------- the decision and the plan


@pytest.mark.quick
def test_choose_is_a_pure_function_of_spec_and_capabilities(tmp: Path) -> None:
    (tmp / "task.py").write_text("")
    auto = load_spec(write_spec(tmp))
    off = load_spec(write_spec(tmp, "off.json", isolation="off"))
    both = isolation.Capabilities(netns=True, userns=True, detail="")
    assert isolation.choose(off, on_hosts(off), None).mode == isolation.HOST
    assert isolation.choose(off, on_hosts(off), both).mode == isolation.HOST
    assert isolation.choose(auto, on_hosts(auto), both).mode == isolation.NETNS
    assert (
        isolation.choose(auto, on_hosts(auto), isolation.Capabilities(False, True, "")).mode
        == isolation.USERNS
    )
    unable = isolation.choose(
        auto,
        on_hosts(auto),
        isolation.Capabilities(False, False, "unshare: Operation not permitted"),
    )
    assert unable.mode == isolation.HOST and not unable.private
    assert "unshare: Operation not permitted" in unable.reason and "root" in unable.remedy
    # Tasks other hosts must reach cannot be shut in, whatever the machine can do.
    me = {"transport": "local", "address": "10.1.2.3"}
    for hosts in ({"me": me, "gpu1": {"transport": "ssh"}}, {"me": me, "gpu1": me}):
        mixed = load_spec(
            write_spec(
                tmp, "mixed.json", hosts=hosts, tasks={"worker": [{"host": "me"}, {"host": "gpu1"}]}
            )
        )
        reached = isolation.choose(mixed, on_hosts(mixed), both)
        assert (
            reached.mode == isolation.HOST
            and "worker:0 at 10.1.2.3" in reached.reason
            and "firewall" in reached.remedy
        )


@pytest.mark.quick
def test_up_probes_this_machine_with_the_runs_own_holder(tmp: Path, needs_netns: None) -> None:
    # `up`'s plan finds what this machine allows by starting the run's namespace holder, and the
    # run uses that holder: one namespace made, not two. A plan that no run opens leaves none.
    (tmp / "task.py").write_text("")
    loaded = load_spec(write_spec(tmp))
    backend = LocalBackend()
    with backend.open(loaded, Console(), UpOptions()) as launch:
        plan = launch.plan("probe-held", tmp / "runs" / "probe-held", 0)
        held = [p.pid for p in processes_of_run("probe-held")]
        # Where only a user namespace works, the probe found that and no holder is left.
        assert len(held) == (1 if CAPS.netns else 0)
        with launch.open(plan) as opened:
            pid = opened.record["netns_holder_pid"]
            assert [p.pid for p in processes_of_run("probe-held")] == [pid]
            assert held in ([pid], [])
    assert processes_of_run("probe-held") == []
    with backend.open(loaded, Console(), UpOptions()) as launch:
        launch.plan("probe-unused", tmp / "runs" / "probe-unused", 0)
        assert len(processes_of_run("probe-unused")) == (1 if CAPS.netns else 0)
    assert processes_of_run("probe-unused") == []


@pytest.mark.quick
def test_plan_shows_the_isolation_mode(tmp: Path) -> None:
    (tmp / "task.py").write_text("")
    spec = write_spec(tmp)
    auto = distlaunch("plan", "--json", str(spec))
    assert auto.returncode == 0, auto.stderr
    loaded = load_spec(spec)
    chosen = isolation.choose(loaded, on_hosts(loaded), CAPS)
    assert json.loads(auto.stdout)["isolation"] == chosen.to_json()
    off = distlaunch("plan", str(write_spec(tmp, "off.json", isolation="off")))
    assert off.returncode == 0, off.stderr
    assert 'isolation: host (the spec sets "isolation": "off")' in off.stdout
    bad = distlaunch("plan", str(write_spec(tmp, "bad.json", isolation="on")))
    assert bad.returncode == 2 and "$.isolation" in bad.stderr


@pytest.mark.quick
def test_private_ports_need_no_lookup_and_no_check(tmp: Path) -> None:
    (tmp / "task.py").write_text("")
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    try:
        fixed = [{"port": taken}, {"port": "auto"}, {"port": "auto"}]
        loaded = load_spec(write_spec(tmp, tasks={"worker": fixed}))
        got = ports.allocate(loaded, on_hosts(loaded), private=True)
        assert got == {
            ("worker", 0): taken,
            ("worker", 1): ports.FIRST_PRIVATE_PORT,
            ("worker", 2): ports.FIRST_PRIVATE_PORT + 1,
        }
        with pytest.raises(SpecError, match="in use"):
            ports.allocate(loaded, on_hosts(loaded), private=False)
    finally:
        busy.close()


# ---------------------------------------------------------------- real TensorFlow clusters


@pytest.mark.integration
def test_isolated_cluster_trains_and_its_ports_are_unreachable(
    tmp: Path, needs_netns: None, launch
) -> None:
    spec = write_spec(tmp, program=MNIST)
    launcher, run_dir = _start(launch, spec)
    record = _wait_running(run_dir, launcher)
    holder = record["netns_holder_pid"]
    namespace = os.readlink(f"/proc/{holder}/ns/net")
    assert namespace != os.readlink("/proc/self/ns/net")
    for task in record["plan"]["tasks"]:
        for address in _host_addresses():
            with pytest.raises(OSError):
                socket.create_connection((address, task["port"]), timeout=2).close()
        # Not vacuous: the task's server was listening inside the run while we knocked.
        assert procs.listening(holder, task["port"]), (
            f"{task['name']} stopped listening too early to tell"
        )
    out, err = _ended(launcher, spec)
    assert launcher.returncode == 0, err
    assert "isolated: tasks run in a private network namespace" in err
    assert "can be reached from other machines" not in err
    assert out.count("final loss") == 2
    _assert_nothing_left(record["run_id"], namespace)


# A stand-in serving as TensorFlow's server does (on every interface, whatever TF_CONFIG says:
# that is the problem isolation solves) until the file argv[1] exists: what isolation "off"
# changes is the launcher's side (no namespace, the warning), so no TensorFlow start is needed.
SERVES_UNTIL_GO = standins.listening(standins.ANY) + standins.until_exists(
    "sys.argv[1]", limit_s=DEADLINE_S
)


@pytest.mark.integration
def test_cluster_with_isolation_off_is_reachable(tmp: Path, launch) -> None:
    go = tmp / "go"
    (tmp / "task.py").write_text(SERVES_UNTIL_GO)
    spec = write_spec(tmp, program={"script": "task.py", "args": [str(go)]}, isolation="off")
    launcher, run_dir = _start(launch, spec)
    record = _wait_running(run_dir, launcher)
    assert "netns_holder_pid" not in record
    assert record["plan"]["isolation"]["mode"] == isolation.HOST
    for task in record["plan"]["tasks"]:
        # Served on every interface, and nothing of the launcher's stands in the way.
        for address in _host_addresses():
            socket.create_connection((address, task["port"]), timeout=5).close()
    go.touch()
    out, err = _ended(launcher, spec)
    assert launcher.returncode == 0, err
    assert "can be reached from other machines" in err and 'remove "isolation": "off"' in err
    assert "isolated:" not in err
    _assert_nothing_left(record["run_id"], None)


# ---------------------------------------------------------------- nothing outlives a run


@pytest.mark.quick
@pytest.mark.integration
def test_success_leaves_nothing(tmp: Path, needs_netns: None, launch) -> None:
    spec = _stand_in(tmp, "peers")
    launcher, run_dir = _start(launch, spec)
    out, err = _ended(launcher, spec)
    assert launcher.returncode == 0, err
    # Every task reached every other over loopback, in one namespace that is not ours.
    assert out.count("reached every peer") == 2
    namespace = _one_namespace(out)
    _assert_nothing_left(_run_id(run_dir), namespace)


@pytest.mark.integration
def test_failure_leaves_nothing(tmp: Path, needs_netns: None, launch) -> None:
    spec = _stand_in(tmp, "fail")
    launcher, run_dir = _start(launch, spec)
    out, err = _ended(launcher, spec)
    assert launcher.returncode == 1, err
    assert "worker-1 exit code 3" in err
    _assert_nothing_left(_run_id(run_dir), _one_namespace(out))


@pytest.mark.quick
@pytest.mark.integration
def test_ctrl_c_leaves_nothing(tmp: Path, needs_netns: None, launch) -> None:
    spec = _stand_in(tmp, "hang")
    launcher, run_dir = _start(launch, spec)
    record = _wait_running(run_dir, launcher)
    namespace = os.readlink(f"/proc/{record['netns_holder_pid']}/ns/net")
    launcher.send_signal(signal.SIGINT)
    _, err = _ended(launcher, spec)
    assert launcher.returncode == 128 + signal.SIGINT, err
    assert run_record(run_dir)["state"] == "interrupted"
    _assert_nothing_left(record["run_id"], namespace)


@pytest.mark.integration
def test_sigkilled_launcher_then_down_leaves_nothing(tmp: Path, needs_netns: None, launch) -> None:
    spec = _stand_in(tmp, "fork")
    launcher, run_dir = _start(launch, spec)
    record = _wait_running(run_dir, launcher)
    run_id = record["run_id"]
    namespace = os.readlink(f"/proc/{record['netns_holder_pid']}/ns/net")
    wait_for(lambda: len(processes_of_run(run_id)) >= 5, "holder, 2 tasks and their 2 children")
    launcher.kill()
    launcher.wait(timeout=DEADLINE_S)
    # The tasks die with the launcher (parent-death signal), what they forked with them (each task
    # is its PID namespace's init), and so does the holder (its lifeline pipe closes).
    _assert_nothing_left(run_id, namespace)
    down = distlaunch("down", run_id, "--shared-dir", str(run_dir.parent))
    assert down.returncode == 0, down.stderr
    assert "marked it interrupted" in down.stdout
    assert run_record(run_dir)["state"] == "interrupted"
    again = distlaunch("down", run_id, "--shared-dir", str(run_dir.parent))
    assert again.returncode == 0 and "nothing was left running" in again.stdout


@pytest.mark.quick
@pytest.mark.integration
def test_down_on_a_live_run_stops_its_launcher_first(tmp: Path, needs_netns: None, launch) -> None:
    spec = _stand_in(tmp, "hang")
    launcher, run_dir = _start(launch, spec)
    record = _wait_running(run_dir, launcher)
    namespace = os.readlink(f"/proc/{record['netns_holder_pid']}/ns/net")
    down = distlaunch("down", record["run_id"], "--shared-dir", str(run_dir.parent))
    assert down.returncode == 0, down.stderr
    assert f"stopped its launcher (pid {launcher.pid})" in down.stdout
    launcher.wait(timeout=DEADLINE_S)
    # The launcher tore its run down itself and recorded why.
    assert launcher.returncode == 128 + signal.SIGTERM
    assert run_record(run_dir)["state"] == "interrupted"
    _assert_nothing_left(record["run_id"], namespace)


# ---------------------------------------------------------------- an unprivileged user


@pytest.mark.quick
@pytest.mark.integration
def test_unprivileged_user_gets_a_user_namespace(capsys: pytest.CaptureFixture) -> None:
    """As `nobody`: probe, open the sandbox, start a listener in it, and fail to reach it from outside.

    The pieces are driven directly (the test venv is not readable by `nobody`); only the standard
    library is needed by netns and procs.
    """
    python = shutil.which("python3", path="/usr/bin:/bin")
    why = None if os.geteuid() == 0 else "needs root to switch to the nobody user"
    why = why or (
        None if shutil.which("setpriv") and python else "needs setpriv and /usr/bin/python3"
    )
    if why:
        with capsys.disabled():
            print(f"\nskipping unprivileged test: {why}")
        pytest.skip(why)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        root.chmod(0o777)  # nobody writes the task's log here
        (root / "distlaunch").mkdir()
        for part in ("launcher", "worker"):
            (root / "distlaunch" / part).symlink_to(REPO / part)
        (root / "driver.py").write_text(_DRIVER)
        driver = subprocess.Popen(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                python,
                str(root / "driver.py"),
            ],
            cwd=root,
            env={"PYTHONPATH": str(root), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        report = json.loads(driver.stdout.readline() or "{}")
        try:
            if report.get("mode") == isolation.HOST:
                with capsys.disabled():
                    print(f"\nskipping unprivileged test: {report['reason']}")
                pytest.skip(report["reason"])
            assert report.get("mode") == isolation.USERNS, (
                driver.stderr.read() if not report else report
            )
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", report["port"]), timeout=2).close()
            assert procs.listening(report["holder"], report["port"])
        finally:
            driver.communicate("done\n", timeout=60)
        assert driver.returncode == 0
        _assert_nothing_left(report["run_id"], report["namespace"])


_DRIVER = """
import json, os, sys, time
from distlaunch.launcher.transports import procs
from distlaunch.launcher.plan.isolation import HOST, NETNS, USERNS, Isolation
from distlaunch.launcher.network import netns
caps = netns.probe()
if not (caps.netns or caps.userns):
    print(json.dumps({"mode": HOST, "reason": caps.detail}), flush=True)
    sys.stdin.readline()
    sys.exit(0)
isolation = Isolation(NETNS if caps.netns else USERNS, "as nobody")
run_id = f"nobody-{os.getpid()}"
port = 20000
with netns.sandbox(isolation, run_id) as box:
    listener = "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', %d)); s.listen(); time.sleep(600)" % port
    task, tree = procs.spawn_contained(
        (sys.executable, "-c", listener), {"DISTLAUNCH_RUN_ID": run_id}, ".", "task.log", box.namespaces()
    )
    while not procs.listening(box.pid, port):
        time.sleep(0.05)
    print(json.dumps({"mode": isolation.mode, "port": port, "holder": box.pid, "run_id": run_id,
                      "namespace": os.readlink(f"/proc/{box.pid}/ns/net")}), flush=True)
    sys.stdin.readline()
    procs.stop_groups([task], 2)
    procs.wait_tree(tree)
"""


# ---------------------------------------------------------------- helpers


def _stand_in(tmp: Path, what: str) -> Path:
    (tmp / "task.py").write_text(TASK)
    return write_spec(tmp, program={"script": "task.py", "args": [what]})


def _start(launch, spec: Path) -> tuple[subprocess.Popen, Path]:
    """Start `distlaunch up SPEC` in the background through the ``launch`` fixture; return it and
    its run dir (once it exists)."""
    launcher = launch(spec)
    return launcher, wait_for_run_dir(spec.parent / "runs", launcher)


def _ended(launcher: subprocess.Popen, spec: Path) -> tuple[str, str]:
    """Wait for ``launcher`` to end; return its stdout and stderr."""
    launcher.wait(timeout=DEADLINE_S)
    return (spec.parent / "stdout.txt").read_text(), (spec.parent / "stderr.txt").read_text()


def _run_id(run_dir: Path) -> str:
    return run_record(run_dir)["run_id"]


def _wait_running(run_dir: Path, launcher: subprocess.Popen) -> dict:
    """Wait until every task has its server listening; return run.json then."""

    def running() -> dict | None:
        record = run_record(run_dir)
        tasks = record.get("tasks") or {}
        states = {t.get("state") for t in tasks.values()}
        return (
            record if len(tasks) == len(record["plan"]["tasks"]) and states == {"running"} else None
        )

    return wait_for(running, "every task to be running", launcher=launcher)


def _one_namespace(out: str) -> str:
    """The one namespace the stand-in tasks said they ran in; not the test's own."""
    found = {line.split(" in ", 1)[1] for line in out.splitlines() if " | in net:[" in line}
    assert len(found) == 1 and os.readlink("/proc/self/ns/net") not in found, out
    return found.pop()


def _settled(run_id: str, count: int) -> list[psutil.Process] | None:
    found = processes_of_run(run_id)
    return found if len(found) == count else None


def _host_addresses() -> list[str]:
    """Every IPv4 address of this machine's own network namespace (loopback included)."""
    return sorted(
        {
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == socket.AF_INET
        }
    )


def _namespaces_in_use() -> set[str]:
    """The network namespace of every process (what `lsns -t net` lists, by identity)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            found.add(os.readlink(f"/proc/{pid}/ns/net"))
        except OSError:
            continue
    return found


def _assert_nothing_left(run_id: str, namespace: str | None) -> None:
    """No process of the run survives, and its namespace is gone: no process is in it and nothing
    (an `ip netns` name, any bind mount) holds it. A veth would die with it; distlaunch makes none.

    Checked by the run's own identity, not by comparing machine-wide lists: other tests may make
    namespaces and veths on this machine at the same time.
    """
    wait_for(lambda: not processes_of_run(run_id), f"every process of run {run_id} to be gone")
    if namespace is None:
        return
    wait_for(lambda: namespace not in _namespaces_in_use(), f"namespace {namespace} to be gone")
    inode = namespace.split("[")[1].rstrip("]")
    lsns = subprocess.run(["lsns", "-t", "net", "-n", "-o", "NS"], capture_output=True, text=True)
    assert inode not in lsns.stdout.split()
    assert namespace not in Path("/proc/self/mountinfo").read_text()
    named = Path("/run/netns")
    for entry in named.iterdir() if named.is_dir() else ():
        try:
            assert str(entry.stat().st_ino) != inode, f"{entry} holds the run's namespace"
        except OSError:
            continue
