"""PSS throughput: training steps per second with 1 worker and with 2 workers, and their ratio.

Runs `distlaunch up` of a chief, 1 ps and 1 worker, then the same with 2 workers, in one
invocation (alternately, for --rounds rounds), training an example with the Keras 3 loop
(`distlaunch.worker.fit`). The rate is read from the chief's metrics file: the steps of every
epoch after the first over the time they took. The first epoch is left out because it includes
tracing and shipping the dataset to the workers; the rest include what a user also waits for:
the end-of-epoch join and checkpoint. Prints the medians and the ratio 2 / 1 workers.

    python bench/ps_throughput.py [--rounds 1] [--epochs 4] [--steps-per-epoch 100]
        [--example cnn_mnist]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from _common import DISTLAUNCH, median

EXAMPLES = ("cnn_mnist", "mnist_mlp", "reuters_conv1d")


def main() -> None:
    """Measure both cluster sizes alternately and print their steps/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=4, help="the first one is not measured")
    parser.add_argument("--steps-per-epoch", type=int, default=100)
    parser.add_argument("--example", choices=EXAMPLES, default="cnn_mnist")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is not measured")
    rates: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for round_ in range(args.rounds):
            for workers in rates:
                spec = _write_spec(work, workers, args)
                rates[workers].append(_steps_per_s(work, spec, f"bench-{workers}w-{round_}"))
    one, two = median(rates[1]), median(rates[2])
    measured = (args.epochs - 1) * args.steps_per_epoch
    print(
        f"example {args.example}, Keras 3 loop, {measured} measured steps per run, {os.cpu_count()} CPU cores"
    )
    print(f"1 worker:  median {one:.1f} steps/s of {[round(r, 1) for r in rates[1]]}")
    print(f"2 workers: median {two:.1f} steps/s of {[round(r, 1) for r in rates[2]]}")
    print(f"ratio 2 / 1 workers: {two / one:.2f}")


def _write_spec(work: Path, workers: int, args: argparse.Namespace) -> Path:
    spec = work / f"ps{workers}.json"
    spec.write_text(
        json.dumps(
            {
                "name": f"bench-ps{workers}",
                "strategy": "parameter_server",
                "program": {
                    "module": f"distlaunch.worker.examples.{args.example}",
                    "args": [
                        "--epochs",
                        str(args.epochs),
                        "--steps-per-epoch",
                        str(args.steps_per_epoch),
                    ],
                },
                "tasks": {"chief": {"count": 1}, "worker": {"count": workers}, "ps": {"count": 1}},
                "shared_dir": "runs",
            }
        )
    )
    return spec


def _steps_per_s(work: Path, spec: Path, run_id: str) -> float:
    """Run the spec to completion and return its steps/s after the first epoch."""
    result = subprocess.run(
        [*DISTLAUNCH, "up", "--run-id", run_id, str(spec)], cwd=work, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(
            f"distlaunch up {spec.name} failed ({result.returncode}):\n{result.stderr[-3000:]}"
        )
    epochs = json.loads((work / "runs" / run_id / "metrics" / "chief-0.json").read_text())
    first, last = epochs[0], epochs[-1]
    return (last["step"] - first["step"]) / (last["time"] - first["time"])


if __name__ == "__main__":
    main()
