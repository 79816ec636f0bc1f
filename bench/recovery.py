"""Recovery: how fast a failure is noticed, and how long the cluster takes to be back, vs a cold start.

Measurements from runs of `distlaunch up` with `restart: on-failure`:

1. detection latency: `kill -9` of a task to the launcher's decision in events.jsonl, repeated;
   prints the p50 and p95 (target p95 <= 0.2 s).
2. PSS worker recovery: kill -9 of worker-1 to worker-1 serving again (its server listening:
   the launcher's "joined" event), over worker-1's cold start in the same run ("started" to
   "joined" of attempt 0) (target with warm standbys <= 0.25).
3. MWMS gang recovery: kill -9 of worker-1 to the first training step after the restore (the
   first heartbeat with a step past the restored one, written by distlaunch.worker right after
   that step), over the cold start of the same gang (start to the first step of attempt 0)
   (target with warm standbys <= 0.40).
4. standby memory: RSS and USS of one standby interpreter (and of taskinit's keeper and init
   around it), sampled once the standbys are ready.

2 and 3 run in rounds alternating `restart.standby` on and off (the kill waits for the standbys
to be ready where they are on); each figure is the median of its rounds.

    python bench/recovery.py [--kills 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
from _common import DISTLAUNCH, median

ON_FAILURE = {"policy": "on-failure", "max_restarts": 100, "backoff": {"initial_s": 0, "max_s": 0}}
# A first checkpoint is written at this step, so a restarted gang has something to restore.
CHECKPOINT_EVERY = 5


TARGETS = {"PSS": 0.25, "MWMS": 0.40}  # recovery over cold start, with warm standbys


def main() -> None:
    """Run the measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    # (strategy, standby on) -> [(recovery s, cold start s)]
    figures: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    memory: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        latencies = detection(Path(tmp) / "detect", options.kills)
        for round_ in range(options.rounds):
            for standby in (True, False) if round_ % 2 == 0 else (False, True):
                for name, measure in (("PSS", pss_worker), ("MWMS", mwms_gang)):
                    work = Path(tmp) / f"{name}-{round_}-{'on' if standby else 'off'}"
                    recovery, cold, sampled = measure(work, standby)
                    figures.setdefault((name, standby), []).append((recovery, cold))
                    memory += sampled
    report(latencies, figures, memory)


def report(
    latencies: list[float],
    figures: dict[tuple[str, bool], list[tuple[float, float]]],
    memory: list[dict[str, float]],
) -> None:
    """Print the figures: detection latencies, (strategy, standby on) -> [(recovery s, cold
    start s)] per round, and the standby memory samples (MB)."""
    p95 = statistics.quantiles(latencies, n=20)[-1]
    print(
        f"detection latency, kill -9 to decision ({len(latencies)} kills): p50 {statistics.median(latencies) * 1000:.1f} ms, "
        f"p95 {p95 * 1000:.1f} ms (target p95 <= 200 ms)"
    )
    what = {
        "PSS": "PSS worker recovery (kill to serving again over its cold start)",
        "MWMS": "MWMS gang recovery (kill to the first step after the restore over a cold start to the first step)",
    }
    for name in ("PSS", "MWMS"):
        for standby in (True, False):
            rounds = figures[(name, standby)]
            ratio = median([r / c for r, c in rounds])
            target = f" (target <= {TARGETS[name]:.2f})" if standby else ""
            print(
                f"{what[name]}, standbys {'on' if standby else 'off'}: ratio {ratio:.2f}{target}; "
                f"{median([r for r, _ in rounds]):.2f} s vs {median([c for _, c in rounds]):.2f} s, "
                f"medians of {len(rounds)}"
            )
        # The standbys' imports may overlap a slow cold start and lengthen it: the same recovery
        # over the cold start of the rounds without standbys.
        warm = median([r for r, _ in figures[(name, True)]])
        cold = median([c for _, c in figures[(name, False)]])
        print(f"  warm recovery over the standbys-off rounds' cold start: {warm / cold:.2f}")
    if memory:
        print(
            f"standby memory ({len(memory)} standbys sampled): interpreter RSS "
            f"{median([m['rss'] for m in memory]):.0f} MB, USS {median([m['uss'] for m in memory]):.0f} MB "
            f"(max RSS {max(m['rss'] for m in memory):.0f} MB); taskinit's keeper and init RSS "
            f"{median([m['taskinit'] for m in memory]):.0f} MB together; one standby per local task"
        )


def detection(work: Path, kills: int) -> list[float]:
    """Kill a sleeping task ``kills`` times; return each kill-to-decision latency."""
    work.mkdir()
    (work / "sleeper.py").write_text("import time\ntime.sleep(3600)\n")
    launcher, run_dir = _up(
        work, {"script": "sleeper.py"}, "multi_worker_mirrored", {"worker": {"count": 1}}, False
    )
    latencies = []
    try:
        for attempt in range(kills):
            pid = _wait(lambda: _task(run_dir, "worker-0", attempt).get("pid"), "the sleeper")
            time.sleep(0.2)  # let it settle: measure detection, not a start in progress
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            decided = _wait(
                lambda: next(
                    (
                        e["time"]
                        for e in _events(run_dir)
                        if e.get("decision") and e.get("attempt") == attempt
                    ),
                    None,
                ),
                "the decision",
            )
            latencies.append(decided - killed_at)
    finally:
        _stop(launcher)
    return latencies


def pss_worker(work: Path, standby: bool) -> tuple[float, float, list[dict[str, float]]]:
    """Kill worker-1 of a PSS run; return (kill to serving again, cold start to serving, standby
    memory samples)."""
    work.mkdir()
    program = {
        "module": "distlaunch.worker.examples.cnn_mnist",
        "args": ["--epochs", "1000", "--steps-per-epoch", "100", "--train-examples", "2000"],
    }
    tasks = {"chief": {}, "worker": {"count": 2}, "ps": {}}
    launcher, run_dir = _up(work, program, "parameter_server", tasks, standby)
    try:
        _wait(
            lambda: (
                _task(run_dir, "chief-0", 0).get("state") == "running"
                and _status_step(run_dir, "chief-0") > 0
            ),
            "training",
        )
        cold = _event_time(run_dir, "worker-1", "joined", 0) - _event_time(
            run_dir, "worker-1", "started", 0
        )
        sampled = _standby_memory(run_dir, 4) if standby else []
        pid = _task(run_dir, "worker-1", 0)["pid"]
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        back = _wait(
            lambda: _event_time(run_dir, "worker-1", "joined", 1), "worker-1 serving again"
        )
    finally:
        _stop(launcher)
    _check_warm(run_dir, "worker-1", standby)
    return back - killed_at, cold, sampled


def mwms_gang(work: Path, standby: bool) -> tuple[float, float, list[dict[str, float]]]:
    """Kill worker-1 of an MWMS run; return (kill to first step after restore, cold start to
    first step, standby memory samples)."""
    work.mkdir()
    program = {
        "module": "distlaunch.worker.examples.mnist_mlp",
        "args": [
            "--epochs",
            "1000",
            "--steps-per-epoch",
            "100",
            "--checkpoint-every",
            str(CHECKPOINT_EVERY),
        ],
    }
    launcher, run_dir = _up(
        work, program, "multi_worker_mirrored", {"worker": {"count": 2}}, standby
    )
    try:
        first_step = _wait(lambda: _first_step_time(run_dir, 0, 0), "the first step")
        cold = first_step - _event_time(run_dir, "worker-0", "started", 0)
        _wait(lambda: (run_dir / "checkpoints" / "checkpoint").is_file(), "a checkpoint")
        sampled = _standby_memory(run_dir, 2) if standby else []
        pid = _task(run_dir, "worker-1", 0)["pid"]
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        restored = _wait(
            lambda: _task(run_dir, "worker-0", 1) and _restored_step(run_dir), "the restore"
        )
        back = _wait(
            lambda: _first_step_time(run_dir, 1, restored), "the first step after the restore"
        )
    finally:
        _stop(launcher)
    _check_warm(run_dir, "worker-1", standby)
    return back - killed_at, cold, sampled


def _standby_memory(run_dir: Path, count: int) -> list[dict[str, float]]:
    """Wait until ``count`` standbys are ready; then each one's memory in MB: its interpreter's
    RSS and USS, and the RSS of taskinit's keeper and init around it."""
    standbys = _wait(
        lambda: (
            (found := (_read(run_dir / "run.json") or {}).get("standbys") or {})
            and len(found) == count
            and all(s["ready"] for s in found.values())
            and found
        ),
        "the standbys",
    )
    samples = []
    for standby in standbys.values():
        keeper = psutil.Process(standby["pid"])
        tree = [keeper, *keeper.children(recursive=True)]
        interpreter = next(p for p in tree if p.cmdline()[1:2] != ["-I"])
        full = interpreter.memory_full_info()
        samples.append(
            {
                "rss": full.rss / 2**20,
                "uss": full.uss / 2**20,
                "taskinit": sum(p.memory_info().rss for p in tree if p is not interpreter) / 2**20,
            }
        )
    return samples


def _check_warm(run_dir: Path, task: str, standby: bool) -> None:
    """Fail loudly if the restart was not the kind this round measures."""
    warm = any(
        e.get("standby")
        for e in _events(run_dir)
        if e["task"] == task and e["event"] == "restarted"
    )
    if warm != standby:
        raise SystemExit(
            f"{task} restarted {'warm' if warm else 'cold'} in a round meant otherwise"
        )


def _up(
    work: Path, program: dict, strategy: str, tasks: dict, standby: bool
) -> tuple[subprocess.Popen, Path]:
    spec = work / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "name": "recovery",
                "strategy": strategy,
                "program": program,
                "tasks": tasks,
                "shared_dir": "runs",
                "restart": {**ON_FAILURE, "standby": standby},
                "timeouts": {"grace_s": 1},
            }
        )
    )
    launcher = subprocess.Popen(
        [*DISTLAUNCH, "up", str(spec)],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run_dir = _wait(
        lambda: (
            next(iter((work / "runs").glob("*/run.json")), None)
            if (work / "runs").exists()
            else None
        ),
        "the run dir",
    ).parent
    return launcher, run_dir


def _stop(launcher: subprocess.Popen) -> None:
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=60)


def _wait(probe, what: str, limit_s: float = 300):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.005)
    raise SystemExit(f"gave up waiting for {what}")


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _events(run_dir: Path) -> list[dict]:
    try:
        return [
            json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line
        ]
    except (OSError, ValueError):
        return []


def _event_time(run_dir: Path, task: str, event: str, attempt: int) -> float | None:
    return next(
        (
            e["time"]
            for e in _events(run_dir)
            if e["task"] == task and e["event"] == event and e["attempt"] == attempt
        ),
        None,
    )


def _task(run_dir: Path, name: str, attempt: int) -> dict:
    task = ((_read(run_dir / "run.json") or {}).get("tasks") or {}).get(name) or {}
    return task if task.get("attempt") == attempt else {}


def _status_step(run_dir: Path, task: str) -> int:
    return int((_read(run_dir / "status" / f"{task}.json") or {}).get("step") or 0)


def _first_step_time(run_dir: Path, attempt: int, after_step: int) -> float | None:
    status = _read(run_dir / "status" / "worker-0.json") or {}
    if status.get("attempt") == attempt and int(status.get("step") or 0) > after_step:
        return status["time"]
    return None


def _restored_step(run_dir: Path) -> int | None:
    log = run_dir / "logs" / "attempt-1" / "worker-0.log"
    text = log.read_text() if log.exists() else ""
    marker = " at step "
    for line in text.splitlines():
        if "resumed from" in line and marker in line:
            return int(line.rsplit(marker, 1)[1])
    return None


if __name__ == "__main__":
    main()
