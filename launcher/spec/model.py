"""The cluster spec: a typed, validated, frozen model of the JSON file a user writes.

`load_spec` is the one way in: it reads the file, validates it and resolves relative paths
against the spec file's folder. Every problem becomes a `SpecError` naming the file, the JSON
path and what was expected, so the CLI can print one line and exit 2.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from distlaunch.launcher.core import backends
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec.records import Field, Invalid, Parsed, Record, after, before
from distlaunch.launcher.spec.records import json_schema as record_schema
from distlaunch.launcher.spec.sources import (
    Source,
    SpecOptions,
    apply_overrides,
    expand,
    json_path,
    preview,
    read_yaml,
    short_path,
)
from distlaunch.worker import contract

ROLES = (contract.CHIEF, contract.WORKER, contract.PS, contract.EVALUATOR)
# Environment names the launcher owns; a spec may not set them.
RESERVED_ENV = re.compile(r"^(TF_CONFIG|DISTLAUNCH_.*)$")
LOCAL_HOSTS = ("localhost", "127.0.0.1")
# A host's name in the spec, and an address: a DNS name or an IPv4 address (TF_CONFIG writes
# host:port, which an IPv6 literal would make ambiguous). Never starts with "-", so it cannot be
# read as an option by ssh.
_HOST_RE = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
# ssh options distlaunch sets itself: a spec that changed them would break connection sharing,
# the host-key policy or the launcher's hold on the remote task.
# At most this many tasks in one spec: TF_CONFIG lists every task in every task's environment,
# so a plan grows with the square of the count (50,000 tasks took 24 GB).
MAX_TASKS = 4096
# At most this many GPUs per task: a count is expanded into indices one by one.
MAX_GPUS = 1024
# At most this many CPUs per task (Linux's CONFIG_NR_CPUS maximum).
MAX_CPUS = 8192
OWNED_SSH_OPTIONS = (
    "BatchMode",
    "ConnectTimeout",
    "ControlMaster",
    "ControlPath",
    "ControlPersist",
    "ForkAfterAuthentication",
    "RemoteCommand",
    "RequestTTY",
    "SessionType",
    "StdinNull",
    "StrictHostKeyChecking",
)


def _port(value: Any) -> int | str:
    if value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535:
        return value
    raise ValueError(f'expected "auto" or a port number 1-65535, got {_shown(value)}')


def _gpus(value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_GPUS:
        return value
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_GPUS for v in value
    ):
        if len(set(value)) != len(value):
            raise ValueError(f"expected distinct GPU indices, got {_shown(value)}")
        return tuple(value)
    raise ValueError(
        f"expected a GPU count (integer 0-{MAX_GPUS}) or a list of GPU indices, got {_shown(value)}"
    )


def _cpus(value: Any) -> int | tuple[int, ...] | str:
    if value in ("auto", "all"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_CPUS:
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_CPUS for v in value)
    ):
        if len(set(value)) != len(value):
            raise ValueError(f"expected distinct CPU ids, got {_shown(value)}")
        return tuple(value)
    raise ValueError(
        f'expected "auto", "all", a CPU count (integer 1-{MAX_CPUS}) or a list of CPU ids, '
        f"got {_shown(value)}"
    )


Port = Annotated[
    int | str,
    Parsed(
        _port, {"oneOf": [{"const": "auto"}, {"type": "integer", "minimum": 1, "maximum": 65535}]}
    ),
]
Gpus = Annotated[
    int | tuple[int, ...] | None,
    Parsed(
        _gpus,
        {
            "oneOf": [
                {"type": "null"},
                {"type": "integer", "minimum": 0},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True},
            ]
        },
    ),
]

Cpus = Annotated[
    int | tuple[int, ...] | str,
    Parsed(
        _cpus,
        {
            "oneOf": [
                {"enum": ["auto", "all"]},
                {"type": "integer", "minimum": 1},
                {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0},
                    "minItems": 1,
                    "uniqueItems": True,
                },
            ]
        },
    ),
]


def _backend_name(value: Any) -> str:
    """A backend's name, as launcher/core/backends.py knows them (installed ones too)."""
    if isinstance(value, str):
        try:
            return backends.entry(value).name
        except backends.UnknownBackend:
            pass
    shown = [repr(name) for name in backends.names()]
    expected = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
    raise ValueError(f"input should be {expected}, got {_shown(value)}")


# The spec's `backend`: one of the registry's names; its schema lists those installed.
BackendName = Annotated[
    str,
    Parsed(_backend_name, lambda: {"enum": list(backends.names()), "type": "string"}),
]


class _PathError(ValueError):
    """A check that knows the JSON path it is about, relative to the model that raised it."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


class TaskEntry(Record):
    """One task of a role: where it runs and what it gets."""

    host: str = Field(
        "localhost",
        description='Host the task runs on: "localhost", "127.0.0.1" or a name from `hosts`.',
    )
    port: Port = Field("auto", description='"auto" or a fixed port number.')
    gpus: Gpus = Field(
        None,
        description="GPU count or list of GPU indices; none means CPU only "
        "(CUDA_VISIBLE_DEVICES is set so tasks on one host never share a GPU).",
    )
    cpus: Cpus = Field(
        "auto",
        description='"auto" (tasks sharing a machine split its CPUs; a task alone keeps them '
        'all), "all" (no pinning), a CPU count, or a list of CPU ids.',
    )


class RoleTasks(Record):
    """All tasks of one role. Written in JSON either as `{"count": N, ...}` or as a list of tasks."""

    entries: list[TaskEntry] = Field(min_length=1)

    @before
    def _from_json(cls, data: Any) -> Any:
        # Two spellings: a list of explicit tasks, or a count with settings shared by all.
        if isinstance(data, list):
            return {"entries": data}
        if isinstance(data, dict):
            unknown = set(data) - {"count", "host", "port", "gpus", "cpus"}
            if unknown:
                raise _PathError(
                    (sorted(unknown)[0],),
                    "unknown key; expected one of: count, host, port, gpus, cpus",
                )
            count = data.get("count", 1)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise _PathError(("count",), f"expected an integer >= 1, got {_shown(count)}")
            if count > MAX_TASKS:
                raise _PathError(
                    ("count",), f"expected at most {MAX_TASKS} tasks, got {_shown(count)}"
                )
            if count > 1 and isinstance(data.get("port"), int):
                raise _PathError(
                    ("port",),
                    "a fixed port needs one task; list the tasks to give each its own port",
                )
            if count > 1 and isinstance(data.get("cpus"), list):
                raise _PathError(
                    ("cpus",),
                    "a CPU list with a count > 1 gives every task the same CPUs; list the tasks "
                    "to give each its own CPUs, or give a CPU count",
                )
            shared = {k: v for k, v in data.items() if k != "count"}
            return {"entries": [shared] * count}
        raise ValueError('expected {"count": N, ...} or a list of tasks')

    def __len__(self) -> int:
        return len(self.entries)


class Tasks(Record):
    """Tasks by role, as TensorFlow names them in TF_CONFIG."""

    chief: RoleTasks | None = None
    worker: RoleTasks | None = None
    ps: RoleTasks | None = None
    evaluator: RoleTasks | None = None

    def by_role(self) -> dict[str, list[TaskEntry]]:
        """Return the roles that have tasks, in TF_CONFIG order, with their entries."""
        out = {}
        for role in ROLES:
            group = getattr(self, role)
            if group is not None:
                out[role] = group.entries
        return out


class Program(Record):
    """What every task runs: a script or a module, with args, env and working dir."""

    script: str | None = Field(None, description="Python script path (relative: to the spec).")
    module: str | None = Field(None, description="Python module run with `python -m`.")
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = Field(None, description="Working dir (default: the spec's folder).")
    python: str | None = Field(None, description="Interpreter (default: the launcher's).")
    keras: Literal["auto", "keras3", "tf_keras"] = Field(
        "auto",
        description="tf_keras sets TF_USE_LEGACY_KERAS=1 for tf.keras model.fit; auto picks it for a "
        "program whose source uses tf.keras or imports tf_keras and never imports keras, else keras3.",
    )

    @after
    def _one_entry_point(self) -> Program:
        if (self.script is None) == (self.module is None):
            raise ValueError('expected exactly one of "script" or "module"')
        for key in self.env:
            if RESERVED_ENV.match(key):
                raise _PathError(("env", key), "this variable is set by distlaunch; remove it")
        return self

    @after
    def _passable_to_a_process(self) -> Program:
        # These strings become argv, environment and paths verbatim; only what the kernel itself
        # cannot carry is refused (a NUL ends a C string; "=" ends an environment name).
        for key, value in self.env.items():
            if not key or "=" in key or "\0" in key:
                raise _PathError(
                    ("env", key),
                    'expected an environment name: not empty, no "=" and no NUL character',
                )
            _no_nul(value, ("env", key))
        for i, arg in enumerate(self.args):
            _no_nul(arg, ("args", i))
        for name in ("script", "module", "workdir", "python"):
            _no_nul(getattr(self, name), (name,))
        return self


def _no_nul(value: str | None, loc: tuple[str | int, ...]) -> None:
    if value is not None and "\0" in value:
        raise _PathError(loc, "expected no NUL character: it cannot be passed to a process")


class Host(Record):
    """A machine tasks are placed on by name: this one (`local`) or one reached over SSH."""

    transport: Literal["local", "ssh"] = Field(
        "ssh", description="local: this machine; ssh: over the system's ssh."
    )
    address: str | None = Field(
        None,
        pattern=_HOST_RE,
        max_length=253,
        description="Name or IPv4 address every host reaches this one at: TF_CONFIG names it and ssh "
        "connects to it (default: the host's name for ssh, 127.0.0.1 for local).",
    )
    user: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$", description="SSH login (default: ssh's)."
    )
    port: int | None = Field(
        None, ge=1, le=65535, description="SSH port (default: ssh's, usually 22)."
    )
    identity_file: str | None = Field(
        None, min_length=1, description="SSH private key (relative: to the spec)."
    )
    ssh_options: list[str] = Field(
        default_factory=list, description='More ssh options, each "Key=Value" as for `ssh -o`.'
    )
    python: str = Field(
        "python3",
        min_length=1,
        description="Interpreter on the host, e.g. a venv's python (program.python is for local tasks).",
    )
    workdir: str | None = Field(
        None, min_length=1, description="Remote working dir (default: the login dir)."
    )
    host_key_checking: Literal["yes", "accept-new"] = Field(
        "yes",
        description="yes: the host key must already be in known_hosts; accept-new: trust a new host's key once.",
    )
    connect_timeout_s: int = Field(
        10, ge=1, le=600, description="How long ssh may take to connect."
    )

    @after
    def _fits_transport(self) -> Host:
        if self.transport == "local":
            ssh_only = sorted(self.model_fields_set - {"transport", "address"})
            if ssh_only:
                raise _PathError((ssh_only[0],), 'only hosts with "transport": "ssh" take this key')
        for i, option in enumerate(self.ssh_options):
            key, sep, value = option.partition("=")
            if not (sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key) and value.strip()):
                raise _PathError(
                    ("ssh_options", i), f'expected "Key=Value" as for ssh -o, got {option!r}'
                )
            owned = {o.lower(): o for o in OWNED_SSH_OPTIONS}.get(key.lower())
            if owned:
                raise _PathError(("ssh_options", i), f"{owned} is set by distlaunch; remove it")
        for name in ("identity_file", "python", "workdir"):
            _no_nul(getattr(self, name), (name,))
        for i, option in enumerate(self.ssh_options):
            _no_nul(option, ("ssh_options", i))
        return self

    def address_of(self, name: str) -> str:
        """The address tasks and ssh use for this host, called ``name`` in the spec."""
        return self.address or ("127.0.0.1" if self.transport == "local" else name)


class Timeouts(Record):
    """How long the launcher waits before it calls something failed."""

    startup_s: float = Field(
        300.0, gt=0, description="Every training task must start its TensorFlow server within this."
    )
    grace_s: float = Field(5.0, ge=0, description="SIGTERM to SIGKILL grace period at teardown.")
    save_s: float = Field(
        30.0,
        gt=0,
        description="On a stop notice (SIGTERM or SIGUSR2 to `up`, `distlaunch down`) the tasks "
        "save and stop within this; the rest are then stopped (SIGTERM, grace_s, SIGKILL).",
    )
    run_s: float | None = Field(None, gt=0, description="Fail the whole run after this long.")
    heartbeat_s: float | None = Field(
        None,
        gt=0,
        description="A task whose distlaunch.worker heartbeat is older than this counts as failed "
        "(it stopped making progress). Off by default.",
    )
    silence_s: float | None = Field(
        None,
        gt=0,
        description="A task that writes no log output, no heartbeat and uses no CPU for this long "
        "is hung: the stacks of every task are captured, then the restart policy decides. Works "
        "for any program. Off by default.",
    )
    formation_s: float = Field(
        60.0,
        gt=0,
        description="Once every training task has started its TensorFlow server, the cluster must "
        "form within this: a task that has not connected to the coordination service by then "
        "cannot reach it, and the run fails saying so instead of waiting.",
    )
    evaluator_drain_s: float = Field(
        60.0,
        ge=0,
        description="After training succeeds, how long the evaluator may take to finish.",
    )


class Backoff(Record):
    """Delay before an automatic restart: initial_s, doubled per recent restart, at most max_s."""

    initial_s: float = Field(1.0, ge=0)
    max_s: float = Field(30.0, ge=0)


class Restart(Record):
    """When failed tasks are started again, and how often."""

    policy: Literal["never", "on-failure"] = Field(
        "never",
        description="never: a failure ends the run. on-failure: restart what the strategy needs.",
    )
    max_restarts: int = Field(
        3, ge=0, description="Automatic restarts allowed (within window_s if set)."
    )
    backoff: Backoff = Field(default_factory=Backoff)
    window_s: float | None = Field(
        None,
        gt=0,
        description="Count only restarts this recent against max_restarts (default: the whole run).",
    )
    non_retryable_exit_codes: list[int] = Field(
        default_factory=lambda: [2],
        description="Exit codes that mean the program is wrong and are never retried "
        "(so are Python's import and syntax errors, read from the task's error file).",
    )
    standby: bool = Field(
        True,
        description="With a restart policy, keep one warm standby per local task (an interpreter "
        "that has imported TensorFlow) so that a restart skips the import; costs its memory.",
    )

    def final_exit_codes(self) -> tuple[int, ...]:
        """The non-retryable exit codes a process can exit with (1-255), sorted, once each: what
        an engine that restarts by itself (compose, Kubernetes) is told never to retry."""
        return tuple(sorted({c for c in self.non_retryable_exit_codes if 0 < c < 256}))


# Kubernetes names: a namespace is a DNS label, a PersistentVolumeClaim a DNS subdomain.
K8S_LABEL = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
K8S_SUBDOMAIN = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$"
# An image reference (registry/name:tag@digest): no space, quote or shell character in it.
IMAGE_REF = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
# A Kubernetes quantity such as "500m", "2" or "8Gi".
K8S_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"


class Kubernetes(Record):
    """What `distlaunch k8s` writes into the manifests beyond the tasks themselves."""

    namespace: str | None = Field(
        None, pattern=K8S_LABEL, description="Namespace of every object (default: kubectl's)."
    )
    image: str | None = Field(
        None,
        pattern=IMAGE_REF,
        max_length=512,
        description="Image every task runs; it must hold distlaunch and the program (default: distlaunch:local).",
    )
    pvc: str | None = Field(
        None,
        pattern=K8S_SUBDOMAIN,
        max_length=253,
        description="PersistentVolumeClaim (ReadWriteMany) mounted as the shared dir; none: a per-pod emptyDir, "
        "lost with the pod.",
    )
    ttl_s: int = Field(
        86400,
        ge=0,
        description="ttlSecondsAfterFinished: finished Jobs and their pods go after this.",
    )
    cpu: str | None = Field(
        None, pattern=K8S_QUANTITY, description='CPU of every task (requests and limits), e.g. "2".'
    )
    memory: str | None = Field(
        None, pattern=K8S_QUANTITY, description='Memory of every task, e.g. "8Gi".'
    )


class Network(Record):
    """How a run across hosts keeps its task ports to itself (local runs: see `isolation`)."""

    protect: Literal["auto", "off", "required"] = Field(
        "auto",
        description="auto: for the run's lifetime each remote host admits connections to the "
        "run's task ports only from the run's own hosts and loopback (an nftables table per run, "
        "held by a guard on the host; needs root or CAP_NET_ADMIN there), and `up` names the hosts "
        "whose ports stay open where it cannot. required: such a host stops the run before "
        "anything starts. off: no firewall.",
    )


class SlurmOptions(Record):
    """How the Slurm backend places tasks on the allocation's nodes."""

    tasks_per_node: int | None = Field(
        None,
        ge=1,
        description="Fill each node with this many tasks before the next one (default: spread the "
        "tasks over the nodes, one at a time).",
    )


class Spec(Record):
    """A whole cluster spec as the user wrote it (paths still relative)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=64)
    strategy: Literal["multi_worker_mirrored", "parameter_server"]
    program: Program
    tasks: Tasks
    shared_dir: str = "./runs"
    timeouts: Timeouts = Field(default_factory=Timeouts)
    restart: Restart = Field(default_factory=Restart)
    host_template: Host | None = Field(
        None, description="Settings every host of `hostfile` starts from (user, python, ...)."
    )
    hostfile: str | None = Field(
        None,
        min_length=1,
        description="A host file (relative: to the spec), one SSH host per line as "
        "`node1 slots=4`; its hosts join `hosts` with host_template's settings. slots caps "
        "per_host.",
    )
    hosts: dict[str, Host] = Field(
        default_factory=dict,
        description="Machines by name, for tasks' `host`; localhost needs no entry.",
    )
    forward_env: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_*?\[\]!-]+$")]] = Field(
        default_factory=list,
        description='Names or glob patterns ("NCCL_*") of the launcher\'s environment variables '
        "sent to every task on every backend; secret-looking values are masked in plan.",
    )
    tf_log_level: Literal["default", "all"] = Field(
        "default",
        description="default: the console hides TensorFlow's C++ INFO lines and its known "
        "harmless start-up warnings (oneDNN, CUDA probes, cpu_feature_guard, absl); the log "
        "files keep them. all: the console shows everything.",
    )
    shared_dir_is_shared: bool = Field(
        True,
        description="true: every SSH host sees shared_dir at the same path (a shared mount). false: each "
        "host writes its run files to that path on its own disk; `distlaunch collect RUN` copies them back.",
    )
    isolation: Literal["auto", "off"] = Field(
        "auto",
        description="auto: when every task runs on this machine's loopback and the machine allows it, "
        "the run's tasks share a private network namespace with loopback only, so their unauthenticated "
        "TensorFlow ports cannot be reached from outside the run (and the tasks cannot reach the "
        "network: no downloads). "
        "off: tasks use the machine's network; their ports are open to anyone who can reach them.",
    )
    permissions: Literal["private", "shared"] = Field(
        "private",
        description="private: the run dir and everything the launcher and tasks create are "
        "owner-only (dirs 0700, files 0600; tasks run with umask 077). "
        "shared: they follow your umask, so others may read them.",
    )
    backend: BackendName = Field(
        backends.DEFAULT,
        description="local: tasks are processes on this machine or its SSH hosts. compose: every task "
        "runs in a container of its own (the distlaunch image, built from this checkout) on an "
        "internal docker-compose network with no published port; TF_CONFIG names service names "
        "(worker-0:2222), the shared dir is mounted at the same path, and the image's python runs "
        "the program (program.python, task ports and isolation do not apply). "
        "slurm: inside a Slurm allocation (salloc, sbatch), every task is a job step on a node of "
        "the allocation; a task's `host` names a node, or is left out to be placed. "
        "`distlaunch up --backend` overrides it.",
    )

    network: Network = Field(
        default_factory=Network, description="The firewall of SSH hosts and Slurm nodes."
    )
    slurm: SlurmOptions = Field(
        default_factory=SlurmOptions,
        description="Placement on Slurm nodes (the other backends ignore it).",
    )
    kubernetes: Kubernetes = Field(
        default_factory=Kubernetes,
        description="Settings of `distlaunch k8s` (the other backends ignore them).",
    )

    @after
    def _shared_dir_passable(self) -> Spec:
        _no_nul(self.shared_dir, ("shared_dir",))
        return self

    @after
    def _host_names(self) -> Spec:
        for name in self.hosts:
            if name in LOCAL_HOSTS or not re.fullmatch(_HOST_RE, name):
                raise _PathError(
                    ("hosts", name),
                    f"expected a host name (letters, digits, '.', '-', '_'; not {' or '.join(LOCAL_HOSTS)}), got {name!r}",
                )
        return self

    @after
    def _roles_fit_strategy(self) -> Spec:
        roles = self.tasks.by_role()
        total = sum(len(entries) for entries in roles.values())
        if total > MAX_TASKS:
            raise _PathError(("tasks",), f"expected at most {MAX_TASKS} tasks in all, got {total}")
        if self.strategy == "multi_worker_mirrored":
            if contract.WORKER not in roles and contract.CHIEF not in roles:
                raise _PathError(("tasks",), "expected at least one worker (or a chief)")
            if contract.PS in roles:
                raise _PathError(("tasks", contract.PS), "ps tasks need strategy parameter_server")
        else:
            if contract.PS not in roles:
                raise _PathError(
                    ("tasks", contract.PS), "parameter_server needs at least one ps task"
                )
            if contract.CHIEF not in roles:
                raise _PathError(
                    ("tasks", contract.CHIEF), "parameter_server needs a chief (the coordinator)"
                )
            if contract.WORKER not in roles:
                raise _PathError(
                    ("tasks", contract.WORKER), "parameter_server needs at least one worker"
                )
        for role in (contract.CHIEF, contract.EVALUATOR):
            if role in roles and len(roles[role]) > 1:
                raise _PathError(
                    ("tasks", role), f"expected one {role} task, got {len(roles[role])}"
                )
        return self


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec plus where it came from, with every path made absolute."""

    spec: Spec
    file: Path
    raw: dict[str, Any]
    shared_dir: Path
    workdir: Path
    script: Path | None
    # The spec's hosts with identity files made absolute (relative ones are relative to the spec).
    hosts: Mapping[str, Host] = field(default_factory=dict)
    # What errors call the spec: the path given (or "<spec>", the Python API's spec as data).
    shown: str = ""

    def address_of(self, host: str) -> str:
        """The address of the host a task names: what TF_CONFIG lists (127.0.0.1 for localhost)."""
        return _machine(self.spec, host)

    def ssh_host(self, name: str) -> Host | None:
        """The SSH host called ``name``; None when tasks on ``name`` run on this machine."""
        host = self.hosts.get(name)
        return host if host is not None and host.transport == "ssh" else None


def json_schema() -> dict[str, Any]:
    """Return the JSON Schema of the cluster spec file."""
    schema = record_schema(Spec)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "distlaunch cluster spec"
    return schema


YAML_SUFFIXES = (".yaml", ".yml")


def load_spec(path: str | Path, options: SpecOptions = SpecOptions()) -> LoadedSpec:
    """Read, validate and resolve the spec at ``path`` (JSON, or YAML for .yaml/.yml) with the
    command line's ``options`` applied first; raise SpecError on any problem."""
    file = Path(path)
    shown = str(path)
    source = _read(file, shown)
    try:
        apply_overrides(source, options.overrides, shown)
        expand(source, file.resolve().parent, shown, options)
        return _validate(source.raw, file, shown)
    except SpecError as exc:
        raise source.locate(exc) from None


def load_spec_data(
    raw: Mapping[str, Any], base: Path, shown: str, options: SpecOptions = SpecOptions()
) -> LoadedSpec:
    """Validate and resolve a spec given as data (the Python API's dict), relative paths against
    ``base``; errors name ``shown`` where a file's would name the file. ``raw`` is not changed."""
    if not isinstance(raw, Mapping):
        raise SpecError(shown, "$", f"expected a mapping, got {type(raw).__name__}")
    source = Source(raw=copy.deepcopy(dict(raw)), file=shown)
    try:
        apply_overrides(source, options.overrides, shown)
        expand(source, base.resolve(), shown, options)
        return _validate(source.raw, base / shown, shown)
    except SpecError as exc:
        raise source.locate(exc) from None


def _read(file: Path, shown: str) -> Source:
    """The raw spec in ``file`` (YAML by its suffix, else JSON), checked for duplicate keys."""
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(shown, "$", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(shown, "$", f"cannot read: {exc}") from None
    if file.suffix.lower() in YAML_SUFFIXES:
        try:
            source = read_yaml(text, shown)
        except RecursionError:
            raise SpecError(shown, "$", "invalid YAML: nested too deeply") from None
        if not isinstance(source.raw, dict):
            raise SpecError(shown, "$", "expected a YAML mapping")
        return source
    try:
        raw = json.loads(text, object_pairs_hook=_DupCheckingDict.from_pairs, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise SpecError(
            shown, "$", f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise SpecError(shown, "$", "invalid JSON: nested too deeply") from None
    try:
        dup = _find_duplicate_key(raw, ())
    except RecursionError:
        raise SpecError(shown, "$", "nested too deeply; expected a cluster spec") from None
    if dup is not None:
        loc, key = dup
        where = _json_path(loc + (key,))
        raise SpecError(shown, where, f"key {preview(key)} appears twice; expected it once")
    if not isinstance(raw, dict):
        raise SpecError(shown, "$", "expected a JSON object")
    return Source(raw=raw, file=shown)


def _validate(raw: dict[str, Any], file: Path, shown: str) -> LoadedSpec:
    try:
        try:
            spec = Spec.model_validate(raw)
        except Invalid as exc:
            raise _first_error(shown, exc) from None
    except RecursionError:
        # json's own limit let it through, but walking it is still too deep: no spec is.
        raise SpecError(shown, "$", "nested too deeply; expected a cluster spec") from None
    return _resolve(spec, file, shown, raw)


# An integer literal longer than this is no number a spec needs (and Python refuses to convert
# one over 4300 digits); it stays a string so that validation names its JSON path.
_MAX_INT_DIGITS = 100


def _parse_int(text: str) -> int | str:
    return int(text) if len(text) <= _MAX_INT_DIGITS else f"{text[:12]}... ({len(text)} digits)"


def _shown(value: Any) -> str:
    """``value`` as JSON for an error message, cut short: a message is one readable line."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _exists(path: Path, test: Callable[[Path], bool]) -> bool:
    """``test(path)``, false where the OS cannot even look (a name longer than NAME_MAX raises
    ENAMETOOLONG, which ``Path.is_file`` lets through on Python 3.11)."""
    try:
        return test(path)
    except OSError:
        return False


def _resolve(spec: Spec, file: Path, shown: str, raw: dict[str, Any]) -> LoadedSpec:
    """Resolve relative paths against the spec file's folder and check what must exist."""
    base = file.resolve().parent
    workdir = (base / spec.program.workdir).resolve() if spec.program.workdir else base
    if not _exists(workdir, Path.is_dir):
        raise SpecError(
            shown,
            "$.program.workdir",
            f"expected an existing directory, got {preview(str(workdir), 80)}",
        )
    script = None
    if spec.program.script is not None:
        script = (base / spec.program.script).resolve()
        if not _exists(script, Path.is_file):
            raise SpecError(
                shown,
                "$.program.script",
                f"expected an existing script file, got {preview(str(script), 80)}",
            )
    elif not re.fullmatch(
        r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", spec.program.module or ""
    ):
        raise SpecError(
            shown, "$.program.module", f"expected a dotted module name, got {spec.program.module!r}"
        )
    hosts = _resolve_hosts(spec, base, shown)
    if backends.entry(spec.backend).hosts_are_nodes:
        _check_fits_nodes(spec, shown, raw)
    else:
        _check_task_hosts(spec, shown, raw)
    _check_unique_ports(spec, shown, raw)
    _check_gpus(spec, shown, raw)
    _check_python(spec, workdir, shown)
    shared_dir = (base / spec.shared_dir).resolve()
    _check_shared_dir(shared_dir, shown)
    return LoadedSpec(
        spec=spec,
        file=file,
        raw=raw,
        shared_dir=shared_dir,
        workdir=workdir,
        script=script,
        hosts=hosts,
        shown=shown,
    )


def _check_python(spec: Spec, workdir: Path, shown: str) -> None:
    """program.python must be an executable here when a task runs here: else every start fails
    with exit 127 (which a restart policy would retry)."""
    python = spec.program.python
    hosts = [e.host for entries in spec.tasks.by_role().values() for e in entries]
    local = any(not _is_ssh(spec, host) for host in hosts)
    if python is None or backends.entry(spec.backend).own_python or not local:
        return
    # A path with a slash is relative to the task's working dir (where it is executed from).
    found = str(workdir / python) if "/" in python else shutil.which(python)
    if found is None or not (os.path.isfile(found) and os.access(found, os.X_OK)):
        raise SpecError(
            shown, "$.program.python", f"expected an executable interpreter, got {python!r}"
        )


def _check_shared_dir(shared_dir: Path, shown: str) -> None:
    """The shared dir must be a folder, or creatable: its nearest existing ancestor a folder."""
    for path in (shared_dir, *shared_dir.parents):
        if path.exists():
            if not path.is_dir():
                what = f"expected a directory, but {str(path)!r} is a file"
                raise SpecError(shown, "$.shared_dir", what)
            return


def _resolve_hosts(spec: Spec, base: Path, shown: str) -> dict[str, Host]:
    """The spec's hosts with identity files made absolute; each must exist."""
    out = {}
    for name, host in spec.hosts.items():
        if host.identity_file is not None:
            identity = (base / Path(host.identity_file).expanduser()).resolve()
            if not identity.is_file():
                raise SpecError(
                    shown,
                    f"$.hosts.{name}.identity_file",
                    f"expected an existing key file, got {str(identity)!r}",
                )
            host = host.model_copy(update={"identity_file": str(identity)})
        out[name] = host
    return out


def _check_task_hosts(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
    """Every task names a known host, and local tasks are reachable when other tasks are remote."""
    names = ", ".join([*LOCAL_HOSTS, *spec.hosts])
    entries = [
        (role, i, e) for role, group in spec.tasks.by_role().items() for i, e in enumerate(group)
    ]
    for role, i, entry in entries:
        if entry.host not in LOCAL_HOSTS and entry.host not in spec.hosts:
            raise SpecError(
                shown,
                _task_path(raw, role, i, "host"),
                f"unknown host {entry.host!r}; expected one of: {names}",
            )
    remote = any(_is_ssh(spec, e.host) for _, _, e in entries)
    for role, i, entry in entries:
        if remote and not _is_ssh(spec, entry.host) and _is_loopback(_machine(spec, entry.host)):
            fix = (
                f"set $.hosts.{entry.host}.address to"
                if entry.host in spec.hosts
                else 'name this machine in $.hosts with "transport": "local" and'
            )
            raise SpecError(
                shown,
                _task_path(raw, role, i, "host"),
                f"tasks on SSH hosts cannot reach a task on {entry.host!r} (loopback); {fix} "
                "the address the other hosts reach this machine at",
            )


def _check_fits_nodes(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
    """Where the backend allocates the nodes (Slurm), a task's host is a node of the allocation
    (checked when `up` starts), SSH hosts do not apply, and it picks the GPU devices: a task
    asks for a count."""
    if spec.hosts:
        raise SpecError(
            shown,
            "$.hosts",
            f"the {spec.backend} backend runs tasks on the allocation's nodes; remove `hosts`",
        )
    for role, entries in spec.tasks.by_role().items():
        for i, entry in enumerate(entries):
            if isinstance(entry.gpus, tuple):
                raise SpecError(
                    shown,
                    _task_path(raw, role, i, "gpus"),
                    f"expected a GPU count under Slurm (it picks the devices), got the list {list(entry.gpus)}",
                )
            if isinstance(entry.cpus, tuple):
                raise SpecError(
                    shown,
                    _task_path(raw, role, i, "cpus"),
                    'expected a CPU count, "auto" or "all" under Slurm (it picks the CPUs), '
                    f"got the list {list(entry.cpus)}",
                )


def _is_ssh(spec: Spec, host: str) -> bool:
    return host in spec.hosts and spec.hosts[host].transport == "ssh"


def _is_loopback(address: str) -> bool:
    return address == "localhost" or address.startswith("127.")


def _machine(spec: Spec, host: str) -> str:
    """Which machine a task's host is, for per-machine checks: its address (127.0.0.1 for this one)."""
    if host in spec.hosts:
        return spec.hosts[host].address_of(host)
    # Not "localhost": it may resolve to ::1 first, which TensorFlow then dials.
    return "127.0.0.1"


def _check_unique_ports(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
    seen: dict[tuple[str, int], str] = {}
    for role, entries in spec.tasks.by_role().items():
        for i, entry in enumerate(entries):
            if isinstance(entry.port, int):
                key = (_machine(spec, entry.host), entry.port)
                where = _task_path(raw, role, i, "port")
                if key in seen:
                    raise SpecError(
                        shown,
                        where,
                        f"port {entry.port} is already used by {seen[key]}; expected a unique port",
                    )
                seen[key] = where


def _check_gpus(spec: Spec, shown: str, raw: dict[str, Any]) -> None:
    """Explicit GPU lists of tasks on one host must not overlap."""
    owner: dict[tuple[str, int], str] = {}
    for role, entries in spec.tasks.by_role().items():
        for i, entry in enumerate(entries):
            if isinstance(entry.gpus, tuple):
                for gpu in entry.gpus:
                    where = _task_path(raw, role, i, "gpus")
                    key = (_machine(spec, entry.host), gpu)
                    if key in owner:
                        raise SpecError(
                            shown,
                            where,
                            f"GPU {gpu} is already given to {owner[key]}; tasks on one host never share a GPU",
                        )
                    owner[key] = where


def task_json_path(raw: dict[str, Any], role: str, index: int, key: str) -> str:
    """Return the JSON path where task ``role:index``'s ``key`` is written in the raw spec."""
    return _task_path(raw, role, index, key)


def _task_path(raw: dict[str, Any], role: str, index: int, key: str) -> str:
    group = raw.get("tasks", {}).get(role)
    if isinstance(group, list):
        return _json_path(("tasks", role, index, key))
    return _json_path(("tasks", role, key))


class _DupCheckingDict(dict):
    """A JSON object that remembers a key it saw twice (json.loads keeps the last silently)."""

    duplicate: str | None = None

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, Any]]) -> _DupCheckingDict:
        obj = cls()
        for key, value in pairs:
            if key in obj and obj.duplicate is None:
                obj.duplicate = key
            obj[key] = value
        return obj


def _find_duplicate_key(
    node: Any, loc: tuple[str | int, ...]
) -> tuple[tuple[str | int, ...], str] | None:
    if isinstance(node, _DupCheckingDict):
        if node.duplicate is not None:
            return loc, node.duplicate
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for key, child in items:
        found = _find_duplicate_key(child, loc + (key,))
        if found:
            return found
    return None


def _json_path(loc: tuple[str | int, ...]) -> str:
    """``loc`` as an error message shows it: a long key (JSON has no key length bound) is cut."""
    return short_path(json_path(loc))


def _first_error(shown: str, err: Invalid) -> SpecError:
    """Turn the first problem into one line with a JSON path the user can find."""
    loc = err.loc
    # RoleTasks parses lists into "entries": show the path as the user wrote it.
    loc = tuple(
        p for i, p in enumerate(loc) if not (p == "entries" and i >= 2 and loc[i - 2] == "tasks")
    )
    if isinstance(err.error, _PathError):
        return SpecError(shown, _json_path(loc + err.error.loc), err.error.message)
    kind = err.kind
    if loc[:2] == ("program", "env") and kind != "extra_forbidden":
        # Environment values are often secrets: the message says what was expected, never the value.
        what = "an object of names and string values" if len(loc) == 2 else "a string"
        message = f"expected {what} (the value is not shown: it may be a secret)"
        return SpecError(shown, _json_path(loc), message)
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        msg = f"unknown key {preview(loc[-1])}; expected one of: {', '.join(allowed)}"
    elif kind == "missing":
        msg = "required key is missing"
    elif kind == "value_error":
        msg = str(err.error)
    else:
        msg = f"{_lower_first(err.msg)}, got {_shown(err.value)}"
    return SpecError(shown, _json_path(loc), msg)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _allowed_keys(loc: tuple[str | int, ...]) -> list[str]:
    """The keys the model at JSON location ``loc`` accepts (for 'unknown key' messages)."""
    model: Any = Spec
    in_map = False
    for part in loc:
        if in_map:  # a name in a name -> model map, like `node1` in $.hosts.node1
            in_map = False
            continue
        if model is RoleTasks:
            model = TaskEntry if isinstance(part, int) else None
            continue
        found = model.fields().get(part) if isinstance(part, str) else None
        model = _model_in(found[0]) if found else None
        if model is None:
            return []
        in_map = get_origin(found[0]) is dict
    if model is RoleTasks:
        return ["count", "host", "port", "gpus", "cpus"]
    return list(model.fields())


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, Record):
        return annotation
    for arg in get_args(annotation) if get_origin(annotation) else ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None
