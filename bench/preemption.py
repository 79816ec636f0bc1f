"""Preemption: steps lost over stop notices at random times, and how fast a notice ends a run.

One run of 2 MWMS workers training `dw.fit` (distlaunch.worker.examples.mnist_mlp, one step per
epoch, so that every completed step prints its ``epoch E/EPOCHS step S`` line, and no periodic
checkpoint: only a notice's save can carry the steps over) on the local backend. Each round
starts it (`up`, then `up --resume`), waits until both workers train, then a random 0-3 s more,
sends SIGTERM to `up` and waits for it to exit. The next round's resume says where it starts
(``resumed from ... at step R``). Steps lost in a round: the last step the workers completed (the
latest step line of the round's logs, or the step they saved) minus R (0 when the notice's save
carried every completed step over). Notice-to-stopped: SIGTERM to `up` exiting (every task gone).

    python bench/preemption.py [--notices 20] [--backend slurm]

prints ``steps lost: N of 20 notices`` and the median notice-to-stopped time. With ``--backend
slurm`` the same rounds run on a real Slurm cluster made on this machine (tests/slurmcluster.py:
needs root), each worker a job step on its own node, inside one 2-node allocation (`slurm_arm`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DISTLAUNCH, REPO, median

EPOCHS = 100000  # never reached: every round ends with a notice
STEP_LINE = re.compile(r"^epoch \d+/\d+ step (\d+)", re.M)
SAVED = re.compile(r"stop notice: saved step (\d+)")
RESUMED = re.compile(r"resumed from \S+ at step (\d+)")


def _spec(folder: Path) -> Path:
    spec = {
        "name": "preempt",
        "strategy": "multi_worker_mirrored",
        "program": {
            "module": "distlaunch.worker.examples.mnist_mlp",
            "args": [
                "--epochs",
                str(EPOCHS),
                "--steps-per-epoch",
                "1",
                "--checkpoint-every",
                "1000000",
            ],
        },
        "tasks": {"worker": {"count": 2}},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 5, "startup_s": 300, "save_s": 60},
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _logs(run_dir: Path, attempt: int) -> list[str]:
    folder = run_dir / "logs" / f"attempt-{attempt}"
    return [p.read_text(errors="replace") for p in sorted(folder.glob("worker-*.log"))]


def _round(
    spec: Path, attempt: int, args: list[str] | None = None, env: dict | None = None
) -> tuple[Path, float, int]:
    """One start and notice: the run dir, notice-to-stopped seconds, `up`'s exit code
    (``args``, ``env``: `up`'s command and environment elsewhere, e.g. in a Slurm allocation)."""
    args = args or [*DISTLAUNCH, "up", *(["--resume"] if attempt else []), str(spec)]
    with open(spec.parent / "up.log", "a") as log:
        up = subprocess.Popen(args, cwd=spec.parent, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            run_dir = None
            while (
                run_dir is None
                or not all(STEP_LINE.search(text) for text in _logs(run_dir, attempt))
                or len(_logs(run_dir, attempt)) < 2
            ):
                if up.poll() is not None:
                    raise SystemExit(f"up ended early ({up.returncode}); see {spec.parent}/up.log")
                time.sleep(0.2)
                runs = sorted((spec.parent / "runs").glob("*/run.json"))
                run_dir = runs[0].parent if runs else None
            time.sleep(random.uniform(0, 3))
            sent = time.perf_counter()
            up.send_signal(signal.SIGTERM)
            code = up.wait(timeout=300)
            return run_dir, time.perf_counter() - sent, code
        finally:
            up.kill()


def _last_completed(run_dir: Path, attempt: int) -> int:
    steps = [0]
    for text in _logs(run_dir, attempt):
        steps += [int(s) for s in STEP_LINE.findall(text)] + [int(s) for s in SAVED.findall(text)]
    return max(steps)


def slurm_arm(notices: int) -> None:
    """The rounds of `main` with ``backend: slurm``, on a 2-node Slurm lab; the same lines."""
    sys.path.insert(0, str(REPO / "tests"))
    from slurm_overhead import _allocation

    from slurmcluster import SlurmLab, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot run: {reason}")
    with tempfile.TemporaryDirectory(prefix="bench-preempt-") as tmp, SlurmLab(2) as lab:
        work = Path(tmp)
        spec = _spec(work)
        data = json.loads(spec.read_text())
        data["backend"] = "slurm"
        data["program"]["python"] = sys.executable
        spec.write_text(json.dumps(data))
        holder, env = _allocation(lab, work)
        lost_rounds, lost_steps, times, codes = 0, 0, [], []
        try:
            for attempt in range(notices + 1):
                args = lab.command(
                    [*DISTLAUNCH, "up", *(["--resume"] if attempt else []), str(spec)]
                )
                run_dir, stopped_s, code = _round(spec, attempt, args, env)
                if attempt:
                    resumed = [int(s) for t in _logs(run_dir, attempt) for s in RESUMED.findall(t)]
                    lost = _last_completed(run_dir, attempt - 1) - min(resumed, default=0)
                    lost_rounds += lost > 0
                    lost_steps += max(lost, 0)
                if attempt < notices:
                    times.append(stopped_s)
                    codes.append(code)
                print(
                    f"notice {attempt + 1}: up exited {code} {stopped_s:.2f} s after it", flush=True
                )
        finally:
            lab.run(["scancel", env["SLURM_JOB_ID"]])
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
            os.kill(int((work / "alloc.env.pid").read_text()), signal.SIGKILL)
    print(f"slurm: exit codes: {sorted(set(codes))} (75: preempted)")
    print(f"slurm: steps lost: {lost_steps} of {notices} notices")
    print(f"slurm: notices that lost any step: {lost_rounds}")
    print(f"slurm: median notice-to-stopped: {median(times):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notices", type=int, default=20)
    parser.add_argument("--backend", choices=("local", "slurm"), default="local")
    options = parser.parse_args()
    if options.backend == "slurm":
        slurm_arm(options.notices)
        return
    with tempfile.TemporaryDirectory(prefix="bench-preempt-") as tmp:
        spec = _spec(Path(tmp))
        lost_rounds, lost_steps, times, codes = 0, 0, [], []
        for attempt in range(options.notices + 1):
            run_dir, stopped_s, code = _round(spec, attempt)
            if attempt:
                resumed = [int(s) for t in _logs(run_dir, attempt) for s in RESUMED.findall(t)]
                start = min(resumed, default=0)
                lost = _last_completed(run_dir, attempt - 1) - start
                lost_rounds += lost > 0
                lost_steps += max(lost, 0)
            if attempt < options.notices:
                times.append(stopped_s)
                codes.append(code)
            print(f"notice {attempt + 1}: up exited {code} {stopped_s:.2f} s after it", flush=True)
    print(f"exit codes: {sorted(set(codes))} (75: preempted)")
    print(f"steps lost: {lost_steps} of {options.notices} notices")
    print(f"notices that lost any step: {lost_rounds}")
    print(f"median notice-to-stopped: {median(times):.2f} s")


if __name__ == "__main__":
    main()
