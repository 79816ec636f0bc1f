"""A real Slurm cluster on this one machine, for tests: slurmctld plus one slurmd per node namespace.

Layout (N is picked at random so parallel sessions do not collide)::

    root namespace                        switch namespace               node namespaces
    slurmctld, srun, salloc, launcher
    dlslN-r 10.79.N.1  <-- veth -->  dlslN-rs --+                   +-- dlslN-n1 10.79.N.11 (slurmd)
                                                +-- bridge dlslN-br +-- dlslN-n2 10.79.N.12 (slurmd)
                                                                    +-- dlslN-o  10.79.N.4 (outsider)

The outsider is a machine on the same network that is no part of the cluster: firewall tests check
that it cannot reach a run's task ports.

The network (namespaces, bridge, veths, addresses) is tests/netlab.py's, as for tests/sshhosts.py:
its bridge lives in a namespace of its own, so the root namespace's firewall (Docker sets FORWARD
to DROP) never sees node-to-node traffic and nothing of the machine's own network setup is changed.

Nothing outside the lab's temp dir is touched either:
- slurm.conf and cgroup.conf are generated there; ``SLURM_CONF`` (in `env`) points the daemons
  and the client commands at it, so /etc/slurm stays as it is;
- a munged of its own, with a fresh key and its socket there (slurm.conf's ``AuthInfo``);
- names resolve through a private /etc/hosts: every daemon, and every command run through
  `command`, runs in a mount namespace of its own where a copy of /etc/hosts with the lab's
  names is bind-mounted over the real one (which is never written);
- each slurmd runs in its node's network namespace and a UTS namespace with the node's hostname,
  so `hostname` in a job step prints the node's name, as on a real cluster.

What a Slurm 22.05 cluster (Debian 12) needs to run this way on one machine: the cgroup v1 plugin
with its mountpoint named, proctrack/linuxproc and task/none (see `_write_files`).
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import portpicker
import psutil
from netlab import NetLab, free_subnet, stop_daemons

DAEMONS = ("slurmctld", "slurmd", "slurmstepd", "munged")
TOOLS = (
    "ip",
    "unshare",
    "srun",
    "salloc",
    "sbatch",
    "squeue",
    "scancel",
    "scontrol",
    "sinfo",
)
READY_WAIT_S = 60.0
CPUS_PER_NODE = 2
# Partitions for preemption: a job of URGENT preempts (requeues) one of PREEMPTIBLE, which has
# GRACE_TIME_S from its warning to the end.
PREEMPTIBLE = "preemptible"
URGENT = "urgent"
GRACE_TIME_S = 60
# Slurm's SIGKILL after its SIGTERM (a cancel, the time limit).
KILL_WAIT_S = 30
# Mount a private copy of /etc/hosts over the real one for this process and what it starts.
_WITH_HOSTS = 'mount --bind "$0" /etc/hosts && exec "$@"'


@dataclass(frozen=True)
class Node:
    """One Slurm node: a network + UTS namespace running a slurmd."""

    name: str
    netns: str
    address: str


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "a Slurm test cluster needs root (ip netns, mounts, slurmd); run as root"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install slurm-wlm munge iproute2 util-linux)"
    for daemon in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged"):
        if not os.path.exists(daemon):
            return f"{daemon} is not installed (apt-get install slurm-wlm munge)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "there is no munge user (apt-get install munge)"
    return None


class SlurmLab:
    """Starts munged, slurmctld and one slurmd per node; ``close()`` removes every trace of them."""

    def __init__(self, nodes: int = 2, gpus_per_node: int = 0) -> None:
        self.subnet = free_subnet(79, "dlsl")
        n = self.subnet.network_address.packed[2]
        self.prefix = f"dlsl{n}"
        self.cluster_name = self.prefix
        # 0755: munged, which runs as the munge user, must reach its folder inside.
        self.dir = Path(tempfile.mkdtemp(prefix=f"distlaunch-slurmlab-{n}-"))
        self.dir.chmod(0o755)
        addresses = list(self.subnet.hosts())
        self.controller_address = str(addresses[0])
        self.controller = f"{self.prefix}-ctl"
        self.nodes = tuple(
            Node(f"{self.prefix}-n{i}", f"{self.prefix}-n{i}", str(addresses[10 + i]))
            for i in range(1, nodes + 1)
        )
        self.outsider = Node("outsider", f"{self.prefix}-o", str(addresses[3]))
        # A tmpfs in each slurmd's mount namespace: a folder the nodes do not share with anyone.
        self.private_dir = self.dir / "nodelocal"
        self.conf = self.dir / "slurm.conf"
        self.hosts_file = self.dir / "hosts"
        self.munge_dir = self.dir / "munge"
        self.gpus_per_node = gpus_per_node
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for name in [
            k for k in self.env if k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))
        ]:
            if name != "SLURM_CONF":
                del self.env[name]
        self._net: NetLab | None = None
        self._daemons: list[subprocess.Popen] = []
        try:
            machines = [(n.netns, n.address) for n in (*self.nodes, self.outsider)]
            self._net = NetLab(self.prefix, self.subnet, self.controller_address, machines)
            self._write_files()
            self._start_munged()
            self._start_slurmctld()
            for node in self.nodes:
                self._start_slurmd(node)
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    # ---- what tests use -------------------------------------------------------------------

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run with the lab's /etc/hosts (so node names resolve); run it with `env`."""
        return [
            "unshare",
            "--mount",
            "--propagation",
            "slave",
            "sh",
            "-c",
            _WITH_HOSTS,
            str(self.hosts_file),
            *argv,
        ]

    def run(self, argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` (a Slurm client command, or anything) against the lab and wait for it."""
        return subprocess.run(
            self.command(argv),
            env=kw.pop("env", self.env),
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    def jobs(self) -> list[str]:
        """The job ids squeue lists (pending or running)."""
        out = self.run(["squeue", "--noheader", "--format=%i"]).stdout
        return out.split()

    def steps(self) -> list[str]:
        """The job steps squeue lists (JOB.STEP), batch and extern steps left out."""
        out = self.run(["squeue", "--steps", "--noheader", "--format=%i"]).stdout
        return [s for s in out.split() if not s.endswith((".batch", ".extern"))]

    def step_names(self) -> dict[str, str]:
        """The job steps squeue lists (JOB.STEP -> step name), batch and extern steps left out."""
        out = self.run(["squeue", "--steps", "--noheader", "--format=%i %j"]).stdout
        pairs = [line.split() for line in out.splitlines() if len(line.split()) == 2]
        return {i: name for i, name in pairs if not i.endswith((".batch", ".extern"))}

    def processes(self, node: Node) -> list[psutil.Process]:
        """Every live process in ``node``'s namespace other than the Slurm daemons themselves."""
        assert self._net is not None
        return self._net.processes(node.netns, DAEMONS)

    def run_in(self, node: Node, argv: list[str]) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``node``'s network namespace and wait for it."""
        assert self._net is not None
        return subprocess.run(
            self._net.exec_argv(node.netns, argv),
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def connects(self, node: Node, address: str, port: int) -> bool:
        """Whether a TCP connection from inside ``node``'s namespace (or the outsider's) to
        ``address:port`` is accepted within a second (a dropped SYN counts as no)."""
        assert self._net is not None
        return self._net.connects(node.netns, address, port)

    def log(self, name: str) -> str:
        """A daemon's log file (``slurmctld``, ``slurmd-NODE``, ``munged``), for failure messages."""
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        """Cancel every job, stop every daemon and delete every namespace and file of the lab."""
        if self._daemons and self.conf.exists():
            try:
                self.run(
                    ["scancel", "--full", "--quiet", *self.jobs()] if self.jobs() else ["true"],
                    timeout=20,
                )
            except (subprocess.TimeoutExpired, OSError):
                pass
        stop_daemons(self._daemons[::-1])
        # slurmstepd and job steps detach from slurmd: whatever is left in a node goes by namespace.
        if self._net is not None:
            self._net.close()
        self._daemons.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- setup ----------------------------------------------------------------------------

    def _write_files(self) -> None:
        hosts = Path("/etc/hosts").read_text()
        lines = [f"{self.controller_address} {self.controller}"] + [
            f"{n.address} {n.name}" for n in self.nodes
        ]
        self.hosts_file.write_text(hosts.rstrip("\n") + "\n" + "\n".join(lines) + "\n")
        self.hosts_file.chmod(0o644)
        d = self.dir
        (d / "state").mkdir()
        self.private_dir.mkdir()
        (d / "plugstack.conf").write_text("")
        conf = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={self.controller}({self.controller_address})",
            f"SlurmctldPort={portpicker.pick_unused_port()}",
            # Each slurmd has a network namespace of its own: one port number serves them all.
            f"SlurmdPort={portpicker.pick_unused_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_dir / 'munge.socket'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobRequeue=1",
            # Slurm's default, as clusters run it: the save bound it sets (transports/slurm/
            # allocation.py save_limits) leaves room for a real save.
            f"KillWait={KILL_WAIT_S}",
            "MinJobAge=30",
            "InactiveLimit=0",
            "MessageTimeout=20",
            f"PlugStackConfig={d / 'plugstack.conf'}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool-%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd-%n.log'}",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            *(["GresTypes=gpu"] if self.gpus_per_node else []),
            *(
                f"NodeName={n.name} NodeAddr={n.address} CPUs={CPUS_PER_NODE} State=UNKNOWN"
                + (f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else "")
                for n in self.nodes
            ),
            # Preemption (tests/test_slurm_preemption.py): a job of `urgent` (the higher
            # PriorityTier) requeues a job of `preemptible` after GraceTime; the job's user signal
            # (`--signal=B:USR2@N`) is what warns it, not a SIGTERM to its tasks. The default
            # partition's jobs are never preempted.
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "SlurmctldParameters=preempt_send_user_signal",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF",
            f"PartitionName={PREEMPTIBLE} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 "
            f"PreemptMode=REQUEUE GraceTime={GRACE_TIME_S}",
            f"PartitionName={URGENT} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF",
        ]
        self.conf.write_text("\n".join(conf) + "\n")
        # slurmd refuses to start without it here: this kernel mounts cgroup v1 controllers under a
        # tmpfs at /sys/fs/cgroup, and nothing of ours uses cgroups (proctrack/linuxproc, task/none).
        if self.gpus_per_node:
            self._write_gpus()
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")

    def _write_gpus(self) -> None:
        """GPUs declared as GRES over stand-in device files: Slurm 22.05 counts a GRES by its
        ``File`` entries and names them in a step's CUDA_VISIBLE_DEVICES, but reads nothing of
        the device. The files are character devices made here (mknod: /dev/null's numbers, minor
        apart), so no real device is named and nothing outside the lab's dir is touched."""
        gpus = self.dir / "gpus"
        gpus.mkdir()
        for i in range(self.gpus_per_node):
            os.mknod(gpus / f"nvidia{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        (self.dir / "gres.conf").write_text(
            f"Name=gpu File={gpus}/nvidia[0-{self.gpus_per_node - 1}]\n"
        )

    def _start_munged(self) -> None:
        munge = pwd.getpwnam("munge")
        self.munge_dir.mkdir()
        # munged wants its socket dir searchable by all (clients connect as any user).
        self.munge_dir.chmod(0o711)
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        os.chown(key, munge.pw_uid, munge.pw_gid)
        m = self.munge_dir
        argv = [
            "setpriv",
            f"--reuid={munge.pw_uid}",
            f"--regid={munge.pw_gid}",
            "--clear-groups",
            "/usr/sbin/munged",
            "--foreground",
            f"--socket={m / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={m / 'munged.pid'}",
            f"--seed-file={m / 'munged.seed'}",
            f"--log-file={m / 'munged.log'}",
        ]
        self._daemon(argv, "munged")
        self._wait(lambda: (m / "munge.socket").exists(), "munged's socket", "munged")

    def _start_slurmctld(self) -> None:
        # Its own UTS namespace: slurmctld only runs where the hostname is SlurmctldHost's name.
        script = f"hostname {shlex.quote(self.controller)} && {_WITH_HOSTS}"
        argv = [
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "slave",
            "sh",
            "-c",
            script,
            str(self.hosts_file),
            "/usr/sbin/slurmctld",
            "-D",
            "-i",
        ]
        self._daemon(argv, "slurmctld")

    def _start_slurmd(self, node: Node) -> None:
        # `ip netns exec` already gives the command a mount namespace of its own.
        script = (
            f"hostname {shlex.quote(node.name)} && "
            f"mount -t tmpfs -o mode=0755 tmpfs {shlex.quote(str(self.private_dir))} && {_WITH_HOSTS}"
        )
        argv = [
            "ip",
            "netns",
            "exec",
            node.netns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            script,
            str(self.hosts_file),
            "/usr/sbin/slurmd",
            "-D",
            "-N",
            node.name,
        ]
        self._daemon(argv, f"slurmd-{node.name}")

    def _daemon(self, argv: list[str], name: str) -> None:
        with open(self.dir / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(
                argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        self._daemons.append(proc)
        time.sleep(0.05)
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited at once: {(self.dir / f'{name}.out').read_text(errors='replace')}"
            )

    def _wait_ready(self) -> None:
        def idle() -> bool:
            done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], timeout=30)
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            return all(states.get(n.name) == "idle" for n in self.nodes)

        self._wait(idle, "every node to be idle", "slurmctld")

    def _wait(self, predicate, what: str, log: str) -> None:
        deadline = time.monotonic() + READY_WAIT_S
        while not predicate():
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                outs = "\n".join(
                    f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                    for p in self.dir.glob("*.out")
                )
                raise RuntimeError(
                    f"Slurm lab: no {what} (see {self.dir}):\n{self.log(log)[-3000:]}\n{outs}"
                )
            time.sleep(0.2)
