"""How a run over many SSH hosts scales: 4, 8 and 16 test hosts with 8 stand-in tasks each.

    sudo python bench/remote_scale.py [--hosts 4 8 16] [--tasks 8] [--cut]

The hosts are the test suite's (tests/sshhosts.py: network namespaces with an sshd each, on this
machine), so this needs root and openssh-server. Each task is a stand-in that needs no
TensorFlow: it listens on its task port (so the launcher sees it join) and waits. It runs under
this interpreter's base Python with ``-I -S`` (a program that needs no site-packages): what a
user's program costs to start is not the launcher's, and 128 of them share this machine's cores. Per host count,
one `distlaunch up` and, printed:
- first: from `up`'s start to the first task's `started` event (preflight, plan, agents, rules);
- started: from the first task's `started` event to the last one's;
- joined: from `up`'s start to the last task's `joined` event (preflight included);
- gone: from the stop request (SIGTERM to the launcher) to every process of the run gone, on
  every host and here;
- the launcher's peak RSS and open fds, sampled every 50 ms while it runs;
- the ssh clients it ran, seen while sampling: those that carry the hosts' agents (the tasks'
  sessions), and all of them (with the preflight probes and ``ssh -G``);
- launcher: the launcher's own CPU time (its process alone, sampled);
- CPU s: the CPU time (user + system) of everything the run made, here and on the hosts: the
  launcher, its ssh clients and masters, the sshd sessions, agents, keepers and stand-ins (every
  process this bench reaped, directly or as their subreaper, from `up` to the hosts' end). All
  the hosts share this machine's cores, so where the machine is busy the wall times above stretch
  with the load; this column barely does: it is the one to compare across loads.

With ``--cut``, one more `up` per host count: once every task has joined, the last host's link
is cut (its cable to the switch goes down) and the bench prints how soon the launcher named it
(the first end of a task there: the issue asks 20 s at most), then brings the link back once the
run has ended and counts what of the run is left on that host (processes, firewall tables).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import standins  # noqa: E402

import sshhosts  # noqa: E402

STAND_IN = standins.listen_and_sleep(600, standins.ANY)
SAMPLE_S = 0.05
PR_SET_CHILD_SUBREAPER = 36


def main() -> None:
    """One line per host count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--tasks", type=int, default=8, help="stand-in tasks per host")
    parser.add_argument("--cut", action="store_true", help="also cut one host's link mid-run")
    args = parser.parse_args()
    reason = sshhosts.unavailable_reason()
    if reason:
        sys.exit(f"remote_scale: cannot make SSH test hosts: {reason}")
    # The ssh masters fork into the background: as their subreaper this bench reaps them, and
    # their CPU time counts with the rest.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    print(
        f"{'hosts':>5} {'tasks':>5} {'first s':>7} {'started s':>9} {'joined s':>9} {'gone s':>7} "
        f"{'RSS MB':>7} {'fds':>5} {'agent ssh':>9} {'all ssh':>7} {'CPU s':>6} {'launcher':>8}"
    )
    for count in args.hosts:
        with tempfile.TemporaryDirectory() as tmp:
            with sshhosts.HostLab(count) as lab:
                _reap()
                cpu = _children_cpu()
                row = _measure(lab, Path(tmp), args.tasks)
            _reap()
            cpu = _children_cpu() - cpu
            print(
                f"{count:>5} {count * args.tasks:>5} {row['first']:>7.2f} {row['started']:>9.2f} "
                f"{row['joined']:>9.2f} {row['gone']:>7.2f} "
                f"{row['rss'] / 2**20:>7.1f} {row['fds']:>5} {row['agents']:>9} {row['ssh']:>7} "
                f"{cpu:>6.1f} {row['launcher_cpu']:>8.1f}",
                flush=True,
            )
        if args.cut:
            with tempfile.TemporaryDirectory() as tmp, sshhosts.HostLab(count) as lab:
                named, left = _cut(lab, Path(tmp), args.tasks)
            print(
                f"{count:>5} hosts: the cut link was named after {named:.1f} s; "
                f"left on its host once it returned: {left}",
                flush=True,
            )


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _reap() -> None:
    """Wait for every child that has ended (the orphans this bench is the subreaper of)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _cut(lab: sshhosts.HostLab, folder: Path, per_host: int) -> tuple[float, str]:
    """Cut the last host's link once every task has joined: how soon the launcher names it
    (seconds), and what is left on that host after the run ended and the link came back."""
    launcher = _up(lab, folder, per_host)
    cut = lab.hosts[-1]
    leg = f"{cut.netns}v"  # the host's end of its cable to the switch (tests/netlab.py)
    shared = folder / "runs"
    while len(_times(shared, "joined")) < len(lab.hosts) * per_host:
        if launcher.poll() is not None:
            sys.exit(f"remote_scale: the launcher exited with {launcher.returncode} first")
        time.sleep(SAMPLE_S)
    plan = json.loads(next(shared.glob("*/run.json")).read_text())["plan"]["tasks"]
    there = {t["name"] for t in plan if t["host_name"] == cut.name}
    subprocess.run(["ip", "-n", cut.netns, "link", "set", leg, "down"], check=True)
    cut_at = time.time()
    try:
        launcher.wait(timeout=300)
        # The cut host's agent ends on the launcher's silence (its heartbeat timeout).
        deadline = time.monotonic() + 120
        while lab.processes(cut) and time.monotonic() < deadline:
            time.sleep(SAMPLE_S)
    finally:
        subprocess.run(["ip", "-n", cut.netns, "link", "set", leg, "up"], check=True)
    ended = [e["time"] for e in _events(shared) if e.get("task") in there and "exit" in e]
    time.sleep(2)  # the link is back: anything still there would show itself now
    left = [" ".join(p.cmdline()) for p in lab.processes(cut)]
    tables = [line for line in _nft_tables(cut) if "distlaunch_" in line]
    return min(ended) - cut_at, f"{len(left)} processes, {len(tables)} firewall tables"


def _nft_tables(host: sshhosts.TestHost) -> list[str]:
    listed = subprocess.run(
        ["ip", "netns", "exec", host.netns, "nft", "list", "tables"],
        capture_output=True,
        text=True,
        check=False,
    )
    return listed.stdout.splitlines()


def _up(lab: sshhosts.HostLab, folder: Path, per_host: int) -> subprocess.Popen:
    """`distlaunch up` of ``per_host`` stand-ins on every host of ``lab``, in ``folder``."""
    (folder / "task.py").write_text(STAND_IN)
    # The stand-ins need nothing but the standard library: run isolated, without site-packages
    # (this checkout's editable install alone adds 25 ms to every interpreter's start, and the
    # 128 stand-ins share the lab's 2 cores: what a user's program costs to start is not the
    # launcher's).
    lean = folder / "python-isolated"
    lean.write_text(f'#!/bin/sh\nexec {shlex.quote(sys._base_executable)} -I -S "$@"\n')
    lean.chmod(0o755)
    spec = {
        "name": "scale",
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py", "python": str(lean)},
        "hosts": {h.name: lab.host_entry(h) for h in lab.hosts},
        "tasks": {"worker": [{"host": h.name} for h in lab.hosts for _ in range(per_host)]},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 300},
    }
    (folder / "spec.json").write_text(json.dumps(spec))
    return subprocess.Popen(
        [sys.executable, "-m", "distlaunch.launcher", "up", "spec.json"],
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _measure(lab: sshhosts.HostLab, folder: Path, per_host: int) -> dict:
    total = len(lab.hosts) * per_host
    began = time.time()
    launcher = _up(lab, folder, per_host)
    me = psutil.Process(launcher.pid)
    rss = fds = 0
    own_cpu = 0.0
    clients: dict[int, str] = {}

    def sample() -> None:
        nonlocal rss, fds, own_cpu
        try:
            rss = max(rss, me.memory_info().rss)
            fds = max(fds, me.num_fds())
            used = me.cpu_times()
            own_cpu = max(own_cpu, used.user + used.system)
            children = me.children(recursive=True)
        except psutil.Error:
            return
        for proc in children:
            try:  # one that has just ended must not hide the others
                if proc.name() == "ssh":
                    clients.setdefault(proc.pid, " ".join(proc.cmdline()))
            except psutil.Error:
                continue

    joined_at = None
    while joined_at is None:
        sample()
        joined = _times(folder / "runs", "joined")
        if len(joined) == total:
            joined_at = max(joined)
        if launcher.poll() is not None:
            sys.exit(f"remote_scale: the launcher exited with {launcher.returncode} first")
        time.sleep(SAMPLE_S)
    stop = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    while launcher.poll() is None or any(lab.processes(h) for h in lab.hosts):
        sample()
        time.sleep(SAMPLE_S / 5)
    gone = time.monotonic() - stop
    started = _times(folder / "runs", "started")
    return {
        "started": max(started) - min(started),
        "first": min(started) - began,
        "joined": joined_at - began,
        "gone": gone,
        "rss": rss,
        "fds": fds,
        "launcher_cpu": own_cpu,
        "agents": sum("distlaunch.host.agent" in c for c in clients.values()),
        "ssh": len(clients),
    }


def _times(shared: Path, kind: str) -> list[float]:
    """The times of the run's events of ``kind`` so far."""
    return [float(e["time"]) for e in _events(shared) if e.get("event") == kind]


def _events(shared: Path) -> list[dict]:
    """The run's events so far."""
    found = list(shared.glob("*/events.jsonl"))
    if not found:
        return []
    events = []
    for line in found[0].read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return events


if __name__ == "__main__":
    main()
