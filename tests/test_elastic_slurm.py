"""Elastic runs under Slurm, on a real 3-node Slurm cluster (tests/slurmcluster.py): what Slurm
does to a job when one of its nodes goes DOWN or is drained, as the launcher reads it
(launcher/transports/slurm/nodes.py), and the refusal of an elastic run in a job that a node's
failure would end.

Runs under `flock /tmp/dl-slurm.lock`; skips, with the reason, where slurmd cannot run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import events, wait_for, wait_for_run_dir
from distlaunch.launcher.spec.model import load_spec
from distlaunch.launcher.transports.slurm import sbatch as batch
from distlaunch.launcher.transports.slurm.agent_step import StepTransport
from distlaunch.launcher.transports.slurm.allocation import Allocation
from distlaunch.launcher.transports.slurm.nodes import (
    NO_KILL_ENV,
    NodeWatch,
    has_no_kill,
    lost_nodes,
    parse_job,
    parse_nodes,
)
from slurmcluster import SlurmLab
from test_firewall import _rules_left


@pytest.fixture(scope="module")
def lab3() -> Iterator[SlurmLab]:
    """A 3-node Slurm cluster for this module (conftest's slurm_lab has 2)."""
    from slurmcluster import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with SlurmLab(3) as cluster:
        yield cluster


@contextmanager
def holding(lab: SlurmLab, tmp: Path, no_kill: bool) -> Iterator[dict[str, str]]:
    """A 3-node allocation held by `salloc` (with --no-kill given as SALLOC_NO_KILL=set, the
    way the launcher can see it, or without), and the environment a shell inside it has."""
    env_file = tmp / "alloc.env"
    env = {**lab.env, **({"SALLOC_NO_KILL": "set"} if no_kill else {})}
    holder = subprocess.Popen(
        lab.command(
            [
                "salloc",
                "--quiet",
                "--nodes=3",
                "sh",
                "-c",
                f"env -0 > {env_file}.tmp && mv {env_file}.tmp {env_file} && exec sleep 600",
            ]
        ),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(env_file.exists, "the allocation", limit_s=60)
        inside = dict(
            item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item
        )
        yield {**lab.env, **inside}
    finally:
        if env_file.exists():
            lab.run(["scancel", inside["SLURM_JOB_ID"]])
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def _node(lab: SlurmLab, name: str, state: str) -> None:
    """Set a node's state by scontrol, as an admin does (RESUME: back in service)."""
    argv = ["scontrol", "update", f"nodename={name}", f"state={state}"]
    done = lab.run(argv + (["reason=elastic test"] if state != "RESUME" else []))
    assert done.returncode == 0 or state == "RESUME", done.stderr


def _in_service(lab: SlurmLab, name: str) -> bool:
    """Whether the node is back (IDLE or in use, no DOWN or DRAIN flag)."""
    shown = parse_nodes(lab.run(["scontrol", "--oneliner", "show", "node", name]).stdout)
    return name in shown and not shown[name].lost()


@pytest.mark.quick
def test_no_kill_is_read_from_what_set_it() -> None:
    job = {"SLURM_JOB_ID": "12"}
    assert not has_no_kill(job)
    assert has_no_kill({**job, "SALLOC_NO_KILL": "set"})
    assert has_no_kill({**job, "SBATCH_NO_KILL": ""})
    assert not has_no_kill({**job, "SBATCH_NO_KILL": "off"})
    assert has_no_kill({**job, NO_KILL_ENV: "12"})
    # The batch script's word holds for its own job only.
    assert not has_no_kill({**job, NO_KILL_ENV: "11"})


@pytest.mark.quick
def test_lost_nodes_name_the_down_the_drained_and_the_removed() -> None:
    shown = parse_nodes(
        "NodeName=a Arch=x86_64 State=MIXED ThreadsPerCore=1\n"
        "NodeName=b State=IDLE+DRAIN Weight=1 Reason=disk full [root@2026-11-29T07:59:58]\n"
        "NodeName=c State=IDLE Weight=1\n"
    )
    assert parse_job("JobId=7 JobState=RUNNING Reason=None NodeList=a,b NumNodes=2") == (
        "RUNNING",
        "a,b",
    )
    lost = lost_nodes(("a", "b", "c"), frozenset({"a", "b"}), shown, "7")
    assert lost == {
        "b": "Slurm node b is IDLE+DRAIN (disk full)",
        "c": "Slurm node c left job 7 (State=IDLE): it does not come back to it",
    }


@pytest.mark.integration
def test_a_down_node_leaves_the_job_for_good_and_a_drained_one_comes_back(
    lab3: SlurmLab, tmp_path: Path
) -> None:
    """What `lost_hosts` and `probe` see, from a real job: a drained node is lost until it is
    RESUMEd, then takes a step again; a DOWN node leaves the job and never returns to it,
    even once back in service; SLURM_JOB_NODELIST goes stale meanwhile."""
    n1, n2, n3 = (n.name for n in lab3.nodes)
    with holding(lab3, tmp_path, no_kill=True) as env:
        alloc = Allocation(env["SLURM_JOB_ID"], (n1, n2, n3), {n1: 1, n2: 1, n3: 1}, False)
        watch = NodeWatch(alloc, poll_s=0.2, run=lambda argv: lab3.run(argv, timeout=60))
        try:
            assert watch.look() == {}
            assert watch.lost() == {}
            _node(lab3, n3, "DRAIN")
            drained = wait_for(watch.lost, "the drained node seen lost", limit_s=30)
            assert list(drained) == [n3]
            assert "DRAIN" in drained[n3] and "elastic test" in drained[n3]
            assert not watch.probe(n3)
            _node(lab3, n3, "RESUME")
            wait_for(lambda: watch.lost() == {}, "the resumed node back", limit_s=30)
            assert watch.probe(n3)

            _node(lab3, n2, "DOWN")
            # Seen DOWN first, maybe, then out of the job (Slurm's resize follows at once).
            wait_for(
                lambda: f"left job {alloc.job_id}" in watch.lost().get(n2, ""),
                "the DOWN node seen out of the job",
                limit_s=30,
            )
            assert list(watch.lost()) == [n2]
            assert not watch.probe(n2)
            # The job runs on without it; the environment's node list still names it.
            job = parse_job(
                lab3.run(["scontrol", "--oneliner", "show", "job", alloc.job_id]).stdout
            )
            assert job is not None and job[0] == "RUNNING"
            assert env["SLURM_JOB_NODELIST"].endswith("[1-3]")
            _node(lab3, n2, "RESUME")
            wait_for(lambda: _in_service(lab3, n2), "the node back in service", limit_s=30)
            # Back in service, but never in this job again.
            assert not watch.probe(n2)
            assert list(watch.look() or {}) == [n2]
            assert watch.probe(n1)
        finally:
            watch.close()
            _node(lab3, n2, "RESUME")
            _node(lab3, n3, "RESUME")


@pytest.mark.integration
def test_without_no_kill_a_down_node_ends_the_whole_job(lab3: SlurmLab, tmp_path: Path) -> None:
    """The reason an elastic run needs --no-kill: Slurm's default takes the whole job down."""
    n1, n2, n3 = (n.name for n in lab3.nodes)
    with holding(lab3, tmp_path, no_kill=False) as env:
        job = env["SLURM_JOB_ID"]
        _node(lab3, n3, "DOWN")
        try:
            ended = wait_for(
                lambda: (
                    (
                        parse_job(lab3.run(["scontrol", "--oneliner", "show", "job", job]).stdout)
                        or ("GONE", "")
                    )[0]
                    != "RUNNING"
                ),
                "the job ended by its node's failure",
                limit_s=30,
            )
            assert ended
        finally:
            _node(lab3, n3, "RESUME")
            wait_for(lambda: _in_service(lab3, n3), "the node back in service", limit_s=30)


SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(300)\n"


def _spec(folder: Path, tasks: dict, **fields) -> Path:
    spec = {
        "name": "elastic",
        "strategy": "multi_worker_mirrored",
        "backend": "slurm",
        "program": {"script": "task.py", "python": sys.executable},
        "tasks": tasks,
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
        **fields,
    }
    (folder / "task.py").write_text(SLEEPER)
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


@pytest.mark.integration
def test_a_node_that_leaves_the_job_keeps_none_of_the_runs_rules(
    lab3: SlurmLab, tmp_path: Path
) -> None:
    """Slurm SIGKILLs the run's agent on a node it takes from the job, so the agent cannot
    remove its firewall rules there: the launcher does, at the end, by a one-node job."""
    victim = lab3.nodes[2]
    spec = _spec(tmp_path, {"worker": {"count": 3}})
    with holding(lab3, tmp_path, no_kill=True) as env:
        launcher = subprocess.Popen(
            lab3.command([sys.executable, "-m", "distlaunch.launcher", "up", str(spec)]),
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_for(
                lambda: _rules_left(victim.netns), "the run's rules on the node", 120, launcher
            )
            wait_for(
                lambda: (
                    len(list(tmp_path.glob("runs/*/logs/attempt-0/worker-2.log"))) == 1
                    and "up"
                    in next(tmp_path.glob("runs/*/logs/attempt-0/worker-2.log")).read_text()
                ),
                "the task on the node",
                120,
                launcher,
            )
            _node(lab3, victim.name, "DOWN")
            out, _ = launcher.communicate(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
            _node(lab3, victim.name, "RESUME")
        assert launcher.returncode == 1, out
        assert f"lost the agent on node {victim.name}: srun: error: Node failure" in out
        assert (
            f"node {victim.name} left job {env['SLURM_JOB_ID']}: its firewall rules were removed "
            "by a one-node job" in out
        )
        assert not _rules_left(victim.netns)
        assert lab3.processes(victim) == []


ELASTIC = {"workers": "2:3"}


@pytest.mark.quick
def test_sbatch_submits_an_elastic_run_with_no_kill_and_says_so_to_the_launcher(
    tmp_path: Path,
) -> None:
    elastic = load_spec(_spec(tmp_path, {"worker": {"count": 3}}, elastic=ELASTIC))
    script = batch.script(elastic, "r", tmp_path / "r", batch.BatchRequest())
    assert "#SBATCH --no-kill\n" in script
    assert f'export {NO_KILL_ENV}="$SLURM_JOB_ID"\n' in script
    plain = load_spec(_spec(tmp_path, {"worker": {"count": 3}}))
    script = batch.script(plain, "r", tmp_path / "r", batch.BatchRequest())
    assert "--no-kill" not in script and NO_KILL_ENV not in script


@pytest.mark.integration
def test_an_elastic_run_in_a_job_a_node_failure_would_end_is_refused_in_one_line(
    lab3: SlurmLab, tmp_path: Path
) -> None:
    spec = _spec(tmp_path, {"worker": {"count": 3}}, elastic=ELASTIC)
    with holding(lab3, tmp_path, no_kill=False) as env:
        result = lab3.run(
            [sys.executable, "-m", "distlaunch.launcher", "up", str(spec)], cwd=tmp_path, env=env
        )
        assert result.returncode == 2, result.stderr + result.stdout
        assert result.stderr.strip().splitlines() == [
            f"distlaunch: error: elastic: Slurm job {env['SLURM_JOB_ID']} may end whole when one "
            "of its nodes fails (no --no-kill seen), so the run could not shrink; submit it with "
            "`distlaunch sbatch`, which adds --no-kill, or by hand with SBATCH_NO_KILL=set sbatch "
            "... / SALLOC_NO_KILL=set salloc ... (the same as -k, and the job can see it: Slurm "
            "shows -k nowhere a job can read)"
        ]
        # Nothing started: no step, no run.
        assert lab3.steps() == []
        assert not list(tmp_path.glob("runs/*/run.json"))


@pytest.mark.integration
def test_once_the_job_lost_a_node_the_agent_steps_share_cpus(
    lab3: SlurmLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step running on a node while Slurm takes another node out of the job keeps its CPUs
    in Slurm's books after it ends (an --exact step there then waits forever): after the loss
    the agents' steps overlap, and start."""
    n1, n2, n3 = (n.name for n in lab3.nodes)
    monkeypatch.setenv("SLURM_CONF", lab3.env["SLURM_CONF"])
    with holding(lab3, tmp_path, no_kill=True) as env:
        alloc = Allocation(env["SLURM_JOB_ID"], (n1, n2, n3), {n1: 1, n2: 1, n3: 1}, False)
        steps = StepTransport(alloc, "r", sys.executable, 1.0, None)
        try:
            before = steps.agent_command(n1).argv
            across = subprocess.Popen(
                lab3.command([*before[: before.index(sys.executable)], "sleep", "5"]),
                env=env,
                stderr=subprocess.DEVNULL,
            )
            wait_for(lambda: any(".agent-" in s for s in lab3.step_names().values()), "the step")
            _node(lab3, n3, "DOWN")
            wait_for(lambda: steps.nodes.in_job() == {n1, n2}, "the job without the node", 30)
            across.wait(timeout=60)
            after = steps.agent_command(n1).argv
            srun = list(after[: after.index(sys.executable)])
            assert "--exact" in before and "--overlap" not in before
            assert "--overlap" in srun and "--exact" not in srun
            done = lab3.run([*srun, "hostname"], env=env, timeout=60)
            assert done.returncode == 0 and done.stdout.strip() == n1, done.stderr
        finally:
            steps.close()
            _node(lab3, n3, "RESUME")
            wait_for(lambda: _in_service(lab3, n3), "the node back in service", limit_s=30)


# Long enough that the world of 2 trains a while after the loss; a global batch 2 and 3 divide.
EPOCH_LINE = re.compile(r"^epoch \d+/\d+ step (\d+) loss (\S+)", re.M)


def _epochs(run_dir: Path, attempt: int) -> list[tuple[int, float]]:
    log = run_dir / "logs" / f"attempt-{attempt}" / "worker-0.log"
    text = log.read_text() if log.exists() else ""
    return [(int(s), float(v)) for s, v in EPOCH_LINE.findall(text)]


def _resumed_at(run_dir: Path, attempt: int, task: str = "worker-0") -> int | None:
    log = run_dir / "logs" / f"attempt-{attempt}" / f"{task}.log"
    found = re.search(r"resumed from \S+ at step (\d+)", log.read_text() if log.exists() else "")
    return int(found.group(1)) if found else None


def _resized(run_dir: Path) -> list[dict]:
    return [e for e in events(run_dir) if e.get("event") == "resized"]


@contextmanager
def elastic_run(lab: SlurmLab, tmp: Path, epochs: int) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`up` of three dw.fit workers, one per node, range 2:3, in a --no-kill allocation, once
    it has trained past step 50 (a checkpoint every 25 steps): the launcher and its run dir.
    Its stderr goes to tmp/stderr.txt."""
    spec = _spec(
        tmp,
        {"worker": {"count": 3}},
        elastic={
            "workers": "2:3",
            "lost_after_s": 2,
            "settle_s": 1,
            "interval_s": 1,
            "cooldown_s": 1,
            "probe_s": 1,
        },
    )
    data = json.loads(spec.read_text())
    args = ["--epochs", str(epochs), "--steps-per-epoch", "25", "--checkpoint-every", "25"]
    data["program"] = {
        "module": "distlaunch.worker.examples.mnist_mlp",
        "args": [*args, "--global-batch-size", "48"],
        "python": sys.executable,
    }
    spec.write_text(json.dumps(data))
    with holding(lab, tmp, no_kill=True) as env, open(tmp / "stderr.txt", "w") as err:
        launcher = subprocess.Popen(
            lab.command([sys.executable, "-m", "distlaunch.launcher", "up", str(spec)]),
            env=env,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            run_dir = wait_for_run_dir(tmp / "runs", launcher)
            wait_for(
                lambda: [s for s, _ in _epochs(run_dir, 0) if s >= 50], "step 50", 300, launcher
            )
            yield launcher, run_dir
            launcher.wait(timeout=600)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
            for node in lab.nodes:
                _node(lab, node.name, "RESUME")


@pytest.mark.integration
def test_a_node_set_down_shrinks_the_world_and_the_run_finishes(
    lab3: SlurmLab, tmp_path: Path
) -> None:
    """Three nodes, one dw.fit worker each, range 2:3: a node set DOWN by scontrol mid-epoch;
    the run goes on in a world of 2 from the latest checkpoint and finishes, and nothing of it
    is left on the DOWN node."""
    n1, n2, n3 = lab3.nodes
    with elastic_run(lab3, tmp_path, epochs=8) as (launcher, run_dir):
        _node(lab3, n3.name, "DOWN")
        [shrink] = wait_for(lambda: _resized(run_dir), "the world to shrink", 240, launcher)
    said = (tmp_path / "stderr.txt").read_text()
    assert launcher.returncode == 0, said[-4000:]
    assert (shrink["old"], shrink["new"]) == (3, 2)
    assert shrink["hosts"] == [n1.name, n2.name]
    assert n3.name in shrink["reason"], shrink
    resumed = _resumed_at(run_dir, shrink["attempt"])
    assert shrink["step"] == resumed >= 50  # from the latest checkpoint
    assert "worlds: 3 -> 2 (elastic.workers 2:3, 1 resizes)" in said
    # The loss goes on from the checkpoint's: nearer the loss at that step than the first.
    before = dict(_epochs(run_dir, 0))
    after = _epochs(run_dir, shrink["attempt"])[0][1]
    assert abs(after - before[resumed]) < abs(after - next(iter(before.values())))
    # Nothing of the run on the DOWN node: no process, no firewall rule (a one-node job of the
    # launcher's removed them: Slurm SIGKILLed the run's agent there).
    job = json.loads((run_dir / "run.json").read_text())["slurm"]["job_id"]
    assert f"node {n3.name} left job {job}: its firewall rules were removed" in said
    assert lab3.processes(n3) == []
    assert not _rules_left(n3.netns)
    wait_for(lambda: _in_service(lab3, n3.name), "the node back in service", limit_s=30)


@pytest.mark.integration
def test_a_drained_node_resumed_grows_the_world_back_with_no_step_lost(
    lab3: SlurmLab, tmp_path: Path
) -> None:
    """Slurm's one way back into a job: a drained node stays in it. The run shrinks off the
    drained node, and once it is RESUMEd grows back onto it at a step the workers agree on."""
    n3 = lab3.nodes[2]
    with elastic_run(lab3, tmp_path, epochs=8) as (launcher, run_dir):
        _node(lab3, n3.name, "DRAIN")
        [shrink] = wait_for(lambda: _resized(run_dir), "the world to shrink", 240, launcher)
        _node(lab3, n3.name, "RESUME")
        [_, grow] = wait_for(lambda: _resized(run_dir)[1:] and _resized(run_dir), "the grow", 300)
    said = (tmp_path / "stderr.txt").read_text()
    assert launcher.returncode == 0, said[-4000:]
    assert f"Slurm node {n3.name} is " in shrink["reason"]
    assert "DRAIN (elastic test)" in shrink["reason"]
    assert (grow["old"], grow["new"]) == (2, 3)
    assert f"{n3.name} answers again" in grow["reason"]
    # The save at the agreed step is the step the world of 3 starts from: 0 steps lost.
    saved = {
        e.get("saved_step")
        for e in events(run_dir)
        if e.get("event") == "exited" and e.get("attempt") == shrink["attempt"]
    }
    assert saved == {grow["step"]}, saved
    assert _resumed_at(run_dir, grow["attempt"], "worker-2") == grow["step"]
    assert "worlds: 3 -> 2 -> 3 (elastic.workers 2:3, 2 resizes)" in said
