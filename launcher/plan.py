"""The plan: a pure function from a loaded spec (plus ports and a run dir) to one TaskPlan per process.

Nothing here touches the machine: the same inputs always give the same plan, which is what
`distlaunch plan` prints and what `up` executes.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from distlaunch.launcher import program_scan, tfconfig
from distlaunch.launcher.backends import TaskTransport
from distlaunch.launcher.isolation import HOST_NETWORK, Isolation
from distlaunch.launcher.program_scan import ProgramChoice
from distlaunch.launcher.spec import RESERVED_ENV, LoadedSpec, TaskEntry
from distlaunch.worker import bootstrap, contract

# Env names whose values `plan` and summaries mask: they usually carry credentials
# (PASS: DB_PASS, PASSWORD, PASSWD; PWD: MYSQL_PWD; AUTH: AUTH_TOKEN, X_AUTH_HEADER).
SECRET_ENV = re.compile(r"(SECRET|TOKEN|PASS|PWD|AUTH|KEY|CREDENTIAL)", re.IGNORECASE)
# The password of a URL's user:password@ (HTTPS_PROXY, DATABASE_URL), whatever the variable's name.
URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):[^/\s@]*@")
# The interpreter of a task in a container of the distlaunch image: docker/Dockerfile puts the
# image's venv first on PATH. The launcher's own interpreter path means nothing in there.
IMAGE_PYTHON = "python"
BOOTSTRAP_MODULE = "distlaunch.worker.bootstrap"


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
    transport: TaskTransport = TaskTransport.LOCAL  # how it runs: here, on an SSH host...

    @property
    def name(self) -> str:
        """The task's name in logs and files, e.g. ``worker-1``."""
        return contract.task_name(self.role, self.index)

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
    # Local tasks get warm standbys (launcher/standby.py): a restart policy, not switched off, and
    # a program that imports TensorFlow after env writes a standby can repeat (or PSS servers).
    standby: bool = False

    def task(self, name: str) -> TaskPlan:
        """Return the task called ``name`` (``worker-1`` or ``worker:1``); KeyError if none."""
        wanted = name.replace(":", "-")
        for task in self.tasks:
            if task.name == wanted:
                return task
        raise KeyError(name)

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
    ports: Mapping[tuple[str, int], int],
    run_id: str,
    run_dir: Path,
    attempt: int = 0,
    visible_gpus: str | None = None,
    isolation: Isolation = HOST_NETWORK,
    containers: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Plan:
    """Build the plan of one attempt. ``visible_gpus`` is the launcher's CUDA_VISIBLE_DEVICES.

    ``isolation`` is recorded, not applied: argv stays the program's own, and the transport runs
    it inside the run's namespace.

    ``containers`` (the compose backend): every task runs in a container of its own, reached at
    its service name, which is its task name: TF_CONFIG lists ``worker-0:PORT``, the command runs
    the image's python, and cwd and the run dir keep their paths (the containers mount them).

    ``environ`` (default: the launcher's environment) is where spec.forward_env's variables are
    read from.
    """
    spec = loaded.spec
    # The one read of the program's source: which Keras, and who serves under PSS.
    program = program_scan.choose(loaded)
    roles = spec.tasks.by_role()
    addresses = {
        role: [
            f"{_address(loaded, e, role, i, containers)}:{ports[(role, i)]}"
            for i, e in enumerate(entries)
        ]
        for role, entries in roles.items()
    }
    gpus = _assign_gpus(loaded, roles)
    tasks = []
    for role, entries in roles.items():
        for index, entry in enumerate(entries):
            remote = None if containers else loaded.ssh_host(entry.host)
            config = tfconfig.tf_config(addresses, role, index)
            # The launcher's CUDA_VISIBLE_DEVICES says nothing about another machine's GPUs.
            visible = None if remote else visible_gpus
            env = _task_env(
                loaded,
                role,
                index,
                attempt,
                run_id,
                run_dir,
                config,
                gpus[(role, index)],
                visible,
                program.keras,
                os.environ if environ is None else environ,
            )
            serves = program.serve_ps_workers and role in (contract.PS, contract.WORKER)
            tasks.append(
                TaskPlan(
                    role=role,
                    index=index,
                    host=_address(loaded, entry, role, index, containers),
                    port=ports[(role, index)],
                    argv=_argv(
                        loaded,
                        IMAGE_PYTHON if containers else remote.python if remote else None,
                        serves,
                    ),
                    env=env,
                    # An SSH task without a workdir starts where ssh logs in ("": the login dir).
                    cwd=(remote.workdir or "") if remote else str(loaded.workdir),
                    tf_config=config,
                    gpus=gpus[(role, index)],
                    log_file=str(contract.log_path(run_dir, attempt, role, index)),
                    host_name=entry.host,
                    transport=(
                        TaskTransport.COMPOSE
                        if containers
                        else TaskTransport.SSH
                        if remote
                        else TaskTransport.LOCAL
                    ),
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
        and any(t.transport == TaskTransport.LOCAL for t in tasks),
    )


def _address(loaded: LoadedSpec, entry: TaskEntry, role: str, index: int, containers: bool) -> str:
    """The host TF_CONFIG names for a task: its service name in a container, else its host's address."""
    return contract.task_name(role, index) if containers else loaded.address_of(entry.host)


def _argv(loaded: LoadedSpec, remote_python: str | None, serves: bool = False) -> tuple[str, ...]:
    """The task's command; on an SSH host it runs that host's python (the script path must exist there),
    in a container the image's. ``serves``: a PSS ps or worker task that only runs a server.

    The program starts through distlaunch.worker.bootstrap, so that an import or syntax error in it
    is recorded like any uncaught exception (and never retried). Locally the bootstrap is run by
    path: ``program.python`` need not have distlaunch installed; elsewhere it is.
    """
    program = loaded.spec.program
    python = remote_python or program.python or sys.executable
    if serves:
        return (python, "-m", program_scan.SERVE_MODULE)
    boot = (python, "-m", BOOTSTRAP_MODULE) if remote_python else (python, bootstrap.__file__)
    if loaded.script is not None:
        return (*boot, str(loaded.script), *program.args)
    return (*boot, "-m", program.module or "", *program.args)


def _assign_gpus(
    loaded: LoadedSpec, roles: Mapping[str, list[TaskEntry]]
) -> dict[tuple[str, int], tuple[int, ...]]:
    """Give every task its GPU indices; counts take the lowest indices no other task on its host holds."""
    claimed = {
        (loaded.address_of(e.host), g)
        for entries in roles.values()
        for e in entries
        if isinstance(e.gpus, tuple)
        for g in e.gpus
    }
    out: dict[tuple[str, int], tuple[int, ...]] = {}
    next_free: dict[str, int] = {}
    for role, entries in roles.items():
        for index, entry in enumerate(entries):
            machine = loaded.address_of(entry.host)
            if isinstance(entry.gpus, tuple):
                out[(role, index)] = entry.gpus
            elif isinstance(entry.gpus, int) and entry.gpus > 0:
                picked = []
                while len(picked) < entry.gpus:
                    gpu = next_free.get(machine, 0)
                    if (machine, gpu) not in claimed:
                        picked.append(gpu)
                    next_free[machine] = gpu + 1
                out[(role, index)] = tuple(picked)
            else:
                out[(role, index)] = ()
    return out


def _task_env(
    loaded: LoadedSpec,
    role: str,
    index: int,
    attempt: int,
    run_id: str,
    run_dir: Path,
    config: Mapping,
    gpus: tuple[int, ...],
    visible_gpus: str | None,
    keras: str,
    environ: Mapping[str, str],
) -> dict[str, str]:
    spec = loaded.spec
    # Defaults the spec's env may override: live logs, and TensorFlow's C++ INFO chatter (one
    # line per gRPC server, CUDA probe, ...) hidden while its warnings and errors still show.
    # The log files keep TensorFlow's C++ INFO lines (level 0); the console hides them unless
    # tf_log_level is "all" (console.TfNoise).
    env = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "0"}
    env.update(forwarded_env(spec.forward_env, environ))
    env.update(spec.program.env)
    if keras == contract.TF_KERAS:
        env["TF_USE_LEGACY_KERAS"] = "1"
    if spec.strategy == contract.PSS:
        # The PSS tutorial: without it a worker's failure can hang the coordinator's RPCs.
        env["GRPC_FAIL_FAST"] = "use_caller"
    env["CUDA_VISIBLE_DEVICES"] = _cuda_visible(gpus, visible_gpus)
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


def _cuda_visible(gpus: tuple[int, ...], visible_gpus: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a task: "" (CPU only) when it has no GPU.

    When the launcher itself sees only some GPUs, the spec's indices count within those.
    """
    if not gpus:
        return ""
    if visible_gpus:
        physical = [g.strip() for g in visible_gpus.split(",") if g.strip()]
        return ",".join(physical[g] if g < len(physical) else str(g) for g in gpus)
    return ",".join(str(g) for g in gpus)


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
        tasks.append(replace(task, env=env, log_file=log_file))
    return replace(plan, attempt=attempt, tasks=tuple(tasks))
