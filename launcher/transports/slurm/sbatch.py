"""`distlaunch sbatch`: a run submitted as a Slurm batch job that runs `up --backend slurm` inside it.

The batch script is written into the run dir first (``job.sbatch``): a plain, readable file that
`sbatch job.sbatch` runs again by hand. Every value in it that came from the user (paths, the
run id, extra sbatch arguments) is shell-quoted: the script is data for bash, never code.

With ``requeue``, Slurm sends the launcher SIGUSR2 ``signal_before_s`` before the time limit
(``--signal=B:USR2@N``: the batch shell is the launcher itself, it `exec`s it), and on a
preemption where the cluster sends the job's own signal (``SlurmctldParameters=
preempt_send_user_signal``). That is a stop notice: the tasks save at one step and stop, the run
is recorded as preempted and the launcher requeues the job; the next start runs the same
``up --run-id RUN``, which resumes the run at that step (next attempt, same run dir). A job
Slurm requeues itself (``scontrol requeue``, a preemption that SIGTERMs the tasks) saves the
same way, within Slurm's KillWait. N is by default the spec's timeouts.save_s plus grace_s plus
SIGNAL_MARGIN_S; the batch script tells the launcher N (SIGNAL_BEFORE_ENV), which keeps its
save deadline within it.

An elastic run's job is submitted with --no-kill (a node's failure must not end the job: the run
shrinks off that node), and its script tells the launcher so (NO_KILL_ENV): Slurm shows it
nowhere a job can read it (transports/slurm/nodes.py).
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from distlaunch.launcher.core.errors import UsageError
from distlaunch.launcher.record import rundir
from distlaunch.launcher.spec.model import LoadedSpec
from distlaunch.launcher.transports.slurm.allocation import SIGNAL_BEFORE_ENV, SUBMITTED_ENV
from distlaunch.launcher.transports.slurm.nodes import NO_KILL_ENV

SCRIPT = rundir.BATCH_SCRIPT
# The launcher's own output (task logs are in logs/); %j is the job id.
OUTPUT = "slurm-%j.out"
# After the pre-timeout signal the launcher needs, besides the save, the tasks' stop (grace_s)
# and its own teardown and requeue (Slurm may send the signal early, never late).
SIGNAL_MARGIN_S = 15


@dataclass(frozen=True)
class BatchRequest:
    """What `distlaunch sbatch` was asked for."""

    nodes: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    requeue: bool = False
    signal_before_s: int | None = None  # None: `signal_lead_s` of the spec
    extra: tuple[str, ...] = ()


def task_count(loaded: LoadedSpec) -> int:
    """How many tasks (so CPUs, one each) the job must hold."""
    return sum(len(entries) for entries in loaded.spec.tasks.by_role().values())


def signal_lead_s(loaded: LoadedSpec) -> int:
    """How long before the time limit a --requeue job is signalled by default: time to save
    (timeouts.save_s), to stop the tasks (grace_s) and for the launcher itself."""
    timeouts = loaded.spec.timeouts
    return math.ceil(timeouts.save_s + timeouts.grace_s + SIGNAL_MARGIN_S)


def default_nodes(loaded: LoadedSpec) -> int:
    """One task per node, or ``slurm.tasks_per_node`` per node."""
    per_node = loaded.spec.slurm.tasks_per_node or 1
    return math.ceil(task_count(loaded) / per_node)


def script(
    loaded: LoadedSpec,
    run_id: str,
    run_dir: Path,
    request: BatchRequest,
    python: str | None = None,
) -> str:
    """The batch script of a run: the allocation as #SBATCH lines, then the launcher."""
    q = shlex.quote
    options = [
        f"--job-name=distlaunch-{loaded.spec.name}",
        f"--nodes={request.nodes or default_nodes(loaded)}",
        f"--ntasks={task_count(loaded)}",
        f"--output={run_dir / OUTPUT}",
        # A requeued job appends to the same output file.
        "--open-mode=append",
    ]
    if request.time:
        options.append(f"--time={request.time}")
    if request.partition:
        options.append(f"--partition={request.partition}")
    if request.account:
        options.append(f"--account={request.account}")
    lead_s = request.signal_before_s or signal_lead_s(loaded)
    if request.requeue:
        options += ["--requeue", f"--signal=B:USR2@{lead_s}"]
    elastic = loaded.spec.elastic is not None
    if elastic:
        # A node's failure must not end the job: the run shrinks off that node (nodes.py).
        options.append("--no-kill")
    up = [
        python or sys.executable,
        "-m",
        "distlaunch.launcher",
        "up",
        "--backend",
        "slurm",
        "--run-id",
        run_id,
    ]
    if request.requeue:
        up.append("--requeue")
    up.append(str(loaded.file.resolve()))
    lines = [
        "#!/bin/bash",
        f"# distlaunch run {run_id} of {loaded.file.resolve()}, written by `distlaunch sbatch`.",
        "# Submit it again by hand with: sbatch " + q(str(run_dir / SCRIPT)),
        *(f"#SBATCH {q(option)}" for option in options),
        *(f"#SBATCH {q(arg)}" for arg in request.extra),
        "set -eu",
        f"cd {q(str(Path.cwd()))}",
        f'export {SUBMITTED_ENV}="$SLURM_JOB_ID"',
        # Slurm shows --no-kill nowhere a job can read it: the launcher's check reads this.
        *([f'export {NO_KILL_ENV}="$SLURM_JOB_ID"'] if elastic else []),
        *([f"export {SIGNAL_BEFORE_ENV}={lead_s}"] if request.requeue else []),
        "# The launcher replaces this shell, so that Slurm's signals (--signal=B:...) reach it.",
        # Started again (a requeue), the same run id resumes the run.
        "exec " + shlex.join(up),
        "",
    ]
    return "\n".join(lines)


def submit(path: Path) -> str:
    """Submit the batch script at ``path``; return the job id. UsageError with sbatch's message
    when Slurm refuses it (no such partition, account, time limit...)."""
    try:
        done = subprocess.run(
            ["sbatch", "--parsable", str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        raise UsageError(
            "sbatch is not installed here: run `distlaunch sbatch` on a Slurm login node"
        ) from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise UsageError(
            f"sbatch refused {path}: {lines[-1].strip() if lines else f'exit code {done.returncode}'}"
        )
    return done.stdout.strip().split(";")[0]


def check_extra(extra: Sequence[str]) -> tuple[str, ...]:
    """Extra sbatch arguments as given after ``--``: each must be an option (``--x=y`` or ``-x``)."""
    for arg in extra:
        if not arg.startswith("-") or "\n" in arg:
            raise UsageError(
                f"expected sbatch options after --, like --mem=8G (one word each), got {arg!r}"
            )
    return tuple(extra)
