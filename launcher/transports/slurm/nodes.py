"""Which of the allocation's nodes an elastic run has lost, as Slurm says it, and whether a node
can take a step again: the Slurm side of an elastic run (`lost_hosts`, `probe`), and whether
the job survives a node's failure at all (`check_no_kill`).

Measured on Slurm 22.05 (tests/slurmcluster.py, 3 nodes, a job holding one step per node) with a
node set DOWN by ``scontrol update nodename=N state=DOWN reason=...``:

- Without --no-kill Slurm ends the whole job within a second: every step on every node is
  cancelled ("CANCELLED ... DUE TO NODE FAILURE"), and the job is requeued (JobRequeue=1) or
  ends NODE_FAIL. No run can shrink in such a job: `check_no_kill` refuses an elastic run there.
- With --no-kill the job stays RUNNING and Slurm takes the node out of it within a second:
  `scontrol show job` shows the shorter NodeList and NumNodes, and a ResizeTime, while
  ``SLURM_JOB_NODELIST`` keeps the old list (stale: only scontrol is asked here). The step on
  that node is ended, nothing of it left there; its srun client prints "srun: error: Node
  failure on N" and exits 0. The steps on the other nodes run on, and new steps start there.
- A node out of the job never comes back to it: once RESUMEd (or by itself: with
  ReturnToService=2 a DOWN node whose slurmd answers is IDLE again, here within 3 s) a step
  there is refused ("Unable to create step for job J: Requested node configuration is not
  available"). Slurm cannot grow an allocation; growing onto new nodes means a new job. So an
  elastic run under Slurm shrinks off a DOWN node and never grows back onto it.
- The job's resize leaks CPUs: a step that ran on a remaining node while Slurm took the other
  node out keeps its CPUs in slurmctld's books after it ends ("_step_dealloc_lps: ... unable to
  update job's core use information due to job resizing"), so a new ``--exact`` step there
  waits for them forever; a node with no step across the resize is not affected, and an
  ``--overlap`` step starts at once. So once the job has lost a node (`NodeWatch.resized`), the
  run's agent steps overlap (the helper still pins each task to its CPUs where Slurm does not).
- A node set DRAIN stays in the job ("draining": its steps run on, new ones start there). The
  admin wants it empty, so it counts as lost here and the run shrinks off it; RESUMEd while the
  job lives, it takes steps again (`probe` says so): the one way an elastic run under Slurm
  grows back.
- Slurm 22.05 shows a job's --no-kill nowhere the job can read it: not in ``scontrol show job``
  (with -d neither), not in ``squeue --json`` (a job with and one without it differ only in
  their state fields), and sbatch/salloc set no variable for it (SLURM_NO_KILL is srun's input
  only). The input variables that set it, ``SBATCH_NO_KILL`` and ``SALLOC_NO_KILL`` (valid
  values "" and "set"; "off" unsets it; any other value makes sbatch/salloc refuse the job), are
  exported into the job, so the launcher sees those; `distlaunch sbatch` writes --no-kill into
  an elastic run's batch script and tells the launcher (``NO_KILL_ENV``).

Reading Slurm costs two scontrol calls (the job, the nodes), a few milliseconds of slurmctld's
time: `NodeWatch` makes them every ``POLL_S`` in a thread of its own, and the supervisor's loop
reads the last answer without waiting.
"""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from distlaunch.launcher.core.errors import UsageError
from distlaunch.launcher.transports.slurm.allocation import Allocation
from distlaunch.launcher.transports.slurm.steps import STEP_PREFIX, srun_argv

# Set by the batch script of `distlaunch sbatch` for an elastic run to the job id: the job was
# submitted with --no-kill (Slurm itself shows it nowhere a job can read it).
NO_KILL_ENV = "DISTLAUNCH_SLURM_NO_KILL"
# The input variables that give sbatch / salloc --no-kill; the job inherits them.
SUBMIT_NO_KILL = ("SBATCH_NO_KILL", "SALLOC_NO_KILL")
# How often NodeWatch asks Slurm about the job and its nodes.
POLL_S = 1.0
# How long a probe step may take (srun waits up to MessageTimeout on a node that does not answer).
PROBE_STEP_S = 30.0
# Node states that take a node from the run: Slurm's base state or one of its flags.
LOST_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN")


def has_no_kill(env: Mapping[str, str]) -> bool:
    """Whether the job ``env`` describes was submitted with --no-kill, as far as a job can
    tell (the module docstring): `distlaunch sbatch` said so, or SBATCH_NO_KILL / SALLOC_NO_KILL
    is set and not "off"."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if job and env.get(NO_KILL_ENV) == job:
        return True
    return any(name in env and env[name].strip().lower() != "off" for name in SUBMIT_NO_KILL)


def check_no_kill(alloc: Allocation, env: Mapping[str, str]) -> None:
    """UsageError (one line, nothing started) when an elastic run's job would not survive the
    failure of one of its nodes (no --no-kill that the launcher can see)."""
    if has_no_kill(env):
        return
    raise UsageError(
        f"elastic: Slurm job {alloc.job_id} may end whole when one of its nodes fails (no "
        "--no-kill seen), so the run could not shrink; submit it with `distlaunch sbatch`, which "
        "adds --no-kill, or by hand with SBATCH_NO_KILL=set sbatch ... / SALLOC_NO_KILL=set salloc "
        "... (the same as -k, and the job can see it: Slurm shows -k nowhere a job can read)"
    )


@dataclass(frozen=True)
class NodeState:
    """One node as ``scontrol show node`` says it: its state (``MIXED+DRAIN``) and reason."""

    name: str
    state: str
    reason: str

    def lost(self) -> bool:
        """Whether the state takes the node from a run (DOWN, DRAIN, FAIL...)."""
        return any(flag in LOST_STATES for flag in self.state.split("+"))


def parse_nodes(text: str) -> dict[str, NodeState]:
    """``scontrol --oneliner show node LIST``'s text, one node a line, by name."""
    out = {}
    for line in text.splitlines():
        name = re.search(r"\bNodeName=(\S+)", line)
        state = re.search(r"\bState=(\S+)", line)
        if name is None or state is None:
            continue
        # Reason is the line's last field and may hold spaces; Slurm adds " [user@time]".
        reason = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?\s*$", line)
        out[name.group(1)] = NodeState(
            name.group(1), state.group(1), reason.group(1).strip() if reason else ""
        )
    return out


def parse_job(text: str) -> tuple[str, str] | None:
    """``scontrol --oneliner show job J``'s JobState and NodeList (compressed, "" when none);
    None when the text has no job."""
    state = re.search(r"\bJobState=(\S+)", text)
    nodes = re.search(r"\bNodeList=(\S*)", text)
    if state is None or nodes is None:
        return None
    node_list = nodes.group(1)
    return state.group(1), "" if node_list == "(null)" else node_list


def lost_nodes(
    nodes: Sequence[str], in_job: frozenset[str], states: Mapping[str, NodeState], job_id: str
) -> dict[str, str]:
    """The run's ``nodes`` that are lost, each with why: out of job ``job_id`` (Slurm removed
    it: it never returns), or in a state that takes it from the run (DOWN, DRAIN...)."""
    out = {}
    for node in nodes:
        seen = states.get(node)
        said = (
            ""
            if seen is None
            else f" (State={seen.state}" + (f", Reason={seen.reason})" if seen.reason else ")")
        )
        if node not in in_job:
            out[node] = f"Slurm node {node} left job {job_id}{said}: it does not come back to it"
        elif seen is not None and seen.lost():
            out[node] = f"Slurm node {node} is {seen.state}" + (
                f" ({seen.reason})" if seen.reason else ""
            )
    return out


Runner = Callable[[list[str]], subprocess.CompletedProcess]


def _scontrol(argv: list[str]) -> subprocess.CompletedProcess:
    """Run a Slurm command; one that does not end within PROBE_STEP_S counts as failed."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, check=False, timeout=PROBE_STEP_S
        )
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"no answer within {PROBE_STEP_S:g} s")


class NodeWatch:
    """The allocation's nodes as Slurm sees them, asked every ``poll_s`` in a thread of its own
    (started by the first `lost`); `lost` and `close` never wait for Slurm."""

    def __init__(self, alloc: Allocation, poll_s: float = POLL_S, run: Runner = _scontrol) -> None:
        self.alloc = alloc
        self.poll_s = poll_s
        self._run = run
        self._lost: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._expanded: dict[str, frozenset[str]] = {}  # NodeList -> its nodes
        # Once Slurm took a node from the job, steps share CPUs (`resized`).
        self.resized = False

    def lost(self) -> dict[str, str]:
        """The nodes lost at the last look (node -> why); {} before the first answer."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._watch, name="slurm-nodes", daemon=True)
            self._thread.start()
        with self._lock:
            return dict(self._lost)

    def look(self) -> dict[str, str] | None:
        """Ask Slurm now (blocks: scontrol): the lost nodes; None when Slurm did not answer or
        the job no longer runs (nothing to say about its nodes then)."""
        in_job = self.in_job()
        if in_job is None:
            return None
        shown = self._run(["scontrol", "--oneliner", "show", "node", ",".join(self.alloc.nodes)])
        states = parse_nodes(shown.stdout)
        return lost_nodes(self.alloc.nodes, in_job, states, self.alloc.job_id)

    def in_job(self) -> frozenset[str] | None:
        """The nodes the job holds now, as ``scontrol show job`` says (SLURM_JOB_NODELIST goes
        stale); None when Slurm did not answer or the job no longer runs."""
        job = self._run(["scontrol", "--oneliner", "show", "job", self.alloc.job_id])
        seen = parse_job(job.stdout) if job.returncode == 0 else None
        if seen is None or seen[0] != "RUNNING":
            return None
        nodes = self._nodes_of(seen[1])
        if nodes is not None and not set(self.alloc.nodes) <= nodes:
            self.resized = True
        return nodes

    def probe(self, node: str) -> bool:
        """Whether ``node`` can take the run's steps again (blocks: run it in a thread): still
        in the job, in no lost state, and a step there runs. A node Slurm took from the job
        never can (the module docstring)."""
        lost = self.look()
        if lost is None or node in lost or node not in self.alloc.nodes:
            return False
        step = [
            *srun_argv(self.alloc.job_id, node, f"{STEP_PREFIX}.probe", overlap=True),
            "true",
        ]
        return self._run(step).returncode == 0

    def close(self) -> None:
        """Stop asking (the thread ends after its current look)."""
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                lost = self.look()
            except OSError:  # scontrol gone from PATH: nothing to say
                lost = None
            if lost is not None:
                with self._lock:
                    self._lost = lost
            self._stop.wait(self.poll_s)

    def _nodes_of(self, node_list: str) -> frozenset[str] | None:
        if not node_list:
            return frozenset()
        if node_list not in self._expanded:
            done = self._run(["scontrol", "show", "hostnames", node_list])
            if done.returncode != 0:
                return None
            self._expanded[node_list] = frozenset(done.stdout.split())
        return self._expanded[node_list]
