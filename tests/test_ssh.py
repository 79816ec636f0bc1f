"""SSH transport: the remote helper and ssh command lines on their own, then real runs on two test
hosts (network namespaces with an sshd each, tests/sshhosts.py): MWMS and PS jobs across hosts,
preflight failures, shell metacharacters, a killed launcher or a dropped connection leaving nothing
running on any host, and `collect` for hosts that share nothing.

Host tests skip, with the reason, where the machine cannot make the hosts (not root, no sshd).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import standins

import sshhosts
from conftest import (
    argv,
    distlaunch,
    only_run_dir,
    processes_of_run,
    wait_for,
    wait_for_run_dir,
    with_cmdline,
)
from distlaunch.launcher.spec.model import Host, load_spec
from distlaunch.launcher.transports.ssh import transport as ssh

HELPER = [sys.executable, "-m", "distlaunch.host.remote"]
# A task that says it is up (after its SIGTERM handler is set, when it has one), then waits.
SLEEPER = """
import os, signal, sys, time
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "--fork" in sys.argv and os.fork() == 0:
    time.sleep(600)
    os._exit(0)
if "--setsid" in sys.argv and os.fork() == 0:
    os.setsid()  # out of the task's process group and session
    time.sleep(600)
    os._exit(0)
print("up", os.getpid(), flush=True)
time.sleep(0.5 if "--exit" in sys.argv else 600)
"""
# Prints what it was given, as JSON: the test compares it with what the spec said.
ECHO = """
import json, os, sys
print("GOT " + json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}), flush=True)
"""
# Chief + worker + ps with ParameterServerStrategy in plain TensorFlow (FINDINGS: the servers only
# join; the coordinator schedules steps). The worker runtime's own PSS support is not needed.
PS_JOB = """
import json, os
import tensorflow as tf
config = json.loads(os.environ["TF_CONFIG"])
role, index = config["task"]["type"], config["task"]["index"]
if role in ("ps", "worker"):
    tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name=role, task_index=index,
                         protocol="grpc", start=True).join()
strategy = tf.distribute.experimental.ParameterServerStrategy(
    tf.distribute.cluster_resolver.TFConfigClusterResolver())
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    total = tf.Variable(0.0)

@tf.function
def step():
    total.assign_add(1.0)
    return total.read_value()

for _ in range(8):
    coordinator.schedule(step)
coordinator.join()
print("total", float(total.numpy()), flush=True)
"""


def _marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries MARK=marker."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MARK") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


# ---- the remote helper, on this machine -------------------------------------------------------


def _helper(request: dict, **kw) -> subprocess.Popen:
    proc = subprocess.Popen(
        HELPER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw
    )
    proc.stdin.write(json.dumps(request).encode() + b"\n")
    proc.stdin.flush()
    return proc


def _outcome(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    """Wait for the helper with its stdin still open (EOF would tell it to kill the task)."""
    out = proc.stdout.read()
    err = proc.stderr.read()
    proc.wait(timeout=60)
    proc.stdin.close()
    return out, err


def _sleeper_request(tmp: Path, marker: str, *flags: str, **extra) -> dict:
    script = tmp / "sleeper.py"
    script.write_text(SLEEPER)
    return {
        "argv": [sys.executable, str(script), *flags],
        "env": {"MARK": marker},
        "grace_s": 1,
        **extra,
    }


def _await_up(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    assert line.startswith(b"up "), line


def test_helper_runs_the_request_and_relays_the_exit_code(tmp: Path) -> None:
    request = {
        "argv": ["sh", "-c", 'echo "$A|$0|$(pwd)"; echo to-stderr >&2; exit 7', "zero"],
        "env": {"A": "x y"},
        "cwd": str(tmp),
    }
    proc = _helper(request)
    out, err = _outcome(proc)
    assert proc.returncode == 7
    # stderr is merged into stdout, in order, like a local task's log.
    assert out.decode().splitlines() == [f"x y|zero|{tmp}", "to-stderr"]


def test_helper_stop_terms_then_kills_the_whole_group(tmp: Path) -> None:
    marker = f"stop-{os.getpid()}"
    proc = _helper(_sleeper_request(tmp, marker, "--ignore-term", "--fork"))
    _await_up(proc)
    assert len(_marked(marker)) == 2
    proc.stdin.write(b"stop\n")
    proc.stdin.flush()
    _, err = _outcome(proc)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert b"asked it to stop" in err
    assert _marked(marker) == []


def test_helper_kills_the_group_at_once_on_eof(tmp: Path) -> None:
    marker = f"eof-{os.getpid()}"
    proc = _helper(_sleeper_request(tmp, marker, "--fork", grace_s=600))
    _await_up(proc)
    proc.stdin.close()  # what the helper sees when the launcher dies or the connection drops
    proc.wait(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL
    assert b"connection closed" in proc.stderr.read()
    assert _marked(marker) == []


@pytest.mark.parametrize("how", ["eof", "stop", "exit"])
def test_helper_leaves_no_setsid_child_behind(tmp: Path, how: str) -> None:
    marker = f"setsid-{how}-{os.getpid()}"
    flags = ["--setsid", "--fork"] + (["--exit"] if how == "exit" else [])
    proc = _helper(_sleeper_request(tmp, marker, *flags))
    _await_up(proc)
    wait_for(lambda: len(_marked(marker)) == 3, "the task and its two children", limit_s=30)
    if how == "eof":
        proc.stdin.close()
        proc.wait(timeout=60)
    else:
        if how == "stop":
            proc.stdin.write(b"stop\n")
            proc.stdin.flush()
        _outcome(proc)
    # By the time the helper has exited, not even the child that left the task's group is left.
    assert _marked(marker) == []


def test_helper_kills_the_group_when_heartbeats_stop(tmp: Path) -> None:
    marker = f"silent-{os.getpid()}"
    proc = _helper(_sleeper_request(tmp, marker, heartbeat_s=2))
    _await_up(proc)
    _, err = _outcome(proc)  # stdin stays open but silent
    assert b"no word from the launcher" in err
    assert _marked(marker) == []


def test_helper_relays_sigterm_to_the_task(tmp: Path) -> None:
    marker = f"term-{os.getpid()}"
    proc = _helper(_sleeper_request(tmp, marker))
    _await_up(proc)
    proc.send_signal(signal.SIGTERM)
    _outcome(proc)
    assert proc.returncode == 128 + signal.SIGTERM
    assert _marked(marker) == []


@pytest.mark.parametrize(
    ("request_", "code", "says"),
    [
        ({"argv": []}, 125, b"bad request"),
        ({"argv": ["/nonexistent/program"]}, 127, b"cannot start the task"),
        ({"argv": ["true"], "cwd": "/nonexistent/dir"}, 127, b"cannot start the task"),
    ],
)
def test_helper_refuses_what_it_cannot_start(request_: dict, code: int, says: bytes) -> None:
    proc = _helper(request_)
    _, err = _outcome(proc)
    assert proc.returncode == code
    assert says in err


def test_helper_imports_neither_launcher_nor_tensorflow() -> None:
    code = (
        "import sys, distlaunch.host.remote; "
        "bad = [m for m in sys.modules if m.startswith(('distlaunch.launcher', 'tensorflow'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- ssh command lines and specs ----------------------------------------------------------------


def test_remote_python_is_quoted_data() -> None:
    assert ssh.remote_python("python3") == "python3"
    assert (
        ssh.remote_python("/opt/my env/bin/python; rm -rf ~")
        == "'/opt/my env/bin/python; rm -rf ~'"
    )
    assert ssh.remote_python("~/venv/bin/python") == '"$HOME"/venv/bin/python'


def test_ssh_argv_keeps_the_launcher_in_control() -> None:
    host = Host.model_validate(
        {
            "address": "10.0.0.5",
            "user": "alice",
            "port": 2200,
            "identity_file": "/keys/id",
            "ssh_options": ["ServerAliveInterval=30", "ProxyJump=bastion"],
        }
    )
    with ssh.Session({"node1": host}) as session:
        argv = session.argv("node1", "exec python3 -m x", slot=1)
        options = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
        control_path = next(o.split("=", 1)[1] for o in options if o.startswith("ControlPath="))
        control_dir = Path(control_path).parent
        assert (control_dir.stat().st_mode & 0o777) == 0o700
    assert argv[-3:] == ["--", "10.0.0.5", "exec python3 -m x"]
    assert {
        "BatchMode=yes",
        "StrictHostKeyChecking=yes",
        "ControlMaster=auto",
        "IdentitiesOnly=yes",
    } <= set(options)
    assert control_path.endswith("/0-1-%C")
    # The spec's options come first: ssh keeps the first value, so they win over defaults.
    assert options.index("ServerAliveInterval=30") < options.index(
        f"ServerAliveInterval={ssh.ALIVE_INTERVAL_S}"
    )
    assert ["-l", "alice"] == argv[argv.index("-l") : argv.index("-l") + 2]
    assert not control_dir.exists()


def _ssh_spec(folder: Path, hosts: dict, tasks: dict, **fields) -> Path:
    (folder / "task.py").write_text("print('hi')\n")
    spec = {
        "name": "s",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py"},
        "hosts": hosts,
        "tasks": tasks,
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
        **fields,
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


@pytest.mark.parametrize(
    ("hosts", "tasks", "where", "says"),
    [
        ({}, {"worker": [{"host": "node7"}]}, "$.tasks.worker[0].host", "unknown host 'node7'"),
        (
            {"node1": {}},
            {"worker": [{"host": "node1"}, {"host": "localhost"}]},
            "$.tasks.worker[1].host",
            "cannot reach",
        ),
        (
            {"node1": {}, "me": {"transport": "local"}},
            {"worker": [{"host": "node1"}, {"host": "me"}]},
            "$.tasks.worker[1].host",
            "set $.hosts.me.address",
        ),
        (
            {"node1": {"ssh_options": ["ControlPath=/tmp/x"]}},
            {"worker": {"host": "node1"}},
            "$.hosts.node1.ssh_options[0]",
            "set by distlaunch",
        ),
        (
            {"node1": {"ssh_options": ["-oProxyCommand=x"]}},
            {"worker": {"host": "node1"}},
            "$.hosts.node1.ssh_options[0]",
            "Key=Value",
        ),
        (
            {"me": {"transport": "local", "identity_file": "k"}},
            {"worker": {"host": "me"}},
            "$.hosts.me.identity_file",
            "only hosts with",
        ),
        (
            {"node1": {"address": "-oProxyCommand=x"}},
            {"worker": {"host": "node1"}},
            "$.hosts.node1.address",
            "expected a host name or IPv4 address",
        ),
        (
            {"node1": {"identity_file": "missing_key"}},
            {"worker": {"host": "node1"}},
            "$.hosts.node1.identity_file",
            "existing key file",
        ),
        (
            {"localhost": {}},
            {"worker": {"host": "localhost"}},
            "$.hosts.localhost",
            "expected a host name",
        ),
    ],
)
def test_bad_host_specs_are_one_line_with_path(
    tmp: Path, hosts: dict, tasks: dict, where: str, says: str
) -> None:
    result = distlaunch("validate", str(_ssh_spec(tmp, hosts, tasks)))
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert where in result.stderr and says in result.stderr


def test_plan_names_every_host_address_and_runs_the_host_python(tmp: Path) -> None:
    hosts = {
        "node1": {"address": "10.1.0.1", "python": "/venv/bin/python", "workdir": "~/job"},
        "here": {"transport": "local", "address": "10.1.0.9"},
    }
    path = _ssh_spec(
        tmp, hosts, {"worker": [{"host": "node1", "port": 4000}, {"host": "here", "port": 4001}]}
    )
    data = json.loads(distlaunch("plan", "--json", str(path)).stdout)
    remote, local = data["tasks"]
    assert remote["tf_config"]["cluster"] == {"worker": ["10.1.0.1:4000", "10.1.0.9:4001"]}
    assert (remote["transport"], remote["host_name"], remote["cwd"]) == ("ssh", "node1", "~/job")
    boot = ["/venv/bin/python", "-m", "distlaunch.host.bootstrap"]
    assert remote["argv"][:4] == [*boot, str(tmp / "task.py")]
    assert local["transport"] == "local" and local["argv"][0] == sys.executable
    assert data["isolation"]["mode"] == "host"  # remote tasks must reach the local one
    assert load_spec(path).hosts["node1"].address_of("node1") == "10.1.0.1"


# ---- real hosts -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(ssh_lab):
    """The module's SSH test hosts (conftest's ssh_lab)."""
    return ssh_lab


def _spec(
    folder: Path,
    lab: sshhosts.HostLab,
    program: dict,
    tasks: dict,
    hosts: dict | None = None,
    **fields,
) -> Path:
    spec = {
        "name": "ssh",
        "strategy": "multi_worker_mirrored",
        "program": program,
        "hosts": hosts if hosts is not None else {h.name: lab.host_entry(h) for h in lab.hosts},
        "tasks": tasks,
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
        **fields,
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


def _script(folder: Path, text: str, name: str = "task.py") -> dict:
    (folder / name).write_text(text)
    return {"script": name}


def _nothing_left(lab: sshhosts.HostLab, run_id: str) -> bool:
    """No process on any test host but its sshd, and no local ssh client of the run."""
    return not any(lab.processes(host) for host in lab.hosts) and not processes_of_run(run_id)


def _handshakes(lab: sshhosts.HostLab, host: sshhosts.TestHost) -> int:
    return (
        (lab.dir / f"sshd-{host.name}.log").read_text(errors="replace").count("Accepted publickey")
    )


@pytest.mark.integration
def test_mwms_job_across_two_hosts(lab: sshhosts.HostLab, tmp: Path) -> None:
    program = {
        "module": "distlaunch.worker.examples.mnist_mlp",
        "args": ["--epochs", "1", "--steps-per-epoch", "5"],
    }
    tasks = {"worker": [{"host": "node1"}, {"host": "node2"}]}
    result = distlaunch("up", str(_spec(tmp, lab, program, tasks)), cwd=tmp)
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(tmp / "runs")
    record = json.loads((run_dir / "run.json").read_text())
    cluster = record["plan"]["tasks"][0]["tf_config"]["cluster"]["worker"]
    assert [a.split(":")[0] for a in cluster] == [h.address for h in lab.hosts]
    losses = sorted(line for line in result.stdout.splitlines() if "final loss" in line)
    # Each line is prefixed with its task and host.
    assert (
        len(losses) == 2
        and losses[0].startswith("worker-0@node1 ")
        and losses[1].startswith("worker-1@node2 ")
    )
    assert losses[0].split("final loss")[1] == losses[1].split("final loss")[1]
    # It trained through each host's firewall (protected by default; test_firewall.py probes the
    # rules with stand-ins), whose rules are gone with the run.
    _assert_was_protected(lab, record)
    assert _nothing_left(lab, record["run_id"])


def _assert_was_protected(lab: sshhosts.HostLab, record: dict) -> None:
    """Every host of the run was protected while it ran, and no rule is left."""
    from test_firewall import _rules_left  # (test_firewall imports this module)

    assert all(h["protected"] for h in record["network"]["hosts"].values()), record["network"]
    assert {h.name: _rules_left(h.netns) for h in lab.hosts} == {h.name: [] for h in lab.hosts}


@pytest.mark.integration
def test_ps_job_across_two_hosts(lab: sshhosts.HostLab, tmp: Path) -> None:
    node1, node2 = (h.name for h in lab.hosts)
    tasks = {"chief": [{"host": node1}], "worker": [{"host": node2}], "ps": [{"host": node2}]}
    path = _spec(tmp, lab, _script(tmp, PS_JOB), tasks, strategy="parameter_server")
    result = distlaunch("up", str(path), cwd=tmp)
    assert result.returncode == 0, result.stderr + result.stdout
    assert any(
        line.startswith(f"chief-0@{node1} ") and line.endswith("| total 8.0")
        for line in result.stdout.splitlines()
    )
    record = json.loads((only_run_dir(tmp / "runs") / "run.json").read_text())
    _assert_was_protected(lab, record)
    assert _nothing_left(lab, record["run_id"])


@pytest.mark.integration
def test_tasks_on_one_host_share_few_connections_which_are_closed_after(
    lab: sshhosts.HostLab, tmp: Path
) -> None:
    node1 = lab.hosts[0]
    before = _handshakes(lab, node1)
    # One more task than a connection carries (sshd allows 10 sessions per connection).
    count = ssh.MUX_SESSIONS + 1
    tasks = {"worker": [{"host": node1.name}] * count}
    result = distlaunch("up", str(_spec(tmp, lab, _script(tmp, "print('hi')\n"), tasks)), cwd=tmp)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"@{node1.name} | hi") == count
    # One: the preflight probe opens the master connection the agent then rides.
    assert _handshakes(lab, node1) - before == 1
    nothing = distlaunch(
        "collect", only_run_dir(tmp / "runs").name, "--shared-dir", str(tmp / "runs")
    )
    assert nothing.returncode == 2 and "share the run dir" in nothing.stderr
    assert _ssh_clients_of(lab) == []


def _ssh_clients_of(lab: sshhosts.HostLab) -> list[psutil.Process]:
    """distlaunch's ssh clients and masters (their control path is under a distlaunch-ssh- dir)
    with a TCP connection to one of this lab's hosts: not another session's, on its own hosts."""
    addresses = {h.address for h in lab.hosts}
    found = []
    for proc in with_cmdline("distlaunch-ssh-", name="ssh"):
        try:
            if any(c.raddr and c.raddr.ip in addresses for c in proc.net_connections("tcp")):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.integration
def test_spec_values_reach_the_remote_task_as_data(
    lab: sshhosts.HostLab, tmp: Path, capsys: pytest.CaptureFixture
) -> None:
    """The injection suite of test_injection.py, through ssh and the remote login shell."""
    from test_injection import NAME_PAYLOADS, PATH_PAYLOADS, PAYLOADS, chain

    canary = tmp / "canary"
    # The remote shell does not have the launcher's environment: the payloads name the canary.
    payloads = [p.replace("$DL_CANARY", str(canary)) for p in PAYLOADS]
    workdir = chain(tmp / "w")
    hosts = {h.name: lab.host_entry(h, workdir=str(workdir)) for h in lab.hosts}
    env = {f"P{i}": p for i, p in enumerate(payloads)}
    env.update({f"N{i} {name}": name for i, name in enumerate(NAME_PAYLOADS)})
    program = {**_script(tmp, ECHO), "args": payloads, "env": env}
    spec = _spec(tmp, lab, program, {"worker": [{"host": "node1"}, {"host": "node2"}]}, hosts)
    result = distlaunch("up", str(spec), cwd=tmp)
    assert result.returncode == 0, result.stderr
    got = [
        json.loads(line.split("GOT ", 1)[1])
        for line in result.stdout.splitlines()
        if "GOT " in line
    ]
    assert len(got) == 2
    for one in got:
        assert one["argv"] == payloads
        assert {k: one["env"].get(k) for k in env} == env
        assert one["cwd"] == str(workdir)
    assert not canary.exists(), "a payload was run by a shell"
    fields = {
        "program.args": len(payloads),
        "program.env values": len(payloads),
        "program.env names": len(NAME_PAYLOADS),
        "hosts.*.workdir": len(PATH_PAYLOADS),
    }
    with capsys.disabled():
        print(
            f"\ninjection (ssh): {len(fields)} fields x up to {len(payloads)} payloads = {sum(fields.values())} "
            "values passed through ssh and the remote shell: all arrived unchanged, none ran"
        )


# Holds its TF_CONFIG port like a TensorFlow server. Attempt 0: worker 1 fails, worker 0 would
# serve forever; attempt 1: both succeed, worker 0 taking its port back (retrying a while).
FLAKY = (
    standins.listening(standins.ANY, bind_tries=300)
    + """
index, attempt = cfg["task"]["index"], int(os.environ["DISTLAUNCH_ATTEMPT"])
print("serving", port, "attempt", attempt, flush=True)
if attempt == 0:
    if index == 1:
        time.sleep(1)
        sys.exit(3)
    time.sleep(600)
"""
)


@pytest.mark.integration
def test_a_gang_restart_reaches_the_remote_tasks(lab: sshhosts.HostLab, tmp: Path) -> None:
    tasks = {"worker": [{"host": "node1"}, {"host": "node2"}]}
    restart = {"policy": "on-failure", "max_restarts": 1, "backoff": {"initial_s": 0.5}}
    result = distlaunch(
        "up", str(_spec(tmp, lab, _script(tmp, FLAKY), tasks, restart=restart)), cwd=tmp
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert sorted(
        line.split()[0] for line in result.stdout.splitlines() if "attempt 1" in line
    ) == ["worker-0@node1", "worker-1@node2"]
    assert _nothing_left(lab, only_run_dir(tmp / "runs").name)


@pytest.mark.integration
def test_a_cluster_can_mix_this_machine_and_ssh_hosts(lab: sshhosts.HostLab, tmp: Path) -> None:
    where = (
        "import json, os\n"
        "print('NET', os.stat('/proc/self/ns/net').st_ino, json.loads(os.environ['TF_CONFIG'])['cluster'], flush=True)\n"
    )
    hosts = {
        "here": {"transport": "local", "address": lab.launcher_address},
        "node1": lab.host_entry(lab.hosts[0]),
    }
    tasks = {"worker": [{"host": "here"}, {"host": "node1"}]}
    result = distlaunch("up", str(_spec(tmp, lab, _script(tmp, where), tasks, hosts)), cwd=tmp)
    assert result.returncode == 0, result.stderr
    seen = {
        line.split()[0]: line.split("NET ", 1)[1]
        for line in result.stdout.splitlines()
        if "NET " in line
    }
    here, there = seen["worker-0@here"], seen["worker-1@node1"]
    assert here.split()[0] == str(os.stat("/proc/self/ns/net").st_ino)
    assert there.split()[0] == str(os.stat(f"/run/netns/{lab.hosts[0].netns}").st_ino)
    assert f"'{lab.launcher_address}:" in here and f"'{lab.hosts[0].address}:" in here


@pytest.mark.integration
def test_preflight_reports_every_bad_host_in_one_go(lab: sshhosts.HostLab, tmp: Path) -> None:
    node1, node2 = lab.hosts
    canary = tmp / "canary"
    busy = lab.run_in(
        node1,
        [
            sys.executable,
            "-c",
            "import socket,sys,time; s=socket.socket(); "
            "s.bind(('0.0.0.0',0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        port = int(busy.stdout.readline())
        hosts = {
            "gone": lab.host_entry(node1, address=lab.unused_address, connect_timeout_s=3),
            "badkey": lab.host_entry(node1, identity_file=str(lab.wrong_identity)),
            "strange": lab.host_entry(
                node2,
                ssh_options=["UserKnownHostsFile=/dev/null", "GlobalKnownHostsFile=/dev/null"],
            ),
            "nopython": lab.host_entry(node2, python=f"/nonexistent/python3; touch {canary}"),
            "busy": lab.host_entry(node1),
        }
        tasks = {
            "worker": [
                {"host": "gone"},
                {"host": "badkey"},
                {"host": "strange"},
                {"host": "nopython"},
                {"host": "busy", "port": port},
            ]
        }
        result = distlaunch(
            "up", str(_spec(tmp, lab, _script(tmp, "print('hi')\n"), tasks, hosts)), cwd=tmp
        )
    finally:
        busy.kill()
        busy.wait()
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "preflight failed on 5 of 5 SSH hosts; nothing was started" in lines[0]
    by_host = {line.split()[0]: line for line in lines[1:]}
    assert "unreachable" in by_host["gone"]
    assert "authentication failed" in by_host["badkey"]
    assert "host key verification failed" in by_host["strange"]
    assert "not found on the host" in by_host["nopython"]
    assert f"port {port} is in use" in by_host["busy"]
    assert not (tmp / "runs").exists() or not list((tmp / "runs").iterdir())
    assert not canary.exists()


@pytest.mark.integration
def test_preflight_refuses_a_gpu_the_host_does_not_have(lab: sshhosts.HostLab, tmp: Path) -> None:
    # The test hosts have no NVIDIA driver: a task given a GPU there would train on the CPU.
    tasks = {"worker": [{"host": "node1", "gpus": 1}, {"host": "node2"}]}
    spec = _spec(tmp, lab, _script(tmp, "print('hi')\n"), tasks)
    result = distlaunch("up", str(spec), cwd=tmp)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "preflight failed on 1 of 2 SSH hosts; nothing was started" in lines[0]
    assert len(lines) == 2 and lines[1].split()[0] == "node1", lines
    assert "$.tasks.worker[0].gpus: asks for a GPU, but the host has none" in lines[1]
    assert not (tmp / "runs").exists() or not list((tmp / "runs").iterdir())
    assert distlaunch("plan", str(spec), cwd=tmp).returncode == 0  # a dry run does not ask


@pytest.mark.integration
def test_accept_new_is_an_explicit_opt_in(lab: sshhosts.HostLab, tmp: Path) -> None:
    known = tmp / "known_hosts"
    known.write_text("")
    options = [f"UserKnownHostsFile={known}", "GlobalKnownHostsFile=/dev/null"]
    hosts = {
        "node1": lab.host_entry(lab.hosts[0], ssh_options=options, host_key_checking="accept-new")
    }
    result = distlaunch(
        "up",
        str(_spec(tmp, lab, _script(tmp, "print('hi')\n"), {"worker": {"host": "node1"}}, hosts)),
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr
    found = subprocess.run(
        ["ssh-keygen", "-F", lab.hosts[0].address, "-f", str(known)], capture_output=True
    )
    assert found.returncode == 0  # the host's key was recorded on first use


@pytest.mark.integration
@pytest.mark.parametrize("how", ["sigkill", "sigterm", "connection"])
def test_nothing_is_left_on_any_host(lab: sshhosts.HostLab, tmp: Path, how: str) -> None:
    """SIGKILL of the launcher, SIGTERM (an orderly stop), or the SSH connection dying under it."""
    tasks = {"worker": [{"host": "node1"}, {"host": "node2"}, {"host": "node2"}]}
    path = _spec(tmp, lab, {**_script(tmp, SLEEPER), "args": ["--ignore-term", "--fork"]}, tasks)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "distlaunch.launcher", "up", str(path)],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        logs = run_dir / "logs" / "attempt-0"
        wait_for(
            lambda: (
                all("up " in (logs / f"worker-{i}.log").read_text() for i in range(3))
                if all((logs / f"worker-{i}.log").exists() for i in range(3))
                else False
            ),
            "every task up",
        )
        assert all(lab.processes(host) for host in lab.hosts)
        # The run's control dir is in its task clients' command lines, and in its masters' (every
        # task's session rides on one).
        clients = [argv(p) for p in psutil.Process(launcher.pid).children()]
        control = {
            Path(a.split("=", 1)[1]).parent
            for c in clients
            for a in c
            if a.startswith("ControlPath=")
        }
        assert len(control) == 1
        control_dir = control.pop()
        if how == "sigkill":
            launcher.kill()
        elif how == "sigterm":
            launcher.terminate()
        else:
            masters = with_cmdline("[mux]", str(control_dir), name="ssh")
            assert len(masters) == 2
            for master in masters:
                master.kill()
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    run_id = run_dir.name
    if how == "sigterm":
        assert launcher.returncode == 128 + signal.SIGTERM, err
    elif how == "connection":
        assert launcher.returncode == 1, err
        assert "failed: worker-" in err
    wait_for(
        lambda: _nothing_left(lab, run_id), "every process of the run to be gone from every host"
    )
    if how == "sigkill":
        # Nobody was left to close the masters: they end ControlPersist seconds after their last
        # session; only the empty control dir would stay behind.
        shutil.rmtree(control_dir)
    else:
        assert not control_dir.exists()


@pytest.mark.integration
def test_hosts_that_share_nothing_keep_their_files_until_collected(
    lab: sshhosts.HostLab, tmp: Path
) -> None:
    writer = (
        "import os, pathlib\n"
        "d = pathlib.Path(os.environ['DISTLAUNCH_CHECKPOINT_DIR'])\n"
        "(d / ('from-' + os.environ['DISTLAUNCH_ROLE'] + os.environ['DISTLAUNCH_INDEX'])).write_text('w')\n"
    )
    shared = lab.private_dir / tmp.name  # each host has its own disk at this path
    tasks = {"worker": [{"host": "node1"}, {"host": "node2"}]}
    path = _spec(tmp, lab, _script(tmp, writer), tasks, shared_dir=str(shared))

    refused = distlaunch("up", str(path), cwd=tmp)
    assert refused.returncode == 2
    assert "is not shared with the launcher" in refused.stderr

    spec = json.loads(path.read_text())
    path.write_text(json.dumps({**spec, "shared_dir_is_shared": False}))
    result = distlaunch("up", str(path), cwd=tmp)
    assert result.returncode == 0, result.stderr
    run_dir = only_run_dir(shared)
    assert not list((run_dir / "checkpoints").iterdir())  # written on the hosts' disks only
    collected = distlaunch("collect", run_dir.name, "--shared-dir", str(shared))
    assert collected.returncode == 0, collected.stderr
    assert (run_dir / "hosts" / "node1" / "checkpoints" / "from-worker0").read_text() == "w"
    assert (run_dir / "hosts" / "node2" / "checkpoints" / "from-worker1").read_text() == "w"


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_stacks_of_a_running_run_on_two_hosts(lab: sshhosts.HostLab, tmp: Path) -> None:
    from test_diagnose import MWMS_STEPS

    tasks = {"worker": [{"host": "node1"}, {"host": "node2"}]}
    spec = _spec(tmp, lab, _script(tmp, MWMS_STEPS), tasks)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "distlaunch.launcher", "up", str(spec)],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        log = run_dir / "logs" / "attempt-0" / "worker-1.log"
        wait_for(
            lambda: log.exists() and "stops inside step" in log.read_text(),
            "worker-1 to stop",
            launcher=launcher,
        )
        shown = distlaunch("stacks", run_dir.name, "--full", cwd=tmp)
        print(shown.stdout, shown.stderr)
        assert shown.returncode == 0
        # Every task's whole stack, read on its own host by the remote helper (with native frames).
        assert "worker-0 | Thread" in shown.stdout and "worker-1 | Thread" in shown.stdout
        assert "worker-1 |     time_sleep (libpython" in shown.stdout
        assert "worker-1: in its own code at train (task.py:22)" in shown.stdout
        assert "worker-0: waits in" in shown.stdout
        taken = next(p for p in (run_dir / "stacks").iterdir() if not p.name.startswith("signal-"))
        files = sorted(p.name for p in taken.iterdir())
        assert files == ["worker-0.txt", "worker-1.txt"]
        assert distlaunch("down", run_dir.name, cwd=tmp).returncode == 0
        launcher.wait(timeout=60)
    finally:
        launcher.kill()
        launcher.communicate()
    assert _nothing_left(lab, run_dir.name)


@pytest.mark.integration
def test_tasks_sharing_a_host_run_on_the_cpus_the_plan_gives_them(
    lab: sshhosts.HostLab, tmp: Path
) -> None:
    from test_cpus import SEEN, seen_by_tasks

    node1 = lab.hosts[0].name
    tasks = {"worker": [{"host": node1}, {"host": node1}]}
    program = {**_script(tmp, SEEN), "env": {"TF_NUM_INTRAOP_THREADS": "3"}}
    spec = _spec(tmp, lab, program, tasks)
    dry = distlaunch("plan", "--json", str(spec), cwd=tmp)
    assert dry.returncode == 0, dry.stderr
    # Before `up` has probed the host, its CPUs are not known: the dry run says so.
    assert [t["cpus"]["how"] for t in json.loads(dry.stdout)["tasks"]] == ["auto", "auto"]
    result = distlaunch("up", str(spec), cwd=tmp)
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(tmp / "runs")
    plan = json.loads((run_dir / "run.json").read_text())["plan"]
    pairs = seen_by_tasks(run_dir, plan)
    for task, seen in pairs:
        assert seen["affinity"] == task["cpus"]["ids"] and seen["threads"] == task["threads"]
        assert seen["threads"]["TF_NUM_INTRAOP_THREADS"] == "3"
        assert seen["threads"]["OMP_NUM_THREADS"] == str(len(seen["affinity"]))
    host = sorted(set(pairs[0][1]["affinity"]) | set(pairs[1][1]["affinity"]))
    if len(host) >= 2:
        assert not set(pairs[0][1]["affinity"]) & set(pairs[1][1]["affinity"])
        assert f"cpus: 2 tasks on {node1}, " in result.stderr
