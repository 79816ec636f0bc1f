"""Supervision at scale: N trivial tasks through the real `distlaunch up`, for N = 16, 64, 256.

Each task is a tiny program (no TensorFlow) that listens on its task port, as a TensorFlow server
would, then waits until a stop file appears (or a long sleep ends). One `up` per N, local
backend, default isolation. Printed per N, from the run's events.jsonl and the launcher's /proc:

- start: first task start to last task start (what N Python processes cost to start here);
- join: last task start to the last task the launcher saw listening (target <= 3 s at 256);
- listen: last task start to the last task listening, as the tasks print it: what the tasks
  themselves take to get there (join minus listen is the launcher's lag in seeing it);
- teardown: SIGTERM to the launcher (the stop request) to the launcher gone, which it is only
  once every task's processes are (target <= 2 s at 256);
- the launcher's peak RSS (VmHWM; target <= 150 MB at 256) and CPU seconds (user + system, its
  own, not its tasks').

    python bench/scale.py [--counts 16,64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DISTLAUNCH, REPO

sys.path.insert(0, str(REPO / "tests"))
import standins  # noqa: E402

# Listens, says when, and ends once the stop file (argv[1]) exists or after argv[2] seconds.
PROGRAM = (
    standins.listening(standins.ANY)
    + 'print("listening", time.time(), flush=True)\n'
    + standins.until_exists("sys.argv[1]", limit_s="float(sys.argv[2])", poll_s=0.5)
)
# How long a task waits for the stop file at most: a bench that died leaves nothing for long.
MAX_SLEEP_S = 600
# How long a phase may take before the bench gives up.
PHASE_LIMIT_S = 300


def main() -> None:
    """Run one `up` per count and print a table row for each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="16,64,256")
    counts = [int(n) for n in parser.parse_args().counts.split(",")]
    print(
        f"{'tasks':>5}  {'start':>8}  {'join':>8}  {'listen':>8}  {'teardown':>8}  "
        f"{'peak RSS':>9}  {'CPU':>7}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for count in counts:
            row = _run(Path(tmp) / str(count), count)
            print(
                f"{count:>5}  {row['start']:>7.2f}s  {row['join']:>7.2f}s  {row['listen']:>7.2f}s  "
                f"{row['teardown']:>7.2f}s  {row['rss'] / 2**20:>6.1f} MB  {row['cpu']:>6.2f}s",
                flush=True,
            )
    print("targets at 256: join <= 3 s, teardown <= 2 s, peak RSS <= 150 MB")


def _run(work: Path, count: int) -> dict[str, float]:
    """One `up` of ``count`` tasks: start, wait until all joined, stop, measure."""
    work.mkdir(parents=True)
    (work / "task.py").write_text(PROGRAM)
    stop_file = work / "stop"
    spec = work / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "name": "scale",
                "strategy": "multi_worker_mirrored",
                "program": {"script": "task.py", "args": [str(stop_file), str(MAX_SLEEP_S)]},
                "tasks": {"worker": {"count": count}},
                "shared_dir": "runs",
            }
        )
    )
    launcher = subprocess.Popen(
        [*DISTLAUNCH, "up", str(spec)],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    peak = 0
    try:
        events = _wait_events(work / "runs", launcher, "joined", count)
        peak = max(peak, _peak_rss(launcher.pid))
        asked = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        cpu = _cpu_at_exit(launcher, lambda: _peak_rss(launcher.pid))
        teardown = time.monotonic() - asked
    finally:
        stop_file.touch()  # whatever happened, no task waits for long
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    peak = max(peak, cpu[1])
    started = [e["time"] for e in events if e["event"] == "started"]
    joined = [e["time"] for e in events if e["event"] == "joined"]
    logs = (work / "runs").glob("*/logs/attempt-0/*.log")
    listening = [float(log.read_text().split()[1]) for log in logs]
    return {
        "start": max(started) - min(started),
        "join": max(joined) - max(started),
        "listen": max(listening) - max(started),
        "teardown": teardown,
        "rss": peak,
        "cpu": cpu[0],
    }


def _wait_events(runs: Path, launcher: subprocess.Popen, event: str, count: int) -> list[dict]:
    """The run's events once ``count`` of them are ``event``; read incrementally, cheaply."""
    deadline = time.monotonic() + PHASE_LIMIT_S
    events: list[dict] = []
    seen, offset, partial = 0, 0, b""
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            raise SystemExit(f"distlaunch up ended early with {launcher.returncode}")
        found = list(runs.glob("*/events.jsonl"))
        if found:
            with open(found[0], "rb") as f:
                f.seek(offset)
                data = partial + f.read()
            offset += len(data) - len(partial)
            *lines, partial = data.split(b"\n")
            for line in lines:
                events.append(json.loads(line))
                seen += events[-1].get("event") == event
            if seen >= count:
                return events
        time.sleep(0.05)
    raise SystemExit(f"{count} tasks were not all {event} within {PHASE_LIMIT_S} s")


def _peak_rss(pid: int) -> int:
    """The process's peak RSS so far (VmHWM), in bytes; 0 once it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_at_exit(launcher: subprocess.Popen, sample) -> tuple[float, int]:
    """Wait for the launcher to exit; its own CPU seconds (read from the zombie, before it is
    reaped: wait's rusage would add its reaped tasks') and the last peak RSS sampled."""
    peak = 0
    deadline = time.monotonic() + PHASE_LIMIT_S
    while time.monotonic() < deadline:
        peak = max(peak, sample())
        # WNOWAIT: the launcher stays a zombie, so /proc still shows its own CPU times.
        if os.waitid(os.P_PID, launcher.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            break
        time.sleep(0.005)
    else:
        raise SystemExit(f"the launcher did not exit within {PHASE_LIMIT_S} s")
    with open(f"/proc/{launcher.pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    # Fields 14 and 15 (utime, stime) are the 12th and 13th after the command name.
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    launcher.wait()
    return cpu, peak


if __name__ == "__main__":
    main()
