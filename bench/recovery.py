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

``--backend`` says where the tasks run: ``local`` (this machine), ``ssh`` (two of the test
suite's SSH hosts, tests/sshhosts.py: network namespaces with an sshd each on this machine;
needs root) or ``slurm`` (tests/slurmcluster.py's two-node cluster on this machine, in one
allocation held for the whole bench; needs root, slurm-wlm and munge; run it under
``flock /tmp/dl-slurm.lock``). On ssh and slurm the tasks are spread over both machines
(worker-1 on the second: alone over SSH, with the ps task on a Slurm node of 2 CPUs), each machine's agent keeps the standbys, the kill -9 is of the
task's program there (found by its environment), and 1 (detection) is left out.

    python bench/recovery.py [--kills 20] [--rounds 2] [--backend local|ssh|slurm]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _common import DISTLAUNCH, REPO, median

sys.path.insert(0, str(REPO / "tests"))  # the SSH hosts' and the Slurm cluster's labs

ON_FAILURE = {"policy": "on-failure", "max_restarts": 100, "backoff": {"initial_s": 0, "max_s": 0}}
# A first checkpoint is written at this step, so a restarted gang has something to restore.
CHECKPOINT_EVERY = 5


TARGETS = {"PSS": 0.25, "MWMS": 0.40}  # recovery over cold start, with warm standbys


class Local:
    """Every task on this machine; a task's pid in run.json is its process group's."""

    name = "local"

    def spec(self, tasks: dict) -> dict:
        """The spec's fields that place ``tasks`` (role -> {"count": N})."""
        return {"tasks": tasks}

    def command(self, argv: list[str]) -> tuple[list[str], dict[str, str] | None]:
        """How `distlaunch` is run against this backend: argv and env (None: ours)."""
        return argv, None

    def kill(self, run_dir: Path, task: str) -> None:
        """kill -9 the task's program (attempt 0)."""
        os.kill(_task(run_dir, task, 0)["pid"], signal.SIGKILL)

    def close(self) -> None:
        """Nothing to release."""


class Remote(Local):
    """Tasks spread over two machines of a lab on this machine, worker-1 on the second
    (`place`). A task's pid in run.json is its agent's client here: the kill finds the program
    itself by its environment (the lab's machines share this machine's processes)."""

    def place(self, tasks: dict, first: str, second: str, ps_second: bool = False) -> dict:
        """``tasks`` (role -> {"count": N}) as lists naming a host each; ``ps_second``: the ps
        task shares the second machine with worker-1 (a Slurm node has CPUs for two tasks)."""
        seconds = {("worker", 1), *([("ps", 0)] if ps_second else [])}
        return {
            role: [{"host": second if (role, i) in seconds else first} for i in range(n)]
            for role, n in ((r, t.get("count", 1)) for r, t in tasks.items())
        }

    def kill(self, run_dir: Path, task: str) -> None:
        """kill -9 the task's program (attempt 0) where it runs."""
        run_id = (_read(run_dir / "run.json") or {})["run_id"]
        role, index = task.rsplit("-", 1)
        wanted = {
            f"DISTLAUNCH_RUN_ID={run_id}",
            f"DISTLAUNCH_ROLE={role}",
            f"DISTLAUNCH_INDEX={index}",
            "DISTLAUNCH_ATTEMPT=0",
        }
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) != proc.pid:
                    continue  # the program leads its group; what it forked does not
                env = set(open(f"/proc/{proc.pid}/environ", "rb").read().decode().split("\0"))
            except (OSError, psutil.Error):
                continue
            if wanted <= env:
                os.kill(proc.pid, signal.SIGKILL)
                return
        raise SystemExit(f"no program of {task} found to kill")


class Ssh(Remote):
    """Two SSH test hosts (tests/sshhosts.py)."""

    name = "ssh"

    def __init__(self) -> None:
        import sshhosts

        reason = sshhosts.unavailable_reason()
        if reason:
            raise SystemExit(f"recovery: cannot make SSH test hosts: {reason}")
        self.lab = sshhosts.HostLab(2)

    def spec(self, tasks: dict) -> dict:
        """Both hosts, worker-1 alone on node2."""
        first, second = self.lab.hosts
        return {
            "hosts": {h.name: self.lab.host_entry(h) for h in self.lab.hosts},
            "tasks": self.place(tasks, first.name, second.name),
        }

    def close(self) -> None:
        """Remove the hosts."""
        self.lab.close()


class Slurm(Remote):
    """tests/slurmcluster.py's two nodes, in one allocation held for the whole bench."""

    name = "slurm"

    def __init__(self, work: Path) -> None:
        from slurm_overhead import _allocation

        from slurmcluster import SlurmLab, unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise SystemExit(f"recovery: cannot make the Slurm cluster: {reason}")
        self.lab = SlurmLab(2)
        self.work = work
        try:
            # Both CPUs of each node: a node runs two tasks (PSS).
            self.holder, self.env = _allocation(self.lab, work, "--ntasks-per-node=2")
        except BaseException:
            self.lab.close()
            raise

    def spec(self, tasks: dict) -> dict:
        """Both nodes, worker-1 on the second (with the ps task: a node has CPUs for two)."""
        first, second = (n.name for n in self.lab.nodes)
        program_python = {"python": sys.executable}
        placed = self.place(tasks, first, second, ps_second=True)
        return {"backend": "slurm", "tasks": placed, **program_python}

    def command(self, argv: list[str]) -> tuple[list[str], dict[str, str] | None]:
        """Inside the allocation, with the lab's node names."""
        return self.lab.command(argv), self.env

    def close(self) -> None:
        """Give the allocation back and stop the cluster."""
        try:
            self.lab.run(["scancel", self.env["SLURM_JOB_ID"]])
            os.killpg(self.holder.pid, signal.SIGKILL)
            self.holder.wait()
            os.kill(int((self.work / "alloc.env.pid").read_text()), signal.SIGKILL)
        finally:
            self.lab.close()


def main() -> None:
    """Run the measurements and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", choices=("local", "ssh", "slurm"), default="local")
    options = parser.parse_args()
    # (strategy, standby on) -> [(recovery s, cold start s)]
    figures: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    memory: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        where: Local = (
            Ssh()
            if options.backend == "ssh"
            else Slurm(Path(tmp))
            if options.backend == "slurm"
            else Local()
        )
        try:
            latencies = (
                detection(Path(tmp) / "detect", options.kills) if where.name == "local" else []
            )
            for round_ in range(options.rounds):
                for standby in (True, False) if round_ % 2 == 0 else (False, True):
                    for name, measure in (("PSS", pss_worker), ("MWMS", mwms_gang)):
                        work = Path(tmp) / f"{name}-{round_}-{'on' if standby else 'off'}"
                        recovery, cold, sampled = measure(work, standby, where)
                        figures.setdefault((name, standby), []).append((recovery, cold))
                        memory += sampled
                        print(
                            f"{name} standbys {'on' if standby else 'off'}: recovery "
                            f"{recovery:.2f} s, cold start {cold:.2f} s",
                            flush=True,
                        )
        finally:
            where.close()
    print(f"backend {where.name}")
    report(latencies, figures, memory)


def report(
    latencies: list[float],
    figures: dict[tuple[str, bool], list[tuple[float, float]]],
    memory: list[dict[str, float]],
) -> None:
    """Print the figures: detection latencies, (strategy, standby on) -> [(recovery s, cold
    start s)] per round, and the standby memory samples (MB)."""
    if latencies:
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
            f"(max RSS {max(m['rss'] for m in memory):.0f} MB); its keepers' RSS (local: taskinit's "
            "keeper and init; remote: the agent's keeper) "
            f"{median([m['taskinit'] for m in memory]):.0f} MB together; one standby per task"
        )


def detection(work: Path, kills: int) -> list[float]:
    """Kill a sleeping task ``kills`` times; return each kill-to-decision latency."""
    work.mkdir()
    (work / "sleeper.py").write_text("import time\ntime.sleep(3600)\n")
    launcher, run_dir = _up(
        work,
        {"script": "sleeper.py"},
        "multi_worker_mirrored",
        {"worker": {"count": 1}},
        False,
        Local(),
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


def pss_worker(
    work: Path, standby: bool, where: Local
) -> tuple[float, float, list[dict[str, float]]]:
    """Kill worker-1 of a PSS run; return (kill to serving again, cold start to serving, standby
    memory samples)."""
    work.mkdir()
    program = {
        "module": "distlaunch.worker.examples.cnn_mnist",
        "args": ["--epochs", "1000", "--steps-per-epoch", "100", "--train-examples", "2000"],
    }
    tasks = {"chief": {}, "worker": {"count": 2}, "ps": {}}
    launcher, run_dir = _up(work, program, "parameter_server", tasks, standby, where)
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
        killed_at = time.time()
        where.kill(run_dir, "worker-1")
        back = _wait(
            lambda: _event_time(run_dir, "worker-1", "joined", 1), "worker-1 serving again"
        )
    finally:
        _stop(launcher)
    _check_warm(run_dir, "worker-1", standby)
    return back - killed_at, cold, sampled


def mwms_gang(
    work: Path, standby: bool, where: Local
) -> tuple[float, float, list[dict[str, float]]]:
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
        work, program, "multi_worker_mirrored", {"worker": {"count": 2}}, standby, where
    )
    try:
        first_step = _wait(lambda: _first_step_time(run_dir, 0, 0), "the first step")
        cold = first_step - _event_time(run_dir, "worker-0", "started", 0)
        _wait(lambda: (run_dir / "checkpoints" / "checkpoint").is_file(), "a checkpoint")
        sampled = _standby_memory(run_dir, 2) if standby else []
        killed_at = time.time()
        where.kill(run_dir, "worker-1")
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
    RSS and USS, and the RSS of its keepers (taskinit's keeper and init around a local one, the
    agent's keeper, remote.py, around a remote one)."""
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
    work: Path, program: dict, strategy: str, tasks: dict, standby: bool, where: Local
) -> tuple[subprocess.Popen, Path]:
    spec = work / "spec.json"
    placed = where.spec(tasks)
    python = placed.pop("python", None)
    spec.write_text(
        json.dumps(
            {
                "name": "recovery",
                "strategy": strategy,
                "program": {**program, **({"python": python} if python else {})},
                **placed,
                "shared_dir": "runs",
                "restart": {**ON_FAILURE, "standby": standby},
                "timeouts": {"grace_s": 1},
            }
        )
    )
    argv, env = where.command([*DISTLAUNCH, "up", str(spec)])
    with open(work / "up.err", "wb") as err:
        launcher = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=err)

    def run_json() -> Path | None:
        if launcher.poll() is not None:  # it refused the spec, or the machines
            said = (work / "up.err").read_text(errors="replace").strip()
            raise SystemExit(f"`distlaunch up` exited with {launcher.returncode}: {said}")
        return next(iter((work / "runs").glob("*/run.json")), None)

    run_dir = _wait(run_json, "the run dir").parent
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
