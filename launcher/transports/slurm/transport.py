"""The Slurm backend: inside an allocation, every task is a job step on one of its nodes.

Why it is built this way:
- The allocation is whatever `salloc` or a batch script holds: its nodes come from
  ``SLURM_JOB_NODELIST`` (`scontrol show hostnames`), its CPUs per node from
  ``SLURM_JOB_CPUS_PER_NODE``. Nothing is asked of the user that Slurm already knows.
- Placement is one pure decision (`place`): a task that names a node goes there; the others are
  spread over the nodes, the least loaded first, or packed ``slurm.tasks_per_node`` at a time.
  Every problem (an unknown node, more tasks than a node's CPUs) is one line.
- Each node runs one agent (`distlaunch.host.agent`, launcher/transports/agent.py) as one job
  step, behind a *local* `srun` client, a child process of the launcher like an SSH host's `ssh`:
  ``srun --nodes=1 --ntasks=1 --nodelist=NODE --exact ... PYTHON -I -S .../launcher/host/agent.py``.
  The step holds the CPUs and GPUs of all the node's tasks; the agent starts each task under its
  helper (`launcher/host/remote.py`), side by side. Both need only the standard library, so they run by
  the path where the node's preflight found them, without site-packages (skipping the scan of
  site-packages saved 0.15-0.25 s per step on the test cluster). srun forwards its stdin to the
  step, so the agent works exactly as over SSH: each task's argv and environment arrive as data
  (no shell parses a spec value), its helper runs it in its own process group with the run's
  umask and error files, `stop` ends it with TERM, grace, KILL, and EOF kills it at once.
- The agent is also the node's firewall guard (launcher/network/firewall.py, `protect_by_agents`):
  the launcher starts every node's agent before any task, sends it the run's rules, and the agent
  holds them until it ends, after its tasks (the rules' code, `distlaunch.host.guard`, is loaded
  by path from beside the agent). So a node runs one distlaunch process for the run (the
  preflight probe has answered and ended before): no guard step beside the agent's. A node
  left without tasks (a gang restart) ends its agent step, whose rules go once the task ports
  have closed, so that the next attempt's step gets its CPUs and GPUs back; the next attempt
  starts a new agent and sends it the rules first (`AgentTransport.link_of`): the agent installs
  them before it reads the line that starts a task, so no task port is ever open without them.
- Measured on Slurm 22.05 (tests/slurmcluster.py): closing srun's stdin ends the step within
  0.1 s (the agent sees EOF); SIGTERM to srun cancels the step; SIGKILL to srun leaves the step
  running on its own, without EOF (a task's step for about 2.5 s; an agent's step until the
  agent's heartbeat timeout ended it 20.5 s later, its rules removed by the agent; nothing
  promises how long); and cancelling a step (`scancel STEP`, or SIGTERM to its srun) SIGKILLs
  its processes at once, so a SIGKILLed agent cannot remove its rules. So an agent's srun runs in
  a session of its own with no death signal: when the launcher dies it lives on to pass the EOF,
  the agent kills its tasks at once and removes its rules; an agent gone silent has its srun
  SIGKILLed, not cancelled. An agent ends only by that EOF (the launcher closes its stdin, or
  dies), by its heartbeat timeout (an srun killed outright, or the link gone), or by `distlaunch
  down`, which sends it SIGHUP (``scancel --signal=HUP``): it stops its tasks (TERM, grace, KILL)
  and removes its rules (SIGTERM would not do: to a step's processes it is Slurm's stop notice,
  which the agent leaves to its tasks). `down` finds the run's steps by name; what a SIGKILLed
  agent left, a step on each node removes by the name run.json recorded.
- CPUs: the node's probe reports the CPUs the step sees (its affinity mask) and the NUMA nodes;
  the node's tasks split the first ``SLURM_JOB_CPUS_PER_NODE`` of them (plan/cpu_fit.py). Each
  step asks for its share (``--cpus-per-task=N --cpu-bind=cores``); where Slurm binds steps
  itself (task/affinity, task/cgroup) its binding stands, and where it does not (task/none) the
  helper pins the task to the plan's CPUs. A dry run (`plan`) knows the counts only.
- Ports are picked on each node before the plan, by the SSH preflight's probe run as a step
  (``--overlap``: it needs no CPU of its own; it answers and ends), which also checks the
  node's Python, TensorFlow, distlaunch and the shared dir. TF_CONFIG names nodes by hostname.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.console import Console
from distlaunch.launcher.core.errors import HostError, Interrupted, Preempted, UsageError
from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.network import firewall
from distlaunch.launcher.plan import ports
from distlaunch.launcher.plan.cpu_fit import Topology
from distlaunch.launcher.plan.isolation import HOST, Isolation
from distlaunch.launcher.plan.placement import on_nodes, with_cpus
from distlaunch.launcher.plan.plan import Plan, TaskPlan, make_plan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import RunRecord, TaskRecord
from distlaunch.launcher.spec.model import LOCAL_HOSTS, LoadedSpec, task_json_path
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.agent import (
    AGENT_MODULE,
    AgentCommand,
    AgentHandle,
    AgentTransport,
)
from distlaunch.launcher.transports.agent_standby import AgentStandbys
from distlaunch.launcher.transports.base import Opened, TaskStacks, UpOptions
from distlaunch.launcher.transports.helper import HELPER_MODULE, STOP_MARGIN_S
from distlaunch.launcher.transports.local.routing import HostConsole
from distlaunch.launcher.transports.ssh.preflight import (
    HostReport,
    picked_ports,
    probe_all,
    probe_source,
)
from distlaunch.worker import contract

PROBE_TIMEOUT_S = 120.0
# After its stdin closed, a step's helper kills the task at once and srun exits; this long at most.
KILL_WAIT_S = 5.0
# Job steps of a run are named after it, so `down` finds them without the launcher.
STEP_PREFIX = "distlaunch"
# The step of a node's agent is named distlaunch.<run id>.agent-<node>.
AGENT_STEP = "agent"
# The step `down` removes a SIGKILLed agent's rules with: distlaunch.<run id>.guard-sweep.<node>.
SWEEP_STEP = "guard-sweep"
# The signal `down` ends an agent step with: it stops its tasks and removes its rules.
AGENT_STOP = signal.SIGHUP
# The step that reads a task's stacks on its node is named distlaunch.<run id>.stacks.<task>.
STACKS_STEP = "stacks"
# Set by the batch script `distlaunch sbatch` writes, to the job id: this job exists for this run.
SUBMITTED_ENV = "DISTLAUNCH_SLURM_JOB"
# Set by the batch script of `distlaunch sbatch --requeue` to its --signal lead time (seconds).
SIGNAL_BEFORE_ENV = "DISTLAUNCH_SLURM_SIGNAL_BEFORE"
# After the save deadline of a notice from Slurm, the launcher still stops the rest (grace_s) and
# tears down before Slurm's SIGKILL; this much is kept for its teardown.
SAVE_MARGIN_S = 5.0
ISOLATION = Isolation(
    HOST,
    # The ports are shut by the nodes' firewall (network.protect), not by the isolation.
    "tasks run as Slurm job steps on the allocation's nodes, on the nodes' network",
)


@dataclass(frozen=True)
class Allocation:
    """The Slurm job the launcher runs in: its id, nodes (in Slurm's order) and CPUs per node."""

    job_id: str
    nodes: tuple[str, ...]
    cpus: Mapping[str, int]
    submitted: bool  # the job was submitted by `distlaunch sbatch` for this run: `down` cancels it
    # The CPUs the allocation gives one task, where it says so (`--cpus-per-task`, or a node's
    # CPUs over `--ntasks-per-node`): a run's task on a node takes that share, not the whole node,
    # so two runs in one allocation (or a run beside the user's own steps) both start.
    task_cpus: int | None = None

    def to_json(self) -> dict:
        """What run.json keeps (the slurm backend's section), for `down`, `stacks` and people."""
        return {
            "job_id": self.job_id,
            "nodes": list(self.nodes),
            "cpus": dict(self.cpus),
            "submitted": self.submitted,
            # Only where the allocation says it: a record read back is written back as it was.
            **({"task_cpus": self.task_cpus} if self.task_cpus else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Allocation:
        """Read the section `to_json` wrote."""
        cpus = data.get("cpus") or {}
        return cls(
            str(data.get("job_id") or ""),
            tuple(str(n) for n in data.get("nodes") or ()),
            {str(n): int(c) for n, c in cpus.items()},
            bool(data.get("submitted")),
            int(data["task_cpus"]) if data.get("task_cpus") else None,
        )


def allocation(env: Mapping[str, str] | None = None) -> Allocation:
    """The allocation this launcher runs inside; UsageError when there is none."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job or not nodelist:
        raise UsageError(
            "not inside a Slurm allocation (SLURM_JOB_ID is not set): run `up --backend slurm` under "
            "`salloc -N NODES` or in a batch script, or submit it with `distlaunch sbatch SPEC`"
        )
    missing = [
        tool for tool in ("scontrol", "srun", "squeue", "scancel") if shutil.which(tool) is None
    ]
    if missing:
        raise UsageError(
            f"{', '.join(missing)} not found: the Slurm client commands must be on PATH"
        )
    done = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.split():
        raise UsageError(
            f"cannot list the allocation's nodes ({nodelist!r}): {done.stderr.strip() or 'scontrol failed'}"
        )
    nodes = tuple(done.stdout.split())
    cpus = dict(
        zip(
            nodes,
            cpus_per_node(env.get("SLURM_JOB_CPUS_PER_NODE", ""), len(nodes)),
            strict=True,
        )
    )
    return Allocation(
        job, nodes, cpus, submitted=env.get(SUBMITTED_ENV) == job, task_cpus=task_cpus(env, cpus)
    )


def task_cpus(env: Mapping[str, str], cpus: Mapping[str, int]) -> int | None:
    """The CPUs the allocation gives one task: ``SLURM_CPUS_PER_TASK``, else the fewest CPUs of
    a node over ``SLURM_NTASKS_PER_NODE``; None when the allocation says neither (the whole node's
    CPUs are the run's to split)."""
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0:
        return int(per_task)
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0 and cpus:
        return max(min(cpus.values()) // int(per_node), 1)
    return None


@dataclass(frozen=True)
class SaveLimit:
    """The most a stop notice from Slurm leaves the tasks to save, and which source says so."""

    save_s: float
    why: str


def save_limits(grace_s: float, env: Mapping[str, str] | None = None) -> list[SaveLimit]:
    """What bounds the save after Slurm's notices to this job: the --signal lead time of a
    `distlaunch sbatch --requeue` job, and the GraceTime of a partition whose jobs are preempted
    (Slurm SIGKILLs the job that long after its warning). Each leaves grace_s and SAVE_MARGIN_S
    for stopping the rest."""
    env = os.environ if env is None else env
    found = []
    lead = env.get(SIGNAL_BEFORE_ENV, "")
    if lead.isdigit():
        found.append(SaveLimit(int(lead) - grace_s - SAVE_MARGIN_S, f"--signal lead time {lead} s"))
    partition = env.get("SLURM_JOB_PARTITION", "")
    if partition:
        shown = subprocess.run(
            ["scontrol", "--oneliner", "show", "partition", partition],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        grace = re.search(r"\bGraceTime=(\d+)", shown)
        mode = re.search(r"\bPreemptMode=(\S+)", shown)
        if grace and int(grace.group(1)) > 0 and mode and mode.group(1) != "OFF":
            found.append(
                SaveLimit(
                    int(grace.group(1)) - grace_s - SAVE_MARGIN_S,
                    f"partition {partition}'s preemption GraceTime {grace.group(1)} s",
                )
            )
    return found


def cpus_per_node(value: str, count: int) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE`` ("2(x3),1") as one number per node; 1 each when unset."""
    out: list[int] = []
    for part in filter(None, value.split(",")):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if found is None:
            return [1] * count
        out += [int(found.group(1))] * int(found.group(2) or 1)
    return out if len(out) == count else [1] * count


def place(loaded: LoadedSpec, alloc: Allocation) -> dict[ports.TaskKey, str]:
    """Put every task on a node of ``alloc``; HostError lists every problem (nothing started).

    A task whose `host` names a node goes there. The others are spread over the nodes (each to
    the node with the fewest tasks so far, Slurm's order breaking ties), or with
    ``slurm.tasks_per_node`` fill the nodes in order. A node may hold as many tasks as the
    allocation has CPUs there: each step takes one CPU (``--exact``).
    """
    spec = loaded.spec
    entries = [
        (role, i, e) for role, group in spec.tasks.by_role().items() for i, e in enumerate(group)
    ]
    problems = []
    placed: dict[ports.TaskKey, str] = {}
    load = dict.fromkeys(alloc.nodes, 0)
    for role, i, entry in entries:
        if entry.host in LOCAL_HOSTS:
            continue
        if entry.host not in load:
            where = task_json_path(loaded.raw, role, i, "host")
            problems.append(
                f"{where}: node {entry.host!r} is not in the allocation; expected one of: {', '.join(alloc.nodes)}"
            )
            continue
        placed[(role, i)] = entry.host
        load[entry.host] += 1
    per_node = spec.slurm.tasks_per_node
    for role, i, entry in entries:
        if (role, i) in placed or entry.host not in LOCAL_HOSTS:
            continue
        if per_node is not None:
            node = next((n for n in alloc.nodes if load[n] < per_node), alloc.nodes[-1])
        else:
            node = min(alloc.nodes, key=lambda n: (load[n], alloc.nodes.index(n)))
        placed[(role, i)] = node
        load[node] += 1
    total, cpus = len(entries), sum(alloc.cpus.values())
    if total > cpus:
        problems.append(
            f"{total} tasks need {total} CPUs, but job {alloc.job_id} has {cpus} on {len(alloc.nodes)} nodes; "
            "ask for more (salloc/sbatch --ntasks-per-node or -N) or run fewer tasks"
        )
    else:
        for node in alloc.nodes:
            if load[node] > alloc.cpus[node]:
                problems.append(
                    f"node {node}: {load[node]} tasks placed there but job {alloc.job_id} has {alloc.cpus[node]} "
                    "CPUs on it; place fewer tasks there"
                )
    if problems:
        raise HostError(
            "cannot place the tasks on the Slurm allocation; nothing was started:",
            problems,
        )
    return placed


def slurm_plan(
    loaded: LoadedSpec,
    nodes: Mapping[ports.TaskKey, str],
    picked: Mapping[ports.TaskKey, int],
    run_id: str,
    run_dir: Path,
    attempt: int = 0,
    topos: Mapping[str, Topology | None] | None = None,
) -> Plan:
    """The plan of one attempt on the nodes (``nodes``: `place`'s decision): TF_CONFIG names
    ``node:port`` with the nodes' own ports (``picked``).

    A task with GPUs asks Slurm for them (``--gpus-per-task``) and gets Slurm's CUDA_VISIBLE_DEVICES;
    a task without any gets "" (CPU only), as elsewhere. ``topos``: what each node gives the run (the probes' reports; none: counts
    only, on the allocation's CPUs per node).
    """
    placed = on_nodes(loaded, nodes).with_ports(picked)
    placed = with_cpus(loaded, placed, topos or {})
    return make_plan(loaded, placed, run_id, run_dir, attempt, isolation=ISOLATION)


def node_cpus(
    alloc: Allocation, nodes: Mapping[ports.TaskKey, str], reports: Sequence[HostReport] = ()
) -> dict[str, Topology]:
    """What each node gives the run: the first of its probe's CPUs, as many as the allocation
    has there (Slurm accounts for those; task/none would let a step run on all), and no more than
    the allocation's share per task (`Allocation.task_cpus`) for each of the run's tasks there
    (``nodes``: `place`'s decision); without a report, that count, Slurm picking which."""
    tasks = Counter(nodes.values())
    limit = {
        n: min(c, alloc.task_cpus * max(tasks[n], 1)) if alloc.task_cpus else c
        for n, c in alloc.cpus.items()
    }
    out = {n: Topology(tuple(range(c)), picks_ids=True) for n, c in limit.items()}
    for report in reports:
        if "topology" in report.facts:
            seen = Topology.from_json(report.facts["topology"])
            cpus = seen.cpus[: limit.get(report.name, len(seen.cpus))]
            out[report.name] = Topology(cpus, seen.nodes, seen.gpu_nodes)
    return out


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


# ---- preflight -------------------------------------------------------------------------------


def preflight(
    loaded: LoadedSpec,
    alloc: Allocation,
    placement: Mapping[ports.TaskKey, str],
    umask: int | None,
) -> list[HostReport]:
    """Probe every node with tasks, in parallel, as a step of the allocation: its Python has
    TensorFlow and this distlaunch, it sees the shared dir, its fixed ports are free and its `auto`
    ports are picked there. HostError lists every problem, one line each (nothing started)."""
    wanted: dict[str, ports.HostPorts] = {}
    for node in sorted(set(placement.values())):
        keys = [k for k, n in placement.items() if n == node]
        fixed = {}
        for role, i in keys:
            port = loaded.spec.tasks.by_role()[role][i].port
            if isinstance(port, int):
                fixed[(role, i)] = port
        wanted[node] = ports.HostPorts(fixed, tuple(k for k in keys if k not in fixed))
    return probe_all(loaded, wanted, umask, NodeProbe(loaded, alloc))


class NodeProbe:
    """The probe of Slurm nodes (`preflight.Probe`): a job step ``PYTHON -c SOURCE REQUEST``
    that answers and ends."""

    machine = "node"
    machines = "Slurm nodes"

    def __init__(self, loaded: LoadedSpec, alloc: Allocation) -> None:
        self.loaded = loaded
        self.alloc = alloc
        self.python = python_of(loaded)

    def label(self, name: str) -> str:
        """``node NAME``."""
        return f"node {name}"

    def request(self, name: str) -> dict:
        """A cluster shares its filesystem: the spec's workdir, the shared dir seen everywhere."""
        return {"shared": True, "workdir": str(self.loaded.workdir), "read_cpus": True}

    def problems(self, report: HostReport) -> list[str]:
        """None: Slurm gives each step the GPUs it asked for, or refuses the step itself."""
        return []

    def run(self, name: str, request: dict) -> dict | str:
        """Run the probe as a step on node ``name``: its answer, or what went wrong in words."""
        step = f"{STEP_PREFIX}.preflight"
        argv = [*srun_argv(self.alloc.job_id, name, step, overlap=True), self.python, "-c"]
        # A session of its own: a Ctrl-C at the terminal is the launcher's to handle.
        proc = subprocess.Popen(
            [*argv, probe_source(), json.dumps(request)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # SIGTERM first: srun then cancels its step (a SIGKILLed srun would leave it).
            procs.stop_groups([proc], KILL_WAIT_S)
            proc.communicate()
            return f"no answer from a job step within {PROBE_TIMEOUT_S:g} s"
        answer = _answer(out)
        if answer is None:
            stderr = err.decode(errors="replace")
            last = [line for line in stderr.splitlines() if line.strip()]
            why = last[-1].strip() if last else f"exit code {proc.returncode}"
            if "No such file" in stderr or "Can't exec" in stderr or proc.returncode in (126, 127):
                why = f"python {self.python!r} cannot run there ({why}); set program.python to the nodes' interpreter"
            return f"the probe step failed: {why}"
        return answer


def _answer(out: bytes) -> dict | None:
    """The probe's answer: the first JSON object line of its output with ``problems`` (lines the
    node's environment printed first are skipped); None when there is none."""
    for line in out.splitlines():
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict) and "problems" in answer:
            return answer
    return None


# ---- transport -------------------------------------------------------------------------------


class StepTransport(AgentTransport):
    """Starts tasks through one agent per node, each a job step of the allocation, and stops
    them (on the node: TERM, grace, KILL).

    A node's agent step holds the CPUs and GPUs of all of the node's tasks (``--exact``) and is
    the node's firewall guard (`guard`); it ends once the node has no task left (a gang restart,
    the end), so that the next attempt's step gets those resources back, and Slurm sees the
    run's steps end with its tasks. The next attempt's agent holds the rules again before its
    first task starts (`link_of`)."""

    def __init__(
        self,
        alloc: Allocation,
        run_id: str,
        python: str,
        grace_s: float,
        umask: int | None,
        helpers: Mapping[str, str] | None = None,
        tasks: Sequence[TaskPlan] = (),
    ) -> None:
        super().__init__(grace_s, umask, close_idle=True, term_is_notice=True)
        self.alloc = alloc
        self.run_id = run_id
        self.python = python
        self.helpers = dict(helpers or {})  # node -> the helper's path there (preflight's finding)
        self.tasks = list(tasks)

    def agent_command(self, machine: str) -> AgentCommand:
        """The node's agent: one step holding what the node's tasks are given."""
        mine = [t for t in self.tasks if t.host_name == machine]
        counts = [t.cpus.count for t in mine]
        argv = [
            *srun_argv(
                self.alloc.job_id,
                machine,
                agent_step_name(self.run_id, machine),
                gpus=sum(len(t.gpus) for t in mine),
                # A task whose `cpus` is "all" counts one, and the step is not bound (as its
                # own step was not).
                cpus=sum(max(count, 1) for count in counts),
                bind=all(counts),
            ),
            *agent_argv(self.python, self.helpers.get(machine)),
        ]
        # No death signal (the module docstring): the launcher's death reaches the agent as the
        # EOF its srun passes on, and the agent removes its rules before it ends. The run id lets
        # `distlaunch down` find the srun like the run's other processes.
        env = {contract.RUN_ID: self.run_id}
        return AgentCommand(tuple(argv), env, f"node {machine}", None)

    def request(self, task: TaskPlan) -> dict:
        """The keeper's request, with SIGTERM taken as a stop notice: Slurm SIGTERMs every
        process of a job it requeues or preempts (KillWait before its SIGKILL), the keeper too,
        which then passes it to the program alone instead of ending the task after grace_s.
        ``keep_bound``: where Slurm bound the step to CPUs of its choosing, they stand."""
        return {**super().request(task), "term_is_notice": True, "keep_bound": True}

    def stacks(self, handle: AgentHandle, native: bool) -> stacks.Source:
        """The task's program, read on its node (see `task_stacks`)."""
        task = handle.task
        helper = helper_argv(self.python, self.helpers.get(task.host_name))
        return task_stacks(
            self.alloc.job_id, task.host_name, self.run_id, task.name, helper, native
        )


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
    mostly), as a job step."""
    name = step_name(run_id, f"{SWEEP_STEP}.{node}")
    argv = [*srun_argv(job, node, name, overlap=True), python, "-m", firewall.GUARD_MODULE]
    try:
        subprocess.run(
            [*argv, "--remove", rules],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pass  # the node does not take a step now: nothing more can be done from here


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


def requeue(alloc: Allocation) -> None:
    """Put the job back in the queue (it was submitted with --requeue): its next start resumes the run."""
    subprocess.run(["scontrol", "requeue", alloc.job_id], capture_output=True, check=False)


# ---- the backend -------------------------------------------------------------------------------


def plan(loaded: LoadedSpec, run_id: str, run_dir: Path, attempt: int) -> Plan:
    """A dry run's plan (`plan`, `tfconfig`): placed on the current allocation, with stand-in
    ports (`up` picks the real ones on the nodes)."""
    alloc = allocation()
    nodes = place(loaded, alloc)
    stand_ins = ports.allocate(loaded, on_nodes(loaded, nodes), private=True)
    return slurm_plan(loaded, nodes, stand_ins, run_id, run_dir, attempt, node_cpus(alloc, nodes))


class SlurmLaunch:
    """One `up` inside a Slurm allocation: place the tasks, probe the nodes (their ports), plan,
    then run every task as a job step."""

    def __init__(self, loaded: LoadedSpec, console: Console, requeue: bool) -> None:
        self.loaded = loaded
        self.console = console
        self.requeue = requeue
        self.alloc = allocation()
        self.placement = place(loaded, self.alloc)
        private = loaded.spec.permissions == "private"
        self.umask = rundir.PRIVATE_UMASK if private else None
        self.helpers: dict[str, str] = {}
        # timeouts.save_s, or less where Slurm's notices leave less (`save_limits`)
        save_s = loaded.spec.timeouts.save_s
        limits = [x for x in save_limits(loaded.spec.timeouts.grace_s) if x.save_s < save_s]
        self.save_limit = min(limits, key=lambda x: x.save_s) if limits else None

    def plan(self, run_id: str, run_dir: Path, attempt: int) -> Plan:
        """Check every node (HostError when one is not usable), then plan with their ports."""
        reports = preflight(self.loaded, self.alloc, self.placement, self.umask)
        for report in reports:
            self.console.say(f"node {report.name}: {report.summary()}")
            if isinstance(report.facts.get("helper"), str):
                self.helpers[report.name] = report.facts["helper"]
        return slurm_plan(
            self.loaded,
            self.placement,
            picked_ports(reports),
            run_id,
            run_dir,
            attempt,
            node_cpus(self.alloc, self.placement, reports),
        )

    @contextmanager
    def open(self, plan: Plan) -> Iterator[Opened]:
        """The job step transport, whose nodes' agents start first as their firewall guards:
        the rules hold before any task starts and go after every task has stopped (with the
        agents, when the transport closes). With ``requeue`` (a batch job of
        `distlaunch sbatch --requeue`), a run interrupted by the pre-timeout signal requeues the
        job on the way out: its next start resumes this run."""
        python = python_of(self.loaded)
        grace_s = self.loaded.spec.timeouts.grace_s
        nodes = ", ".join(sorted(set(self.placement.values())))
        with StepTransport(
            self.alloc, plan.run_id, python, grace_s, self.umask, self.helpers, plan.tasks
        ) as steps:
            protection = firewall.protect_by_agents(
                self.loaded.spec.network.protect,
                plan.run_id,
                firewall.run_rules(plan),
                steps.guard,
            )
            notes = (
                f"tasks run as steps of Slurm job {self.alloc.job_id} on {nodes}",
                *protection.notes(),
            )
            limit = self.save_limit
            save_s = None if limit is None else max(limit.save_s, 1.0)
            if limit is not None:
                notes += (
                    f"a stop notice's save must end within {save_s:g} s, not timeouts.save_s "
                    f"{self.loaded.spec.timeouts.save_s:g} s: {limit.why} bounds it",
                )
            try:
                record = {"network": protection.to_json()}
                console = HostConsole(self.console, plan)
                why = None if limit is None else limit.why
                standbys = AgentStandbys(steps, TaskTransport.SLURM) if plan.standby else None
                yield Opened(
                    steps,
                    record,
                    self.alloc,
                    notes,
                    console,
                    standbys=standbys,
                    save_s=save_s,
                    save_why=why,
                )
            except Preempted:
                # Saved on a notice: Slurm's time-limit or preemption signal (SIGUSR2), or its
                # SIGTERM of a job it requeues itself (requeueing it again changes nothing).
                if self.requeue:
                    self.console.say(
                        f"tasks saved on the stop notice; requeueing job {self.alloc.job_id}, "
                        f"which resumes run {plan.run_id} from that checkpoint"
                    )
                    requeue(self.alloc)
                raise
            except Interrupted as exc:
                if self.requeue and exc.signum == rundir.PRE_TIMEOUT_SIGNAL:
                    self.console.say(
                        f"the job is near its time limit: tasks stopped; requeueing job "
                        f"{self.alloc.job_id}, which resumes run {plan.run_id} from its latest "
                        "checkpoint"
                    )
                    requeue(self.alloc)
                raise


class SlurmBackend:
    """The `slurm` backend (a `transports.base.Backend`): every task a step of the allocation."""

    name: ClassVar[str] = "slurm"
    title: ClassVar[str] = "Slurm"

    def plan(self, loaded: LoadedSpec, run_id: str, run_dir: Path, attempt: int) -> Plan:
        """A dry run's plan (`plan` above: stand-in ports on the current allocation)."""
        return plan(loaded, run_id, run_dir, attempt)

    @contextmanager
    def open(
        self, loaded: LoadedSpec, console: Console, options: UpOptions
    ) -> Iterator[SlurmLaunch]:
        """One `up` (UsageError outside an allocation, or when the tasks do not fit its nodes);
        ``options.requeue``: see `SlurmLaunch.open`."""
        yield SlurmLaunch(loaded, console, options.requeue)

    @contextmanager
    def cleanup(self, record: RunRecord, run_dir: Path, grace_s: float) -> Iterator[list[str]]:
        """Before the sweep, end the run's steps (they run on other nodes, out of its reach)
        and remove its agents' rules (`cancel_steps`)."""
        alloc = self.section(record)
        if alloc is None:
            yield []
            return
        # The python the run's steps ran (its guards' too): a task's, as planned.
        tasks = record.plan.get("tasks") or [{}]
        python = (tasks[0].get("argv") or [sys.executable])[0]
        names = [t["name"] for t in tasks if "name" in t]
        yield cancel_steps(record.run_id, alloc.to_json(), record.network, python, names, grace_s)

    @contextmanager
    def stacks(self, record: RunRecord, run_dir: Path) -> Iterator[TaskStacks]:
        """Each task by the helper in a step on its node (`task_stacks`)."""
        alloc = self.section(record)
        job = alloc.job_id if alloc else ""

        def read(plan: dict, entry: TaskRecord, native: bool) -> stacks.Source:
            # The nodes' interpreter is the tasks' own (a cluster shares its filesystem).
            helper = helper_argv(plan["argv"][0], None)
            return task_stacks(job, plan["host_name"], record.run_id, plan["name"], helper, native)

        yield read

    def section(self, record: RunRecord) -> Allocation | None:
        """The job ``record`` keeps (None: a run of another backend)."""
        if record.backend != self.name or record.section is None:
            return None
        return Allocation.from_json(record.section)
