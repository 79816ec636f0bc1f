"""How much SSH costs: start and stop 8 trivial tasks on 2 SSH hosts, as a ratio to the same 8 tasks run locally.

    sudo python bench/ssh_fanout.py [--tasks 8] [--rounds 5]

The hosts are the test suite's (tests/sshhosts.py: network namespaces with an sshd each, on this
machine), so this needs root and openssh-server. One round: start every task through its
transport, wait until each has printed "up" into its log (the task really runs), then stop them
all (SIGTERM, grace, SIGKILL) and wait until they are gone. Local and SSH rounds alternate in one
run; the median of each is printed, and their ratio. The master connections are opened once
before (as `up`'s preflight does) and that time is printed on its own: it is paid once per run,
not per task, and so is the time of one bare multiplexed session: the floor of what each
remote task costs (the host's login shell runs its rc files for every session).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import sshhosts  # noqa: E402
from distlaunch.launcher.plan import placement, ports  # noqa: E402
from distlaunch.launcher.plan.plan import make_plan  # noqa: E402
from distlaunch.launcher.record import rundir  # noqa: E402
from distlaunch.launcher.spec.model import load_spec  # noqa: E402
from distlaunch.launcher.transports.local.transport import LocalTransport  # noqa: E402
from distlaunch.launcher.transports.ssh import preflight  # noqa: E402
from distlaunch.launcher.transports.ssh import transport as ssh  # noqa: E402

TASK = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"
GRACE_S = 2.0


def main() -> None:
    """Measure and print one line per transport, then the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    reason = sshhosts.unavailable_reason()
    if reason:
        sys.exit(f"ssh_fanout: cannot make SSH test hosts: {reason}")
    with sshhosts.HostLab() as lab, tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "task.py").write_text(TASK)
        remote_spec = _spec(folder, "remote", lab, args.tasks)
        local_spec = _spec(folder, "local", None, args.tasks)
        loaded = load_spec(remote_spec)
        with ssh.Session(loaded.hosts) as session:
            began = time.perf_counter()
            reports = preflight.check(loaded, session, None)
            connect_s = time.perf_counter() - began
            floor_s = statistics.median(_session_s(session, lab.hosts[0].name) for _ in range(5))
            remote_plan = _plan(remote_spec, preflight.picked_ports(reports))
            local_plan = _plan(local_spec, {})
            with ssh.SshTransport(session, GRACE_S, None) as remote:
                times: dict[str, list[float]] = {"local": [], "ssh": []}
                for _ in range(args.rounds):
                    times["local"].append(_round(LocalTransport(), local_plan))
                    times["ssh"].append(_round(remote, remote_plan))
    local, remote_s = statistics.median(times["local"]), statistics.median(times["ssh"])
    print(
        f"preflight + master connections to {len(lab.hosts)} hosts (once per run): {connect_s:.2f} s"
    )
    print(
        f"one multiplexed session running `true` (the host's login shell included): median {floor_s:.3f} s"
    )
    print(f"local: start + stop {args.tasks} tasks: median {local:.3f} s over {args.rounds} rounds")
    print(
        f"ssh:   start + stop {args.tasks} tasks on {len(lab.hosts)} hosts: median {remote_s:.3f} s over {args.rounds} rounds"
    )
    print(f"ssh / local: {remote_s / local:.2f}x")


def _session_s(session: ssh.Session, name: str) -> float:
    began = time.perf_counter()
    session.run(name, "true")
    return time.perf_counter() - began


def _spec(folder: Path, name: str, lab: sshhosts.HostLab | None, count: int) -> Path:
    hosts = {h.name: lab.host_entry(h) for h in lab.hosts} if lab else {}
    names = list(hosts) or ["localhost"]
    spec = {
        "name": name,
        "strategy": "multi_worker_mirrored",
        "program": {"script": "task.py"},
        "hosts": hosts,
        "tasks": {"worker": [{"host": names[i % len(names)]} for i in range(count)]},
        "shared_dir": "runs",
        "isolation": "off",
        "timeouts": {"grace_s": GRACE_S},
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(spec))
    return path


def _plan(path: Path, remote_ports: dict):
    loaded = load_spec(path)
    run_id = rundir.new_run_id(loaded.spec.name)
    run_dir = loaded.shared_dir / run_id
    rundir.make_dirs(run_dir, 0)
    placed = placement.on_hosts(loaded)
    picked = ports.allocate(loaded, placed, remote=remote_ports)
    return make_plan(loaded, placed.with_ports(picked), run_id, run_dir)


def _round(transport, plan) -> float:
    """Seconds to start every task, see it run, stop it and see it gone."""
    for task in plan.tasks:
        Path(task.log_file).unlink(missing_ok=True)
    began = time.perf_counter()
    handles = [transport.start(task) for task in plan.tasks]
    waiting = {task.log_file for task in plan.tasks}
    while waiting:
        waiting = {f for f in waiting if not _says_up(f)}
        if any(h.exit_status() is not None for h in handles):
            raise SystemExit(f"a task ended early; see {plan.run_dir}/logs")
        time.sleep(0.002)
    transport.stop(handles, GRACE_S)
    took = time.perf_counter() - began
    for handle in handles:
        handle.close()
    return took


def _says_up(log_file: str) -> bool:
    try:
        return b"up\n" in Path(log_file).read_bytes()
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    main()
