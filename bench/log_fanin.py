"""Log fan-in: a task printing 1,000,000 lines under `distlaunch up` versus writing them to a file itself.

Both sides run the same program with the same environment; under `up` its output is also echoed,
prefixed, to the launcher's stdout (sent to /dev/null here, so terminal speed is not measured).
Prints the median wall-time ratio (target <= 1.03), checks every line reached the task's log, and
reports the launcher's peak RSS (target <= 100 MB), sampled every 10 ms with psutil.

It also splits each `up` into its phases, from the run's events.jsonl: the launcher's own start
(Python, imports, spec, plan, run dir) up to the task's start, the task's run (started to exited,
which is where the echo of its output could slow it down), and the launcher's end after it.
The launcher runs with Python's bytecode cache, as an installed distlaunch has it
(`_common.bytecode_on`).

And the floor under the ratio, timed in the same rounds: the same task started as every local
task is (`procs.spawn_contained`: taskinit's keeper and PID namespace, which make sure nothing
the task starts outlives it) but with no launcher around it, plus a bare `python -c pass` (the
launcher's own interpreter start). No `up` can come in under their sum.

    python bench/log_fanin.py [--rounds 3] [--lines 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _common import DISTLAUNCH, bytecode_on, median, timed

from distlaunch.launcher.transports import procs

PROGRAM = """
import sys
for i in range(int(sys.argv[1])):
    print(f"line {i}: loss=0.1234 accuracy=0.9876 step={i}")
"""


def main() -> None:
    """Time both sides alternately and print the ratio, the line check and the peak RSS."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lines", type=int, default=1_000_000)
    args = parser.parse_args()
    bytecode_on()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "printer.py").write_text(PROGRAM)
        spec = work / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "name": "fanin",
                    "strategy": "multi_worker_mirrored",
                    "program": {"script": "printer.py", "args": [str(args.lines)]},
                    "tasks": {"worker": {"count": 1}},
                    "shared_dir": "runs",
                }
            )
        )
        # The same environment the task gets under `up` (PYTHONUNBUFFERED=1 among it).
        plan = json.loads(
            subprocess.run(
                [*DISTLAUNCH, "plan", "--json", str(spec)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        env = {**os.environ, **plan["tasks"][0]["env"]}
        up_times, direct_times, peaks, phases = [], [], [], []
        kept_times, python_times = [], []
        for _ in range(args.rounds):
            kept_times.append(_timed_contained(plan["tasks"][0]["argv"], env, work))
            python_times.append(timed([sys.executable, "-c", "pass"]))
            with open(work / "direct.log", "wb") as out:
                direct_times.append(
                    timed(
                        plan["tasks"][0]["argv"],
                        cwd=work,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
            seconds, peak, phase = _timed_up(spec)
            up_times.append(seconds)
            peaks.append(peak)
            phases.append(phase)
        logs = sorted((work / "runs").glob("*/logs/attempt-0/worker-0.log"))
        complete = all(_count_lines(log) == args.lines for log in logs)
    up_s, direct_s = median(up_times), median(direct_times)
    print(
        f"task writing to a file itself: median {direct_s:.2f} s of {[round(t, 2) for t in direct_times]}"
    )
    print(
        f"same task under distlaunch up: median {up_s:.2f} s of {[round(t, 2) for t in up_times]}"
    )
    print(f"ratio up / direct: {up_s / direct_s:.3f} (target <= 1.03)")
    before, task, after = (median([p[i] for p in phases]) for i in range(3))
    print(
        f"up's phases (medians): launcher start to task start {before:.2f} s, task {task:.2f} s "
        f"({task / direct_s:.3f} of direct), task exit to launcher exit {after:.2f} s"
    )
    kept_s, python_s = median(kept_times), median(python_times)
    print(
        f"floor: the task in taskinit's keeper alone {kept_s:.2f} s ({kept_s / direct_s:.3f} of "
        f"direct) + a bare Python start {python_s:.3f} s = {(kept_s + python_s) / direct_s:.3f} "
        "of direct, before any launcher work"
    )
    print(f"every line in the log: {complete} ({args.lines} lines x {len(logs)} runs)")
    print(f"launcher peak RSS: {max(peaks) / 2**20:.1f} MB (target <= 100 MB)")


def _timed_up(spec: Path) -> tuple[float, int, tuple[float, float, float]]:
    """Run `up`; its wall time, the launcher's peak RSS and its phases (see the docstring)."""
    runs = spec.parent / "runs"
    known = set(runs.glob("*")) if runs.exists() else set()
    wall = time.time()
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*DISTLAUNCH, "up", str(spec)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    # The RSS is sampled beside the wait, not in its loop: a poll every 10 ms would add up to
    # 10 ms to every `up` measured (the direct side's end is seen at once).
    peak = [0]
    sampler = threading.Thread(target=_sample_rss, args=(proc, peak), daemon=True)
    sampler.start()
    proc.wait()
    seconds = time.perf_counter() - start
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"distlaunch up failed with {proc.returncode}")
    (run_dir,) = set(runs.glob("*")) - known
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    times = {e["event"]: e["time"] for e in map(json.loads, lines)}
    started, exited = times["started"], times["exited"]
    return seconds, peak[0], (started - wall, exited - started, wall + seconds - exited)


def _timed_contained(argv: list[str], env: dict[str, str], work: Path) -> float:
    """The task started as `up` starts a local task (taskinit's keeper, its own PID namespace,
    output appended to a file), with no launcher: its start to the last of its processes gone."""
    start = time.perf_counter()
    proc, tree = procs.spawn_contained(argv, env, str(work), str(work / "contained.log"))
    proc.wait()
    procs.wait_tree(tree)
    seconds = time.perf_counter() - start
    os.close(tree)
    if proc.returncode != 0:
        raise SystemExit(f"the contained task failed with {proc.returncode}")
    return seconds


def _sample_rss(proc: subprocess.Popen, peak: list[int]) -> None:
    """Keep the launcher's peak RSS in ``peak[0]``, sampled every 10 ms until it exits."""
    launcher = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            peak[0] = max(peak[0], launcher.memory_info().rss)
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


if __name__ == "__main__":
    main()
