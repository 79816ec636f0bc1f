"""The compose transport: every task in a container of its own, under one docker-compose project.

It has LocalTransport's interface, so the supervisor runs a compose run exactly like a local one.
Each task is a local child process (procs.spawn) of

    compose -p PROJECT -f FILE run --rm --no-deps --use-aliases -T --name PROJECT-worker-0 worker-0

which creates the task's container, streams its output into the task's log file, and exits with
the container's exit code; the pidfd of that process is the task's exit event. Facts this relies
on, checked against docker-compose 1.29 and Docker 20.10 (v2's `docker compose` takes the same
flags but was not available to check):
- `--use-aliases` gives a `run` container its service name on the network (TF_CONFIG's hosts);
- concurrent `run`s of a fresh project race to create its network and all but one fail, so
  `open_transport` creates the network first (`up --no-start` with every service scaled to 0);
- `run` ignores the service's `restart` key, and `--rm` removes the container when it ends;
- a container killed with `docker kill` exits 137 (128 + SIGKILL), and `run` exits with that;
- killing the `run` process does NOT stop its container: the launcher stops containers by name
  (`stop`), removes a leftover before starting a task again (`start`), and `down` at the end
  removes everything the project has, one-off containers included;
- a stop notice (`notify`) is `docker kill --signal SIGTERM`: it reaches the container's PID 1,
  docker-init (the file's ``init: true``), which passes a signal on to its child, the task's
  program, alone (not to its process group: tini without ``-g``), as taskinit's NOTICE does for
  a local task.

The compose backend needs a local engine: bind mounts name host paths, and `joined` reads the
container's sockets through /proc of its pid, the way the local transport does.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from distlaunch.launcher.core.console import Console
from distlaunch.launcher.diagnosis import stacks
from distlaunch.launcher.plan.plan import Plan, TaskPlan
from distlaunch.launcher.record import rundir
from distlaunch.launcher.record.state import RunRecord, TaskRecord
from distlaunch.launcher.spec.model import LoadedSpec
from distlaunch.launcher.transports import procs
from distlaunch.launcher.transports.base import Opened, TaskStacks, UpOptions
from distlaunch.launcher.transports.compose import DEFAULT_BASE, DEFAULT_TAG
from distlaunch.launcher.transports.compose import file as compose
from distlaunch.launcher.transports.compose.docker import (
    compose_command,
    container_pid,
    docker,
    run,
)
from distlaunch.launcher.transports.compose.image import (
    ImageRequest,
    ensure_image,
    pip_ca_bundle,
)
from distlaunch.launcher.transports.helper import HELPER_MODULE
from distlaunch.launcher.transports.local.cpus import this_machine
from distlaunch.worker import contract

# The run dir's file with every docker and compose command the launcher ran, and their output.
DOCKER_LOG = "docker.log"
COMPOSE_FILE = "docker-compose.yml"
# After its container stopped, a `run` process only removes the container and exits.
CLIENT_EXIT_S = 10.0
PROJECT_LABEL = "com.docker.compose.project"


def task_stacks(container: str, run_id: str, task: str, native: bool) -> stacks.Source:
    """Where the stacks of ``task`` are read: in its container, by the remote helper the image
    has (``docker exec``: py-spy there, as the container's user; where it lacks ptrace rights, the
    program's own faulthandler, signalled there). The local `compose run` process that stands for
    the task is never read or signalled: it is not the program."""
    argv = ["docker", "exec", "-i", container, "python", "-m", HELPER_MODULE]
    return stacks.helper(argv, run_id, task, native, f"in container {container}")


class ComposeHandle(procs.TaskProcess):
    """One task's `compose run` process (its exit code is the container's) and its container."""

    def __init__(self, task: TaskPlan, proc: subprocess.Popen, container: str) -> None:
        super().__init__(task, proc)
        self.container = container
        self._container_pid: int | None = None

    def joined(self) -> bool:
        """Whether the task's TensorFlow server listens on its port inside its container."""
        if self._container_pid is None:
            # One `docker inspect` per check until the container runs; then only /proc reads.
            self._container_pid = container_pid(self.container)
            if self._container_pid is None:
                return False
        return procs.listening(self._container_pid, self.task.port)


class ComposeTransport:
    """Starts and stops tasks as containers of one compose project (see the module docstring)."""

    def __init__(
        self, project: str, file: Path, log: Path, service_env: Mapping[str, Mapping[str, str]]
    ) -> None:
        self.project = project
        self.file = file
        self.log = log
        self.service_env = service_env
        self._started: set[str] = set()

    def compose(self, *args: str) -> list[str]:
        """The compose command line for this project."""
        return [*compose_command(), "--project-name", self.project, "--file", str(self.file), *args]

    def start(self, task: TaskPlan) -> ComposeHandle:
        """Start one task in a new container; its output goes to its log file."""
        name = compose.container_name(self.project, task.name)
        if task.name in self._started:
            # A restart: the previous container is stopped, but `run --rm` may not have removed it.
            docker("rm", "--force", name, check=False)
        self._started.add(task.name)
        # What differs from the file (a restart's attempt number and error file) is passed as
        # `-e NAME`, its value taken from the `run` process's environment: no value on a command
        # line, and no compose interpolation of it.
        changed = {k: v for k, v in task.env.items() if self.service_env[task.name].get(k) != v}
        flags = [arg for key in changed for arg in ("-e", key)]
        argv = self.compose(
            "run", "--rm", "--no-deps", "--use-aliases", "-T", "--name", name, *flags, task.name
        )
        rundir.create_file(task.log_file)
        proc = procs.spawn(argv, changed, str(self.file.parent), task.log_file)
        return ComposeHandle(task, proc, name)

    def stop(self, handles: Sequence[ComposeHandle], grace_s: float) -> None:
        """Stop the tasks' containers (SIGTERM, ``grace_s``, SIGKILL) and reap their `run` processes."""
        if not handles:
            return
        # `docker stop` stops them side by side; one not created yet is refused, and `down` removes it.
        docker(
            "stop", "--time", str(math.ceil(grace_s)), *(h.container for h in handles), check=False
        )
        deadline = time.monotonic() + CLIENT_EXIT_S
        for handle in handles:
            try:
                handle.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        procs.stop_groups([h.proc for h in handles], 0)

    def notify(self, handles: Sequence[ComposeHandle]) -> bool:
        """Send each task a stop notice: SIGTERM to its container's init, which passes it on to
        the program alone (see the module docstring); all containers in one command."""
        if handles:
            docker(
                "kill", "--signal", "SIGTERM", *(h.container for h in handles),
                check=False, log=self.log,
            )  # fmt: skip
        return True

    def kill(self, handles: Sequence[ComposeHandle]) -> None:
        """Kill the tasks' containers now and reap their `run` processes."""
        # `docker stop --time 0` sends SIGKILL right after SIGTERM.
        self.stop(handles, 0)

    def stacks(self, handle: ComposeHandle, native: bool) -> stacks.Source:
        """The task's program, read in its container (see `task_stacks`)."""
        run_id = handle.task.env.get(contract.RUN_ID, "")
        return task_stacks(handle.container, run_id, handle.task.name, native)

    def down(self, grace_s: float) -> None:
        """Remove every container, network and volume of the project, then check that none is left."""
        run(
            self.compose(
                "down", "--volumes", "--remove-orphans", "--timeout", str(math.ceil(grace_s))
            ),
            check=False,
            log=self.log,
        )
        # Whatever `down` missed (a container created after it looked) goes by the project's label.
        left = docker(
            "ps",
            "--all",
            "--quiet",
            "--filter",
            f"label={PROJECT_LABEL}={self.project}",
            check=False,
        ).split()
        if left:
            docker("rm", "--force", "--volumes", *left, check=False, log=self.log)

    def describe(self) -> ComposeProject:
        """What run.json records about the project, enough to inspect or remove it by hand."""
        return ComposeProject(self.project, self.file, tuple(compose_command()))


@contextmanager
def open_transport(
    loaded: LoadedSpec, plan: Plan, image: ImageRequest, console: Console
) -> Iterator[ComposeTransport]:
    """Build or reuse the image, write the compose file and create the network; on the way out,
    whatever happened (success, failure, Ctrl-C), remove the project."""
    compose_command()  # fail now, not after a build of minutes, when there is no compose
    run_dir = Path(plan.run_dir)
    log = run_dir / DOCKER_LOG
    rundir.create_file(log)
    started = time.monotonic()
    built = ensure_image(image, log, pip_ca_bundle(), announce=console.say)
    if built.built:
        console.say(f"image {image.tag}: built in {time.monotonic() - started:.0f} s")
    project = compose.project_name(plan.run_id)
    file = run_dir / COMPOSE_FILE
    user = f"{os.getuid()}:{os.getgid()}"
    # `up` stops the servers itself: they serve until it does, as on every backend.
    data = compose.compose_file(loaded, plan, image.tag, user, supervised=True)
    write_compose_file(file, data)
    service_env = {task.name: dict(task.env) for task in plan.tasks}
    transport = ComposeTransport(project, file, log, service_env)
    try:
        # The network alone (every service scaled to 0): concurrent `run`s would race to create it.
        scale = [arg for task in plan.tasks for arg in ("--scale", f"{task.name}=0")]
        run(transport.compose("up", "--no-start", *scale), log=log)
        yield transport
    finally:
        # A second Ctrl-C must not cut the teardown short and leave containers running; `down`
        # inherits the ignored SIGINT, which reaches it too from a terminal.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            transport.down(loaded.spec.timeouts.grace_s)
        finally:
            signal.signal(signal.SIGINT, previous)


class ComposeLaunch:
    """One `up` of the compose backend: plan the containers, then open the project."""

    def __init__(self, loaded: LoadedSpec, console: Console, image: ImageRequest) -> None:
        self.loaded = loaded
        self.console = console
        self.image = image

    def plan(self, run_id: str, run_dir: Path, attempt: int) -> Plan:
        """Tasks as containers reached at their service names (compose_file.compose_plan)."""
        return compose.compose_plan(self.loaded, run_id, run_dir, attempt, this_machine(None))

    @contextmanager
    def open(self, plan: Plan) -> Iterator[Opened]:
        """The image, the compose file and the network (see `open_transport`)."""
        with open_transport(self.loaded, plan, self.image, self.console) as transport:
            note = f"compose project {transport.project}: {compose.ISOLATION.reason}"
            yield Opened(transport, section=transport.describe(), notes=(note,))


@dataclass(frozen=True)
class ComposeProject:
    """The compose backend's run.json section: the run's project, its file, and the compose
    command that ran it."""

    project: str
    file: Path
    command: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ComposeProject:
        """Read the section."""
        return cls(
            str(data.get("project", "")),
            Path(str(data.get("file", ""))),
            tuple(str(a) for a in data.get("command") or ()),
        )

    def to_json(self) -> dict[str, Any]:
        """The section as JSON data."""
        return {"project": self.project, "file": str(self.file), "command": list(self.command)}


class ComposeBackend:
    """The `compose` backend (a `transports.base.Backend`): every task in a container."""

    name: ClassVar[str] = "compose"
    title: ClassVar[str] = "compose"

    def plan(self, loaded: LoadedSpec, run_id: str, run_dir: Path, attempt: int) -> Plan:
        """Tasks as containers reached at their service names (compose_file.compose_plan)."""
        return compose.compose_plan(loaded, run_id, run_dir, attempt, this_machine(None))

    @contextmanager
    def open(
        self, loaded: LoadedSpec, console: Console, options: UpOptions
    ) -> Iterator[ComposeLaunch]:
        """One `up`, its tasks in containers of ``options.image``."""
        image = ImageRequest(options.image or DEFAULT_TAG, options.base_image or DEFAULT_BASE)
        yield ComposeLaunch(loaded, console, image)

    @contextmanager
    def cleanup(self, record: RunRecord, run_dir: Path, grace_s: float) -> Iterator[list[str]]:
        """After the sweep (the `compose run` clients), remove the whole project: its
        containers outlive a SIGKILLed launcher."""
        yield []
        project = self.section(record)
        if project is not None:
            log = run_dir / "logs" / "compose-down.log"
            ComposeTransport(project.project, project.file, log, {}).down(grace_s)

    @contextmanager
    def stacks(self, record: RunRecord, run_dir: Path) -> Iterator[TaskStacks]:
        """Each task by the helper in its container (`task_stacks`)."""
        project = self.section(record)
        name = project.project if project else ""

        def read(plan: dict, entry: TaskRecord, native: bool) -> stacks.Source:
            task = plan.get("name", "")
            container = compose.container_name(name, task)
            return task_stacks(container, record.run_id, task, native)

        yield read

    def section(self, record: RunRecord) -> ComposeProject | None:
        """The project ``record`` keeps (None: a run of another backend)."""
        if record.backend != self.name or record.section is None:
            return None
        return ComposeProject.from_json(record.section)


def write_compose_file(path: Path, data: dict) -> None:
    """Write a compose file (JSON, which compose reads as YAML) readable by its owner only:
    the environment in it may hold the program's secrets."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # also when the file was there before, with another mode
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
