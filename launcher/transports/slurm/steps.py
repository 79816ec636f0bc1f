"""A Slurm run's job steps by name and command: the srun of one step, the agent's and the
helper's commands on a node, a task's stacks read in a step, and the cleanup of a run's steps
without the launcher (`down`). The names let `down` find a run's steps by themselves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.network import firewall
from distlaunch.launcher.spec.model import LoadedSpec
from distlaunch.launcher.transports.agent import AGENT_MODULE
from distlaunch.launcher.transports.helper import HELPER_MODULE, STOP_MARGIN_S

# How long a step that answers and ends (a node's probe, a sweep of rules) may take.
PROBE_TIMEOUT_S = 120.0
# Job steps of a run are named after it, so `down` finds them without the launcher.
STEP_PREFIX = "distlaunch"
# The step of a node's agent is named distlaunch.<run id>.agent-<node>.
AGENT_STEP = "agent"
# The step `down` removes a SIGKILLed agent's rules with: distlaunch.<run id>.guard-sweep.<node>.
SWEEP_STEP = "guard-sweep"
# How long the one-node job that removes rules from a node that left the run's job may wait
# for that node (srun --immediate); a node that does not take it at once is down for real.
SWEEP_IMMEDIATE_S = 10
# The signal `down` ends an agent step with: it stops its tasks and removes its rules.
AGENT_STOP = signal.SIGHUP
# The step that reads a task's stacks on its node is named distlaunch.<run id>.stacks.<task>.
STACKS_STEP = "stacks"


def python_of(loaded: LoadedSpec) -> str:
    """The interpreter on the nodes: the program's, or the launcher's (the same path on a cluster)."""
    return loaded.spec.program.python or sys.executable


def step_name(run_id: str, task: str) -> str:
    """The job step name of a task of a run: `down` and people find the run's steps by it (`down`
    by the whole name: ``distlaunch.ab.worker-0`` begins like run ``ab.worker-0``'s steps too)."""
    return f"{STEP_PREFIX}.{run_id}.{task}"


def helper_argv(python: str, helper: str | None) -> list[str]:
    """The command that runs the remote helper on a node: by ``helper``, the path the node's
    preflight found it at (isolated, no site: 0.15-0.25 s of site-packages scan saved per step),
    or as a module when that path is not a plain source file."""
    if helper and os.path.isabs(helper) and helper.endswith(".py"):
        return [python, "-I", "-S", helper]
    return [python, "-m", HELPER_MODULE]


def agent_step_name(run_id: str, node: str) -> str:
    """The job step name of the agent of a run on ``node`` (no dot after the run id: a run
    whose id begins like this one's never takes it for its own)."""
    return step_name(run_id, f"{AGENT_STEP}-{node}")


def agent_argv(python: str, helper: str | None) -> list[str]:
    """The command that runs a node's agent: by path, beside the helper the node's preflight
    found (isolated, no site, as `helper_argv`), or as a module."""
    if helper and os.path.isabs(helper) and helper.endswith(".py"):
        return [python, "-I", "-S", os.path.join(os.path.dirname(helper), "agent.py")]
    return [python, "-m", AGENT_MODULE]


def srun_argv(
    job_id: str,
    node: str,
    name: str,
    gpus: int = 0,
    overlap: bool = False,
    cpus: int = 0,
    bind: bool | None = None,
) -> list[str]:
    """The srun command of one single-task step on ``node``; the step's command follows it.

    ``--exact``: the step takes only its own CPUs (``cpus``, its tasks' share of the node; 0:
    one, as for a task whose `cpus` is "all"), so the steps of a node run side by side;
    ``overlap`` (preflight's probe) shares CPUs with the tasks instead. ``bind`` (default: when
    ``cpus`` is given) asks Slurm to bind the step to cores.
    """
    argv = [
        "srun",
        f"--jobid={job_id}",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={max(cpus, 1)}",
        f"--nodelist={node}",
        f"--job-name={name}",
        "--quiet",
        "--overlap" if overlap else "--exact",
    ]
    if cpus if bind is None else bind:
        argv.append("--cpu-bind=cores")
    if gpus:
        argv.append(f"--gpus-per-task={gpus}")
    return argv


def task_stacks(
    job_id: str,
    node: str,
    run_id: str,
    task: str,
    helper: Sequence[str],
    native: bool,
) -> stacks.Source:
    """Where the stacks of ``task`` on ``node`` are read: a step of job ``job_id`` on that node
    (``--overlap``: it takes no CPU from the tasks) running the remote helper's stacks query
    (``helper``: its command there; py-spy on the node, else the program's own faulthandler).
    The local srun that stands for the task is never read or signalled: srun passes a signal on
    to its step, which would end the task."""
    name = step_name(run_id, f"{STACKS_STEP}.{task}")
    argv = [*srun_argv(job_id, node, name, overlap=True), *helper]
    return stacks.helper(argv, run_id, task, native, f"on node {node}")


# ---- cleanup without the launcher --------------------------------------------------------------


def cancel_steps(
    run_id: str,
    info: Mapping,
    network: Mapping | None = None,
    python: str = sys.executable,
    tasks: Collection[str] = (),
    grace_s: float = 0.0,
) -> list[str]:
    """End every job step left of Slurm run ``run_id`` and remove any firewall rule left on its
    nodes; with ``submitted``, cancel its whole job. ``info`` is the run's run.json ``slurm`` entry
    (`Allocation.to_json`), ``network`` its ``network`` entry, ``tasks`` its tasks' names,
    ``grace_s`` its timeouts.grace_s.

    Steps are found by their exact names (`run_step_names`): run ``ab``'s are never run
    ``ab.x``'s. The nodes' agents get SIGHUP (a cancel would SIGKILL them, leaving their rules):
    each stops its tasks (TERM, ``grace_s``, KILL), removes its rules once the task ports have
    closed and ends its step; a step still there after that is cancelled. An agent SIGKILLed
    earlier (its srun was killed, or it did not end in time) left its rules: a step on each
    protected node removes them by the name run.json recorded (`guard.remove_leftovers`), while
    the job still runs. Returns what was ended (``JOB.STEP`` ids, or the job id).
    """
    job = info.get("job_id")
    if not job:
        return []
    nodes = [str(n) for n in info.get("nodes") or ()]
    names = run_step_names(run_id, tasks, nodes)
    agent_names = {agent_step_name(run_id, node) for node in nodes}
    steps = _steps_of(str(job), names)
    agents = [i for i, name in steps.items() if name in agent_names]
    task_steps = [i for i in steps if i not in agents]
    if task_steps:
        subprocess.run(["scancel", "--quiet", *task_steps], capture_output=True, check=False)
    if agents:
        subprocess.run(
            ["scancel", "--quiet", f"--signal={AGENT_STOP.name.removeprefix('SIG')}", *agents],
            capture_output=True,
            check=False,
        )
        deadline = time.monotonic() + grace_s + STOP_MARGIN_S + firewall.CLOSE_TIMEOUT_S
        while set(agents) & set(_steps_of(str(job), names)) and time.monotonic() < deadline:
            time.sleep(0.2)
        late = sorted(set(agents) & set(_steps_of(str(job), names)))
        if late:
            subprocess.run(["scancel", "--quiet", *late], capture_output=True, check=False)
    left = {
        node: str(h["name"])
        for node, h in ((network or {}).get("hosts") or {}).items()
        if h.get("protected") and h.get("name")
    }
    if left:
        with ThreadPoolExecutor(max_workers=len(left)) as pool:
            list(
                pool.map(
                    lambda node: _remove_rules(str(job), node, run_id, left[node], python), left
                )
            )
    cancelled = sorted(steps)
    if info.get("submitted"):
        subprocess.run(["scancel", "--quiet", str(job)], capture_output=True, check=False)
        cancelled.append(str(job))
    return cancelled


def run_step_names(run_id: str, tasks: Collection[str], nodes: Collection[str]) -> set[str]:
    """Every step name run ``run_id`` gives: its tasks' (before the agents) and its agents' on
    ``nodes``."""
    return {step_name(run_id, task) for task in tasks} | {
        agent_step_name(run_id, node) for node in nodes
    }


def _remove_rules(job: str, node: str, run_id: str, rules: str, python: str) -> None:
    """Remove what an agent of ``run_id`` left on ``node`` under the name ``rules`` (nothing,
    mostly), as a job step, or as a job of its own where the job takes no step there (the node
    left it, or the job has ended: `remove_rules_outside`)."""
    name = step_name(run_id, f"{SWEEP_STEP}.{node}")
    argv = [*srun_argv(job, node, name, overlap=True), python, "-m", firewall.GUARD_MODULE]
    try:
        done = subprocess.run(
            [*argv, "--remove", rules],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return  # the node does not take a step now: nothing more can be done from here
    if done.returncode != 0:
        remove_rules_outside(node, run_id, rules, python)


def remove_rules_outside(node: str, run_id: str, rules: str, python: str) -> bool:
    """Remove what an agent of ``run_id`` left on ``node`` under the name ``rules``, where the
    node has left the run's job (a node failure under --no-kill: nodes.py): no step of that
    job runs there any more, so this is a one-node job of its own, started only if the node
    takes it at once (``--immediate``: a node that is really down keeps nothing of the run once
    it reboots), in the job's partition and account. Slurm SIGKILLs a step on a node it takes
    from a job, the agent too (measured: every process of the run gone there within a second,
    its nftables table left). Whether the rules went (the job ran)."""
    # Outside the allocation: srun makes a new job only without the job's variables.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SRUN_", "SALLOC_", "SBATCH_")) or k == "SLURM_CONF"
    }
    argv = [
        "srun",
        f"--immediate={SWEEP_IMMEDIATE_S}",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        f"--job-name={step_name(run_id, f'{SWEEP_STEP}.{node}')}",
        "--time=1",
        "--quiet",
    ]
    for option, name in (
        ("--partition", "SLURM_JOB_PARTITION"),
        ("--account", "SLURM_JOB_ACCOUNT"),
    ):
        if os.environ.get(name):
            argv.append(f"{option}={os.environ[name]}")
    try:
        done = subprocess.run(
            [*argv, python, "-m", firewall.GUARD_MODULE, "--remove", rules],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def _steps_of(job: str, names: Collection[str]) -> dict[str, str]:
    """The live steps of ``job`` whose name is one of ``names``: ``JOB.STEP`` id -> step name."""
    listed = subprocess.run(
        ["squeue", "--steps", f"--jobs={job}", "--noheader", "--format=%i %j"],
        capture_output=True,
        text=True,
        check=False,
    )
    pairs = (line.split() for line in listed.stdout.splitlines())
    return {p[0]: p[1] for p in pairs if len(p) == 2 and p[1] in names}
