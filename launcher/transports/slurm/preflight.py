"""The preflight of a Slurm run: every node with tasks probed as a job step (its Python,
TensorFlow, distlaunch, the shared dir, its CPUs), its ports picked there before the plan.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping

from distlaunch.launcher.plan import ports
from distlaunch.launcher.spec.model import LoadedSpec
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.slurm.allocation import Allocation
from distlaunch.launcher.transports.slurm.steps import (
    PROBE_TIMEOUT_S,
    STEP_PREFIX,
    python_of,
    srun_argv,
)
from distlaunch.launcher.transports.ssh.preflight import HostReport, probe_all, probe_source

# After its stdin closed, a step's helper kills the task at once and srun exits; this long at most.
KILL_WAIT_S = 5.0


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
