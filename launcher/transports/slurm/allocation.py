"""The allocation a Slurm run lives in, and where its tasks go on it.

The allocation is whatever `salloc` or a batch script holds: its nodes come from
``SLURM_JOB_NODELIST`` (`scontrol show hostnames`), its CPUs per node from
``SLURM_JOB_CPUS_PER_NODE``; nothing is asked of the user that Slurm already knows. Placement is
one pure decision (`place`); `save_limits` reads what bounds a stop notice's save (the --signal
lead time, a partition's preemption GraceTime). It starts no step (steps.py does).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from distlaunch.launcher.core.errors import HostError, UsageError
from distlaunch.launcher.plan import ports
from distlaunch.launcher.plan.cpu_fit import Topology
from distlaunch.launcher.spec.model import LOCAL_HOSTS, LoadedSpec, task_json_path
from distlaunch.launcher.transports.ssh.preflight import HostReport

# Set by the batch script `distlaunch sbatch` writes, to the job id: this job exists for this run.
SUBMITTED_ENV = "DISTLAUNCH_SLURM_JOB"
# Set by the batch script of `distlaunch sbatch --requeue` to its --signal lead time (seconds).
SIGNAL_BEFORE_ENV = "DISTLAUNCH_SLURM_SIGNAL_BEFORE"
# After the save deadline of a notice from Slurm, the launcher still stops the rest (grace_s) and
# tears down before Slurm's SIGKILL; this much is kept for its teardown (the last of it: each
# node's agent, told to end, kills its tasks and removes its rules: well under a second on the
# test cluster, tests/test_slurm_firewall.py).
SAVE_MARGIN_S = 5.0


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
    (Slurm SIGKILLs the job that long after its warning); where neither is in force, KillWait
    (Slurm's SIGKILL after its SIGTERM). Each leaves grace_s and SAVE_MARGIN_S for stopping the
    rest, which ends with the nodes' agents removing their firewall rules."""
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
    if not found and (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")):
        # No earlier warning is arranged: Slurm's own SIGTERM (the time limit, scancel, a
        # requeue) is the notice, to every process of the job, and its SIGKILL follows KillWait
        # later. The nodes' agents remove their firewall rules only after the launcher has
        # stopped the tasks: a save past that leaves the rules behind on every node.
        shown = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, check=False
        ).stdout
        wait = kill_wait(shown)
        if wait is not None:
            found.append(SaveLimit(wait - grace_s - SAVE_MARGIN_S, f"Slurm's KillWait {wait} s"))
    return found


def kill_wait(config: str) -> int | None:
    """KillWait in seconds, from `scontrol show config`'s text (``KillWait = 30 sec``)."""
    found = re.search(r"^KillWait\s*=\s*(\d+)", config, re.MULTILINE)
    return int(found.group(1)) if found else None


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
            out[report.name] = replace(seen, cpus=cpus)
    return out


def requeue(alloc: Allocation) -> None:
    """Put the job back in the queue (it was submitted with --requeue): its next start resumes the run."""
    subprocess.run(["scontrol", "requeue", alloc.job_id], capture_output=True, check=False)
