"""How long `distlaunch plan --json`'s text takes to write: the standard library's
``json.dumps(data, indent=2)`` and `core.json_text.dumps`, side by side on the same plan.

The plan is a spec's of N MWMS workers on this machine (default 1,025): N tasks, each with a
TF_CONFIG cluster of N addresses. Each round times both writers on the same data (in turn, the
order alternating) and checks that their texts are the same; prints the medians of CPU time, the
ratio, and the text's size.

    python bench/plan_json.py [--workers 1025] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from distlaunch.launcher.core import json_text
from distlaunch.launcher.run.up import build_plan, choose_run
from distlaunch.launcher.spec.model import load_spec


def plan_data(folder: Path, workers: int) -> dict:
    """`plan --json`'s data (without its firewall part) for ``workers`` local workers."""
    (folder / "task.py").write_text("")
    spec = folder / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "name": "bench",
                "strategy": "multi_worker_mirrored",
                "program": {"script": "task.py"},
                "tasks": {"worker": {"count": workers}},
            }
        )
    )
    loaded = load_spec(spec)
    return build_plan(loaded, choose_run(loaded, None, False)).to_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1025)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = plan_data(Path(tmp), args.workers)
    writers = {
        "json.dumps(indent=2)": lambda: json.dumps(data, indent=2),
        "json_text.dumps": lambda: json_text.dumps(data, indent=2),
    }
    cpu: dict[str, list[float]] = {name: [] for name in writers}
    for n in range(args.rounds):
        texts = []
        for name in list(writers)[:: 1 if n % 2 == 0 else -1]:
            start = time.process_time()
            texts.append(writers[name]())
            cpu[name].append(time.process_time() - start)
        assert texts[0] == texts[1], "the two writers' texts differ"
    medians = {name: statistics.median(times) for name, times in cpu.items()}
    for name, value in medians.items():
        print(f"{name:22} {value:.3f} s CPU (median of {args.rounds})")
    old, new = medians.values()
    print(f"ratio {old / new:.1f}x; {len(texts[0]) / 1e6:.1f} MB, {args.workers} workers")


if __name__ == "__main__":
    main()
