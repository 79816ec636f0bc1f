"""The Slurm backend against a real Slurm cluster on this machine (tests/slurmcluster.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest

from conftest import (
    events,
    only_run_dir,
    processes_of_run,
    run_record,
    wait_for,
    wait_for_run_dir,
)
from slurmcluster import SlurmLab
from test_firewall import _rules_left


@pytest.fixture(scope="module")
def lab(slurm_lab):
    """The module's Slurm cluster (conftest's slurm_lab)."""
    return slurm_lab


def test_the_lab_runs_a_step_on_both_nodes(lab: SlurmLab) -> None:
    done = lab.run(["srun", "-N2", "-n2", "-l", "hostname"])
    assert done.returncode == 0, done.stderr
    assert sorted(line.split(": ", 1)[1] for line in done.stdout.splitlines()) == [
        n.name for n in lab.nodes
    ]


MNIST = {
    "module": "distlaunch.worker.examples.mnist_mlp",
    "args": ["--epochs", "1", "--steps-per-epoch", "5"],
}


def _spec(folder: Path, program: dict, tasks: dict, **fields) -> Path:
    spec = {
        "name": "slurm",
        "strategy": "multi_worker_mirrored",
        "backend": "slurm",
        "program": {**program, "python": sys.executable},
        "tasks": tasks,
        "shared_dir": "runs",
        "timeouts": {"grace_s": 2, "startup_s": 120},
        **fields,
    }
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2))
    return path


def _launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "distlaunch.launcher", *args]


def _task_steps(lab: SlurmLab) -> list[str]:
    """The job steps of tasks (JOB.STEP): every step but the runs' firewall guards."""
    return [i for i, name in lab.step_names().items() if ".guard." not in name]


def _no_rules(lab: SlurmLab) -> bool:
    """No nftables table or iptables chain of any run in any node's namespace."""
    return not any(_rules_left(node.netns) for node in lab.nodes)


def _nothing_left(lab: SlurmLab, run_id: str) -> bool:
    """No job step and no process (but the Slurm daemons) on any node; no local srun of the run."""
    if lab.steps() or any(lab.processes(node) for node in lab.nodes):
        return False
    return not processes_of_run(run_id)


@pytest.mark.integration
def test_mwms_across_two_nodes_inside_salloc(lab: SlurmLab, tmp: Path) -> None:
    spec = _spec(tmp, MNIST, {"worker": {"count": 2}})
    result = lab.run(
        ["salloc", "--nodes=2", "--quiet", *_launcher("up", str(spec))],
        cwd=tmp,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(tmp / "runs")
    record = run_record(run_dir)
    cluster = record["plan"]["tasks"][0]["tf_config"]["cluster"]["worker"]
    # Spread over the nodes, named by hostname.
    assert [a.split(":")[0] for a in cluster] == [n.name for n in lab.nodes]
    losses = sorted(line for line in result.stdout.splitlines() if "final loss" in line)
    assert len(losses) == 2
    assert losses[0].startswith(f"worker-0@{lab.nodes[0].name} ") and losses[1].startswith(
        f"worker-1@{lab.nodes[1].name} "
    )
    assert losses[0].split("final loss")[1] == losses[1].split("final loss")[1]
    assert list((run_dir / "checkpoints").iterdir())
    # Protected by default: each node's guard held its table for the run, and took it away.
    assert all(h["protected"] for h in record["network"]["hosts"].values())
    assert _no_rules(lab)
    wait_for(
        lambda: _nothing_left(lab, record["run_id"]),
        "no step or process left",
        limit_s=30,
    )


@contextmanager
def _allocation(lab: SlurmLab, tmp: Path, *salloc_args: str) -> Iterator[dict[str, str]]:
    """Hold an allocation (salloc running a sleep) and yield the environment a shell inside it has,
    so a launcher can be started, killed and looked after while the allocation lives on."""
    env_file = tmp / "alloc.env"
    holder = subprocess.Popen(
        lab.command(
            [
                "salloc",
                "--quiet",
                *salloc_args,
                "sh",
                "-c",
                (
                    f"echo $$ > {env_file}.pid && env -0 > {env_file}.tmp && mv {env_file}.tmp "
                    f"{env_file} && exec sleep 600"
                ),
            ]
        ),
        env=lab.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(env_file.exists, "the allocation", limit_s=60)
        inside = dict(
            item.split("=", 1) for item in env_file.read_text().split("\0") if "=" in item
        )
        yield {**lab.env, **{k: v for k, v in inside.items() if k.startswith("SLURM_")}}
    finally:
        lab.run(["scancel", inside.get("SLURM_JOB_ID", "none")] if env_file.exists() else ["true"])
        # salloc outlives its cancelled job until its command ends (which is in a process group
        # of its own): end them both.
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        if Path(f"{env_file}.pid").exists():
            try:
                os.kill(int(Path(f"{env_file}.pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_outside_an_allocation_up_says_so_in_one_line(lab: SlurmLab, tmp: Path) -> None:
    (tmp / "task.py").write_text("print('never')\n")
    result = lab.run(
        _launcher("up", str(_spec(tmp, {"script": "task.py"}, {"worker": {"count": 2}}))),
        cwd=tmp,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        (
            "distlaunch: error: not inside a Slurm allocation (SLURM_JOB_ID is not set): run `up --backend slurm` under "
            "`salloc -N NODES` or in a batch script, or submit it with `distlaunch sbatch SPEC`"
        )
    ]
    assert not (tmp / "runs").exists() or not any((tmp / "runs").iterdir())


def test_bad_placement_and_node_problems_are_one_line_each_and_start_nothing(
    lab: SlurmLab, tmp: Path
) -> None:
    (tmp / "task.py").write_text("print('never')\n")
    node1, node2 = (n.name for n in lab.nodes)
    with _allocation(lab, tmp, "--nodes=2") as env:  # one CPU on each node
        too_many = _spec(tmp, {"script": "task.py"}, {"worker": {"count": 3}})
        result = lab.run(_launcher("up", str(too_many)), cwd=tmp, env=env)
        assert result.returncode == 2, result.stderr
        assert (
            f"3 tasks need 3 CPUs, but job {env['SLURM_JOB_ID']} has 2 on 2 nodes" in result.stderr
        )
        assert "Traceback" not in result.stderr

        crowded = _spec(tmp, {"script": "task.py"}, {"worker": [{"host": node1}, {"host": node1}]})
        result = lab.run(_launcher("up", str(crowded)), cwd=tmp, env=env)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines()[1:] == [
            f"  node {node1}: 2 tasks placed there but job {env['SLURM_JOB_ID']} has 1 CPUs on it; place fewer tasks there"
        ]

        unknown = _spec(
            tmp,
            {"script": "task.py"},
            {"worker": [{"host": node1}, {"host": "nowhere"}]},
        )
        result = lab.run(_launcher("up", str(unknown)), cwd=tmp, env=env)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines()[1:] == [
            f"  $.tasks.worker[1].host: node 'nowhere' is not in the allocation; expected one of: {node1}, {node2}"
        ]

        # A port taken on node 2 and a shared dir that the nodes do not see.
        squatter = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                lab.nodes[1].netns,
                sys.executable,
                "-c",
                "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 23456)); s.listen(); time.sleep(60)",
            ]
        )
        try:
            wait_for(
                lambda: "23456" in lab.run_in(lab.nodes[1], ["ss", "-ltn"]).stdout,
                "the squatter",
            )
            workers = {"worker": [{"host": node1}, {"host": node2, "port": 23456}]}
            # Node 1 passes: its probe goes on as its firewall guard, and must end with the run.
            one_bad = lab.run(
                _launcher("up", str(_spec(tmp, {"script": "task.py"}, workers))), cwd=tmp, env=env
            )
            spec = _spec(tmp, {"script": "task.py"}, workers, shared_dir=str(lab.private_dir))
            result = lab.run(_launcher("up", str(spec)), cwd=tmp, env=env)
        finally:
            squatter.kill()
            squatter.wait()
        assert one_bad.returncode == 2, one_bad.stderr
        assert one_bad.stderr.strip().splitlines() == [
            "distlaunch: error: preflight failed on 1 of 2 Slurm nodes; nothing was started:",
            f'  node {node2}: port 23456 is in use here; expected a free port or "auto"',
        ]
        assert lab.processes(lab.nodes[0]) == []
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert (
            lines[0]
            == "distlaunch: error: preflight failed on 2 of 2 Slurm nodes; nothing was started:"
        )
        assert f'  node {node2}: port 23456 is in use here; expected a free port or "auto"' in lines
        assert sum("is not shared with the launcher" in line for line in lines) == 2
        assert len(lines) == 4
        assert lab.steps() == []


# Holds its TF_CONFIG port like a TensorFlow server, and forks a child that would outlive it.
SERVER = """
import json, os, socket, subprocess, sys, time
config = json.loads(os.environ["TF_CONFIG"])
role, index = config["task"]["type"], config["task"]["index"]
server = socket.socket()
server.bind(("0.0.0.0", int(config["cluster"][role][index].rsplit(":", 1)[1])))
server.listen()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("serving", flush=True)
time.sleep(600)
"""


@pytest.mark.integration
def test_a_sigkilled_launcher_leaves_no_step_and_no_process_on_any_node(
    lab: SlurmLab, tmp: Path
) -> None:
    from distlaunch.host import remote

    (tmp / "server.py").write_text(SERVER)
    spec = _spec(tmp, {"script": "server.py"}, {"worker": {"count": 2}})
    with _allocation(lab, tmp, "--nodes=2") as env:
        with open(tmp / "out.txt", "w") as out:
            launcher = subprocess.Popen(
                lab.command(_launcher("up", str(spec))),
                cwd=tmp,
                env=env,
                stdout=out,
                stderr=out,
            )
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        wait_for(
            lambda: sum(e["event"] == "joined" for e in events(run_dir)) == 2,
            "both tasks to join",
            launcher=launcher,
        )
        assert len(_task_steps(lab)) == 2 and len(lab.steps()) == 2  # the agents are the guards
        assert all(len(lab.processes(node)) >= 3 for node in lab.nodes)  # helper, task, its child
        # Each step's agent runs by the path the node's preflight found, without site-packages,
        # and each task's helper is a fork of it (no interpreter of its own to start).
        agents = [
            p.cmdline()[1:]
            for node in lab.nodes
            for p in lab.processes(node)
            if p.cmdline()[-1:] == [str(Path(remote.__file__).with_name("agent.py"))]
        ]
        assert agents == [["-I", "-S", str(Path(remote.__file__).with_name("agent.py"))]] * 2
        helpers = [
            p
            for node in lab.nodes
            for p in lab.processes(node)
            if " ".join(p.cmdline()).startswith("distlaunch.host.remote: keeper of task ")
        ]
        assert len(helpers) == 2
        # No preflight probe goes on as a guard (python -c PROBE): the agent is the node's.
        guards = [
            p
            for node in lab.nodes
            for p in lab.processes(node)
            if p.cmdline()[1:2] == ["-c"] and "then_guard" in p.cmdline()[-1]
        ]
        assert len(guards) == 0
        launcher.kill()
        launcher.wait()
        wait_for(
            lambda: _nothing_left(lab, run_record(run_dir)["run_id"]),
            "no step or process left",
            limit_s=60,
        )
        assert _no_rules(lab)
        assert lab.jobs() == [env["SLURM_JOB_ID"]]  # the allocation itself lives on


@pytest.mark.integration
def test_down_cancels_the_steps_a_killed_launcher_and_its_sruns_left(
    lab: SlurmLab, tmp: Path
) -> None:
    (tmp / "server.py").write_text(SERVER)
    spec = _spec(tmp, {"script": "server.py"}, {"worker": {"count": 2}})
    with _allocation(lab, tmp, "--nodes=2") as env:
        with open(tmp / "out.txt", "w") as out:
            launcher = subprocess.Popen(
                lab.command(_launcher("up", str(spec))),
                cwd=tmp,
                env=env,
                stdout=out,
                stderr=out,
            )
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        wait_for(
            lambda: sum(e["event"] == "joined" for e in events(run_dir)) == 2,
            "both tasks to join",
            launcher=launcher,
        )
        # SIGKILL of srun leaves its step running (nobody tells slurmstepd): here, of both sruns.
        for proc in processes_of_run(run_dir.name):
            # A short-lived process of the run may be gone between the listing and this look.
            with suppress(psutil.NoSuchProcess):
                if proc.name() == "srun":
                    proc.kill()
        launcher.kill()
        launcher.wait()
        steps = lab.steps()
        assert len(_task_steps(lab)) == 2 and len(steps) == 2  # the agents', which are the guards
        assert all(_rules_left(node.netns) for node in lab.nodes)
        result = lab.run(_launcher("down", str(run_dir)), cwd=tmp, env=env)
        assert result.returncode == 0, result.stderr
        # A step whose srun was killed may still end by itself before `down` looks (its
        # slurmstepd loses the I/O peer; seen under load): down cancels those left, no others.
        cancelled = re.search(r"cancelled Slurm ([\d. ]+)", result.stdout)
        assert cancelled and set(cancelled.group(1).split()) <= set(steps), result.stdout
        # The agents were asked with SIGHUP (a cancelled step is SIGKILLed): their rules are gone.
        assert _no_rules(lab)
        wait_for(
            lambda: _nothing_left(lab, run_dir.name),
            "no step or process left",
            limit_s=60,
        )
        assert run_record(run_dir)["state"] == "interrupted"


@pytest.mark.integration
def test_pss_chief_workers_and_ps_across_nodes(lab: SlurmLab, tmp: Path) -> None:
    from test_ssh import PS_JOB

    (tmp / "ps_job.py").write_text(PS_JOB)
    tasks = {"chief": {"count": 1}, "worker": {"count": 2}, "ps": {"count": 1}}
    spec = _spec(tmp, {"script": "ps_job.py"}, tasks, strategy="parameter_server")
    result = lab.run(
        [
            "salloc",
            "--nodes=2",
            "--ntasks-per-node=2",
            "--quiet",
            *_launcher("up", str(spec)),
        ],
        cwd=tmp,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    record = run_record(only_run_dir(tmp / "runs"))
    hosts = {t["name"]: t["host"] for t in record["plan"]["tasks"]}
    node1, node2 = (n.name for n in lab.nodes)
    # Spread in TF_CONFIG order: chief, worker 0, worker 1, ps.
    assert hosts == {
        "chief-0": node1,
        "worker-0": node2,
        "worker-1": node1,
        "ps-0": node2,
    }
    assert any(
        line.startswith(f"chief-0@{node1} ") and line.endswith("| total 8.0")
        for line in result.stdout.splitlines()
    )
    wait_for(
        lambda: _nothing_left(lab, record["run_id"]),
        "no step or process left",
        limit_s=30,
    )


@pytest.mark.integration
def test_a_worker_killed_on_its_node_is_restarted_and_training_resumes(
    lab: SlurmLab, tmp: Path
) -> None:
    args = ["--epochs", "3", "--steps-per-epoch", "20", "--checkpoint-every", "10"]
    spec = _spec(
        tmp,
        {**MNIST, "args": args},
        {"worker": {"count": 2}},
        restart={"policy": "on-failure", "max_restarts": 2},
    )
    with _allocation(lab, tmp, "--nodes=2") as env:
        with open(tmp / "out.txt", "w") as out:
            launcher = subprocess.Popen(
                lab.command(_launcher("up", str(spec))),
                cwd=tmp,
                env=env,
                stdout=out,
                stderr=out,
            )
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        wait_for(
            lambda: (run_dir / "checkpoints" / "checkpoint").exists(),
            "a first checkpoint",
            launcher=launcher,
        )
        node2 = lab.nodes[1]
        # The task's program, not its warm standby (the same command line: only its initial
        # environment names DISTLAUNCH_STANDBY).
        victim = [
            p
            for p in lab.processes(node2)
            if "distlaunch.worker.examples.mnist_mlp" in p.cmdline()
            and b"DISTLAUNCH_STANDBY=" not in Path(f"/proc/{p.pid}/environ").read_bytes()
        ]
        assert len(victim) == 1
        victim[0].kill()
        launcher.wait(timeout=300)
        output = (tmp / "out.txt").read_text()
        assert launcher.returncode == 0, output[-3000:]
    record = run_record(run_dir)
    assert record["attempt"] == 1 and {t["restarts"] for t in record["tasks"].values()} == {1}
    decision = next(e for e in events(run_dir) if e.get("decision") == "restart")
    assert decision["task"] == "worker-1" and "restarting worker-0, worker-1" in decision["reason"]
    for task in ("worker-0", "worker-1"):
        assert "resumed from" in (run_dir / "logs" / "attempt-1" / f"{task}.log").read_text()
    assert json.loads((run_dir / "metrics" / "worker-0.json").read_text())[-1]["step"] == 60
    wait_for(
        lambda: _nothing_left(lab, record["run_id"]),
        "no step or process left",
        limit_s=30,
    )


def _job_state(lab: SlurmLab, job: str) -> str:
    """The job's state as scontrol tells it (it remembers finished jobs for MinJobAge)."""
    out = lab.run(["scontrol", "--oneliner", "show", "job", job]).stdout
    found = re.search(r"\bJobState=(\S+)", out)
    return found.group(1) if found else ""


def _submit(lab: SlurmLab, tmp: Path, spec: Path, *args: str) -> tuple[str, Path]:
    result = lab.run(_launcher("sbatch", str(spec), *args), cwd=tmp)
    assert result.returncode == 0, result.stderr
    found = re.search(r"submitted Slurm job (\d+) for run (\S+); run dir (\S+)", result.stdout)
    assert found, result.stdout
    return found.group(1), Path(found.group(3))


@pytest.mark.integration
def test_sbatch_runs_the_job_and_a_requeue_after_the_pre_timeout_signal_resumes_it(
    lab: SlurmLab, tmp: Path
) -> None:
    args = ["--epochs", "3", "--steps-per-epoch", "20", "--checkpoint-every", "10"]
    spec = _spec(tmp, {**MNIST, "args": args}, {"worker": {"count": 2}})
    extra = ("--", "--comment=distlaunch-test")
    job, run_dir = _submit(lab, tmp, spec, "--nodes", "2", "--requeue", "--time", "30", *extra)
    script = (run_dir / "job.sbatch").read_text()
    for line in (
        "--nodes=2",
        "--time=30",
        "--requeue",
        # timeouts.save_s (default 30) + grace_s (2) + 15
        "--signal=B:USR2@47",
        "--comment=distlaunch-test",
    ):
        assert f"#SBATCH {line}\n" in script
    started = time.monotonic()
    wait_for(lambda: (run_dir / "checkpoints" / "checkpoint").exists(), "a first checkpoint")
    # What Slurm sends the batch shell --signal-before seconds before the time limit (its timing
    # is only accurate to a minute, so the test sends it itself).
    signalled = lab.run(["scancel", "--batch", "--signal=USR2", job])
    assert signalled.returncode == 0, signalled.stderr
    print(f"checkpoint and signal after {time.monotonic() - started:.0f} s")

    pending_since: list[float] = []

    def resumed_and_done() -> bool:
        if _job_state(lab, job) == "PENDING":
            # Slurm holds a requeued job back a while (BeginTime); the test skips most of that
            # wait, but not all: job credentials carry whole seconds, and a restart within the
            # second of the requeue gets a credential slurmd still counts as revoked ("Job
            # credential revoked": the batch job dies before the launcher starts).
            pending_since[:1] = pending_since[:1] or [time.monotonic()]
            if time.monotonic() - pending_since[0] > 2.0:
                lab.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        record = run_record(run_dir)
        return record.get("attempt") == 1 and record.get("state") == "succeeded"

    try:
        wait_for(resumed_and_done, "the requeued job to finish the run", limit_s=600)
    except BaseException:
        # The evidence, shown with the failure: the job as Slurm sees it and the launcher's output.
        print(lab.run(["scontrol", "--oneliner", "show", "job", job]).stdout)
        print(run_record(run_dir).get("state"), run_record(run_dir).get("attempt"))
        print((run_dir / f"slurm-{job}.out").read_text(errors="replace")[-4000:])
        print(lab.log("slurmctld")[-3000:])
        raise
    print(f"resumed run done after {time.monotonic() - started:.0f} s")
    record = run_record(run_dir)
    assert record["slurm"]["job_id"] == job and record["slurm"]["submitted"]
    # The signal was a stop notice: the tasks saved on it (tests/test_slurm_preemption.py).
    assert record["history"][0]["state"] == "preempted"
    for task in ("worker-0", "worker-1"):
        assert "resumed from" in (run_dir / "logs" / "attempt-1" / f"{task}.log").read_text()
    assert json.loads((run_dir / "metrics" / "worker-0.json").read_text())[-1]["step"] == 60
    assert (run_dir / "checkpoints" / "checkpoint").exists()

    # The launcher records the run's end just before it prints it.
    def ended() -> str | None:
        text = (run_dir / f"slurm-{job}.out").read_text()
        return text if f"run {record['run_id']} succeeded" in text else None

    out = wait_for(ended, "the launcher's last line")
    assert "tasks saved on the stop notice; requeueing job" in out
    wait_for(lambda: _job_state(lab, job) == "COMPLETED", "the job to complete")
    wait_for(
        lambda: _nothing_left(lab, record["run_id"]),
        "no step or process left",
        limit_s=30,
    )


@pytest.mark.integration
def test_status_logs_restart_and_down_work_on_a_slurm_run(lab: SlurmLab, tmp: Path) -> None:
    (tmp / "server.py").write_text(SERVER)
    spec = _spec(tmp, {"script": "server.py"}, {"worker": {"count": 2}})
    with _allocation(lab, tmp, "--nodes=2") as env:
        with open(tmp / "out.txt", "w") as out:
            launcher = subprocess.Popen(
                lab.command(_launcher("up", str(spec))),
                cwd=tmp,
                env=env,
                stdout=out,
                stderr=out,
            )
        run_dir = wait_for_run_dir(tmp / "runs", launcher)
        wait_for(
            lambda: sum(e["event"] == "joined" for e in events(run_dir)) == 2,
            "both tasks to join",
            launcher=launcher,
        )
        status = lab.run(_launcher("status", str(run_dir)), cwd=tmp, env=env)
        rows = [line.split() for line in status.stdout.splitlines() if line.startswith("  worker-")]
        assert status.returncode == 0 and [r[1] for r in rows] == [
            "running",
            "running",
        ], status.stdout
        logs = lab.run(_launcher("logs", str(run_dir)), cwd=tmp, env=env)
        assert "worker-0 | serving" in logs.stdout and "worker-1 | serving" in logs.stdout
        first_steps = set(_task_steps(lab))
        restart = lab.run(_launcher("restart", str(run_dir), "worker-1"), cwd=tmp, env=env)
        assert restart.returncode == 0, restart.stderr
        # An MWMS task restarts the gang: both old steps are killed, both tasks come back as new steps
        # that get their ports back.
        wait_for(
            lambda: sum(e["event"] == "joined" for e in events(run_dir)) == 4,
            "both tasks to join again",
            launcher=launcher,
        )
        steps = set(_task_steps(lab))
        assert len(steps) == 2 and not steps & first_steps
        down = lab.run(_launcher("down", str(run_dir)), cwd=tmp, env=env)
        assert down.returncode == 0 and "stopped its launcher" in down.stdout, (
            down.stdout + down.stderr
        )
        launcher.wait(timeout=60)
        assert _no_rules(lab)
        wait_for(
            lambda: _nothing_left(lab, run_dir.name),
            "no step or process left",
            limit_s=60,
        )
        assert run_record(run_dir)["state"] == "interrupted"


def test_a_nodes_agent_step_holds_its_tasks_gpus_and_each_task_gets_its_share(
    tmp: Path,
) -> None:
    """Changed by issue 48: the plan still leaves CUDA_VISIBLE_DEVICES of a GPU task unset (the
    devices are Slurm's to pick), but the task's request names its share of the agent step's
    list, so tasks of one node no longer all see all of its GPUs (tests/test_slurm_gpus.py runs
    it on GRES GPUs)."""
    from distlaunch.host import gpu_share
    from distlaunch.launcher.spec.model import load_spec
    from distlaunch.launcher.transports.slurm import allocation, transport
    from distlaunch.launcher.transports.slurm.agent_step import StepTransport

    (tmp / "task.py").write_text("")
    tasks = {"worker": [{"gpus": 2, "host": "a"}, {"gpus": 2, "host": "a"}, {"host": "b"}]}
    loaded = load_spec(_spec(tmp, {"script": "task.py"}, tasks))
    alloc = allocation.Allocation("7", ("a", "b"), {"a": 2, "b": 1}, submitted=False)
    placement = allocation.place(loaded, alloc)
    ports = {("worker", i): 1111 * (i + 1) for i in range(3)}
    plan = transport.slurm_plan(loaded, placement, ports, "r", tmp / "r")
    first, second, cpu = plan.tasks
    assert "CUDA_VISIBLE_DEVICES" not in first.env and cpu.env["CUDA_VISIBLE_DEVICES"] == ""
    steps = StepTransport(alloc, "r", sys.executable, 2.0, None, tasks=plan.tasks)
    assert "--gpus-per-task=4" in steps.agent_command("a").argv
    assert not any("--gpus" in a for a in steps.agent_command("b").argv)
    assert steps.request(first)[gpu_share.SHARE] == [0, 1]
    assert steps.request(second)[gpu_share.SHARE] == [2, 3]
    assert gpu_share.SHARE not in steps.request(cpu)
    assert first.tf_config["cluster"]["worker"] == ["a:1111", "a:2222", "b:3333"]
    indices = _spec(tmp, {"script": "task.py"}, {"worker": [{"gpus": [0]}, {}]})
    result = subprocess.run(
        _launcher("validate", str(indices)), capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"distlaunch: error: {indices}: $.tasks.worker[0].gpus: expected a GPU count under Slurm "
        "(it picks the devices), got the list [0]"
    )


def test_the_helper_runs_by_path_without_site_packages_or_else_as_a_module() -> None:
    from distlaunch.launcher.transports.slurm import steps as slurm

    path = "/opt/venv/lib/python3.11/site-packages/distlaunch/launcher/host/remote.py"
    assert slurm.helper_argv("py", path) == ["py", "-I", "-S", path]
    module = ["py", "-m", "distlaunch.host.remote"]
    assert slurm.helper_argv("py", None) == module
    assert slurm.helper_argv("py", "/opt/distlaunch.zip/distlaunch/worker/remote.pyc") == module


def test_placement_spreads_by_default_packs_with_tasks_per_node_and_honours_a_named_node(
    tmp: Path,
) -> None:
    from distlaunch.launcher.spec.model import load_spec
    from distlaunch.launcher.transports.slurm import allocation as slurm

    (tmp / "task.py").write_text("")
    alloc = slurm.Allocation("7", ("a", "b", "c"), {"a": 2, "b": 2, "c": 2}, submitted=False)
    tasks = {"chief": [{"host": "c"}], "worker": {"count": 3}}
    spread = slurm.place(load_spec(_spec(tmp, {"script": "task.py"}, tasks)), alloc)
    assert spread == {
        ("chief", 0): "c",
        ("worker", 0): "a",
        ("worker", 1): "b",
        ("worker", 2): "a",
    }
    packed = load_spec(_spec(tmp, {"script": "task.py"}, tasks, slurm={"tasks_per_node": 2}))
    assert slurm.place(packed, alloc) == {
        ("chief", 0): "c",
        ("worker", 0): "a",
        ("worker", 1): "a",
        ("worker", 2): "b",
    }
    assert slurm.cpus_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    assert slurm.cpus_per_node("", 2) == [1, 1]


@pytest.mark.integration
def test_down_on_a_submitted_run_cancels_its_job(lab: SlurmLab, tmp: Path) -> None:
    (tmp / "server.py").write_text(SERVER)
    spec = _spec(tmp, {"script": "server.py"}, {"worker": {"count": 2}})
    job, run_dir = _submit(lab, tmp, spec, "--nodes", "2")
    wait_for(lambda: sum(e["event"] == "joined" for e in events(run_dir)), "a task to join")
    down = lab.run(_launcher("down", str(run_dir)), cwd=tmp)
    assert down.returncode == 0, down.stderr
    assert re.search(rf"cancelled Slurm (\S+ )*{job}\b", down.stdout), down.stdout
    wait_for(lambda: job not in lab.jobs(), "the job to leave the queue", limit_s=60)
    wait_for(lambda: _nothing_left(lab, run_dir.name), "no step or process left", limit_s=60)


@pytest.mark.integration
def test_tasks_sharing_a_node_run_on_the_cpus_the_plan_gives_them(lab: SlurmLab, tmp: Path) -> None:
    from test_cpus import SEEN, seen_by_tasks

    (tmp / "task.py").write_text(SEEN)
    program = {"script": "task.py", "env": {"TF_NUM_INTRAOP_THREADS": "3"}}
    spec = _spec(tmp, program, {"worker": {"count": 2}})
    salloc = ["salloc", "--nodes=1", "--ntasks=2", "--quiet"]
    dry = lab.run([*salloc, *_launcher("plan", "--json", str(spec))], cwd=tmp, timeout=120)
    assert dry.returncode == 0, dry.stderr
    # Before the node's probe, the counts are known (Slurm may pick which CPUs).
    assert [t["cpus"]["count"] for t in json.loads(dry.stdout)["tasks"]] == [1, 1]
    result = lab.run([*salloc, *_launcher("up", str(spec))], cwd=tmp, timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(tmp / "runs")
    pairs = seen_by_tasks(run_dir, run_record(run_dir)["plan"])
    for task, seen in pairs:
        assert seen["affinity"] == task["cpus"]["ids"] and len(seen["affinity"]) == 1
        assert (
            seen["threads"]
            == task["threads"]
            == {
                "TF_NUM_INTRAOP_THREADS": "3",
                "TF_NUM_INTEROP_THREADS": "2",  # never 1 (cpu_fit.MIN_INTEROP_THREADS)
                "OMP_NUM_THREADS": "1",
            }
        )
    assert pairs[0][1]["affinity"] != pairs[1][1]["affinity"]
    assert "cpus: 2 tasks on " in result.stderr and "1 CPU each (auto)" in result.stderr
    assert "cpu-bind" not in result.stderr + result.stdout  # no warning from srun
