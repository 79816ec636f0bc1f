"""Wall time of a first `distlaunch.run(fn, workers=2)` over a hand-written harness doing the same.

The harness is what users write today without distlaunch: a Python program that picks two free
ports, writes each worker's TF_CONFIG, starts two `python -c` processes running the same function
and reads their results from their output. Each round runs both as fresh Python processes (the
first call of a session: interpreter, imports, TensorFlow), alternating between the two so that
machine noise hits both alike; the medians' ratio is printed (target <= 1.10). Both sides run the
function below: a MultiWorkerMirroredStrategy all-reduce.

    python bench/api.py [--rounds 3]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    """Time both side by side and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "api_call.py").write_text(API)
        (work / "hand.py").write_text(HAND)
        api_times, hand_times = [], []
        for _ in range(rounds):
            hand_times.append(timed([sys.executable, "hand.py"], cwd=work))
            api_times.append(timed([sys.executable, "api_call.py"], cwd=work))
    api_s, hand_s = median(api_times), median(hand_times)
    print(
        f"hand-written harness:      median {hand_s:.2f} s of {[round(t, 2) for t in hand_times]}"
    )
    print(f"distlaunch.run first call: median {api_s:.2f} s of {[round(t, 2) for t in api_times]}")
    print(f"ratio first call / hand: {api_s / hand_s:.3f} (target <= 1.10)")
    print("warm/cold: not measured (the warm interpreter pool is not built yet)")


if __name__ == "__main__":
    main()
