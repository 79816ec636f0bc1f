"""The agent's command on a Slurm node: one job step per node holding what the node's tasks
are given (their CPUs, their GPUs), running the agent (launcher/transports/agent.py) behind a local
srun, and the keeper's request of each task as a Slurm step takes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from distlaunch.host import gpu_share
from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.plan.plan import TaskPlan
from distlaunch.launcher.transports.agent import AgentCommand, AgentHandle, AgentTransport
from distlaunch.launcher.transports.slurm.allocation import Allocation
from distlaunch.launcher.transports.slurm.nodes import NodeWatch
from distlaunch.launcher.transports.slurm.steps import (
    agent_argv,
    agent_step_name,
    helper_argv,
    srun_argv,
    task_stacks,
)
from distlaunch.worker import contract


class StepTransport(AgentTransport):
    """Starts tasks through one agent per node, each a job step of the allocation, and stops
    them (on the node: TERM, grace, KILL).

    A node's agent step holds the CPUs and GPUs of all of the node's tasks (``--exact``) and is
    the node's firewall guard (`guard`); it ends once the node has no task left (a gang restart,
    the end), so that the next attempt's step gets those resources back, and Slurm sees the
    run's steps end with its tasks. The next attempt's agent holds the rules again before its
    first task starts (`link_of`).

    For an elastic run it says which nodes Slurm took from the run (`lost_hosts`: DOWN, DRAIN,
    out of the job) and whether one can take steps again (`probe`): nodes.py."""

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
        self.nodes = NodeWatch(alloc)

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
                # Once the job lost a node, CPUs of steps that ran across that are never given
                # back to the job: a step that asked for its own would wait forever (nodes.py).
                overlap=self.nodes.resized,
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
        ``keep_bound``: where Slurm bound the step to CPUs of its choosing, they stand.
        A task with GPUs gets its share of the agent step's (`gpu_share`): its own devices."""
        request = {**super().request(task), "term_is_notice": True, "keep_bound": True}
        if task.gpus:
            node = [t.gpus for t in self.tasks if t.host_name == task.host_name]
            request[gpu_share.SHARE] = gpu_share.positions(task.gpus, node)
        return request

    def lost_hosts(self) -> Mapping[str, str]:
        """The nodes the run has lost, each with why (`base.ResizeTransport`): those whose agent
        was lost (`AgentTransport.lost_hosts`), and those Slurm took from the run (DOWN, DRAIN,
        out of the job) as last seen by a thread that asks Slurm every second; Slurm's word
        wins. Never waits."""
        return {**super().lost_hosts(), **self.nodes.lost()}

    def probe(self, host_name: str) -> bool:
        """Whether node ``host_name`` can take the run's steps again (blocks up to
        nodes.PROBE_STEP_S: call it from a thread). A node Slurm took out of the job never can:
        only a drained node RESUMEd while the job lives comes back."""
        return self.nodes.probe(host_name)

    def close(self) -> None:
        """Stop watching the nodes, then end every agent."""
        self.nodes.close()
        super().close()

    def stacks(self, handle: AgentHandle, native: bool) -> stacks.Source:
        """The task's program, read on its node (see `task_stacks`)."""
        task = handle.task
        helper = helper_argv(self.python, self.helpers.get(task.host_name))
        return task_stacks(
            self.alloc.job_id, task.host_name, self.run_id, task.name, helper, native
        )
