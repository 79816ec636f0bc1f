"""SSH hosts behind a jump host: the firewall admits the launcher, not the jump host.

The guard's SSH session comes from the jump host (ProxyJump or ProxyCommand), while the launcher
checks that tasks joined by connecting to their ports from its own address. On the SSH test hosts
of tests/sshhosts.py (under ``flock /tmp/dl-ssh.lock``): node2 reached through node1, every task
on node2; the launcher's join checks pass, and neither the jump host nor the outsider gets in.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

import sshhosts
from conftest import distlaunch, run_record
from distlaunch.launcher.spec.model import Host
from distlaunch.launcher.transports.ssh import transport as ssh
from test_firewall import LISTENER, _hold, _release, _rules_left, fw_lab
from test_ssh import _script, _spec

__all__ = ["fw_lab"]  # a fixture of test_firewall, used here


@pytest.mark.quick
def test_ssh_tells_which_hosts_it_reaches_through_a_jump_host() -> None:
    hosts = {
        "direct": Host(transport="ssh", address="10.0.0.11"),
        "jumped": Host(transport="ssh", address="10.0.0.12", ssh_options=["ProxyJump=bastion"]),
        "command": Host(
            transport="ssh",
            address="10.0.0.13",
            ssh_options=["ProxyCommand=ssh -W %h:%p bastion"],
        ),
        "none": Host(transport="ssh", address="10.0.0.14", ssh_options=["ProxyCommand=none"]),
    }
    assert ssh.jumped_hosts(hosts) == ["command", "jumped"]


def _accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.integration
def test_behind_a_jump_host_the_launcher_is_admitted_and_the_jump_host_is_not(
    fw_lab: sshhosts.HostLab, tmp: Path
) -> None:
    jump, node2 = fw_lab.hosts
    entry = fw_lab.host_entry(node2)
    entry["ssh_options"] = [*entry["ssh_options"], *fw_lab.through(jump)]
    spec = _spec(
        tmp,
        fw_lab,
        _script(tmp, LISTENER),
        {"worker": [{"host": "node2"}, {"host": "node2"}]},
        {"node2": entry},
    )
    launcher, run_dir, tasks = _hold(fw_lab, tmp, spec, ["worker-0", "worker-1"])
    try:
        assert _rules_left(node2.netns)
        allowed = run_record(run_dir)["network"]["hosts"]["node2"]["allowed"]
        assert fw_lab.launcher_address in allowed and jump.address not in allowed, allowed
        for name, _, address, port in tasks:
            assert _accepts(address, port), f"{name}: the launcher was refused"
            assert not fw_lab.connects(jump, address, port), f"{name}: the jump host got in"
            assert not fw_lab.connects(fw_lab.outsider, address, port), f"{name}: the outsider"
    finally:
        _, err = _release(launcher, run_dir)
    assert launcher.returncode == 0, err
    assert _rules_left(node2.netns) == []
    # `plan` says so.
    plan = distlaunch("plan", str(spec), cwd=tmp)
    assert plan.returncode == 0, plan.stderr
    assert re.search(
        rf"node2: nftables table inet \S+: tcp ports \d+, \d+ admit {re.escape(node2.address)}, "
        rf"the launcher \([^)]*{re.escape(fw_lab.launcher_address)}[^)]*\) and loopback; "
        "the jump host is not admitted",
        plan.stdout,
    ), plan.stdout
