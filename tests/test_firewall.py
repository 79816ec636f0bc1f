"""The per-run firewall of SSH hosts (launcher/network/firewall.py, launcher/host/guard.py).

Pure parts first (which rules each host gets, the nftables script, hostile run ids), then real
runs on the SSH test hosts of tests/sshhosts.py, where a third namespace on the same bridge, the
outsider, stands for any machine that can reach the hosts but is no part of the run: it cannot
connect to a task port while MWMS and PSS jobs train across the hosts, and no rule of the run is
left on any host after the run, after `kill -9` of the launcher, or when `required` refuses a host
that cannot be firewalled (a login without CAP_NET_ADMIN).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import standins

import sshhosts
from conftest import (
    distlaunch,
    events,
    run_record,
    start_up,
    wait_for,
    wait_for_run_dir,
    write_spec,
)
from distlaunch.host import guard
from distlaunch.launcher.network import firewall
from distlaunch.launcher.plan.plan import Plan, TaskPlan
from test_ssh import _nothing_left, _script, _spec

# Appended to a task program: say so, then wait for the test to create <run dir>/release. While a
# task holds, its TensorFlow server still listens: the test probes the ports from every side.
HOLD = """
import os as _os, time as _time
print("holding", flush=True)
while not _os.path.exists(_os.path.join(_os.environ["DISTLAUNCH_RUN_DIR"], "release")):
    _time.sleep(0.1)
"""
# Listens on its TF_CONFIG port like a TensorFlow server, without TensorFlow's start-up cost.
# What these tests probe is the guard's rules on the ports, not what TensorFlow sends through
# them: that a protected run trains across the hosts is tests/test_ssh.py's MWMS and PSS runs
# (the same specs, protected by default; they assert it).
LISTENER = standins.listening(standins.ANY) + HOLD
# Under PSS the launcher runs ps and workers as TensorFlow servers of its own (a program that
# never creates a tf.distribute.Server, as this one: `python -m distlaunch.worker.serve`); the
# chief is LISTENER.


def _task(name: str, host: str, address: str, port: int, transport: str = "ssh") -> TaskPlan:
    role, index = name.split("-")
    return TaskPlan(
        role,
        int(index),
        address,
        port,
        (),
        {},
        "",
        {},
        (),
        "",
        host_name=host,
        transport=transport,
    )


@pytest.mark.quick
def test_each_remote_host_admits_every_host_of_the_run_to_its_own_ports_only() -> None:
    plan = Plan(
        "r",
        "/runs/r",
        "multi_worker_mirrored",
        0,
        (
            _task("worker-0", "node1", "10.0.0.1", 4000),
            _task("worker-1", "node2", "10.0.0.2", 4001),
            _task("worker-2", "node2", "10.0.0.2", 4002),
            _task("worker-3", "here", "10.0.0.9", 4003, transport="local"),
        ),
    )
    rules = firewall.plan_rules(plan)
    assert sorted(rules) == ["node1", "node2"]  # this machine is no remote host
    assert rules["node1"].ports == (4000,) and rules["node2"].ports == (4001, 4002)
    assert rules["node1"].allow == rules["node2"].allow == ("10.0.0.1", "10.0.0.2", "10.0.0.9")
    assert firewall.plan_json("off", rules)["hosts"] == {}


@pytest.mark.quick
def test_the_nft_script_drops_all_but_the_run_and_a_hostile_run_id_stays_a_name() -> None:
    name = firewall.rules_name('x"; flush ruleset; }\ntable ip t {', "/runs/x", "node1")
    assert guard.NAME.fullmatch(name) and guard.table_name(name).startswith("distlaunch_x")
    script = guard.nft_ruleset("distlaunch_r", (4000, 4001), ["10.0.0.2", "10.0.0.1", "fd00::1"])
    assert "tcp dport { 4000, 4001 } ip saddr { 10.0.0.1, 10.0.0.2 } accept" in script
    assert "tcp dport { 4000, 4001 } ip6 saddr { fd00::1 } accept" in script
    # Loopback first, the drop last: nothing but the run's hosts gets past it.
    lines = [line.strip() for line in script.splitlines()]
    assert lines.index('iifname "lo" accept') < lines.index("tcp dport { 4000, 4001 } drop")
    with pytest.raises(ValueError):
        guard.nft_ruleset("distlaunch_r", (4000,), ["10.0.0.1; flush ruleset"])
    chain = guard.chain_name('x"; -F INPUT')
    assert len(chain) <= 28 and chain[3:].isalnum()  # iptables' limit; nothing but a digest
    add, remove = guard.iptables_scripts(
        chain, tuple(range(4000, 4016)), ["10.0.0.1", "fd00::1"], 4
    )
    assert f"-A {chain} -s 10.0.0.1 -j RETURN" in add and "fd00::1" not in add
    assert add.count("-I INPUT -p tcp -m multiport") == 2  # at most 15 ports per rule
    assert remove.count("-D INPUT") == 2 and f"-X {chain}" in remove
    for bad in (
        b'{"run_id": "r", "ports": ["22; x"]}',
        b'{"run_id": "r", "ports": [70000]}',
        b"[]",
    ):
        with pytest.raises((ValueError, TypeError)):
            guard.parse(bad)


@pytest.mark.quick
def test_a_bad_protect_value_is_one_line_and_plan_shows_the_rules(tmp: Path) -> None:
    (tmp / "task.py").write_text("print('hi')\n")
    bad = distlaunch("validate", str(write_spec(tmp, network={"protect": "on"})))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "$.network.protect" in bad.stderr
    hosts = {"node1": {"address": "10.1.0.1"}, "node2": {"address": "10.1.0.2"}}
    tasks = {"worker": [{"host": "node1", "port": 4000}, {"host": "node2", "port": 4001}]}
    plan = distlaunch("plan", str(write_spec(tmp, hosts=hosts, tasks=tasks)))
    assert plan.returncode == 0, plan.stderr
    assert "node2: nftables table inet distlaunch_t_" in plan.stdout
    assert re.search(
        r"tcp ports 4001 admit 10\.1\.0\.1, 10\.1\.0\.2, the launcher \([0-9a-f.:, ]+\), "
        r"the address the launcher's SSH session comes from and loopback;",
        plan.stdout,
    ), plan.stdout
    local = distlaunch("plan", "--json", str(write_spec(tmp)))
    assert json.loads(local.stdout)["network"] == {"protect": "auto", "hosts": {}}


# ---- the guard on its own, in a throwaway network namespace ------------------------------------


@pytest.fixture
def netns_name():
    """A fresh network namespace (deleted afterwards) whose firewall a guard may change."""
    reason = sshhosts.unavailable_reason()
    if reason is None and shutil.which("nft") is None:
        reason = "nft is not installed (apt-get install nftables)"
    if reason is not None:
        pytest.skip(reason)
    name = f"dlfw-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _rules_left(netns: str) -> list[str]:
    """The run tables (nftables) and run chains (iptables, IPv4 and IPv6) in namespace ``netns``."""
    found = []
    for argv, mark in (
        (["nft", "list", "tables"], guard.TABLE_PREFIX),
        (["iptables-save"], ":DL-"),
        (["ip6tables-save"], ":DL-"),
    ):
        listed = subprocess.run(
            ["ip", "netns", "exec", netns, *argv],
            check=True,
            capture_output=True,
            text=True,
        )
        found += [line for line in listed.stdout.splitlines() if mark in line]
    return found


def _hiding_nft(argv: list[str]) -> list[str]:
    """``argv`` run where nft cannot be found (/dev/null mounted over it in a private mount
    namespace): a host without nftables, where the guard falls back to iptables."""
    nft = os.path.realpath(shutil.which("nft"))
    return [
        "unshare",
        "-m",
        "sh",
        "-c",
        'mount --bind /dev/null "$0" && exec "$@"',
        nft,
        *argv,
    ]


@pytest.mark.parametrize(
    ("backend", "how"),
    [
        ("nftables", "eof"),
        ("nftables", "silence"),
        ("nftables", "sigterm"),
        ("iptables", "eof"),
        ("iptables", "sigterm"),
    ],
)
def test_the_guard_removes_its_rules_however_it_is_ended(
    netns_name: str, backend: str, how: str
) -> None:
    """EOF is what a SIGKILLed launcher or a dropped connection looks like from the host."""
    argv = [
        "ip",
        "netns",
        "exec",
        netns_name,
        sys.executable,
        "-m",
        "distlaunch.host.guard",
    ]
    if backend == "iptables":
        argv = _hiding_nft(argv)  # every program execs the next: the pid stays the guard's
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    request = {
        "run_id": f"g-{how}",
        "name": f"g_{how}_1a2b",
        "ports": [4000],
        "allow": ["10.9.9.9"],
        "heartbeat_s": 1,
    }
    proc.stdin.write(json.dumps(request).encode() + b"\n")
    proc.stdin.flush()
    answer = json.loads(proc.stdout.readline())
    name = (
        guard.table_name(request["name"])
        if backend == "nftables"
        else guard.chain_name(request["name"])
    )
    assert answer == {
        "protected": True,
        "how": backend,
        "table": name,
        "allowed": ["10.9.9.9"],
    }
    assert _rules_left(netns_name) and all(name in line for line in _rules_left(netns_name))
    if how == "eof":
        proc.stdin.close()
    elif how == "sigterm":
        proc.send_signal(signal.SIGTERM)  # `ip netns exec` execs: this is the guard itself
    # "silence": stdin stays open, and no heartbeat comes.
    proc.wait(timeout=60)
    err = proc.stderr.read()
    if not proc.stdin.closed:
        proc.stdin.close()
    assert proc.returncode == 0, err
    says = {
        "eof": b"connection closed",
        "silence": b"no word from the launcher for 1 s",
        "sigterm": b"SIGTERM",
    }
    assert says[how] in err
    assert _rules_left(netns_name) == []


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["nftables", "iptables"])
def test_remove_takes_away_what_a_sigkilled_guard_left(netns_name: str, backend: str) -> None:
    """`down` runs ``guard --remove NAME`` on a Slurm run's nodes, where a cancelled step
    SIGKILLs its guard."""
    argv = ["ip", "netns", "exec", netns_name, sys.executable, "-m", "distlaunch.host.guard"]
    if backend == "iptables":
        argv = _hiding_nft(argv)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    request = {"run_id": "left", "name": "left_1a2b", "ports": [4000, 4001], "allow": ["10.9.9.9"]}
    proc.stdin.write(json.dumps(request).encode() + b"\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["how"] == backend
    proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()
    assert _rules_left(netns_name)  # what a SIGKILLed guard leaves
    done = subprocess.run(
        [*argv, "--remove", "left_1a2b"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    removed = json.loads(done.stdout)["removed"]
    assert len(removed) == (1 if backend == "nftables" else 2), removed
    assert _rules_left(netns_name) == []
    again = subprocess.run(
        [*argv, "--remove", "left_1a2b"], capture_output=True, text=True, check=False
    )
    assert json.loads(again.stdout) == {"removed": []}


@pytest.mark.quick
@pytest.mark.parametrize("backend", ["nftables", "iptables"])
def test_installing_twice_then_removing_once_leaves_no_rule(netns_name: str, backend: str) -> None:
    """An agent restarted on a host installs the rules of the same name again: the iptables
    fallback used to add a second INPUT jump, and its removal (one jump, then the chain) failed
    whole, leaving the DROP chain behind."""
    code = (
        "from distlaunch.host import rules\n"
        "first = rules.install('twice_1a2b', (4000,), ['10.9.9.9'])\n"
        "again = rules.install('twice_1a2b', (4000,), ['10.9.9.9'])\n"
        "print(first.how, again.how)\n"
        "again.remove()\n"
    )
    argv = ["ip", "netns", "exec", netns_name, sys.executable, "-c", code]
    if backend == "iptables":
        argv = _hiding_nft(argv)
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [backend, backend]
    assert _rules_left(netns_name) == []


# ---- real hosts -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fw_lab(ssh_lab):
    """The SSH test hosts and the outsider (conftest's ssh_lab), where nft is installed."""
    if shutil.which("nft") is None:
        pytest.skip("nft is not installed (apt-get install nftables)")
    return ssh_lab


def _tables(lab: sshhosts.HostLab) -> dict[str, list[str]]:
    """The run's rules on each test host: nftables tables and iptables chains."""
    return {h.name: _rules_left(h.netns) for h in lab.hosts}


def _hold(lab: sshhosts.HostLab, tmp: Path, spec: Path, holders: list[str]) -> tuple:
    """Start `up` on ``spec`` and wait until every task in ``holders`` holds; return the launcher,
    the run dir and the run's tasks as (name, host name, address, port)."""
    launcher = start_up(spec)
    try:
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        logs = run_dir / "logs" / "attempt-0"

        def holding() -> bool:
            return all(
                (logs / f"{n}.log").exists() and "holding" in (logs / f"{n}.log").read_text()
                for n in holders
            )

        wait_for(holding, f"{', '.join(holders)} to hold", launcher=launcher)
    except BaseException:
        # A run that never held is ended here: left up, its tables would fail the next test.
        launcher.kill()
        launcher.wait()
        raise
    tasks = [
        (t["name"], t["host_name"], t["host"], t["port"])
        for t in run_record(run_dir)["plan"]["tasks"]
    ]
    return launcher, run_dir, tasks


def _shut_to_outsiders_open_to_peers(lab: sshhosts.HostLab, tasks: list[tuple]) -> None:
    by_name = {h.name: h for h in lab.hosts}
    for name, host, address, port in tasks:
        peer = next(h for h in lab.hosts if h.name != host)
        assert lab.connects(peer, address, port), (
            f"{name} on {host}: the run's own host {peer.name} was refused"
        )
        assert lab.connects(by_name[host], address, port), f"{name}: its own host was refused"
        assert not lab.connects(lab.outsider, address, port), (
            f"{name} on {host}:{port} admitted the outsider"
        )


def _release(launcher, run_dir: Path) -> tuple[str, str]:
    (run_dir / "release").write_text("")
    launcher.wait(timeout=300)
    folder = run_dir.parent.parent
    return (folder / "stdout.txt").read_text(), (folder / "stderr.txt").read_text()


@pytest.mark.integration
def test_outsider_is_shut_out_while_an_mwms_run_serves_across_hosts(
    fw_lab: sshhosts.HostLab, tmp: Path
) -> None:
    tasks = {"worker": [{"host": "node1"}, {"host": "node2"}]}
    spec = _spec(tmp, fw_lab, _script(tmp, LISTENER), tasks)
    launcher, run_dir, planned = _hold(fw_lab, tmp, spec, ["worker-0", "worker-1"])
    try:
        assert all(len(t) == 1 for t in _tables(fw_lab).values()), _tables(fw_lab)
        _shut_to_outsiders_open_to_peers(fw_lab, planned)
        status = distlaunch("status", str(run_dir))
        assert (
            "firewall: node1 protected" in status.stdout
            and "firewall: node2 protected" in status.stdout
        )
    finally:
        out, err = _release(launcher, run_dir)
    assert launcher.returncode == 0, err
    assert "firewall: on node1, node2 the run's task ports admit only the run's hosts" in err
    assert out.count("| holding") == 2, out
    assert _tables(fw_lab) == {"node1": [], "node2": []}
    network = run_record(run_dir)["network"]
    assert all(h["protected"] and h["how"] == "nftables" for h in network["hosts"].values())
    assert (
        fw_lab.launcher_address in network["hosts"]["node1"]["allowed"]
    )  # the SSH client, for join checks
    assert "was protected while the run ran" in distlaunch("status", str(run_dir)).stdout


@pytest.mark.integration
def test_outsider_is_shut_out_while_a_pss_run_serves_across_hosts(
    fw_lab: sshhosts.HostLab, tmp: Path
) -> None:
    tasks = {
        "chief": [{"host": "node1"}],
        "worker": [{"host": "node2"}],
        "ps": [{"host": "node2"}],
    }
    spec = _spec(tmp, fw_lab, _script(tmp, LISTENER), tasks, strategy="parameter_server")
    launcher, run_dir, planned = _hold(fw_lab, tmp, spec, ["chief-0"])
    try:
        # The servers are probed once they are up: the launcher has seen each join.
        wait_for(
            lambda: (
                {e["task"] for e in events(run_dir) if e["event"] == "joined"}
                >= {"worker-0", "ps-0"}
            ),
            "the servers to join",
            launcher=launcher,
        )
        # The chief's own port is unused by TensorFlow: only the servers' ports are probed.
        _shut_to_outsiders_open_to_peers(fw_lab, [t for t in planned if t[0] != "chief-0"])
    finally:
        out, err = _release(launcher, run_dir)
    assert launcher.returncode == 0, err
    # The chief ended the run; its servers were stopped (PS_JOB's "total 8.0" under protection:
    # tests/test_ssh.py's PSS run).
    assert any(line.startswith("chief-0@node1 ") for line in out.splitlines()), out
    tasks_of = run_record(run_dir)["tasks"]
    assert [tasks_of[n]["state"] for n in ("worker-0", "ps-0")] == ["stopped", "stopped"]
    assert _tables(fw_lab) == {"node1": [], "node2": []}


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["nftables", "iptables"])
def test_no_rule_is_left_after_kill_9_of_the_launcher(
    fw_lab: sshhosts.HostLab, tmp: Path, backend: str
) -> None:
    hosts = None
    if backend == "iptables":  # hosts without nftables: their python cannot find nft
        wrapper = tmp / "python-without-nft"
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.join(_hiding_nft([sys.executable]))} "$@"\n')
        wrapper.chmod(0o755)
        hosts = {h.name: fw_lab.host_entry(h, python=str(wrapper)) for h in fw_lab.hosts}
    tasks = {"worker": [{"host": "node1"}, {"host": "node2"}, {"host": "node2"}]}
    spec = _spec(tmp, fw_lab, _script(tmp, LISTENER), tasks, hosts)
    launcher, run_dir, planned = _hold(fw_lab, tmp, spec, ["worker-0", "worker-1", "worker-2"])
    try:
        assert all(h["how"] == backend for h in run_record(run_dir)["network"]["hosts"].values())
        assert all(_tables(fw_lab).values())
        assert not any(
            fw_lab.connects(fw_lab.outsider, address, port) for _, _, address, port in planned
        )
        launcher.kill()
        launcher.wait()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    wait_for(
        lambda: _tables(fw_lab) == {"node1": [], "node2": []},
        "every run table to be gone from every host",
    )
    wait_for(
        lambda: _nothing_left(fw_lab, run_dir.name),
        "every process of the run to be gone from every host",
    )


@pytest.mark.integration
def test_protect_off_leaves_the_ports_open_and_says_so(fw_lab: sshhosts.HostLab, tmp: Path) -> None:
    """The control: on the same hosts and network, the outsider does reach an unprotected port."""
    spec = _spec(
        tmp,
        fw_lab,
        _script(tmp, LISTENER),
        {"worker": [{"host": "node1"}]},
        network={"protect": "off"},
    )
    launcher, run_dir, planned = _hold(fw_lab, tmp, spec, ["worker-0"])
    try:
        assert _tables(fw_lab) == {"node1": [], "node2": []}
        _, _, address, port = planned[0]
        assert fw_lab.connects(fw_lab.outsider, address, port)
    finally:
        _, err = _release(launcher, run_dir)
    assert launcher.returncode == 0, err
    assert f'"network": {{"protect": "off"}}: ports {port} on node1 stay open' in err


def _without_net_admin(tmp: Path) -> str:
    """A python for a host entry that runs this interpreter with CAP_NET_ADMIN out of reach (as a
    login that is not root would be): dropped from the bounding set, it is gone after exec."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is not installed (util-linux)")
    wrapper = tmp / "python-without-net-admin"
    wrapper.write_text(
        f'#!/bin/sh\nexec {setpriv} --bounding-set -net_admin --inh-caps -net_admin -- {sys.executable} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


@pytest.mark.integration
def test_a_host_without_cap_net_admin_is_named_open_or_refused(
    fw_lab: sshhosts.HostLab, tmp: Path
) -> None:
    node1, node2 = fw_lab.hosts
    hosts = {
        node1.name: fw_lab.host_entry(node1),
        node2.name: fw_lab.host_entry(node2, python=_without_net_admin(tmp)),
    }
    tasks = {"worker": [{"host": "node1"}, {"host": "node2"}]}

    spec = _spec(tmp, fw_lab, _script(tmp, "print('hi')\n"), tasks, hosts)
    result = distlaunch("up", str(spec), cwd=tmp)
    assert result.returncode == 0, result.stderr
    only = next((tmp / "runs").glob("*/run.json")).parent
    port = run_record(only)["plan"]["tasks"][1]["port"]
    assert (
        f"note: ports {port} stay open to anyone who reaches node2: user root may not change the firewall"
        in result.stderr
    )
    assert "firewall: on node1 the run's task ports admit only" in result.stderr
    network = run_record(only)["network"]["hosts"]
    assert network["node1"]["protected"] and not network["node2"]["protected"]
    assert "CAP_NET_ADMIN" in network["node2"]["why"]
    assert f"firewall: node2 OPEN (ports {port})" in distlaunch("status", str(only)).stdout

    shutil.rmtree(tmp / "runs")
    spec = _spec(
        tmp,
        fw_lab,
        _script(tmp, "print('hi')\n"),
        tasks,
        hosts,
        network={"protect": "required"},
    )
    refused = distlaunch("up", str(spec), cwd=tmp)
    assert refused.returncode == 2, refused.stderr
    # The hosts' preflight lines, then the error: one line.
    lines = refused.stderr.strip().splitlines()
    assert [line for line in lines if "error:" in line] == lines[-1:]
    assert (
        '"protect": "required"' in refused.stderr
        and "node2: user root may not change the firewall" in refused.stderr
    )
    assert "nothing was started" in refused.stderr and "hi" not in refused.stdout
    assert not any((tmp / "runs").glob("*/run.json"))
    assert _tables(fw_lab) == {
        "node1": [],
        "node2": [],
    }  # node1's guard was closed, its table removed
    wait_for(
        lambda: not any(fw_lab.processes(h) for h in fw_lab.hosts),
        "the guards to be gone from the hosts",
    )


@pytest.mark.quick
def test_the_guard_imports_neither_launcher_nor_tensorflow() -> None:
    code = (
        "import sys, distlaunch.host.guard; "
        "bad = [m for m in sys.modules if m.startswith(('distlaunch.launcher', 'tensorflow'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
