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
  helper (`launcher/host/remote.py`), side by side, and gives each task its own of the step's
  GPUs (its request names its share of the step's CUDA_VISIBLE_DEVICES: host/gpu_share.py). Both need only the standard library, so they run by
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

The package: allocation.py (the allocation, placement, what bounds a notice's save), steps.py
(step names and commands, cleanup without the launcher), preflight.py (the nodes' probe),
agent_step.py (the agent's step and the keeper's request); this module plans and opens a run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.console import Console
from distlaunch.launcher.core.errors import Interrupted, Preempted
from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.network import firewall
from distlaunch.launcher.plan import ports
from distlaunch.launcher.plan.cpu_fit import Topology
from distlaunch.launcher.plan.isolation import HOST, Isolation
from distlaunch.launcher.plan.placement import on_nodes, with_cpus
from distlaunch.launcher.plan.plan import Plan, make_plan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import RunRecord, TaskRecord
from distlaunch.launcher.spec.model import LoadedSpec
from distlaunch.launcher.transports.agent_standby import AgentStandbys
from distlaunch.launcher.transports.base import Opened, TaskStacks, UpOptions
from distlaunch.launcher.transports.local.routing import HostConsole
from distlaunch.launcher.transports.slurm.agent_step import StepTransport
from distlaunch.launcher.transports.slurm.allocation import (
    Allocation,
    allocation,
    node_cpus,
    place,
    requeue,
    save_limits,
)
from distlaunch.launcher.transports.slurm.nodes import check_no_kill
from distlaunch.launcher.transports.slurm.preflight import preflight
from distlaunch.launcher.transports.slurm.steps import (
    cancel_steps,
    helper_argv,
    python_of,
    remove_rules_outside,
    task_stacks,
)
from distlaunch.launcher.transports.ssh.preflight import picked_ports

ISOLATION = Isolation(
    HOST,
    # The ports are shut by the nodes' firewall (network.protect), not by the isolation.
    "tasks run as Slurm job steps on the allocation's nodes, on the nodes' network",
)


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

    A task with GPUs gets them through its node's agent step (``--gpus-per-task``: the node's
    sum), its own share of the step's CUDA_VISIBLE_DEVICES given by the agent (agent_step.py);
    a task without any gets "" (CPU only), as elsewhere. ``topos``: what each node gives the run (the probes' reports; none: counts
    only, on the allocation's CPUs per node).
    """
    placed = on_nodes(loaded, nodes).with_ports(picked)
    placed = with_cpus(loaded, placed, topos or {})
    return make_plan(loaded, placed, run_id, run_dir, attempt, isolation=ISOLATION)


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
        if loaded.spec.elastic is not None:
            # Before anything starts: a job that a node's failure ends cannot shrink.
            check_no_kill(self.alloc, os.environ)
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
            finally:
                self.sweep_left(steps, protection, plan.run_id)

    def sweep_left(
        self, steps: StepTransport, protection: firewall.Protection, run_id: str
    ) -> None:
        """Remove the firewall rules of the nodes that left the job during the run (a node
        failure under --no-kill: Slurm SIGKILLs the run's agent there, whose rules stay), by a
        one-node job of their own (`remove_rules_outside`); say where that could not be done."""
        in_job = steps.nodes.in_job()
        if in_job is None:
            return
        python = python_of(self.loaded)
        for host in protection.hosts:
            if not host.protected or not host.name or host.host in in_job:
                continue
            if remove_rules_outside(host.host, run_id, host.name, python):
                self.console.say(
                    f"node {host.host} left job {self.alloc.job_id}: its firewall rules were "
                    "removed by a one-node job"
                )
            else:
                self.console.say(
                    f"node {host.host} left job {self.alloc.job_id} and takes no job now: its "
                    f"{host.rules} stays until it reboots or `{python} -m "
                    f"{firewall.GUARD_MODULE} --remove {host.name}` runs there"
                )


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
