"""The network under the test labs (tests/sshhosts.py, tests/slurmcluster.py): machines as
network namespaces on one bridge, reached from the root namespace, all in one 10.X.N.0/24.

Layout (the labs name their own machines; PREFIX ends in the subnet's N)::

    root namespace                    switch namespace              machine namespaces
    PREFIX-r ROOT  <-- veth -->  PREFIX-rs --+                  +-- NETNS (NETNSv) ADDRESS
                                             +- bridge PREFIX-br +-- ...

The bridge lives in a namespace of its own: its netfilter tables are empty, so firewall rules of
the root namespace (Docker sets FORWARD to DROP) never see machine-to-machine traffic, and
nothing of the machine's own firewall or network setup is changed. Every address exists only
inside these namespaces; ``close()`` deletes every namespace (their veths and the bridge go with
them) after killing whatever still runs in them.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence

import psutil


class NetLab:
    """Namespaces, bridge, veths, addresses and routes of one lab; ``close()`` removes them all.

    ``machines`` are (namespace, address) pairs; ``root_address`` is the root namespace's address
    on the bridge (where the launcher, or slurmctld, runs)."""

    def __init__(
        self,
        prefix: str,
        subnet: ipaddress.IPv4Network,
        root_address: str,
        machines: Sequence[tuple[str, str]],
    ) -> None:
        self.prefix = prefix
        self._namespaces: list[str] = []
        try:
            self._make(subnet.prefixlen, root_address, machines)
        except BaseException:
            self.close()
            raise

    def exec_argv(self, netns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside network namespace ``netns``."""
        return ["ip", "netns", "exec", netns, *argv]

    def connects(self, netns: str, address: str, port: int) -> bool:
        """Whether a TCP connection from inside ``netns`` to ``address:port`` is accepted within a
        second (a dropped SYN counts as no)."""
        probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)"
        argv = self.exec_argv(netns, [sys.executable, "-c", probe, address, str(port)])
        return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0

    def processes(self, netns: str, daemons: Sequence[str] = ()) -> list[psutil.Process]:
        """Every live process in ``netns`` but the lab's own ``daemons`` (by process name)."""
        found = []
        for proc in self.all_in(netns):
            try:
                if proc.name() not in daemons and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        return found

    def all_in(self, netns: str) -> list[psutil.Process]:
        """Every process in ``netns``, zombies and daemons included."""
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        found = []
        for pid in out.stdout.split():
            try:
                found.append(psutil.Process(int(pid)))
            except psutil.NoSuchProcess:
                continue
        return found

    def close(self) -> None:
        """Kill what still runs in the namespaces (a session sshd forked, a detached job step),
        then delete them; the labs stop their daemons first."""
        for name in self._namespaces:
            for proc in self.all_in(name):
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
        for name in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        # The root end of a veth disappears with its peer; this only matters after a failed setup.
        subprocess.run(["ip", "link", "del", f"{self.prefix}-r"], capture_output=True)
        self._namespaces.clear()

    def _make(self, bits: int, root_address: str, machines: Sequence[tuple[str, str]]) -> None:
        sw, br = f"{self.prefix}-sw", f"{self.prefix}-br"
        self._netns_add(sw)
        ip("-n", sw, "link", "add", br, "type", "bridge")
        ip("-n", sw, "link", "set", br, "up")
        ip("-n", sw, "link", "set", "lo", "up")
        # The root namespace's leg: root namespace <-> bridge.
        root, root_peer = f"{self.prefix}-r", f"{self.prefix}-rs"
        ip("link", "add", root, "type", "veth", "peer", "name", root_peer, "netns", sw)
        ip("-n", sw, "link", "set", root_peer, "master", br, "up")
        ip("addr", "add", f"{root_address}/{bits}", "dev", root)
        ip("link", "set", root, "up")
        for netns, address in machines:
            self._netns_add(netns)
            leg, peer = f"{netns}v", f"{netns}s"
            ip("-n", netns, "link", "add", leg, "type", "veth", "peer", "name", peer, "netns", sw)
            ip("-n", sw, "link", "set", peer, "master", br, "up")
            ip("-n", netns, "addr", "add", f"{address}/{bits}", "dev", leg)
            ip("-n", netns, "link", "set", leg, "up")
            ip("-n", netns, "link", "set", "lo", "up")

    def _netns_add(self, name: str) -> None:
        ip("netns", "add", name)
        self._namespaces.append(name)


def stop_daemons(daemons: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each daemon's process group (each was started in a session of its own), give each
    10 s to exit, then SIGKILL its group; reap them all."""
    for proc in daemons:
        _signal_group(proc, signal.SIGTERM)
    for proc in daemons:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def free_subnet(second_octet: int, prefix: str) -> ipaddress.IPv4Network:
    """A 10.SECOND.N.0/24 that no interface or route of the root namespace uses and whose
    namespaces (``PREFIX`` + N) do not exist: N is drawn at random so parallel sessions do not
    collide."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    used += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    candidates = list(range(100, 200))
    random.shuffle(candidates)
    for n in candidates:
        if f"10.{second_octet}.{n}." not in used and f"{prefix}{n}-" not in names:
            return ipaddress.IPv4Network(f"10.{second_octet}.{n}.0/24")
    raise RuntimeError(f"no free 10.{second_octet}.N.0/24 subnet for a test lab")


def ip(*args: str) -> None:
    """Run ``ip ARGS``; raise RuntimeError with its stderr when it fails."""
    run(["ip", *args])


def run(argv: list[str]) -> None:
    """Run ``argv``; raise RuntimeError with its stderr when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed: {result.stderr.strip()}")
