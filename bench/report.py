"""How long `distlaunch report` takes to write a large run's report.html.

A synthetic run dir (`synthetic_run`): N tasks (default 256) over A attempts (default 50), as
the launcher and distlaunch.worker write them: run.json, events.jsonl with every start, join,
failure, gang kill and restart, one hang, a stop notice and every task's save, and each task's
metrics and heartbeat. Prints the median wall and CPU time of `write_report` (reading the run dir, drawing, writing
report.html) over the rounds (target: under 1 s at 256 x 50), the file's size and its element
counts.

    python bench/report.py [--tasks 256] [--attempts 50] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

from distlaunch.launcher.record.state import RunRecord, RunState, TaskRecord
from distlaunch.launcher.report.write import write_report
from distlaunch.worker import contract

ATTEMPT_S = 10.0  # each attempt's length in the synthetic run
METRICS_PER_ATTEMPT = 4


def synthetic_run(run_dir: Path, tasks: int = 256, attempts: int = 50) -> Path:
    """Write a run dir of ``tasks`` MWMS workers over ``attempts`` attempts: each attempt but
    the last ends with one worker's failure (the 11th a hang) and a gang restart; the last with
    a stop notice on which every worker saves, so the run ends preempted. Returns ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    names = [contract.task_name(contract.WORKER, i) for i in range(tasks)]
    t0 = 1_800_000_000.0
    lines = []

    def event(at: float, task: str, kind: str, attempt: int, **fields) -> None:
        lines.append(
            json.dumps(
                {"time": round(at, 3), "task": task, "event": kind, "attempt": attempt, **fields}
            )
        )

    metrics: dict[str, list[dict]] = {name: [] for name in names}
    step = 0
    for attempt in range(attempts):
        start = t0 + attempt * ATTEMPT_S
        end = start + ATTEMPT_S - 0.5
        for name in names:
            kind = "restarted" if attempt else "started"
            event(start, name, kind, attempt, pid=1000 + attempt)
            event(start + 0.3, name, "joined", attempt, port=20000)
        for k in range(1, METRICS_PER_ATTEMPT + 1):
            at = start + k * (ATTEMPT_S - 1) / METRICS_PER_ATTEMPT
            step += 25
            for i, name in enumerate(names):
                loss = 2.5 * math.exp(-step / 800) + 0.01 * (i % 7)
                metrics[name].append({"epoch": step // 25, "step": step, "loss": loss, "time": at})
        if attempt == attempts - 1:
            event(end - 1, "run", "notice", attempt, signal="SIGTERM", save_s=30.0)
            for name in names:
                event(
                    end,
                    name,
                    "exited",
                    attempt,
                    decision="preempted",
                    exit="exit code 75",
                    exit_code=75,
                    saved_step=step,
                    save_s=0.4,
                )
            continue
        culprit = names[(attempt * 7) % tasks]
        if attempt == 10:
            event(
                end,
                culprit,
                "hung",
                attempt,
                decision="restart",
                exit="hung: no log output for 120 s",
                silent_s=120.0,
            )
        else:
            event(
                end, culprit, "exited", attempt, decision="restart", exit="exit code 1", exit_code=1
            )
        for name in names:
            if name != culprit:
                event(
                    end + 0.01, name, "killed", attempt, exit="signal SIGKILL", reason="restarting"
                )
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")
    for i, name in enumerate(names):
        path = contract.metrics_path(run_dir, contract.WORKER, i)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(metrics[name]))
    record = RunRecord(
        run_id="synthetic-256",
        name="synthetic",
        strategy=contract.MWMS,
        state=RunState.PREEMPTED,
        attempt=attempts - 1,
        started_at=t0,
        ended_at=t0 + attempts * ATTEMPT_S,
        exit_code=contract.EXIT_PREEMPTED,
        tasks={
            name: TaskRecord(role=contract.WORKER, index=i, port=20000 + i, attempt=attempts - 1)
            for i, name in enumerate(names)
        },
        preempted={"step": step, "save_s": 0.4},
    )
    record.save(run_dir)
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=256)
    parser.add_argument("--attempts", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = synthetic_run(Path(tmp) / "run", args.tasks, args.attempts)
        walls, cpus = [], []
        for _ in range(args.rounds):
            began, began_cpu = time.perf_counter(), time.process_time()
            path = write_report(run_dir)
            walls.append(time.perf_counter() - began)
            cpus.append(time.process_time() - began_cpu)
        html = path.read_text()
        bars, rows = html.count('class="bar '), html.count('<g class="row"')
        # CPU time too: on a shared machine the wall time also counts what others run.
        print(
            f"report of {args.tasks} tasks x {args.attempts} attempts: "
            f"{statistics.median(walls):.3f} s wall, {statistics.median(cpus):.3f} s CPU "
            f"(medians of {args.rounds}; wall {min(walls):.3f}-{max(walls):.3f} s), "
            f"{len(html) / 1e6:.1f} MB, {bars} bars, {rows} rows"
        )


if __name__ == "__main__":
    main()
