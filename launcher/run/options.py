"""The options of a launch: one frozen dataclass that names each option's default and says, once,
what it does.

Every way of starting a run takes its options from here: `distlaunch.run`, `start` and `submit`
(a function on every task), `distlaunch.launch` and `up` (a spec; which run), the pytest plugin's
``tf_cluster`` marker and `distlaunch up`'s flags. Their signatures name each default as
``DEFAULTS.<option>`` and build a `LaunchOptions` from what they were given, which is what goes
down to the launch (tests/test_launch_options.py compares every signature with this class).
"None" means "not set": no time limit, no spec of the call's own, the spec's own backend.
This module imports nothing of the launcher: the API's and the plugin's start stay cheap.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from distlaunch.launcher.spec.model import Spec

# A spec: a JSON/YAML file, the spec as data (relative paths against the working directory), or
# the typed model.
SpecInput: TypeAlias = "str | os.PathLike[str] | Mapping[str, Any] | Spec"

# contract.MWMS and contract.PSS (the worker package's import costs a plugin's load 40 ms; the
# options test checks they agree).
MWMS = "multi_worker_mirrored"
PSS = "parameter_server"


@dataclass(frozen=True)
class LaunchOptions:
    """How a run is launched. Each field is an option of `distlaunch.run` (and `start`), of the
    ``tf_cluster`` marker, and, for the last four, of `distlaunch.launch`, `distlaunch.up` and
    the `distlaunch up` command."""

    workers: int | tuple[int, int] = 2
    """Worker tasks of a call's own cluster (a role of count 0 is left out); a range ``(MIN,
    MAX)`` makes an elastic run: MAX worker tasks and the spec's ``elastic`` section of that
    range, its other settings at their defaults. With ``spec``, a range sets that spec's
    ``elastic.workers`` (its worker role is the slots; its other elastic settings stay); a
    count is then not used."""
    chief: int = 0
    """Chief tasks of a call's own cluster (0 or 1)."""
    ps: int = 0
    """Parameter server tasks of a call's own cluster."""
    evaluator: int = 0
    """Evaluator tasks of a call's own cluster (0 or 1): a sidecar, restarted alone."""
    strategy: str | None = None
    """"multi_worker_mirrored" or "parameter_server"; None: parameter_server when ``ps`` > 0,
    else multi_worker_mirrored."""
    timeout_s: float | None = None
    """The whole run's time limit in seconds (timeouts.run_s); None: no limit."""
    gpus: int = 0
    """GPUs of this machine for each chief and worker of a call's own cluster, each its own (0:
    CPU only; StartError when the machine has fewer). Ps tasks and the evaluator stay on the
    CPU."""
    spec: SpecInput | None = None
    """A spec (file, dict or typed Spec) whose tasks, strategy, hosts and settings a call runs
    on, its program replaced by the call; the counts, strategy and GPUs above are then not used
    (a ``workers`` range is: it sets the spec's ``elastic.workers``).
    None: the local cluster the counts describe, run dirs under ./runs."""
    restart: Mapping[str, Any] | str | None = None
    """The spec's restart setting: a policy name such as "on-failure", or the whole mapping;
    None: the spec's (a call's own cluster: never)."""
    env: Mapping[str, str] | None = None
    """Variables added to each task's environment."""
    quiet: bool = False
    """True: the tasks' prefixed lines go to the run dir's logs only, not to sys.stdout."""
    pool: bool | None = None
    """Whether a call may take its tasks from the warm pool of this process (a live cluster of
    the same shape whose interpreters imported TensorFlow in an earlier call); None: on unless
    DISTLAUNCH_POOL=0. Calls with ``spec``, ``restart`` or ``timeout_s`` always start a cluster
    of their own."""
    keep: bool = False
    """Keep a call's payload (the function and its arguments) and result files in the run dir;
    False: removed once read."""
    backend: str | None = None
    """Where the tasks run ("local", "compose", "slurm" or a plugin's), replacing the spec's;
    None: the spec's."""
    run_id: str | None = None
    """The run's id; an existing run with this id is resumed. None: a new id."""
    resume: bool = False
    """Resume the spec's latest unfinished run."""
    overrides: tuple[str, ...] = ()
    """Spec values set before validation, as `--set` takes them ("tasks.worker.count=4")."""

    @property
    def strategy_name(self) -> str:
        """The strategy a call's own cluster runs under (``strategy``, or what ``ps`` implies)."""
        if self.strategy is not None:
            return self.strategy
        return PSS if self.ps else MWMS

    @property
    def spec_overrides(self) -> tuple[str, ...]:
        """``overrides``, with ``backend`` among them: it replaces the spec's before validation,
        as what a task's `host` may name depends on it."""
        if self.backend is None:
            return tuple(self.overrides)
        return (*self.overrides, f"backend={self.backend}")


DEFAULTS = LaunchOptions()
"""Every option's default: signatures name theirs as ``DEFAULTS.<option>``."""
