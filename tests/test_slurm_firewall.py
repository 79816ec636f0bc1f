"""The per-run firewall on Slurm nodes: a guard per node, as a job step
(launcher/transports/slurm/).

On the Slurm test cluster of tests/slurmcluster.py, the outsider (a namespace on the nodes' bridge
that is no part of the cluster) cannot connect to a task port while the nodes and the launcher
can; no rule of the run is left on any node after `kill -9` of the launcher; a node where the
tasks' user lacks CAP_NET_ADMIN is named open (`auto`) or refuses the run (`required`); `down`
removes what a SIGKILLed guard left. The orderly end and `distlaunch down` of whole runs are
checked in tests/test_slurm.py's runs, which are protected by default.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import standins

from conftest import events, run_record, wait_for, wait_for_run_dir
from distlaunch.launcher.transports.slurm.allocation import SAVE_MARGIN_S, kill_wait
from slurmcluster import KILL_WAIT_S, SlurmLab
from test_firewall import LISTENER, _rules_left, _without_net_admin
from test_slurm import _allocation, _launcher, _no_rules, _nothing_left, _spec, _submit
from test_slurm import lab as lab  # noqa: F401  (the module's cluster fixture)


def _tables(lab: SlurmLab) -> dict[str, list[str]]:
    """The run tables and chains (nftables, iptables) in each node's namespace."""
    return {node.name: _rules_left(node.netns) for node in lab.nodes}


@pytest.mark.integration
def test_outsider_is_shut_out_while_nodes_connect_and_kill_9_leaves_no_rule(
    lab: SlurmLab, tmp: Path
) -> None:
    (tmp / "listener.py").write_text(LISTENER)
    spec = _spec(tmp, {"script": "listener.py"}, {"worker": {"count": 2}})
    node1, node2 = lab.nodes
    with _allocation(lab, tmp, "--nodes=2") as env:
        plan = lab.run(_launcher("plan", str(spec)), cwd=tmp, env=env)
        assert plan.returncode == 0, plan.stderr
        rule = next(line for line in plan.stdout.splitlines() if f"  {node1.name}: " in line)
        # The launcher's own address (the join check connects from it), not an SSH session's.
        assert (
            f"admit {node1.name}, {node2.name}, the launcher ({lab.controller_address}) and "
            "loopback;"
        ) in rule
        with open(tmp / "out.txt", "w") as out:
            launcher = subprocess.Popen(
                lab.command(_launcher("up", str(spec))), cwd=tmp, env=env, stdout=out, stderr=out
            )
        try:
            run_dir = wait_for_run_dir(tmp / "runs", launcher)
            logs = run_dir / "logs" / "attempt-0"
            holding = [logs / "worker-0.log", logs / "worker-1.log"]
            wait_for(
                lambda: (
                    all(log.exists() and "holding" in log.read_text() for log in holding)
                    and sum(e["event"] == "joined" for e in events(run_dir)) == 2
                ),
                "both tasks to join and hold",
                launcher=launcher,
            )
            tables = _tables(lab)
            assert all(len(found) == 1 for found in tables.values()), tables
            by_name = {n.name: n for n in lab.nodes}
            for task in run_record(run_dir)["plan"]["tasks"]:
                home = by_name[task["host_name"]]
                peer = node2 if home is node1 else node1
                port = task["port"]
                assert lab.connects(peer, home.address, port), f"{peer.name} refused at {port}"
                assert lab.connects(home, home.address, port), f"{home.name} refused at {port}"
                assert not lab.connects(lab.outsider, home.address, port), (
                    f"{task['name']} on {home.name}:{port} admitted the outsider"
                )
            network = run_record(run_dir)["network"]
            assert network["protect"] == "auto"
            assert all(h["protected"] and h["how"] == "nftables" for h in network["hosts"].values())
            assert lab.controller_address in network["hosts"][node1.name]["allowed"]
            status = lab.run(_launcher("status", str(run_dir)), cwd=tmp, env=env)
            for node in lab.nodes:
                assert f"firewall: {node.name} protected" in status.stdout, status.stdout
            output = (tmp / "out.txt").read_text()
            assert f"firewall: on {node1.name}, {node2.name} the run's task ports admit only" in (
                output
            )
            launcher.kill()
            launcher.wait()
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        wait_for(lambda: _no_rules(lab), "every run table to leave every node")
        wait_for(
            lambda: _nothing_left(lab, run_dir.name),
            "no step or process left",
            limit_s=60,
        )


@pytest.mark.integration
def test_a_node_without_cap_net_admin_is_named_open_or_refused(lab: SlurmLab, tmp: Path) -> None:
    (tmp / "task.py").write_text("print('hi')\n")
    python = _without_net_admin(tmp)  # every step of the run, the guards' too, runs this python
    tasks = {"worker": {"count": 2}}

    def up(protect: str) -> subprocess.CompletedProcess:
        spec = _spec(tmp, {"script": "task.py"}, tasks, network={"protect": protect})
        data = json.loads(spec.read_text())
        data["program"]["python"] = python
        spec.write_text(json.dumps(data))
        return lab.run(
            ["salloc", "--nodes=2", "--quiet", *_launcher("up", str(spec))], cwd=tmp, timeout=300
        )

    result = up("auto")
    assert result.returncode == 0, result.stderr
    only = next((tmp / "runs").glob("*/run.json")).parent
    record = run_record(only)
    for task in record["plan"]["tasks"]:
        assert (
            f"note: ports {task['port']} stay open to anyone who reaches {task['host_name']}: "
            "user root may not change the firewall"
        ) in result.stderr
    assert not any(h["protected"] for h in record["network"]["hosts"].values())
    status = lab.run(_launcher("status", str(only)), cwd=tmp)
    assert f"firewall: {lab.nodes[0].name} OPEN" in status.stdout, status.stdout

    refused = up("required")
    assert refused.returncode == 2, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and '"protect": "required"' in errors[0]
    assert "nothing was started" in errors[0] and "hi" not in refused.stdout
    assert len(list((tmp / "runs").glob("*/run.json"))) == 1  # the auto run's only
    assert _no_rules(lab), _tables(lab)
    wait_for(lambda: not lab.steps(), "no step left")


def test_down_removes_the_rules_of_a_sigkilled_guard(lab: SlurmLab, tmp: Path) -> None:
    """A cancelled step is SIGKILLed (Slurm 22.05): `down`'s sweep takes away what its guard left."""
    from distlaunch.launcher.network import firewall
    from distlaunch.launcher.transports.slurm import steps as slurm

    node = lab.nodes[0]
    with _allocation(lab, tmp, "--nodes=2") as env:
        job = env["SLURM_JOB_ID"]
        name = slurm.agent_step_name("left", node.name)
        argv = [*slurm.srun_argv(job, node.name, name, overlap=True), sys.executable]
        guard = subprocess.Popen(
            lab.command([*argv, "-m", firewall.GUARD_MODULE]),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        request = {"run_id": "left", "name": "left_1a2b", "ports": [4000], "allow": []}
        guard.stdin.write(json.dumps(request).encode())
        guard.stdin.write(b"\n")
        guard.stdin.flush()
        assert json.loads(guard.stdout.readline())["protected"]
        for proc in lab.processes(node):
            if firewall.GUARD_MODULE in proc.cmdline():
                proc.kill()
        guard.wait(timeout=60)
        guard.stdin.close()
        guard.stdout.close()
        assert _rules_left(node.netns) and not lab.steps()
        code = (
            "import json, sys; from distlaunch.launcher.transports.slurm import steps as slurm; "
            "slurm.cancel_steps('left', *map(json.loads, sys.argv[1:]))"
        )
        network = {"hosts": {node.name: {"protected": True, "name": "left_1a2b"}}}
        done = lab.run(
            [sys.executable, "-c", code, json.dumps({"job_id": job}), json.dumps(network)],
            env=env,
        )
        assert done.returncode == 0, done.stderr
        assert _no_rules(lab), _tables(lab)


# A task whose save on a stop notice never ends (a blocked MWMS worker ignores SIGTERM too): only
# the launcher's KILL ends it. The name makes program_scan take it for a program that saves on a
# notice, so the launcher waits for its save (up to the bound) before it stops it.
DEAF = (
    "PreemptionCheckpointHandler = None\n"
    + standins.SWALLOW_SIGTERM
    + standins.listening(standins.ANY)
    + 'print("holding", flush=True)\ntime.sleep(600)\n'
)


@pytest.mark.integration
def test_a_job_slurm_cancels_removes_its_rules_before_killwaits_sigkill(
    lab: SlurmLab, tmp: Path
) -> None:
    """scancel (as the time limit) SIGTERMs every process of the job and SIGKILLs them KillWait
    later; a SIGKILLed agent cannot remove its rules. The spec's save_s (60 s) is longer than
    KillWait leaves: the launcher keeps to what KillWait leaves, so the tasks are stopped and the
    agents remove their rules before Slurm's SIGKILL."""
    (tmp / "task.py").write_text(DEAF)
    timeouts = {"grace_s": 2, "startup_s": 120, "save_s": 60}
    spec = _spec(tmp, {"script": "task.py"}, {"worker": {"count": 2}}, timeouts=timeouts)
    job, run_dir = _submit(lab, tmp, spec, "--nodes", "2")
    wait_for(
        lambda: sum(e["event"] == "joined" for e in events(run_dir)) == 2, "both tasks to join"
    )
    assert all(_rules_left(node.netns) for node in lab.nodes), _tables(lab)
    out = (run_dir / f"slurm-{job}.out").read_text()
    bound = KILL_WAIT_S - timeouts["grace_s"] - SAVE_MARGIN_S
    assert (
        f"a stop notice's save must end within {bound:g} s, not timeouts.save_s 60 s: "
        f"Slurm's KillWait {KILL_WAIT_S} s bounds it"
    ) in out
    cancelled = lab.run(["scancel", job])
    assert cancelled.returncode == 0, cancelled.stderr
    started = time.monotonic()
    wait_for(lambda: job not in lab.jobs(), "the job to end", limit_s=KILL_WAIT_S + 60)
    print(f"the job ended {time.monotonic() - started:.1f} s after scancel")
    out = (run_dir / f"slurm-{job}.out").read_text()
    assert _no_rules(lab), (_tables(lab), out[-3000:])


@pytest.mark.quick
def test_killwait_is_read_from_scontrols_config() -> None:
    shown = "JobCompType             = jobcomp/none\nKillWait                = 30 sec\nKillOnBadExit = 0\n"
    assert kill_wait(shown) == 30
    assert kill_wait("KillOnBadExit = 0\n") is None
