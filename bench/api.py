"""`distlaunch.run(fn, workers=2)`: a first call over a hand-written harness, and consecutive calls
with the warm pool over the same with it off.

First call: the harness is what users write today without distlaunch: a Python program that picks two free
ports, writes each worker's TF_CONFIG, starts two `python -c` processes running the same function
and reads their results from their output. Each round runs both as fresh Python processes (the
first call of a session: interpreter, imports, TensorFlow), alternating between the two so that
machine noise hits both alike; the medians' ratio is printed (target <= 1.10). Both sides run the
function below: a MultiWorkerMirroredStrategy all-reduce.

Consecutive calls: one Python process makes 10 calls of the same function, with the pool
(DISTLAUNCH_POOL=1: the first call starts the cluster, the next 9 reuse its interpreters) and
without (DISTLAUNCH_POOL=0: every call a cluster of its own); each round runs both, one after
the other; the ratio of the median per call over all rounds is printed (target <= 0.30), and the
memory of a warm task (RSS and USS, read with psutil after the 10 calls).

A large argument: one Python process makes a 300 MB NumPy array and passes it to
`distlaunch.run` twice, one-shot then pooled (a cold call, then a first call of the pool); the
caller's peak RSS (ru_maxrss) is printed over the argument's size (target <= 2x: the argument
itself plus at most as much again), with each call's seconds.

    python bench/api.py [--rounds 5] [--series-rounds 2] [--calls 10] [--large-mb 300]
                        [--parts first,series,large]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import median, timed

FUNCTION = """
def total(x):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    value = strategy.run(lambda: tf.constant(x + task))
    return float(strategy.reduce("SUM", value, axis=None))
"""

API = (
    FUNCTION
    + """
import distlaunch

values = distlaunch.run(total, 1.0, workers=2, quiet=True)
assert values == {"worker-0": 3.0, "worker-1": 3.0}, values
"""
)

# The harness itself runs no TensorFlow: only its two workers do.
HAND = (
    f"FUNCTION = {FUNCTION!r}\n"
    + """
import json, os, subprocess, sys

import portpicker

ports = [portpicker.pick_unused_port() for _ in range(2)]
cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
code = FUNCTION + "\\nprint(repr(total(1.0)))"
workers = [
    subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for i in range(2)
]
values = [float(w.communicate()[0].split()[-1]) for w in workers]
assert values == [3.0, 3.0] and all(w.returncode == 0 for w in workers), values
"""
)


# CALLS consecutive calls in one process; prints each call's seconds, then (with the pool) the
# memory of each warm task, as JSON.
SERIES = (
    FUNCTION
    + """
import json, os, sys, time

import psutil

import distlaunch

times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    values = distlaunch.run(total, 1.0, workers=2, quiet=True)
    times.append(time.perf_counter() - start)
    assert values == {"worker-0": 3.0, "worker-1": 3.0}, values
memory = []
for proc in psutil.Process().children(recursive=True):
    try:
        # The task's interpreter itself, not the init it runs under (same command line).
        if "distlaunch.worker.call" in proc.cmdline() and not proc.children():
            info = proc.memory_full_info()
            memory.append([info.rss, info.uss])
    except psutil.Error:
        continue
print(json.dumps({"times": times, "memory": memory}))
"""
)


# One large argument, one-shot then pooled; prints the argument's size, the caller's peak RSS
# before and after the calls, and each call's seconds, as JSON.
LARGE = """
import json, resource, sys, time

import numpy as np

import distlaunch

def size(array):
    return int(array.nbytes)

array = np.ones(int(sys.argv[1]) << 20, dtype=np.uint8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
times = []
for pool in (False, True):
    start = time.perf_counter()
    values = distlaunch.run(size, array, workers=2, quiet=True, pool=pool)
    times.append(time.perf_counter() - start)
    assert values == {"worker-0": array.nbytes, "worker-1": array.nbytes}, values
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
print(json.dumps({"bytes": array.nbytes, "before": before, "peak": peak, "times": times}))
"""


def _series(work: Path, calls: int, pool: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "series.py", str(calls)],
        cwd=work,
        env={**os.environ, "DISTLAUNCH_POOL": "1" if pool else "0"},
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    """Time both comparisons side by side and print their ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of first calls")
    parser.add_argument("--series-rounds", type=int, default=2, help="rounds of consecutive calls")
    parser.add_argument("--calls", type=int, default=10, help="calls per series")
    parser.add_argument("--large-mb", type=int, default=300, help="the large argument's size")
    parser.add_argument(
        "--parts", default="first,series,large", help="which comparisons to run (comma list)"
    )
    options = parser.parse_args()
    parts = set(options.parts.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "api_call.py").write_text(API)
        (work / "hand.py").write_text(HAND)
        (work / "series.py").write_text(SERIES)
        (work / "large.py").write_text(LARGE)
        api_times, hand_times, warm, cold, memory = [], [], [], [], []
        for _ in range(options.rounds if "first" in parts else 0):
            hand_times.append(timed([sys.executable, "hand.py"], cwd=work))
            api_times.append(timed([sys.executable, "api_call.py"], cwd=work))
        for _ in range(options.series_rounds if "series" in parts else 0):
            with_pool = _series(work, options.calls, pool=True)
            warm += with_pool["times"]
            memory += with_pool["memory"]
            cold += _series(work, options.calls, pool=False)["times"]
        if "large" in parts:
            out = subprocess.run(
                [sys.executable, "large.py", str(options.large_mb)],
                cwd=work,
                check=True,
                capture_output=True,
                text=True,
            )
            large = json.loads(out.stdout.splitlines()[-1])
    if "first" in parts:
        _print_first(api_times, hand_times)
    if "series" in parts:
        _print_series(warm, cold, memory)
    if "large" in parts:
        mib = 1 << 20
        print(
            f"a {large['bytes'] / mib:.0f} MiB argument: caller peak RSS {large['peak'] / mib:.0f}"
            f" MiB ({large['before'] / mib:.0f} MiB before the calls); peak / argument "
            f"{large['peak'] / large['bytes']:.2f} (target <= 2); one-shot call "
            f"{large['times'][0]:.2f} s, pooled first call {large['times'][1]:.2f} s"
        )


def _print_first(api_times: list[float], hand_times: list[float]) -> None:
    api_s, hand_s = median(api_times), median(hand_times)
    print(
        f"hand-written harness:      median {hand_s:.2f} s of {[round(t, 2) for t in hand_times]}"
    )
    print(f"distlaunch.run first call: median {api_s:.2f} s of {[round(t, 2) for t in api_times]}")
    print(f"ratio first call / hand: {api_s / hand_s:.3f} (target <= 1.10)")


def _print_series(warm: list[float], cold: list[float], memory: list[list[int]]) -> None:
    warm_s, cold_s = median(warm), median(cold)
    print(f"calls with the pool:  median {warm_s:.3f} s of {[round(t, 3) for t in warm]}")
    print(f"calls without it:     median {cold_s:.3f} s of {[round(t, 2) for t in cold]}")
    print(f"ratio warm / cold: {warm_s / cold_s:.3f} (target <= 0.30)")
    mib = 1 << 20
    print(
        "a warm task's memory after the calls: RSS "
        + ", ".join(f"{rss / mib:.0f}" for rss, _ in memory)
        + " MiB; USS "
        + ", ".join(f"{uss / mib:.0f}" for _, uss in memory)
        + " MiB"
    )


if __name__ == "__main__":
    main()
