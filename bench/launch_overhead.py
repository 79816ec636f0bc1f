"""Wall time of `distlaunch up` over a hand launch of the same two MWMS processes.

The hand launch is what users do today: a bash script that exports each task's environment
(TF_CONFIG and the rest, taken from `distlaunch plan --json`, so both sides run identical
processes) and starts both workers in the background. Rounds alternate between the two so
that machine noise hits both alike; the medians' ratio is printed (target <= 1.05).

    python bench/launch_overhead.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import tempfile
from pathlib import Path

from _common import DISTLAUNCH, median, timed

ARGS = ["--epochs", "3", "--steps-per-epoch", "20"]


def main() -> None:
    """Time both launches side by side and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec = work / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "name": "bench",
                    "strategy": "multi_worker_mirrored",
                    "program": {"module": "distlaunch.worker.examples.mnist_mlp", "args": ARGS},
                    "tasks": {"worker": {"count": 2}},
                    "shared_dir": "runs",
                }
            )
        )
        up_times, hand_times = [], []
        for _ in range(rounds):
            up_times.append(
                timed(
                    [*DISTLAUNCH, "up", str(spec)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            script = _hand_script(spec, work)
            hand_times.append(
                timed(["bash", str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
    up_s, hand_s = median(up_times), median(hand_times)
    print(
        f"hand launch (bash + TF_CONFIG): median {hand_s:.2f} s of {[round(t, 2) for t in hand_times]}"
    )
    print(
        f"distlaunch up:                  median {up_s:.2f} s of {[round(t, 2) for t in up_times]}"
    )
    print(f"ratio up / hand: {up_s / hand_s:.3f} (target <= 1.05)")


def _hand_script(spec: Path, work: Path) -> Path:
    """Write the bash script a user would write: export each task's env, start both, wait."""
    plan = json.loads(
        subprocess.run(
            [*DISTLAUNCH, "plan", "--json", str(spec)], check=True, capture_output=True, text=True
        ).stdout
    )
    lines = ["set -e", "pids=()"]
    for task in plan["tasks"]:
        Path(task["log_file"]).parent.mkdir(parents=True, exist_ok=True)
        Path(plan["run_dir"], "checkpoints").mkdir(parents=True, exist_ok=True)
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in task["env"].items())
        lines.append(
            f"(cd {shlex.quote(task['cwd'])} && env {exports} {shlex.join(task['argv'])} > {shlex.quote(task['log_file'])} 2>&1) & pids+=($!)"
        )
    lines.append('for p in "${pids[@]}"; do wait "$p"; done')
    script = work / "hand.sh"
    script.write_text("\n".join(lines) + "\n")
    return script


if __name__ == "__main__":
    main()
