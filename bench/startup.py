"""The launcher's start: `distlaunch --help`, and `up` from its command to its first task's start.

Each figure is a median over the rounds, with a bare `python -c pass` timed in the same rounds
beside it (alternating), so a noisy machine shows as a slow interpreter too. Targets: `--help`
<= 0.06 s; launcher start to first task start <= 0.10 s (the time the command was started to
the `started` event the launcher writes to events.jsonl once the task's process is running; the
spec is one local task, default isolation, a program that exits at once).

Python's bytecode cache is on, as an installed distlaunch has it (`_common.bytecode_on`).

    python bench/startup.py [--rounds 10] [--beside DIR]

--beside DIR times another distlaunch too (DIR on PYTHONPATH holds its `distlaunch` package, e.g.
an older checkout's), alternating with this one in the same rounds, and prints the ratios: a
before/after on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--beside", type=Path, help="PYTHONPATH of another distlaunch to time")
    args = parser.parse_args()
    bytecode_on()
    launchers = {"this": dict(os.environ)}
    if args.beside is not None:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(args.beside)], check=True)
        launchers["beside"] = {**os.environ, "PYTHONPATH": str(args.beside.resolve())}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    bare: list[float] = []
    helps: dict[str, list[float]] = {name: [] for name in launchers}
    firsts: dict[str, list[float]] = {name: [] for name in launchers}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec = _spec(work)
        for env in launchers.values():
            timed([*COMMAND, "up", str(spec)], cwd=work, env=env, **quiet)  # warms the caches
        for round_ in range(args.rounds):
            bare.append(timed([sys.executable, "-c", "pass"]))
            # Each goes first in every other round: neither gains from the other's run before it.
            for name, env in list(launchers.items())[:: -1 if round_ % 2 else 1]:
                helps[name].append(timed([*COMMAND, "--help"], env=env, **quiet))
                firsts[name].append(_first_start(spec, env))
    print(f"python -c pass:           median {median(bare):.3f} s of {_shown(bare)}")
    for name in launchers:
        label = "" if len(launchers) == 1 else f" [{name}]"
        print(
            f"distlaunch --help{label}: median {median(helps[name]):.3f} s of "
            f"{_shown(helps[name])} (target <= 0.06 s)"
        )
        print(
            f"up: start to first task{label}: median {median(firsts[name]):.3f} s of "
            f"{_shown(firsts[name])} (target <= 0.10 s)"
        )
    if "beside" in launchers:
        for what, times in (("--help", helps), ("up to first task", firsts)):
            ratio = median(times["this"]) / median(times["beside"])
            # Each round's own ratio too: on a busy machine the load moves both of a round alike.
            rounds = median([a / b for a, b in zip(times["this"], times["beside"], strict=True)])
            print(
                f"{what}: this / beside = {ratio:.2f} (median of the rounds' ratios {rounds:.2f})"
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


def _first_start(spec: Path, env: dict[str, str]) -> float:
    """Run `up`; seconds from its command to the first task's `started` event."""
    runs = spec.parent / "runs"
    known = set(runs.glob("*")) if runs.exists() else set()
    wall = time.time()
    subprocess.run(
        [*COMMAND, "up", str(spec)],
        cwd=spec.parent,
        env=env,
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
