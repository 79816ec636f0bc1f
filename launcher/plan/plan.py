"""The plan: a pure function from a loaded spec (plus where its tasks run and a run dir) to one
TaskPlan per process.

Where each task runs (machine, address, port, GPUs, transport, python, cwd) is decided before,
once per backend (launcher/plan/placement.py); the plan only reads it.

Nothing here touches the machine: the same inputs always give the same plan, which is what
`distlaunch plan` prints and what `up` executes.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from distlaunch.host import bootstrap
from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.plan import cpu_fit, program_scan, tfconfig
from distlaunch.launcher.plan.cpu_fit import UNPINNED, TaskCpus
from distlaunch.launcher.plan.elastic import ElasticPlan, elastic_plan
from distlaunch.launcher.plan.isolation import HOST_NETWORK, Isolation
from distlaunch.launcher.plan.placement import Placement, Placements
from distlaunch.launcher.plan.program_scan import ProgramChoice
from distlaunch.launcher.spec.model import RESERVED_ENV, LoadedSpec
from distlaunch.worker import contract

# Env names whose values `plan` and summaries mask: they usually carry credentials
# (PASS: DB_PASS, PASSWORD, PASSWD; PWD: MYSQL_PWD; AUTH: AUTH_TOKEN, X_AUTH_HEADER).
SECRET_ENV = re.compile(r"(SECRET|TOKEN|PASS|PWD|AUTH|KEY|CREDENTIAL)", re.IGNORECASE)
# The password of a URL's user:password@ (HTTPS_PROXY, DATABASE_URL), whatever the variable's name.
URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):[^/\s@]*@")
BOOTSTRAP_MODULE = "distlaunch.host.bootstrap"
# The tasks that get warm standbys: this machine's, and those an agent runs (SSH hosts, Slurm
# nodes); a container or a pod is started anew by its engine.
STANDBY_TRANSPORTS = (TaskTransport.LOCAL, TaskTransport.SSH, TaskTransport.SLURM)


@dataclass(frozen=True)
class TaskPlan:
    """Everything needed to start one task process."""

    role: str
    index: int
    host: str
    port: int
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to the launcher's own environment
    cwd: str
    tf_config: Mapping
    gpus: tuple[int, ...]
    log_file: str
    host_name: str = "localhost"  # the host as the spec names it
    transport: TaskTransport = TaskTransport.LOCAL
    attempt: int = 0  # the attempt this task starts in (its log and error files are that attempt's)
    cpus: TaskCpus = UNPINNED  # the CPUs it is pinned to (placement.with_cpus)
    threads_kept: tuple[str, ...] = ()  # thread variables (cpu_fit.THREAD_ENV) the user set

    @property
    def name(self) -> str:
        """The task's name in logs and files, e.g. ``worker-1``."""
        return contract.task_name(self.role, self.index)

    @property
    def cpu_machine(self) -> str:
        """The machine whose CPUs the task's count on, by name: localhost for a local task."""
        return "localhost" if self.transport == TaskTransport.LOCAL else self.host_name

    @property
    def address(self) -> str:
        """host:port as it appears in TF_CONFIG."""
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Plan:
    """One attempt of a run: every task to start and where its files go."""

    run_id: str
    run_dir: str
    strategy: str
    attempt: int
    tasks: tuple[TaskPlan, ...] = field(default_factory=tuple)
    isolation: Isolation = HOST_NETWORK
    program: ProgramChoice = ProgramChoice(contract.KERAS3, "")
    # Local, SSH and Slurm tasks get warm standbys (launcher/transports/local/standby.py, and
    # agent_standby.py for the agents' hosts): a restart policy, not switched off, and a program
    # that imports TensorFlow after env writes a standby can repeat (or PSS servers).
    standby: bool = False
    # An elastic run (the spec's `elastic`): its range and every worker slot. The plan holds
    # every slot (MAX workers); the world that runs is `world.world_plan`'s choice of them.
    elastic: ElasticPlan | None = None

    def task(self, name: str) -> TaskPlan:
        """Return the task called ``name`` (``worker-1`` or ``worker:1``); KeyError if none."""
        wanted = name.replace(":", "-")
        for task in self.tasks:
            if task.name == wanted:
                return task
        raise KeyError(name)

    def cpu_notes(self) -> list[str]:
        """`up`'s lines on the machines whose CPUs `auto` split between tasks, e.g.
        ``cpus: 2 tasks on localhost, 1 CPU each (auto)``; none where no machine was split."""
        machines: dict[str, list[TaskPlan]] = {}
        for task in self.tasks:
            if task.cpus.how == cpu_fit.CpuHow.AUTO and task.cpus.pinned:
                machines.setdefault(task.cpu_machine, []).append(task)
        notes = []
        for machine, tasks in machines.items():
            sizes = sorted({t.cpus.count for t in tasks})
            if tasks[0].cpus.shared:
                notes.append(
                    f"cpus: {len(tasks)} tasks on {machine} share its {cpu_fit.cpus_word(sizes[0])} "
                    "left (auto: more tasks than CPUs; give them counts or lists to pin each)"
                )
            elif len(tasks) > 1:
                each = "-".join(map(str, (sizes[0], sizes[-1]) if len(sizes) > 1 else sizes))
                word = "CPU" if sizes == [1] else "CPUs"
                notes.append(f"cpus: {len(tasks)} tasks on {machine}, {each} {word} each (auto)")
        return notes

    def to_json(self, mask_secrets: bool = True) -> dict:
        """Return the plan as JSON-ready data; env values whose names look secret are masked."""
        return {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "strategy": self.strategy,
            "attempt": self.attempt,
            "isolation": self.isolation.to_json(),
            "program": self.program.to_json(),
            "standby": self.standby,
            "tasks": [
                {
                    "name": t.name,
                    "role": t.role,
                    "index": t.index,
                    "host": t.host,
                    "host_name": t.host_name,
                    "transport": t.transport,
                    "port": t.port,
                    "argv": list(t.argv),
                    "cwd": t.cwd,
                    "env": masked_env(t.env) if mask_secrets else dict(t.env),
                    "tf_config": t.tf_config,
                    "gpus": list(t.gpus),
                    "cpus": t.cpus.to_json(),
                    "threads": {k: t.env[k] for k in cpu_fit.THREAD_ENV if k in t.env},
                    "threads_kept": list(t.threads_kept),
                    "log_file": t.log_file,
                }
                for t in self.tasks
            ],
        }


def masked_env(env: Mapping[str, str]) -> dict[str, str]:
    """Return ``env`` with the values of secret-looking names replaced by ``***``, and the
    password of every ``scheme://user:password@`` in the others too."""
    return {k: "***" if SECRET_ENV.search(k) else _mask_url(v) for k, v in env.items()}


def _mask_url(value: str) -> str:
    return URL_PASSWORD.sub(r"\1:***@", value)


def masked_spec(raw: Mapping) -> dict:
    """Return a copy of a raw spec whose secret-looking ``program.env`` values are ``***``.

    run.json keeps this copy: a run dir is read by `status` and by people, never trusted with secrets.
    """
    out = copy.deepcopy(dict(raw))
    program = out.get("program")
    if isinstance(program, dict) and isinstance(program.get("env"), dict):
        program["env"] = masked_env(program["env"])
    return out


def make_plan(
    loaded: LoadedSpec,
    placed: Placements,
    run_id: str,
    run_dir: Path,
    attempt: int = 0,
    visible_gpus: str | None = None,
    isolation: Isolation = HOST_NETWORK,
    environ: Mapping[str, str] | None = None,
) -> Plan:
    """Build the plan of one attempt, every task where ``placed`` puts it (every port picked).

    ``visible_gpus`` is the launcher's CUDA_VISIBLE_DEVICES. ``isolation`` is recorded, not
    applied: argv stays the program's own, and the transport runs it inside the run's namespace.
    ``environ`` (default: the launcher's environment) is where spec.forward_env's variables are
    read from.
    """
    spec = loaded.spec
    # The one read of the program's source: which Keras, and who serves under PSS.
    program = program_scan.choose(loaded)
    addresses = placed.addresses()
    # One read of the environment for every task: os.environ decodes each variable on each read,
    # and a plan of N tasks read it 2N times.
    environ = dict(os.environ if environ is None else environ)
    forwarded = forwarded_env(spec.forward_env, environ)
    tasks = []
    for row in placed.rows:
        role, index = row.key
        config = tfconfig.tf_config(addresses, role, index)
        env = _task_env(
            loaded,
            row,
            attempt,
            run_id,
            run_dir,
            config,
            visible_gpus,
            program.keras,
            environ,
            forwarded,
        )
        serves = program.serve_ps_workers and role in (contract.PS, contract.WORKER)
        tasks.append(
            TaskPlan(
                role=role,
                index=index,
                host=row.address,
                port=row.known_port,
                argv=_argv(loaded, row, serves),
                env=env,
                cwd=row.cwd,
                tf_config=config,
                gpus=row.gpus,
                log_file=str(contract.log_path(run_dir, attempt, role, index)),
                host_name=row.host_name,
                transport=row.transport,
                attempt=attempt,
                cpus=row.cpus,
                threads_kept=_threads_kept(loaded, row, environ, forwarded),
            )
        )
    restart = spec.restart
    return Plan(
        run_id=run_id,
        run_dir=str(run_dir),
        strategy=spec.strategy,
        attempt=attempt,
        tasks=tuple(tasks),
        isolation=isolation,
        program=program,
        standby=restart.policy != "never"
        and restart.standby
        and (program.warm_restarts or program.serve_ps_workers)
        and any(t.transport in STANDBY_TRANSPORTS for t in tasks),
        elastic=elastic_plan(spec.elastic, tasks),
    )


def _argv(loaded: LoadedSpec, row: Placement, serves: bool = False) -> tuple[str, ...]:
    """The task's command, run by ``row``'s python (on an SSH host the script path must exist
    there). ``serves``: a PSS ps or worker task that only runs a server.

    The program starts through distlaunch.host.bootstrap, so that an import or syntax error in it
    is recorded like any uncaught exception (and never retried). Where the launcher's files are
    (this machine, a Slurm cluster) the bootstrap is run by path: ``program.python`` need not have
    distlaunch installed; elsewhere it is.
    """
    program = loaded.spec.program
    python = row.python
    if serves:
        return (python, "-m", program_scan.SERVE_MODULE)
    if row.transport.sees_launcher_files:
        boot: tuple[str, ...] = (python, bootstrap.__file__)
    else:
        boot = (python, "-m", BOOTSTRAP_MODULE)
    if loaded.script is not None:
        return (*boot, str(loaded.script), *program.args)
    return (*boot, "-m", program.module or "", *program.args)


def _task_env(
    loaded: LoadedSpec,
    row: Placement,
    attempt: int,
    run_id: str,
    run_dir: Path,
    config: Mapping,
    visible_gpus: str | None,
    keras: str,
    environ: Mapping[str, str],
    forwarded: Mapping[str, str],
) -> dict[str, str]:
    spec = loaded.spec
    role, index = row.key
    # Defaults the spec's env may override: live logs, and TensorFlow's C++ INFO chatter (one
    # line per gRPC server, CUDA probe, ...) hidden while its warnings and errors still show.
    # The log files keep TensorFlow's C++ INFO lines (level 0); the console hides them unless
    # tf_log_level is "all" (console.TfNoise).
    env = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "0"}
    env.update(forwarded)
    env.update(spec.program.env)
    sizes = cpu_fit.threads(row.cpus)
    if sizes is not None:
        # TensorFlow's and OpenMP's pools sized to the task's CPUs, unless the user sized them
        # (a local task inherits the launcher's environment: a value there is the user's too).
        inherited = environ if row.transport == TaskTransport.LOCAL else {}
        for name, size in sizes.items():
            env.setdefault(name, inherited.get(name, str(size)))
    if keras == contract.TF_KERAS:
        env["TF_USE_LEGACY_KERAS"] = "1"
    if spec.strategy == contract.PSS:
        # The PSS tutorial: without it a worker's failure can hang the coordinator's RPCs.
        env["GRPC_FAIL_FAST"] = "use_caller"
    visible = _cuda_visible(row, visible_gpus)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    env.update(
        {
            contract.TF_CONFIG: tfconfig.dumps(config),
            contract.RUN_ID: run_id,
            contract.RUN_DIR: str(run_dir),
            contract.ROLE: role,
            contract.INDEX: str(index),
            contract.ATTEMPT: str(attempt),
            contract.STRATEGY: spec.strategy,
            contract.KERAS: keras,
            contract.ERROR_FILE: str(contract.error_path(run_dir, attempt, role, index)),
            contract.STATUS_FILE: str(contract.status_path(run_dir, role, index)),
            contract.CHECKPOINT_DIR: str(contract.checkpoint_dir(run_dir)),
            contract.METRICS_FILE: str(contract.metrics_path(run_dir, role, index)),
        }
    )
    return env


def _threads_kept(
    loaded: LoadedSpec, row: Placement, environ: Mapping[str, str], forwarded: Mapping[str, str]
) -> tuple[str, ...]:
    """The thread variables (cpu_fit.THREAD_ENV) a pinned task keeps as the user set them: in the
    spec's env, the forwarded environment, or (a local task) the launcher's own environment."""
    if not row.cpus.pinned:
        return ()
    spec = loaded.spec
    users = {**forwarded, **spec.program.env}
    local = row.transport == TaskTransport.LOCAL
    return tuple(k for k in cpu_fit.THREAD_ENV if k in users or (local and k in environ))


def forwarded_env(patterns: list[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` whose names match one of the glob ``patterns`` (case
    sensitive), except those distlaunch sets itself (TF_CONFIG, DISTLAUNCH_*,
    CUDA_VISIBLE_DEVICES)."""
    return {
        key: value
        for key, value in sorted(environ.items())
        if any(fnmatch.fnmatchcase(key, p) for p in patterns)
        and not RESERVED_ENV.match(key)
        and key != "CUDA_VISIBLE_DEVICES"
    }


def _cuda_visible(row: Placement, visible_gpus: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for a task: "" (CPU only) when it has no GPU; None (not set) for a
    Slurm task with GPUs: Slurm names the devices it gave the node's agent step, and the agent
    gives the task its share of them (launcher/host/gpu_share.py).

    The launcher's own CUDA_VISIBLE_DEVICES (``visible_gpus``) says which of this machine's GPUs
    it may use: a local task's indices count within those. It says nothing about another machine.
    """
    if not row.gpus:
        return ""
    if row.transport == TaskTransport.SLURM:
        return None
    if visible_gpus and row.transport == TaskTransport.LOCAL:
        physical = [g.strip() for g in visible_gpus.split(",") if g.strip()]
        return ",".join(physical[g] if g < len(physical) else str(g) for g in row.gpus)
    return ",".join(str(g) for g in row.gpus)


def for_attempt(plan: Plan, attempt: int) -> Plan:
    """The same plan for another attempt: same ports and TF_CONFIG, the attempt's own files.

    A restarted task must come back at the address its peers know, with DISTLAUNCH_ATTEMPT, its
    log file and its error file naming the new attempt.
    """
    run_dir = Path(plan.run_dir)
    tasks = []
    for task in plan.tasks:
        env = dict(task.env)
        env[contract.ATTEMPT] = str(attempt)
        env[contract.ERROR_FILE] = str(contract.error_path(run_dir, attempt, task.role, task.index))
        log_file = str(contract.log_path(run_dir, attempt, task.role, task.index))
        tasks.append(replace(task, env=env, log_file=log_file, attempt=attempt))
    return replace(plan, attempt=attempt, tasks=tuple(tasks))
