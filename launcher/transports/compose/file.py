"""The compose backend's pure half: the plan of a run in containers, and that plan as a compose file.

Every task is a compose service named after the task (``worker-0``), so TF_CONFIG names service
names and one fixed port: each container has its own network namespace, nothing collides. The
services share one network marked ``internal`` and publish no port: TensorFlow's gRPC servers
take work from anyone who reaches them, so nothing outside the project may. The shared dir is
bind-mounted at its own path, so every path in the plan and in run.json means the same file on
the host and in the containers.

Nothing here touches the machine (see compose_backend for running it). The file is plain JSON,
which is valid YAML: compose reads it as is, and no YAML library is needed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from distlaunch.launcher.core.backends import TaskTransport
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.plan import placement
from distlaunch.launcher.plan.cpu_fit import Topology
from distlaunch.launcher.plan.isolation import Isolation
from distlaunch.launcher.plan.placement import IMAGE_PYTHON, Placements
from distlaunch.launcher.plan.plan import Plan, TaskPlan, make_plan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.spec.model import LoadedSpec, task_json_path
from distlaunch.worker import chief_result, contract

# Every task's TensorFlow server port, inside its own container.
SERVICE_PORT = 2222
# The project's one network; `internal` keeps it from any route to the outside.
NETWORK = "cluster"
ISOLATION = Isolation(
    "compose",
    "every task runs in its own container on an internal compose network; no port is published",
)


def compose_plan(
    loaded: LoadedSpec, run_id: str, run_dir: Path, attempt: int = 0, cpus: Topology | None = None
) -> Plan:
    """The plan of one attempt in containers: the spec's tasks each in a container, reached at
    its service name (its task name) on SERVICE_PORT. ``cpus``: what the Docker host gives the
    run (its containers split it as local tasks do, each pinned by its service's ``cpuset``);
    None: not known, lists only.

    Raises SpecError for what containers cannot do yet: tasks on SSH hosts, and GPUs; and for
    `cpus` that do not fit the host.
    """
    where = placement.on_hosts(loaded)
    _check_fits(loaded, where)
    where = placement.with_cpus(loaded, where, {placement.THIS_MACHINE: cpus})
    placed = placement.in_containers(
        where, SERVICE_PORT, TaskTransport.COMPOSE, address=contract.task_name
    )
    return make_plan(loaded, placed, run_id, run_dir, attempt, isolation=ISOLATION)


def project_name(run_id: str) -> str:
    """The compose project of a run: its run id as compose accepts it (lowercase, [a-z0-9_-])."""
    return re.sub(r"[^a-z0-9_-]", "-", run_id.lower())


def container_name(project: str, task: str) -> str:
    """The name of a task's container, fixed so the launcher can find it without asking compose."""
    return f"{project}-{task}"


def compose_file(
    loaded: LoadedSpec, plan: Plan, image: str, user: str, supervised: bool = False
) -> dict[str, Any]:
    """The compose file of ``plan`` (a `compose_plan`): one service per task, running ``image`` as ``user``.

    ``user`` is "uid:gid": the tasks write checkpoints and status files into the shared dir on
    the host, which should belong to whoever ran the launcher, as with the local backend.
    ``supervised``: `distlaunch up` runs the file and stops a PSS run's servers itself. A file
    run by hand has nobody to do it: its chief tells the ps and worker tasks its result and they
    end with it (distlaunch.worker.chief_result), so `docker compose up` ends.
    """
    volumes = [
        {
            "type": "bind",
            "source": _literal(str(path)),
            "target": _literal(str(path)),
            "read_only": read_only,
        }
        for path, read_only in mounts(loaded)
    ]
    # A container does not inherit the launcher's umask: the image's python sets it, then execs
    # the task's argv (as data). Not `sh -c 'umask ...; exec "$@"'`: a shell drops environment
    # entries whose names are not shell identifiers, and a spec's env names are the user's.
    entrypoint = [
        "python",
        "-c",
        f"import os, sys; os.umask(0o{rundir.PRIVATE_UMASK:03o}); os.execvp(sys.argv[1], sys.argv[1:])",
    ]
    private = loaded.spec.permissions == "private"
    end = None if supervised else end_with_chief(loaded)
    services = {
        task.name: {
            "image": image,
            **({"entrypoint": entrypoint} if private else {}),
            # exec form: no shell in between
            "command": [_literal(arg) for arg in _told_argv(task, end)],
            "working_dir": _literal(task.cwd),
            "environment": {key: _literal(value) for key, value in _env(task, end).items()},
            "user": user,
            # docker-init as PID 1 passes SIGTERM on (a bare python as PID 1 ignores it) and
            # reaps whatever the program forks.
            "init": True,
            "volumes": volumes,
            "networks": [NETWORK],
            "restart": restart_policy(loaded, task.role),
            # Every digit, to the millisecond (``:g`` writes 1234567 as 1.23457e+06).
            "stop_grace_period": f"{stop_grace_s(loaded, plan):.3f}".rstrip("0").rstrip(".") + "s",
            # The task's CPUs (docker sets the container's affinity mask and cpuset cgroup).
            **({"cpuset": ",".join(map(str, task.cpus.ids))} if task.cpus.ids else {}),
        }
        for task in plan.tasks
    }
    return {"services": services, "networks": {NETWORK: {"internal": True}}}


def stop_grace_s(loaded: LoadedSpec, plan: Plan) -> float:
    """How long `docker compose stop` or `down` of the file waits between SIGTERM and SIGKILL.

    Docker's SIGTERM reaches the program (docker-init passes it on), and to a program that saves
    on a stop notice it is one: it gets the save's deadline, timeouts.save_s, where that is the
    longer; any other gets timeouts.grace_s, as at the launcher's teardown."""
    timeouts = loaded.spec.timeouts
    if plan.program.saves_on_notice:
        return max(timeouts.grace_s, timeouts.save_s)
    return timeouts.grace_s


def end_with_chief(loaded: LoadedSpec) -> chief_result.EndRule | None:
    """How a PSS run's servers end with the chief when the file runs by hand (None for MWMS):
    compose never restarts the chief (`restart_policy`), so its first failure is final."""
    if loaded.spec.strategy != contract.PSS:
        return None
    return chief_result.EndRule(0, loaded.spec.restart.final_exit_codes())


def _told_argv(task: TaskPlan, end: chief_result.EndRule | None) -> tuple[str, ...]:
    """The task's argv; with ``end``, the chief's runs under chief_result, which tells the
    servers its result."""
    if end is None or task.role != contract.CHIEF:
        return task.argv
    return (IMAGE_PYTHON, "-m", chief_result.__name__, "--", *task.argv)


def _env(task: TaskPlan, end: chief_result.EndRule | None) -> dict[str, str]:
    """The task's env; with ``end``, a ps or worker task's says how it ends with the chief."""
    if end is None or task.role not in (contract.PS, contract.WORKER):
        return dict(task.env)
    return {**task.env, contract.END_WITH_CHIEF: end.to_env()}


def mounts(loaded: LoadedSpec) -> list[tuple[Path, bool]]:
    """The host folders a container sees, each at its own path, with whether it is read-only.

    The shared dir (read-write: logs, checkpoints, status files), then the program's workdir and
    the script's folder, read-only: the containers run as the launcher's user and have no
    business changing the source. A folder inside one already mounted is not mounted again.
    """
    out = [(loaded.shared_dir, False)]
    code = [loaded.workdir] + ([loaded.script.parent] if loaded.script is not None else [])
    for folder in code:
        if not any(folder == seen or seen in folder.parents for seen, _ in out):
            out.append((folder, True))
    return out


def restart_policy(loaded: LoadedSpec, role: str) -> str:
    """Compose's ``restart`` for a role's containers: what of the spec's restart policy compose can do.

    `distlaunch up` restarts tasks itself (its supervisor decides, with the spec's budget and
    backoff) and starts each container with `compose run`, which ignores this key. For a user who
    runs the file with `docker compose up`, "on-failure" is expressible where a task restarts
    alone: a parameter-server worker (the coordinator waits for it). An MWMS failure restarts the
    whole gang and a ps takes the chief with it, which compose cannot express: those stay "no".
    """
    rules = loaded.spec.restart
    if (
        rules.policy == "on-failure"
        and loaded.spec.strategy == contract.PSS
        and role == contract.WORKER
    ):
        return f"on-failure:{rules.max_restarts}"
    return "no"


def _check_fits(loaded: LoadedSpec, where: Placements) -> None:
    """Refuse what containers here cannot run (``where``: the spec's placement), naming the
    spec's JSON path."""
    for row in where.rows:
        if row.transport == TaskTransport.SSH:
            raise SpecError(
                loaded.shown,
                task_json_path(loaded.raw, row.role, row.index, "host"),
                "the compose backend runs every task on this machine's Docker engine; expected a local host",
            )
        if row.gpus:
            raise SpecError(
                loaded.shown,
                task_json_path(loaded.raw, row.role, row.index, "gpus"),
                "the compose backend gives containers no GPU yet; remove gpus or use the local backend",
            )


def _literal(value: str) -> str:
    # Compose substitutes $VAR in every value of the file; a spec value is data, never a template.
    return value.replace("$", "$$")
