"""The typed spec: frozen dataclasses made from data the schema has passed.

`Spec.of` builds a spec from valid, spread data (spec/model.py's `load_spec` is the way in from a
file); `Spec.model_validate` checks data first, for the Python API's typed spec. Nothing here
reads a file or checks across fields (spec/checks.py does).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from distlaunch.launcher.core import backends
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.spec import checker, files, rules
from distlaunch.launcher.spec.hosts import expand
from distlaunch.launcher.spec.invalid import Invalid, json_path, short_path, shown, spec_error
from distlaunch.launcher.spec.sources import Source, SpecOptions
from distlaunch.worker import contract

ROLES = (contract.CHIEF, contract.WORKER, contract.PS, contract.EVALUATOR)
# Environment names the launcher owns; a spec may not set them.
RESERVED_ENV = re.compile(rules.RESERVED_ENV)

# A task's GPUs: a count, a tuple of indices, or None (CPU only).
Gpus = int | tuple[int, ...] | None
# A task's CPUs: a count, a tuple of CPU ids, "all" (no pinning) or "auto".
Cpus = int | tuple[int, ...] | str


def _int(value: Any) -> int:
    """A valid integer (JSON Schema counts 2.0 as the integer 2)."""
    return int(value)


def _ints(value: Any) -> Any:
    """A count or a list of indices as the model holds them (a list becomes a tuple)."""
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return value if value is None or isinstance(value, str) else int(value)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class TaskEntry:
    """One task of a role: where it runs and what it gets."""

    host: str = "localhost"
    port: int | str = "auto"
    gpus: Gpus = None
    cpus: Cpus = "auto"

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> TaskEntry:
        """A task from valid data."""
        port = data.get("port", "auto")
        return cls(
            host=data.get("host", "localhost"),
            port=port if isinstance(port, str) else _int(port),
            gpus=_ints(data.get("gpus")),
            cpus=_ints(data.get("cpus", "auto")),
        )


@dataclass(frozen=True)
class Tasks:
    """Tasks by role, as TensorFlow names them in TF_CONFIG (None: no such role)."""

    chief: tuple[TaskEntry, ...] | None = None
    worker: tuple[TaskEntry, ...] | None = None
    ps: tuple[TaskEntry, ...] | None = None
    evaluator: tuple[TaskEntry, ...] | None = None

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Tasks:
        """The roles from valid data whose `per_host` roles are spread already (a count of
        at most MAX_TASKS: the schema bounds it)."""
        roles: dict[str, tuple[TaskEntry, ...]] = {}
        for role in ROLES:
            group = data.get(role)
            if isinstance(group, list):
                roles[role] = tuple(TaskEntry.of(entry) for entry in group)
            elif isinstance(group, dict):
                shared = TaskEntry.of(group)
                roles[role] = (shared,) * _int(group.get("count", 1))
        return cls(**roles)

    def by_role(self) -> dict[str, list[TaskEntry]]:
        """Return the roles that have tasks, in TF_CONFIG order, with their entries."""
        return {role: list(group) for role in ROLES if (group := getattr(self, role)) is not None}


@dataclass(frozen=True)
class Program:
    """What every task runs: a script or a module, with args, env and working dir."""

    script: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    python: str | None = None
    keras: Literal["auto", "keras3", "tf_keras"] = "auto"

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Program:
        """The program from valid data."""
        return cls(
            **{**data, "args": tuple(data.get("args", ())), "env": dict(data.get("env", {}))}
        )


@dataclass(frozen=True)
class Host:
    """A machine tasks are placed on by name: this one (`local`) or one reached over SSH."""

    transport: Literal["local", "ssh"] = "ssh"
    address: str | None = None
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    ssh_options: tuple[str, ...] = ()
    python: str = "python3"
    workdir: str | None = None
    host_key_checking: Literal["yes", "accept-new"] = "yes"
    connect_timeout_s: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "ssh_options", tuple(self.ssh_options))

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Host:
        """The host from valid data."""
        port = data.get("port")
        values = {**data, "port": None if port is None else _int(port)}
        if "connect_timeout_s" in data:
            values["connect_timeout_s"] = _int(data["connect_timeout_s"])
        return cls(**values)

    @classmethod
    def model_validate(cls, data: Any) -> Host:
        """A host from data checked against the schema's host (as run.json records one)."""
        try:
            checker.validate____defs_host(data, {}, "data")
        except Invalid as exc:
            raise spec_error("<host>", data, exc) from None
        return cls.of(data)

    def model_dump(self, mode: str = "json") -> dict[str, Any]:
        """The host as JSON data (what `model_validate` reads back)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def address_of(self, name: str) -> str:
        """The address tasks and ssh use for this host, called ``name`` in the spec."""
        return self.address or ("127.0.0.1" if self.transport == "local" else name)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Timeouts:
    """How long the launcher waits before it calls something failed (seconds)."""

    startup_s: float | None = 300.0  # None: no deadline
    grace_s: float = 5.0
    save_s: float = 30.0
    run_s: float | None = None
    heartbeat_s: float | None = None
    silence_s: float | None = None
    formation_s: float = 60.0
    evaluator_drain_s: float = 60.0

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Timeouts:
        """The timeouts from valid data."""
        return cls(**{key: _float(value) for key, value in data.items()})


@dataclass(frozen=True)
class Backoff:
    """Delay before an automatic restart: initial_s, doubled per recent restart, at most max_s."""

    initial_s: float = 1.0
    max_s: float = 30.0


@dataclass(frozen=True)
class Restart:
    """When failed tasks are started again, and how often."""

    policy: Literal["never", "on-failure"] = "never"
    max_restarts: int = 3
    backoff: Backoff = field(default_factory=Backoff)
    window_s: float | None = None
    non_retryable_exit_codes: tuple[int, ...] = (2,)
    standby: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "non_retryable_exit_codes", tuple(self.non_retryable_exit_codes))
        if isinstance(self.backoff, Mapping):  # written as the spec writes it
            object.__setattr__(self, "backoff", Backoff(**self.backoff))

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Restart:
        """The restart policy from valid data."""
        values = dict(data)
        if "max_restarts" in data:
            values["max_restarts"] = _int(data["max_restarts"])
        if "backoff" in data:
            values["backoff"] = {k: float(v) for k, v in data["backoff"].items()}
        if "window_s" in data:
            values["window_s"] = _float(data["window_s"])
        if "non_retryable_exit_codes" in data:
            values["non_retryable_exit_codes"] = _ints(data["non_retryable_exit_codes"])
        return cls(**values)

    def final_exit_codes(self) -> tuple[int, ...]:
        """The non-retryable exit codes a process can exit with (1-255), sorted, once each: what
        an engine that restarts by itself (compose, Kubernetes) is told never to retry."""
        return tuple(sorted({c for c in self.non_retryable_exit_codes if 0 < c < 256}))


@dataclass(frozen=True)
class Elastic:
    """An elastic run: a world of ``min_workers``..``max_workers`` workers chosen from the worker
    role's tasks (its slots), and the budgets and timings of resizing it."""

    min_workers: int
    max_workers: int
    sizes: tuple[int, ...] | None = None  # None: every size in the range
    batch: Literal["global", "per_worker"] = "global"
    resizes: int = 10
    lost_after_s: float = 10.0
    settle_s: float = 10.0
    interval_s: float = 30.0
    cooldown_s: float = 30.0
    cooldown_max_s: float = 600.0
    probe_s: float = 5.0

    @classmethod
    def of(cls, data: Mapping[str, Any], slots: int) -> Elastic:
        """The section from valid data; ``slots``, the worker role's task count, is MAX where
        ``workers`` is written "MIN:" (spec/checks.py checks the range against it)."""
        low, _, high = data["workers"].partition(":")
        values = {k: v for k, v in data.items() if k != "workers"}
        for key in ELASTIC_SECONDS:
            if key in values:
                values[key] = float(values[key])
        if "resizes" in values:
            values["resizes"] = _int(values["resizes"])
        if values.get("sizes") is not None:
            values["sizes"] = tuple(int(n) for n in values["sizes"])
        return cls(min_workers=int(low), max_workers=int(high) if high else slots, **values)

    @property
    def range_text(self) -> str:
        """The range as the spec writes it, MAX filled in: "2:3"."""
        return f"{self.min_workers}:{self.max_workers}"

    def accepted(self) -> tuple[int, ...]:
        """The world sizes a run may take, smallest first: the range, less what ``sizes``
        leaves out."""
        span = range(self.min_workers, self.max_workers + 1)
        return tuple(n for n in span if self.sizes is None or n in self.sizes)

    def to_json(self) -> dict[str, Any]:
        """The section as `plan --json` shows it: MIN and MAX apart, every value filled in."""
        return {
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            **{f.name: _plain(getattr(self, f.name)) for f in fields(self)[2:]},
            "accepted": list(self.accepted()),
        }


# Elastic's durations (seconds): floats however they were written.
ELASTIC_SECONDS = (
    "lost_after_s",
    "settle_s",
    "interval_s",
    "cooldown_s",
    "cooldown_max_s",
    "probe_s",
)


@dataclass(frozen=True)
class Kubernetes:
    """What `distlaunch k8s` writes into the manifests beyond the tasks themselves."""

    namespace: str | None = None
    image: str | None = None
    pvc: str | None = None
    ttl_s: int = 86400
    cpu: str | None = None
    memory: str | None = None

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Kubernetes:
        """The settings from valid data."""
        values = dict(data)
        if "ttl_s" in data:
            values["ttl_s"] = _int(data["ttl_s"])
        return cls(**values)


@dataclass(frozen=True)
class Network:
    """How a run across hosts keeps its task ports to itself (local runs: see `isolation`)."""

    protect: Literal["auto", "off", "required"] = "auto"


@dataclass(frozen=True)
class SlurmOptions:
    """How the Slurm backend places tasks on the allocation's nodes."""

    tasks_per_node: int | None = None


@dataclass(frozen=True)
class Spec:
    """A whole cluster spec as the user wrote it (paths still relative), host files and
    `per_host` spread into `hosts` and task lists."""

    name: str
    strategy: Literal["multi_worker_mirrored", "parameter_server"]
    program: Program
    tasks: Tasks
    shared_dir: str = "./runs"
    timeouts: Timeouts = field(default_factory=Timeouts)
    restart: Restart = field(default_factory=Restart)
    elastic: Elastic | None = None  # None: the worker count is fixed
    host_template: Host | None = None
    hostfile: str | None = None
    hosts: Mapping[str, Host] = field(default_factory=dict)
    forward_env: tuple[str, ...] = ()
    tf_log_level: Literal["default", "all"] = "default"
    shared_dir_is_shared: bool = True
    isolation: Literal["auto", "off"] = "auto"
    permissions: Literal["private", "shared"] = "private"
    backend: str = backends.DEFAULT
    network: Network = field(default_factory=Network)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    kubernetes: Kubernetes = field(default_factory=Kubernetes)
    # The data it was made from, as written (the Python API sends it to the launcher process).
    data: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, data: Mapping[str, Any], written: Mapping[str, Any]) -> Spec:
        """The spec from valid, spread data; ``written`` is the data as the user wrote it."""
        parts = {
            "program": Program.of,
            "tasks": Tasks.of,
            "timeouts": Timeouts.of,
            "restart": Restart.of,
            "network": lambda d: Network(**d),
            "slurm": lambda d: SlurmOptions(
                None if d.get("tasks_per_node") is None else _int(d["tasks_per_node"])
            ),
            "kubernetes": Kubernetes.of,
            "host_template": lambda d: None if d is None else Host.of(d),
            "hosts": lambda d: {name: Host.of(host) for name, host in d.items()},
            "forward_env": tuple,
        }
        values = {key: parts.get(key, _same)(value) for key, value in data.items()}
        if data.get("elastic") is not None:  # "MIN:" reads the worker role's (spread) tasks
            slots = len(values["tasks"].worker or ())
            values["elastic"] = Elastic.of(data["elastic"], slots)
        return cls(**values, data=written)

    @classmethod
    def model_validate(cls, data: Any) -> Spec:
        """A typed spec from data (the Python API's): SpecError where it is not one."""
        if not isinstance(data, Mapping):
            raise SpecError("<spec>", "$", f"expected a mapping, got {type(data).__name__}")
        raw = copy.deepcopy(dict(data))
        check_schema(raw, "<spec>")
        spread = copy.deepcopy(raw)
        expand(Source(spread, "<spec>"), Path.cwd(), "<spec>", SpecOptions())
        return cls.of(spread, raw)

    def model_dump(self, mode: str = "json", exclude_unset: bool = True) -> dict[str, Any]:
        """The spec as the data it was made from (the values that were set)."""
        return copy.deepcopy(dict(self.data))


def _same(value: Any) -> Any:
    return value


def check_schema(raw: Any, shown: str) -> None:
    """SpecError for the first value the schema refuses (or a number no schema can hold)."""
    try:
        files.check_numbers(raw, ())
        checker.validate(raw, {}, "data")
        name = raw.get("backend", backends.DEFAULT)
        try:
            backends.entry(name)
        except backends.UnknownBackend:
            names = [repr(n) for n in backends.names()]
            expected = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
            raise SpecError(shown, "$.backend", f"expected {expected}, got {shown_value(name)}")
    except Invalid as exc:
        raise spec_error(shown, raw, exc) from None
    except files.BadNumber as exc:
        raise SpecError(shown, short_path(json_path(exc.loc)), exc.message) from None
    except RecursionError:
        raise SpecError(shown, "$", "nested too deeply; expected a cluster spec") from None


shown_value = shown
