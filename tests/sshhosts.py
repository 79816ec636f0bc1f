"""SSH test hosts on this one machine: network namespaces with an sshd each, joined by a bridge.

Layout (N is picked at random so parallel sessions do not collide)::

    root namespace (the launcher)          switch namespace              host namespaces
    dlsN-r 10.77.N.1  <-- veth -->  dlsN-rs --+                     +-- dlsN-h1 10.77.N.2  (sshd)
                                              +--- bridge dlsN-br --+-- dlsN-h2 10.77.N.3  (sshd)
                                                                    +-- dlsN-o  10.77.N.4 (outsider)

The outsider is a machine on the same network that is no part of any cluster: firewall tests
check that it cannot reach a run's task ports. `HostLab.through` reaches one host through another
(a jump host, as ProxyJump or ProxyCommand do on real networks).

The network (namespaces, bridge, veths, addresses) is tests/netlab.py's: its bridge lives in a
namespace of its own, so the root namespace's firewall never sees host-to-host traffic. Every
address is in 10.77.N.0/24 and exists only inside these namespaces.

Each sshd runs in a private mount namespace with a tmpfs over ``private_dir``: that one path is
a disk of the host's own (for "hosts share nothing" tests) while the rest of the filesystem,
Python and distlaunch included, is shared as on a cluster with a common mount.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from netlab import NetLab, free_subnet, run, stop_daemons

SSHD = "/usr/sbin/sshd"
# Only the namespaces' own processes count as "left running"; sshd is the test host itself.
HOST_DAEMONS = ("sshd",)
READY_WAIT_S = 30.0


@dataclass(frozen=True)
class TestHost:
    """One test host: a namespace with an sshd on ``address:22``."""

    name: str
    netns: str
    address: str


def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "SSH test hosts need root (ip netns, mounts); run as root"
    for tool in ("ip", "ssh", "ssh-keygen", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 openssh-client util-linux)"
    if not os.path.exists(SSHD):
        return f"{SSHD} is not installed (apt-get install openssh-server)"
    return None


class HostLab:
    """Creates the namespaces, keys and sshd servers; ``close()`` removes every one of them."""

    def __init__(self, count: int = 2, bashrc: dict[str, str] | None = None) -> None:
        # By host name, what the login user's ~/.bashrc says on that host (the rest: nothing).
        self.bashrc = dict(bashrc or {})
        self.subnet = free_subnet(77, "dls")
        n = self.subnet.network_address.packed[2]
        self.prefix = f"dls{n}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"distlaunch-sshlab-{n}-"))
        self.private_dir = self.dir / "hostlocal"
        self.identity = self.dir / "id_ed25519"
        self.wrong_identity = self.dir / "id_other"
        self.known_hosts = self.dir / "known_hosts"
        addresses = list(self.subnet.hosts())
        self.launcher_address = str(addresses[0])
        # In the subnet, answered by nobody: an unreachable host that costs no traffic elsewhere.
        self.unused_address = str(addresses[200])
        self.hosts = tuple(
            TestHost(f"node{i}", f"{self.prefix}-h{i}", str(addresses[i]))
            for i in range(1, count + 1)
        )
        self.outsider = TestHost("outsider", f"{self.prefix}-o", str(addresses[count + 1]))
        self._net: NetLab | None = None
        self._sshd: list[subprocess.Popen] = []
        try:
            machines = [(h.netns, h.address) for h in (*self.hosts, self.outsider)]
            self._net = NetLab(self.prefix, self.subnet, self.launcher_address, machines)
            self._make_keys()
            for host in self.hosts:
                self._start_sshd(host)
        except BaseException:
            self.close()
            raise

    def host_entry(self, host: TestHost, **overrides: object) -> dict:
        """The spec's `hosts` entry for ``host``: key, known_hosts, this machine's Python."""
        entry = {
            "transport": "ssh",
            "address": host.address,
            "user": "root",
            "identity_file": str(self.identity),
            "ssh_options": [
                f"UserKnownHostsFile={self.known_hosts}",
                "GlobalKnownHostsFile=/dev/null",
            ],
            "python": sys.executable,
            "connect_timeout_s": 5,
        }
        entry.update(overrides)
        return entry

    def through(self, jump: TestHost) -> list[str]:
        """ssh options that reach a host through ``jump`` (its sshd forwards the connection, as a
        bastion does): the host sees the session come from ``jump``'s address. ProxyCommand, not
        ProxyJump: the jump connection then gets this lab's key and known_hosts too."""
        inner = shlex.join(
            [
                "ssh",
                "-i",
                str(self.identity),
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "BatchMode=yes",
                "-o",
                f"UserKnownHostsFile={self.known_hosts}",
                "-o",
                "GlobalKnownHostsFile=/dev/null",
                "-W",
                "%h:%p",
                f"root@{jump.address}",
            ]
        )
        return [f"ProxyCommand={inner}"]

    def processes(self, host: TestHost) -> list[psutil.Process]:
        """Every live process in ``host``'s namespace other than its sshd."""
        assert self._net is not None
        return self._net.processes(host.netns, HOST_DAEMONS)

    def run_in(self, host: TestHost, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s network namespace."""
        assert self._net is not None
        return subprocess.Popen(self._net.exec_argv(host.netns, argv), **kw)

    def connects(self, host: TestHost, address: str, port: int) -> bool:
        """Whether a TCP connection from inside ``host``'s namespace to ``address:port`` is accepted
        within a second (a dropped SYN counts as no)."""
        assert self._net is not None
        return self._net.connects(host.netns, address, port)

    def close(self) -> None:
        """Stop every sshd, then remove the network (tests/netlab.py) and the lab's files."""
        stop_daemons(self._sshd)
        # Then a session process sshd forked for a connection that is still open goes with it.
        if self._net is not None:
            self._net.close()
        self._sshd.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> HostLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make_keys(self) -> None:
        for key in (self.identity, self.wrong_identity):
            run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    "distlaunch-test",
                    "-f",
                    str(key),
                ]
            )
        (self.dir / "authorized_keys").write_text(self.identity.with_suffix(".pub").read_text())
        lines = []
        for host in self.hosts:
            key = self.dir / f"hostkey-{host.name}"
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
            kind, blob = key.with_suffix(".pub").read_text().split()[:2]
            lines.append(f"{host.address} {kind} {blob}")
        self.known_hosts.write_text("\n".join(lines) + "\n")
        self.private_dir.mkdir()

    def _start_sshd(self, host: TestHost) -> None:
        config = self.dir / f"sshd_config-{host.name}"
        config.write_text(
            "\n".join(
                [
                    f"ListenAddress {host.address}",
                    "Port 22",
                    f"HostKey {self.dir / f'hostkey-{host.name}'}",
                    f"PidFile {self.dir / f'sshd-{host.name}.pid'}",
                    f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    # The key files live under /tmp (world-writable): sshd's ownership checks would refuse.
                    "StrictModes no",
                    "UseDNS no",
                    "PrintMotd no",
                    # MaxSessions stays at sshd's default (10 sessions per connection), as on real hosts.
                    "Subsystem sftp internal-sftp",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        log = open(self.dir / f"sshd-{host.name}.log", "ab")
        # `ip netns exec` gives the command a mount namespace of its own whose mounts do not
        # propagate back: the tmpfs is seen by this sshd and its sessions only.
        # The sessions' shell reads no ~/.bashrc of this machine's root: a cluster node's root
        # has the distribution's default one, and this machine's runs `pyenv init` (0.1 s of CPU
        # for every session, 3.5 s of a 16-host run's start in bench/remote_scale.py).
        rc_file = "/dev/null"
        if host.name in self.bashrc:  # a login shell of its own (one that talks, say)
            rc_file = str(self.dir / f"bashrc-{host.name}")
            Path(rc_file).write_text(self.bashrc[host.name])
        mask = " ".join(
            f"&& mount --bind {shlex.quote(rc_file)} {shlex.quote(str(rc))}" for rc in _shell_rcs()
        )
        private = shlex.quote(str(self.private_dir))
        script = f"mount -t tmpfs -o mode=0755 tmpfs {private} {mask} && exec {SSHD} -D -e -f {shlex.quote(str(config))}"
        proc = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        self._sshd.append(proc)
        deadline = time.monotonic() + READY_WAIT_S
        while not _accepts(host.address, 22):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd on {host.address} did not start; see {self.dir}/sshd-{host.name}.log"
                )
            time.sleep(0.05)


def _shell_rcs() -> list[Path]:
    """The lab user's (root's) shell startup files a session's non-interactive bash reads."""
    return [rc for rc in (Path("~root/.bashrc").expanduser(),) if rc.is_file()]


def _accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False
