"""The launcher's start: `distlaunch --help`, and `up` from its command to its first task's start.

Each figure is a median over the rounds, with a bare `python -c pass` timed in the same rounds
beside it (alternating), so a noisy machine shows as a slow interpreter too. Targets: `--help`
<= 0.06 s; launcher start to first task start <= 0.10 s (the time the command was started to
the `started` event the launcher writes to events.jsonl once the task's process is running; the
spec is one local task, default isolation, a program that exits at once).

Python's bytecode cache is on, as an installed distlaunch has it (`_common.bytecode_on`).

    python bench/startup.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DISTLAUNCH, bytecode_on, median, timed

# The console script when it is installed beside this interpreter (what users type), else -m.
SCRIPT = Path(sys.executable).with_name("distlaunch")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else DISTLAUNCH


def main() -> None:
    """Time both figures with a bare interpreter beside them and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    rounds = parser.parse_args().rounds
    bytecode_on()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec = _spec(work)
        bare, helps, firsts = [], [], []
        timed([*COMMAND, "up", str(spec)], cwd=work, **quiet)  # warms the disk cache
        for _ in range(rounds):
            bare.append(timed([sys.executable, "-c", "pass"]))
            helps.append(timed([*COMMAND, "--help"], **quiet))
            firsts.append(_first_start(spec))
    print(f"python -c pass:           median {median(bare):.3f} s of {_shown(bare)}")
    print(
        f"distlaunch --help:        median {median(helps):.3f} s of {_shown(helps)} (target <= 0.06 s)"
    )
    print(
        f"up: start to first task:  median {median(firsts):.3f} s of {_shown(firsts)} "
        "(target <= 0.10 s)"
    )


def _spec(work: Path) -> Path:
    (work / "noop.py").write_text("")
    spec = work / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "name": "startup",
                "strategy": "multi_worker_mirrored",
                "program": {"script": "noop.py"},
                "tasks": {"worker": {"count": 1}},
                "shared_dir": "runs",
            }
        )
    )
    return spec


def _first_start(spec: Path) -> float:
    """Run `up`; seconds from its command to the first task's `started` event."""
    runs = spec.parent / "runs"
    known = set(runs.glob("*")) if runs.exists() else set()
    wall = time.time()
    subprocess.run(
        [*COMMAND, "up", str(spec)],
        cwd=spec.parent,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (run_dir,) = set(runs.glob("*")) - known
    events = map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
    return min(e["time"] for e in events if e["event"] == "started") - wall


def _shown(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


if __name__ == "__main__":
    main()
