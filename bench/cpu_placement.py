"""CPU placement: training steps/s of tasks sharing this machine, `"cpus": "auto"` (each task
pinned to CPUs of its own, thread pools sized to them) over `"cpus": "all"` (every task on every
CPU, TensorFlow's own behaviour), and their ratio.

Two clusters, each run under both settings alternately, for --rounds rounds in one invocation:
2 MultiWorkerMirroredStrategy workers and a ParameterServerStrategy cluster (chief, 2 workers,
1 ps), both training `distlaunch.worker.examples.cnn_mnist` for --epochs x --steps-per-epoch
steps (default 5 x 40 = 200). The rate is read from the chief's metrics file: the steps of
every epoch after the first over the time they took (the first includes tracing and the
cluster's start). Prints each median, every round's ratio and the median ratio auto / all.

    python bench/cpu_placement.py [--rounds 5] [--epochs 5] [--steps-per-epoch 40]
        [--only mwms|pss]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from _common import DISTLAUNCH, median

CLUSTERS = {
    "mwms": ("multi_worker_mirrored", {"worker": 2}, "worker-0"),
    "pss": ("parameter_server", {"chief": 1, "worker": 2, "ps": 1}, "chief-0"),
}
SETTINGS = ("all", "auto")


def main() -> None:
    """Measure both settings alternately per cluster and print their steps/s and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=5, help="the first one is not measured")
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--only", choices=sorted(CLUSTERS))
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is not measured")
    clusters = [args.only] if args.only else list(CLUSTERS)
    rates = {(c, s): [] for c in clusters for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for round_ in range(args.rounds):
            for cluster in clusters:
                # Alternate which setting goes first, so neither always runs on a warmer machine.
                for setting in SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]:
                    spec = _write_spec(work, cluster, setting, args)
                    run_id = f"bench-{cluster}-{setting}-{round_}"
                    rates[(cluster, setting)].append(_steps_per_s(work, spec, run_id, cluster))
    steps = args.epochs * args.steps_per_epoch
    print(
        f"cnn_mnist, {steps} steps per run ({(args.epochs - 1) * args.steps_per_epoch} measured), "
        f"{args.rounds} rounds alternating, {len(os.sched_getaffinity(0))} CPUs"
    )
    for cluster in clusters:
        alls, autos = rates[(cluster, "all")], rates[(cluster, "auto")]
        per_round = [round(a / b, 2) for a, b in zip(autos, alls, strict=True)]
        print(f"{cluster}: all  median {median(alls):.2f} steps/s of {[round(r, 2) for r in alls]}")
        print(
            f"{cluster}: auto median {median(autos):.2f} steps/s of {[round(r, 2) for r in autos]}"
        )
        print(
            f"{cluster}: ratio auto / all {median(autos) / median(alls):.2f} (per round {per_round})"
        )


def _write_spec(work: Path, cluster: str, setting: str, args: argparse.Namespace) -> Path:
    strategy, counts, _ = CLUSTERS[cluster]
    spec = work / f"{cluster}-{setting}.json"
    program = {
        "module": "distlaunch.worker.examples.cnn_mnist",
        "args": ["--epochs", str(args.epochs), "--steps-per-epoch", str(args.steps_per_epoch)],
    }
    tasks = {role: {"count": n, "cpus": setting} for role, n in counts.items()}
    spec.write_text(
        json.dumps(
            {
                "name": f"bench-{cluster}",
                "strategy": strategy,
                "program": program,
                "tasks": tasks,
                "shared_dir": "runs",
            }
        )
    )
    return spec


def _steps_per_s(work: Path, spec: Path, run_id: str, cluster: str) -> float:
    """Run the spec to completion and return its chief's steps/s after the first epoch."""
    result = subprocess.run(
        [*DISTLAUNCH, "up", "--run-id", run_id, str(spec)], cwd=work, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(
            f"distlaunch up {spec.name} failed ({result.returncode}):\n{result.stderr[-3000:]}"
        )
    chief = CLUSTERS[cluster][2]
    epochs = json.loads((work / "runs" / run_id / "metrics" / f"{chief}.json").read_text())
    first, last = epochs[0], epochs[-1]
    return (last["step"] - first["step"]) / (last["time"] - first["time"])


if __name__ == "__main__":
    main()
