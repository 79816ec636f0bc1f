"""Elastic runs: a host lost to training resumed on fewer workers, and the planned grow back,
side by side with a cold start of the same world.

On 3 SSH test hosts (tests/sshhosts.py: network namespaces with an sshd each on this machine;
needs root), one worker each, `dw.fit` (distlaunch.worker.examples.mnist_mlp, a checkpoint every
CHECKPOINT_EVERY steps). Each round, in alternating order:

- cold 2 / cold 3: `up` of a plain (not elastic) run of 2 workers (hosts 1-2) or 3, from the
  command to its first training step (worker-0's status file), then stopped;
- elastic: `up` of the 3 workers with ``elastic.workers`` "2:3" (the knobs in ELASTIC); once it
  trains, host 3's cable drops every packet both ways (nothing answers, no reset: a machine
  gone dead). Shrink: the cut to the first step of the 2-worker world (worker-0's status
  in the resized attempt, at a step past the checkpoint it restored). Then the packets flow
  again; grow: their return to the first step of the 3-worker world, the pause in training
  (the save's notice to that first step), and the steps lost at the grow (each worker's saved
  step minus the step the 3-worker world resumed from: 0 is the promise of a save at a step
  the workers agree on).

Ratios: the shrink over a cold start of 2; the grow's pause over a cold start of 3. The shrink
includes ELASTIC's lost_after_s and settle_s, which the spec sets (a user's choice, printed).

    python bench/elastic.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DISTLAUNCH, REPO, median

sys.path.insert(0, str(REPO / "tests"))  # the SSH hosts' lab

CHECKPOINT_EVERY = 5
# The elastic section of the measured run: short waits, so that the bench measures the
# launcher and TensorFlow rather than the knobs (lost_after_s + settle_s is the floor of the
# shrink; a cluster would keep the defaults).
ELASTIC = {
    "workers": "2:3",
    "lost_after_s": 3,
    "settle_s": 1,
    "interval_s": 1,
    "cooldown_s": 1,
    "cooldown_max_s": 1,
    "probe_s": 1,
}
RESTART = {"policy": "on-failure", "max_restarts": 3, "backoff": {"initial_s": 0.5}}
PROGRAM = {
    "module": "distlaunch.worker.examples.mnist_mlp",
    "args": [
        "--epochs",
        "1000",
        "--steps-per-epoch",
        "100",
        "--checkpoint-every",
        str(CHECKPOINT_EVERY),
        # Split evenly over 2 and 3 workers (elastic.batch "global" keeps the global batch).
        "--global-batch-size",
        "48",
    ],
}


def main() -> None:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    # A SIGTERM unwinds like an exception: every run is stopped and the hosts are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import sshhosts

    reason = sshhosts.unavailable_reason()
    if reason:
        raise SystemExit(f"elastic: cannot make SSH test hosts: {reason}")
    cold: dict[int, list[float]] = {2: [], 3: []}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, sshhosts.HostLab(3) as lab:
        for round_ in range(options.rounds):
            order = ["cold2", "cold3", "elastic"]
            for what in order if round_ % 2 == 0 else order[::-1]:
                work = Path(tmp) / f"{what}-{round_}"
                try:
                    if what == "elastic":
                        runs.append(elastic(lab, work))
                        print(f"round {round_} elastic: {_said(runs[-1])}", flush=True)
                    else:
                        world = int(what[-1])
                        cold[world].append(cold_start(lab, work, world))
                        print(f"round {round_} cold {world}: {cold[world][-1]:.2f} s", flush=True)
                except SystemExit:
                    # What the launcher said, before its folder goes with the temp dir.
                    said = (work / "up.out").read_text(errors="replace").splitlines()
                    print("\n".join(line for line in said if "|" not in line[:40])[-6000:])
                    raise
    report(cold, runs)


def report(cold: dict[int, list[float]], runs: list[dict]) -> None:
    """Print the medians and ratios of the rounds."""
    shrink = median([r["shrink"] for r in runs])
    seen = median([r["seen"] for r in runs])
    pause = median([r["pause"] for r in runs])
    back = median([r["grow"] for r in runs])
    print(f"elastic knobs: {json.dumps(ELASTIC)}; {len(runs)} rounds, medians")
    print(
        f"shrink (host 3 gone dead to the first step on 2 workers) over a cold start of 2: "
        f"{shrink / median(cold[2]):.2f} ({shrink:.2f} s vs {median(cold[2]):.2f} s; the "
        f"resize decided {seen:.2f} s after the loss)"
    )
    print(
        f"grow pause (the save's notice to the first step on 3) over a cold start of 3: "
        f"{pause / median(cold[3]):.2f} ({pause:.2f} s vs {median(cold[3]):.2f} s); host 3's "
        f"return to the first step on 3: {back:.2f} s; steps lost at the grow (each worker's "
        f"saved step minus the step the world of 3 resumed from): {[r['lost'] for r in runs]}"
    )


def _said(run: dict) -> str:
    return (
        f"shrink {run['shrink']:.2f} s (decided after {run['seen']:.2f} s), grow "
        f"{run['grow']:.2f} s (pause {run['pause']:.2f} s), steps lost {run['lost']}"
    )


def cold_start(lab, work: Path, world: int) -> float:
    """`up` of ``world`` plain workers to their first step (seconds)."""
    began = time.time()
    launcher, run_dir = _up(lab, work, world, elastic=False)
    try:
        first = _wait(lambda: _step_after(run_dir, 0, 0), "the first step", launcher)
    finally:
        _stop(launcher)
    return first[1] - began


def elastic(lab, work: Path) -> dict:
    """The elastic run: shrink when host 3 goes dead, grow when it answers again (seconds, steps)."""
    launcher, run_dir = _up(lab, work, 3, elastic=True)
    host = lab.hosts[-1]
    try:
        _wait(lambda: (run_dir / "checkpoints" / "checkpoint").is_file(), "a checkpoint", launcher)
        _stall(host, True)
        cut = time.time()
        shrunk = _wait(lambda: _resized(run_dir, 2), "the shrink to 2 workers", launcher)
        _, first2 = _wait(
            lambda: _step_after(run_dir, shrunk["attempt"], shrunk["step"]),
            "the first step on 2 workers",
            launcher,
        )
        _stall(host, False)
        returned = time.time()
        grown = _wait(lambda: _resized(run_dir, 3), "the grow back to 3 workers", launcher)
        _, first3 = _wait(
            lambda: _step_after(run_dir, grown["attempt"], grown["step"]),
            "the first step on 3 workers",
            launcher,
        )
    finally:
        _stall(host, False)
        _stop(launcher)
    # The grow's save: its notice (training stops at the next step the workers agree on), and
    # the step each worker of the world of 2 saved at.
    happened = _events(run_dir)
    notice = [e for e in happened if e.get("event") == "notice" and e["time"] > shrunk["time"]]
    saved = {
        e["saved_step"]
        for e in happened
        if e.get("event") == "exited" and e.get("attempt") == shrunk["attempt"]
        if e.get("saved_step") is not None
    }
    return {
        "shrink": first2 - cut,
        "seen": shrunk["time"] - cut,
        "grow": first3 - returned,
        "pause": first3 - notice[0]["time"] if notice else float("nan"),
        "lost": sorted(step - grown["step"] for step in saved) or None,
    }


def _stall(host, on: bool) -> None:
    """Drop every packet of ``host``'s cable, both ways (``on``), or stop dropping them: a table
    of the bench's own in the host's namespace (the run's firewall table is another). Nothing
    answers, no reset: a machine gone dead (tests/test_elastic_ssh.py's way)."""
    nft = ["ip", "netns", "exec", host.netns, "nft"]
    if not on:
        subprocess.run([*nft, "delete", "table", "inet", "dlstall"], capture_output=True)
        return
    leg = f"{host.netns}v"  # the host's end of its cable to the switch (tests/netlab.py)
    table = (
        "table inet dlstall {\n"
        f'  chain in {{ type filter hook input priority -100; iifname "{leg}" drop; }}\n'
        f'  chain out {{ type filter hook output priority -100; oifname "{leg}" drop; }}\n'
        "}\n"
    )
    subprocess.run([*nft, "-f", "-"], input=table, text=True, check=True)


def _up(lab, work: Path, world: int, elastic: bool) -> tuple[subprocess.Popen, Path]:
    work.mkdir(parents=True)
    hosts = lab.hosts[:world]
    spec = {
        "name": "elastic",
        "strategy": "multi_worker_mirrored",
        "program": {**PROGRAM, "python": sys.executable},
        "hosts": {h.name: lab.host_entry(h) for h in hosts},
        "tasks": {"worker": [{"host": h.name} for h in hosts]},
        "shared_dir": "runs",
        "timeouts": {"grace_s": 1, "startup_s": 300},
        # As a user would run it: a task's failure restarts the gang (tests/test_elastic_ssh.py).
        "restart": RESTART,
        **({"elastic": ELASTIC} if elastic else {}),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    with open(work / "up.out", "wb") as out:
        launcher = subprocess.Popen(
            [*DISTLAUNCH, "up", "spec.json"], cwd=work, stdout=out, stderr=subprocess.STDOUT
        )

    def run_json() -> Path | None:
        if launcher.poll() is not None:  # it refused the spec, or the hosts
            said = (work / "up.out").read_text(errors="replace").strip()
            raise SystemExit(f"`distlaunch up` exited with {launcher.returncode}: {said}")
        return next(iter((work / "runs").glob("*/run.json")), None)

    return launcher, _wait(run_json, "the run dir").parent


def _stop(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=120)


def _wait(probe, what: str, launcher: subprocess.Popen | None = None, limit_s: float = 300):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        if launcher is not None and launcher.poll() is not None:
            raise SystemExit(f"`distlaunch up` exited with {launcher.returncode} before {what}")
        time.sleep(0.01)
    raise SystemExit(f"gave up waiting for {what}")


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _status(run_dir: Path) -> dict:
    """worker-0's heartbeat (written by distlaunch.worker after each step): step, attempt, time."""
    return _read(run_dir / "status" / "worker-0.json") or {}


def _step_after(run_dir: Path, attempt: int, step: int | None) -> tuple[int, float] | None:
    """(attempt, time) of worker-0's first heartbeat in ``attempt`` or later past ``step``
    (None: from the start)."""
    status = _status(run_dir)
    if status.get("attempt", -1) < attempt or int(status.get("step") or 0) <= (step or 0):
        return None
    return status["attempt"], status["time"]


def _events(run_dir: Path) -> list[dict]:
    try:
        text = (run_dir / "events.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines() if line]
    except (OSError, ValueError):
        return []


def _resized(run_dir: Path, world: int) -> dict | None:
    """The run's latest `resized` event to ``world`` workers (its attempt, and the step the
    new world resumes from)."""
    found = [e for e in _events(run_dir) if e.get("event") == "resized" and e.get("new") == world]
    return found[-1] if found else None


if __name__ == "__main__":
    main()
