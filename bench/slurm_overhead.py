"""Wall time of `up --backend slurm` over the same two srun steps launched by hand with TF_CONFIG.

Runs on a real Slurm cluster made on this machine (tests/slurmcluster.py: needs root and
slurm-wlm + munge) and holds one 2-node allocation for the whole benchmark. The hand launch is
what users do today: a bash script that runs one `srun --nodes=1 --ntasks=1 --nodelist=NODE
--exact` per worker with its environment (TF_CONFIG and the rest, from `distlaunch plan --json`
inside the allocation, so both sides run identical processes on the same nodes) and waits for
both. Rounds alternate between the two (and which goes first) so that machine noise hits both
alike; the medians and their ratio are printed (target <= 1.10).

The launcher's own time is traced from each `up`'s events.jsonl: its command to its first task's
start (Python, imports, spec, placement, the node probes, the nodes' agents taking the firewall
rules) plus its last task's exit to its own exit (the agents removing their rules, the record);
target <= 0.35 s. The hand launch's own share (bash, then its sruns return) is a few
milliseconds.

Both sides run with Python's bytecode cache on, as an installed distlaunch has it
(`_common.bytecode_on`).

    python bench/slurm_overhead.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DISTLAUNCH, REPO, bytecode_on, median

sys.path.insert(0, str(REPO / "tests"))
from slurmcluster import SlurmLab, unavailable_reason

ARGS = ["--epochs", "3", "--steps-per-epoch", "20"]


def main() -> None:
    """Time both launches side by side and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot run: {reason}")
    bytecode_on()
    with tempfile.TemporaryDirectory() as tmp, SlurmLab(2) as lab:
        work = Path(tmp)
        spec = work / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "name": "bench",
                    "strategy": "multi_worker_mirrored",
                    "backend": "slurm",
                    "program": {
                        "module": "distlaunch.worker.examples.mnist_mlp",
                        "args": ARGS,
                        "python": sys.executable,
                    },
                    # Unpinned, as the hand launch's tasks are: the lab's two nodes share this
                    # machine's cores, and each node's one allocated CPU is its CPU 0, so `auto`
                    # would pin both tasks to the same core (nodes of a cluster have their own).
                    "tasks": {"worker": {"count": 2, "cpus": "all"}},
                    "shared_dir": "runs",
                }
            )
        )
        holder, env = _allocation(lab, work)
        try:
            up_times, hand_times, own = [], [], []
            for round_ in range(rounds):
                script = _hand_script(lab, spec, env, work)
                # Which side goes first alternates too: neither always gets the warmer machine.
                sides = [
                    (up_times, [*DISTLAUNCH, "up", str(spec)]),
                    (hand_times, ["bash", str(script)]),
                ]
                for times, argv in sides if round_ % 2 == 0 else reversed(sides):
                    wall = time.time()
                    times.append(_timed(lab, argv, env, work))
                    if times is up_times:
                        own.append(_own_time(work / "runs", wall, wall + times[-1]))
        finally:
            lab.run(["scancel", env["SLURM_JOB_ID"]])
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
            # salloc's command runs in a process group of its own.
            os.kill(int((work / "alloc.env.pid").read_text()), signal.SIGKILL)
    up_s, hand_s = median(up_times), median(hand_times)
    print(
        f"hand launch (2 srun steps + TF_CONFIG): median {hand_s:.2f} s of {[round(t, 2) for t in hand_times]}"
    )
    print(
        f"distlaunch up --backend slurm:          median {up_s:.2f} s of {[round(t, 2) for t in up_times]}"
    )
    before, after = median([o[0] for o in own]), median([o[1] for o in own])
    print(
        f"launcher's own time (traced, medians): {before + after:.2f} s (target <= 0.35 s): command "
        f"to first task start {before:.2f} s, last task exit to its exit {after:.2f} s; "
        f"difference of the medians {up_s - hand_s:.2f} s"
    )
    print(f"ratio up / hand: {up_s / hand_s:.3f} (target <= 1.10)")


def _own_time(runs: Path, start: float, end: float) -> tuple[float, float]:
    """The latest run's time before its first task started and after its last task exited."""
    # The hand launch's run dirs (made by _hand_script) have no events.
    latest = max(runs.glob("*/events.jsonl"), key=lambda p: p.stat().st_mtime)
    events = [json.loads(line) for line in latest.read_text().splitlines()]
    started = min(e["time"] for e in events if e["event"] == "started")
    exited = max(e["time"] for e in events if e["event"] == "exited")
    return started - start, end - exited


def _allocation(
    lab: SlurmLab, work: Path, *salloc_args: str
) -> tuple[subprocess.Popen, dict[str, str]]:
    """Hold a 2-node allocation (salloc running a sleep, ``salloc_args`` added); return it and a
    shell's environment in it."""
    env_file = work / "alloc.env"
    holder = subprocess.Popen(
        lab.command(
            [
                "salloc",
                "--quiet",
                "--nodes=2",
                *salloc_args,
                "sh",
                "-c",
                (
                    f"echo $$ > {env_file}.pid && env -0 > {env_file}.tmp && mv {env_file}.tmp "
                    f"{env_file} && exec sleep 3600"
                ),
            ]
        ),
        env=lab.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not env_file.exists():
        if time.monotonic() > deadline:
            sys.exit("no allocation within 60 s")
        time.sleep(0.1)
    inside = dict(item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item)
    return holder, {
        **lab.env,
        **{k: v for k, v in inside.items() if k.startswith("SLURM_")},
    }


def _timed(lab: SlurmLab, argv: list[str], env: dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        lab.command(argv),
        env=env,
        cwd=cwd,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def _hand_script(lab: SlurmLab, spec: Path, env: dict[str, str], work: Path) -> Path:
    """The bash script a user would write: one srun step per worker with its env, then wait."""
    out = subprocess.run(
        lab.command([*DISTLAUNCH, "plan", "--json", str(spec)]),
        env=env,
        cwd=work,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    plan = json.loads(out)
    lines = ["set -e", "pids=()"]
    for task in plan["tasks"]:
        Path(task["log_file"]).parent.mkdir(parents=True, exist_ok=True)
        Path(plan["run_dir"], "checkpoints").mkdir(parents=True, exist_ok=True)
        exports = " ".join(shlex.quote(f"{k}={v}") for k, v in task["env"].items())
        srun = f"srun --nodes=1 --ntasks=1 --cpus-per-task=1 --exact --nodelist={shlex.quote(task['host'])}"
        lines.append(
            f"(cd {shlex.quote(task['cwd'])} && {srun} env {exports} {shlex.join(task['argv'])} > {shlex.quote(task['log_file'])} 2>&1) & pids+=($!)"
        )
    lines.append('for p in "${pids[@]}"; do wait "$p"; done')
    script = work / "hand.sh"
    script.write_text("\n".join(lines) + "\n")
    return script


if __name__ == "__main__":
    main()
