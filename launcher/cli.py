"""The `distlaunch` command line. The only place where errors become exit codes (`exit_codes`).

Exit codes: 0 success, 1 a task failed, 2 bad spec or usage (or an SSH host failed preflight or
`collect`, Docker cannot start a compose run, or the network sandbox cannot be made: nothing was
started, the fix is in the spec or on the host), 128+N interrupted by signal N.
"""

from __future__ import annotations

import atexit
import enum
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from distlaunch.launcher.core import backends
from distlaunch.launcher.core.errors import (
    HostError,
    Interrupted,
    LaunchError,
    Preempted,
    RecordError,
    RunFailed,
    SpecError,
    UsageError,
)
from distlaunch.launcher.transports.compose import DEFAULT_BASE, DEFAULT_TAG
from distlaunch.worker import contract

# Every command imports what it needs in its body: `--help`, and a command's start, pay only
# for their own (the spec's parsing, the run dir, the supervisor... are imported by those that use them).
if TYPE_CHECKING:
    from distlaunch.launcher.core.console import Console
    from distlaunch.launcher.spec.sources import SpecOptions


class ExitCode(enum.IntEnum):
    """What `distlaunch` exits with."""

    OK = 0
    FAILED = 1  # a task failed (or the run could not be recorded)
    USAGE = 2  # bad spec or usage, or a host, engine or sandbox that cannot run it: nothing started
    SIGNALLED = 128  # plus N: interrupted by signal N, after every task was stopped
    PREEMPTED = contract.EXIT_PREEMPTED  # saved on a stop notice: `up --resume` continues


def exit_codes() -> dict[type[LaunchError], ExitCode]:
    """Each error's exit code; an error not listed gets its nearest listed base class's."""
    from distlaunch.launcher.network.netns import SandboxError
    from distlaunch.launcher.transports.compose.docker import DockerError

    return {
        LaunchError: ExitCode.FAILED,
        RunFailed: ExitCode.FAILED,
        Preempted: ExitCode.PREEMPTED,
        RecordError: ExitCode.FAILED,
        SpecError: ExitCode.USAGE,
        UsageError: ExitCode.USAGE,
        HostError: ExitCode.USAGE,
        DockerError: ExitCode.USAGE,
        SandboxError: ExitCode.USAGE,
    }


def exit_code(error: LaunchError) -> int:
    """The exit code for ``error``."""
    if isinstance(error, Interrupted):
        return ExitCode.SIGNALLED + error.signum
    codes = exit_codes()
    return next(codes[cls] for cls in type(error).__mro__ if cls in codes)


class BackendChoice(click.Choice):
    """`--backend`: one of launcher/core/backends.py's names. The list (which scans the installed
    entry points) is made only when shown or when a name is not built in: `--help` and an `up`
    of a built-in backend do not pay for it."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        """Every backend's name."""
        return backends.names()

    @choices.setter
    def choices(self, _value: object) -> None:
        """click.Choice sets its list; this one's comes from the registry."""

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> object:
        """``value`` when it is a built-in backend's name, else click.Choice's check."""
        if isinstance(value, str) and value in backends.BUILTIN:
            return value
        return super().convert(value, param, ctx)


@dataclass
class Settings:
    """Options shared by subcommands, kept in click's ``ctx.obj``."""

    shared_dir: Path = Path("./runs")


def _keep_shared_dir(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.ensure_object(Settings).shared_dir = Path(value)


# Declared once, accepted before the subcommand (`distlaunch --shared-dir X status`) and after it
# (`distlaunch status RUN --shared-dir X`, which wins); the subcommands read ctx.obj.
SHARED_DIR = click.option(
    "--shared-dir",
    expose_value=False,
    callback=_keep_shared_dir,
    help="Where runs are looked up by id.  [default: ./runs]",
)

SPEC = click.argument("spec", type=click.Path(dir_okay=False, path_type=str))
SET = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override a spec value before it is validated, e.g. tasks.worker.count=4 or "
    '\'program.args=["--epochs","1"]\' (the value is read as YAML/JSON). Repeatable.',
)
HOSTS = click.option(
    "--hosts",
    "only_hosts",
    metavar="NAMES",
    default="",
    help="Comma-separated: run only on these hosts of the spec (per_host spreads over them).",
)
EXCLUDE = click.option(
    "--exclude",
    "exclude_hosts",
    metavar="NAMES",
    default="",
    help="Comma-separated: leave these hosts of the spec out.",
)


def _options(
    overrides: tuple[str, ...], only_hosts: str = "", exclude_hosts: str = ""
) -> SpecOptions:
    """The spec options of the command line's --set, --hosts and --exclude."""
    from distlaunch.launcher.spec.sources import SpecOptions

    return SpecOptions(
        overrides=overrides,
        only_hosts=tuple(n for n in only_hosts.split(",") if n.strip()),
        exclude_hosts=tuple(n for n in exclude_hosts.split(",") if n.strip()),
    )


IMAGE = click.option(
    "--image",
    envvar="DISTLAUNCH_IMAGE",
    default=DEFAULT_TAG,
    show_default=True,
    help="Compose backend: the distlaunch image's tag (`up` builds it from this checkout when it changed).",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="distlaunch")
@SHARED_DIR
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Turn one cluster spec file into a running TensorFlow multi-worker cluster."""
    ctx.ensure_object(Settings)


@cli.command()
@SPEC
@SET
def validate(spec: str, overrides: tuple[str, ...]) -> None:
    """Check SPEC and print a one-line verdict; exit 2 when it is malformed."""
    from distlaunch.launcher.spec.model import load_spec

    loaded = load_spec(spec, _options(overrides))
    counts = ", ".join(f"{len(v)} {k}" for k, v in loaded.spec.tasks.by_role().items())
    click.echo(f"{spec}: ok ({loaded.spec.strategy}; {counts})")


@cli.command()
@SPEC
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@SET
@HOSTS
@EXCLUDE
def plan(
    spec: str, as_json: bool, overrides: tuple[str, ...], only_hosts: str, exclude_hosts: str
) -> None:
    """Dry run: print every task's command, env and TF_CONFIG without starting anything.

    `auto` ports are picked as `up` would pick them; `up` picks again when it starts.
    """
    from distlaunch.launcher.network import firewall
    from distlaunch.launcher.run.up import build_plan, choose_run
    from distlaunch.launcher.spec.model import load_spec
    from distlaunch.launcher.transports.ssh.transport import jumped_hosts

    loaded = load_spec(spec, _options(overrides, only_hosts, exclude_hosts))
    the_plan = build_plan(loaded, choose_run(loaded, None, False))
    data = the_plan.to_json()
    rules = firewall.run_rules(the_plan, jumped_hosts(loaded.hosts))
    data["network"] = firewall.plan_json(loaded.spec.network.protect, rules)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(
        f"run {data['run_id']}: {data['strategy']}, {len(data['tasks'])} tasks, run dir {data['run_dir']}"
    )
    click.echo(f"isolation: {data['isolation']['mode']} ({data['isolation']['reason']})")
    click.echo(f"keras: {data['program']['keras']} ({data['program']['keras_reason']})")
    if data["program"]["serve_reason"]:
        click.echo(f"roles: {data['program']['serve_reason']}")
    click.echo(
        _standby_line(data, loaded.spec.restart.policy != "never" and loaded.spec.restart.standby)
    )
    if data["network"]["hosts"]:
        click.echo(
            "firewall of the SSH hosts and Slurm nodes (added before any task starts, removed at "
            "the end):"
        )
        for rule in rules.values():
            click.echo(f"  {rule.describe()}")
    elif rules:
        click.echo('firewall: off ("network": {"protect": "off"}): remote task ports stay open')
    else:
        click.echo(
            "firewall: none needed (no task on an SSH host or Slurm node; local tasks: see isolation)"
        )
    # Every value a spec controls is printed shell-quoted: one line per item, copy-pasteable.
    for task in data["tasks"]:
        ssh = task.get("transport") == backends.TaskTransport.SSH
        over = f" (SSH host {task['host_name']})" if ssh else ""
        click.echo(f"\n{task['name']} on {task['host']}:{task['port']}{over}")
        click.echo(f"  command: {_shell_join(task['argv'])}")
        click.echo(f"  cwd:     {_shell_join([task['cwd']])}")
        click.echo(f"  gpus:    {','.join(map(str, task['gpus'])) or 'none (CPU only)'}")
        click.echo(f"  cpus:    {_cpus_text(task)}")
        if task["threads"]:
            kept = set(task["threads_kept"])
            shown = [
                f"{k}={v}" + (" (yours, kept)" if k in kept else "")
                for k, v in task["threads"].items()
            ]
            click.echo(f"  threads: {', '.join(shown)}")
        click.echo(f"  log:     {_shell_join([task['log_file']])}")
        click.echo("  env:")
        for key, value in task["env"].items():
            click.echo(f"    {_shell_join([f'{key}={value}'])}")


def _cpus_text(task: dict) -> str:
    """`plan`'s words for a task's CPUs (its ``cpus`` in `plan --json`)."""
    from distlaunch.launcher.plan.cpu_fit import cpulist, cpus_word

    cpus = task["cpus"]
    how, ids, count = cpus["how"], cpus["ids"], cpus["count"]
    if count == 0:
        if how == "auto":
            return "auto (split on the host when `up` has probed it)"
        return "all (not pinned)"
    where = cpulist(ids) if ids else "picked by the machine"
    shared = ", shared by the auto tasks: more tasks than CPUs" if cpus["shared"] else ""
    return f"{where} ({cpus_word(count)}, {how}{shared})"


def _standby_line(data: dict, wanted: bool) -> str:
    """`plan`'s line on warm standbys (``wanted``: the spec's restart settings ask for them): on
    or off, and what the program's env writes before its TensorFlow import make of them."""
    program = data["program"]
    cold = program["standby_cold"]
    if not data["standby"]:
        if not wanted:
            return "standbys: off"
        if not program["uses_tensorflow"]:
            return "standbys: off (the program imports no TensorFlow)"
        return f"standbys: off (restarts are cold: {cold})" if cold else "standbys: off"
    if cold:  # PSS: the servers get standbys, the program does not
        return f"standbys: on for the servers; the program restarts cold: {cold}"
    first = (
        f"; each first sets what the program sets before importing TensorFlow: "
        f"{', '.join(program['standby_env'])}"
        if program["standby_env"]
        else ""
    )
    return (
        f"standbys: on (one warm interpreter per task for restarts{first}; "
        '"restart": {"standby": false} turns them off)'
    )


@cli.command()
@SPEC
@click.argument("task")
def tfconfig(spec: str, task: str) -> None:
    """Print the TF_CONFIG of TASK (e.g. worker:1) for launching it by hand."""
    from distlaunch.launcher.plan import tfconfig as tfc
    from distlaunch.launcher.run.up import build_plan, choose_run
    from distlaunch.launcher.spec.model import load_spec

    loaded = load_spec(spec)
    the_plan = build_plan(loaded, choose_run(loaded, None, False))
    try:
        found = the_plan.task(task)
    except KeyError:
        names = ", ".join(t.name.replace("-", ":") for t in the_plan.tasks)
        raise UsageError(f"no task {task!r} in {spec}; expected one of: {names}") from None
    click.echo(tfc.dumps(found.tf_config))


@cli.command()
def schema() -> None:
    """Print the JSON Schema of the cluster spec."""
    from distlaunch.launcher.spec.model import json_schema

    click.echo(json.dumps(json_schema(), indent=2))


@cli.command()
@SPEC
@click.option("--run-id", help="Use this run id; an existing run with this id is resumed.")
@click.option("--resume", is_flag=True, help="Resume the latest unfinished run of this spec.")
@click.option("--fresh", is_flag=True, help="Start a new run even if the last one did not finish.")
@click.option(
    "--backend",
    type=BackendChoice(),
    help="Where tasks run (default: the spec's `backend`): local processes, one container each under "
    "docker-compose, or one Slurm job step each inside the current allocation.",
)
@IMAGE
@click.option(
    "--base-image",
    envvar="DISTLAUNCH_BASE_IMAGE",
    default=DEFAULT_BASE,
    show_default=True,
    help="Compose backend: the image the distlaunch image is built on (python3 3.11+ with venv).",
)
@click.option(
    "--requeue",
    is_flag=True,
    help="Slurm batch job: on the pre-timeout signal (SIGUSR2) stop the tasks and requeue the job, "
    "which then resumes the run (what `distlaunch sbatch --requeue` writes).",
)
@SET
@HOSTS
@EXCLUDE
def up(
    spec: str,
    run_id: str | None,
    resume: bool,
    fresh: bool,
    backend: str | None,
    image: str,
    base_image: str,
    requeue: bool,
    overrides: tuple[str, ...],
    only_hosts: str,
    exclude_hosts: str,
) -> None:
    """Start every task of SPEC, stream their output, and supervise the run to its end."""
    from distlaunch.launcher.core.console import Console
    from distlaunch.launcher.run.up import choose_run, claim_and_up
    from distlaunch.launcher.spec.model import load_spec
    from distlaunch.launcher.transports.base import UpOptions

    if resume and fresh:
        raise UsageError("--resume and --fresh exclude each other")
    # --backend replaces the spec's before validation: what a task's `host` may name depends on it.
    if backend is not None:
        overrides = (*overrides, f"backend={backend}")
    loaded = load_spec(spec, _options(overrides, only_hosts, exclude_hosts))
    console = Console(quiet_tf=loaded.spec.tf_log_level == "default")
    if not (resume or fresh or run_id):
        resume = _offer_resume(loaded, console)
    target = choose_run(loaded, run_id, resume)
    # The one path `distlaunch.launch` takes too (launcher/api/child.py).
    try:
        claim_and_up(loaded, target, console, UpOptions(image, base_image, requeue))
    except RunFailed:
        _say_report(console, target.run_dir)
        raise


@cli.command("compose")
@SPEC
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the file here (default: standard output).",
)
@click.option("--run-id", help="The run the containers write into (default: a new run id).")
@IMAGE
def compose_file(spec: str, output: Path | None, run_id: str | None, image: str) -> None:
    """Write a docker-compose file that runs SPEC with one container per task.

    Services are named after the tasks (worker-0); TF_CONFIG names them at port 2222 on an
    internal network, and no port is published. The shared dir is mounted at its own path, and
    the run dir is created there (the containers write checkpoints and status files into it). The
    image must exist: `distlaunch up --backend compose` builds it, or
    `docker build -f docker/Dockerfile -t IMAGE .` in this checkout.
    """
    from distlaunch.launcher.core.console import Console
    from distlaunch.launcher.record import rundir
    from distlaunch.launcher.run.up import choose_run
    from distlaunch.launcher.spec.model import load_spec
    from distlaunch.launcher.transports.compose import file as compose
    from distlaunch.launcher.transports.compose.transport import write_compose_file
    from distlaunch.launcher.transports.local.cpus import this_machine

    loaded = load_spec(spec)
    target = choose_run(loaded, run_id, False)
    plan = compose.compose_plan(
        loaded, target.run_id, target.run_dir, target.attempt, this_machine(None)
    )
    data = compose.compose_file(loaded, plan, image, f"{os.getuid()}:{os.getgid()}")
    rundir.make_dirs(target.run_dir, target.attempt, loaded.spec.permissions == "private")
    if output is None:
        click.echo(json.dumps(data, indent=2))
        where = "FILE"
    else:
        write_compose_file(output, data)
        where = str(output)
    Console().say(
        f"run dir {plan.run_dir}; start it with `docker compose -p {compose.project_name(plan.run_id)} -f {where} up` "
        "(or docker-compose)"
    )


@cli.command("k8s")
@SPEC
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the manifests here (default: standard output).",
)
@click.option(
    "--image",
    help="Image of every task (default: the spec's kubernetes.image, else distlaunch:local).",
)
@click.option(
    "--namespace",
    help="Namespace of every object (default: the spec's kubernetes.namespace, else kubectl's).",
)
@click.option(
    "--jobset",
    is_flag=True,
    help="Emit one JobSet (restarts the whole set on a failure) instead of plain Jobs.",
)
@click.option(
    "--run-id",
    help="The run's id: its run dir on the shared volume, and its objects' names (default: a new one).",
)
def k8s_manifests(
    spec: str,
    output: Path | None,
    image: str | None,
    namespace: str | None,
    jobset: bool,
    run_id: str | None,
) -> None:
    """Write Kubernetes manifests that run SPEC: one Indexed Job per role, or one JobSet.

    A headless Service names the pods (<job>-<index>.<service>), a NetworkPolicy admits the task
    port from the run's own pods only, and each pod builds its TF_CONFIG from its index. Apply
    them with `kubectl apply -f FILE`.
    """
    from distlaunch.launcher.core.console import Console
    from distlaunch.launcher.export import k8s
    from distlaunch.launcher.record.rundir import new_run_id
    from distlaunch.launcher.spec.model import load_spec

    loaded = load_spec(spec)
    settings = loaded.spec.kubernetes
    image = k8s.check_image(image) if image else settings.image or DEFAULT_TAG
    namespace = k8s.check_namespace(namespace) if namespace else settings.namespace
    run_id = k8s.check_run_id(run_id) if run_id else new_run_id(loaded.spec.name)
    made = k8s.manifests(loaded, run_id, image, namespace, jobset)
    text = k8s.to_yaml(made.objects)
    if output is None:
        click.echo(text, nl=False)
    else:
        # Owner-only: the program's env is in it.
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    console = Console()
    kinds = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in made.objects)
    console.say(f"run dir {made.run_dir} on the shared volume; objects: {kinds}")
    for note in made.notes:
        console.say(f"note: {note}")


def _offer_resume(loaded, console: Console) -> bool:
    """When this spec's last run did not finish, ask (on a terminal) whether to resume it."""
    from distlaunch.launcher.record.state import latest_unfinished

    unfinished = latest_unfinished(loaded.shared_dir, loaded.spec.name)
    if unfinished is None:
        return False
    if sys.stdin.isatty():
        return click.confirm(
            f"distlaunch: run {unfinished.name} did not finish; resume it?", default=True
        )
    console.say(
        f"run {unfinished.name} did not finish: starting a new run (`up --resume` continues it, `--fresh` hides this note)"
    )
    return False


@cli.command(context_settings={"ignore_unknown_options": True})
@SPEC
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    help="Nodes to ask for (default: one per task, or per slurm.tasks_per_node tasks).",
)
@click.option("--time", "time_limit", help="Time limit, as sbatch takes it (e.g. 2:00:00).")
@click.option("--partition", help="Slurm partition.")
@click.option("--account", help="Slurm account.")
@click.option(
    "--requeue",
    is_flag=True,
    help="Near the time limit, or when preempted, the tasks save and stop and the job is requeued; "
    "it resumes the run at the saved step.",
)
@click.option(
    "--signal-before",
    type=click.IntRange(min=1),
    help="With --requeue: seconds before the time limit that the launcher is signalled "
    "(default: timeouts.save_s + grace_s + 15).",
)
@click.argument("sbatch_args", nargs=-1, type=click.UNPROCESSED)
def sbatch(
    spec: str,
    nodes: int | None,
    time_limit: str | None,
    partition: str | None,
    account: str | None,
    requeue: bool,
    signal_before: int | None,
    sbatch_args: tuple[str, ...],
) -> None:
    """Submit SPEC as a Slurm batch job running `up --backend slurm`; more sbatch options after `--`.

    The batch script is written to <run_dir>/job.sbatch first (readable, and runnable by hand).
    """
    from distlaunch.launcher.record import rundir
    from distlaunch.launcher.run.up import choose_run
    from distlaunch.launcher.spec.model import load_spec
    from distlaunch.launcher.spec.sources import SpecOptions
    from distlaunch.launcher.transports.slurm import sbatch as batch

    loaded = load_spec(spec, SpecOptions(overrides=("backend=slurm",)))
    request = batch.BatchRequest(
        nodes,
        time_limit,
        partition,
        account,
        requeue,
        signal_before,
        batch.check_extra(sbatch_args),
    )
    target = choose_run(loaded, None, False)
    rundir.make_dirs(target.run_dir, target.attempt, loaded.spec.permissions == "private")
    path = target.run_dir / batch.SCRIPT
    rundir.create_file(path)  # with the run dir's file mode
    path.write_text(batch.script(loaded, target.run_id, target.run_dir, request))
    job = batch.submit(path)
    click.echo(f"submitted Slurm job {job} for run {target.run_id}; run dir {target.run_dir}")
    click.echo(
        f"  follow it: distlaunch logs {target.run_id} -f --shared-dir {loaded.shared_dir}  (once it runs)"
    )


@cli.command()
@click.argument("run", required=False)
@SHARED_DIR
@click.pass_obj
@click.option(
    "--json", "as_json", is_flag=True, help="Print the run's state and task table as JSON."
)
@click.option(
    "-w",
    "--watch",
    is_flag=True,
    help="Redraw every second, like top: each task's step, steps/s, loss, last checkpoint and "
    "ETA from its distlaunch.worker heartbeat, until the run ends (Ctrl-C quits).",
)
def status(settings: Settings, run: str | None, as_json: bool, watch: bool) -> None:
    """Show the state of RUN (a run id or directory; default: the latest run)."""
    from distlaunch.launcher.control.liveness import launcher_alive
    from distlaunch.launcher.control.status import LOST, cpu_text, cpu_use, run_state, status_rows
    from distlaunch.launcher.diagnosis.summary import preempted_line
    from distlaunch.launcher.network import firewall
    from distlaunch.launcher.record import rundir
    from distlaunch.launcher.record.state import RunRecord

    path = rundir.resolve_run(run, settings.shared_dir)
    if watch:
        from distlaunch.launcher.control.status import watch as watch_run

        watch_run(path, lambda text: click.echo(text, nl=False))
        return
    record = RunRecord.load(path)
    rows = status_rows(record, use=cpu_use(record))
    state = run_state(record)
    if as_json:
        head = {
            "run_id": record.run_id,
            "state": state,
            "attempt": record.attempt,
            "exit_code": record.exit_code,
            "failure": record.failure.to_json() if record.failure else None,
            "network": record.network,
            "preempted": record.preempted,
        }
        click.echo(json.dumps({**head, "run_dir": str(path), "tasks": rows}, indent=2))
        return
    click.echo(f"run {record.run_id}: {state} (attempt {record.attempt}) in {path}")
    if state == LOST:
        click.echo(
            f"  its launcher (pid {record.launcher_pid}) is gone; `distlaunch down {record.run_id}` stops what is left"
        )
    if record.failure:
        click.echo(f"  {record.failure.summary}")
    if isinstance(record.preempted, dict):
        click.echo(f"  {preempted_line(record.run_id, record.preempted, record.spec_file)}")
    for line in firewall.status_lines(record.network, launcher_alive(record)):
        click.echo(f"  {line}")
    click.echo(
        f"  {'TASK':<12} {'STATE':<10} {'PID':>8} {'PORT':>6} {'ATTEMPT':>7} {'RESTARTS':>8} {'UPTIME':>8} "
        f"{'CPU USE':>12}  EXIT"
    )
    for row in rows:
        uptime = f"{row['uptime_s']:.0f}s" if row["uptime_s"] is not None else "-"
        click.echo(
            f"  {row['task']:<12} {row['state'] or '?':<10} {row['pid'] or '':>8} {row['port'] or '':>6} "
            f"{row['attempt']:>7} {row['restarts']:>8} {uptime:>8} {cpu_text(row):>12}  {row['exit'] or ''}"
        )


@cli.command()
@click.argument("run", required=False)
@click.argument("task", required=False)
@SHARED_DIR
@click.pass_obj
@click.option("-n", "--lines", default=50, show_default=True, help="How many lines per task.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the run ends.")
def logs(settings: Settings, run: str | None, task: str | None, lines: int, follow: bool) -> None:
    """Print the last lines of TASK's log (every task's when omitted) in its latest attempt."""
    from distlaunch.launcher.control import logs as control_logs
    from distlaunch.launcher.core.console import Console
    from distlaunch.launcher.diagnosis.summary import tail
    from distlaunch.launcher.record import rundir

    path = rundir.resolve_run(run, settings.shared_dir)
    for file in control_logs.log_files(path, task):
        for line in tail(str(file), lines).splitlines():
            click.echo(f"{file.stem} | {line}")
    if follow:
        control_logs.follow(path, task, Console())


@cli.command()
@click.argument("run", required=False)
@click.argument("task", required=False)
@SHARED_DIR
@click.pass_obj
@click.option("--no-native", is_flag=True, help="Python frames only (faster; no C++ frames).")
@click.option("--full", is_flag=True, help="Also print every task's whole dump.")
def stacks(
    settings: Settings, run: str | None, task: str | None, no_native: bool, full: bool
) -> None:
    """Capture every thread's stack of each running task (or TASK) into RUN/stacks/<time>/ and
    print where each task is."""
    from distlaunch.launcher.control.stacks import take_stacks
    from distlaunch.launcher.diagnosis import stacks as stack_dumps
    from distlaunch.launcher.record import rundir

    path = rundir.resolve_run(run, settings.shared_dir)
    captures = take_stacks(path, task, native=not no_native)
    for capture in captures if full else ():
        for line in capture.file.read_text().splitlines():
            click.echo(f"{capture.task} | {line}")
    for line in stack_dumps.summary(captures):
        click.echo(line)
    if captures:
        click.echo(f"stacks written to {captures[0].file.parent}")


@cli.command()
@click.argument("run")
@click.argument("task")
@SHARED_DIR
@click.pass_obj
def restart(settings: Settings, run: str, task: str) -> None:
    """Restart TASK of the running RUN the way its strategy needs (an MWMS task: the whole gang)."""
    from distlaunch.launcher.control.requests import request_restart
    from distlaunch.launcher.record import rundir

    path = rundir.resolve_run(run, settings.shared_dir)
    name = request_restart(path, task)
    click.echo(
        f"asked the launcher of {path.name} to restart {name}; see `distlaunch status {path.name}`"
    )


@cli.command()
@click.argument("run")
@SHARED_DIR
@click.pass_obj
@click.option(
    "--grace",
    type=float,
    default=None,
    help="Seconds from SIGTERM to SIGKILL (default: the spec's timeouts.grace_s).",
)
@click.option("--now", is_flag=True, help="Stop at once: the tasks do not save first.")
def down(settings: Settings, run: str, grace: float | None, now: bool) -> None:
    """Stop RUN (a run id or directory): its launcher if alive (its tasks save first, unless
    --now), then every leftover process."""
    from distlaunch.launcher.control.down import down as run_down
    from distlaunch.launcher.record import rundir

    result = run_down(rundir.resolve_run(run, settings.shared_dir), grace, now, say=click.echo)
    done = []
    if result.launcher_pid is not None:
        done.append(f"stopped its launcher (pid {result.launcher_pid})")
        if result.ended:
            done.append(result.ended)
    if result.stopped:
        done.append(
            f"stopped {result.stopped} leftover process{'es' if result.stopped != 1 else ''}"
        )
    if result.cancelled:
        done.append(f"cancelled {result.backend} {' '.join(result.cancelled)}")
    if result.marked:
        done.append("marked it interrupted")
    said = "; ".join(done) or "nothing was left running"
    if result.launcher_pid is None and result.ended:
        said += f"; it had ended: {result.ended}"
    click.echo(f"run {result.run_id}: {said}")


@cli.command()
@click.argument("run")
@SHARED_DIR
@click.pass_obj
def collect(settings: Settings, run: str) -> None:
    """Copy the run files of RUN's SSH hosts (when they share no run dir) into RUN/hosts/<host>/."""
    from distlaunch.launcher.control.collect import collect as run_collect
    from distlaunch.launcher.record import rundir

    for got in run_collect(rundir.resolve_run(run, settings.shared_dir)):
        click.echo(f"{got.host}: {got.files} files, {got.bytes} bytes into {got.into}")


@cli.command()
@click.argument("run", required=False)
@SHARED_DIR
@click.pass_obj
def report(settings: Settings, run: str | None) -> None:
    """Write RUN/report.html: the run told as a picture (a timeline of every task's attempts,
    restarts, notices, saves, hangs and the root cause; loss and steps/s over time). RUN is a
    run id or directory (default: the latest run); a running run's report shows it so far."""
    from distlaunch.launcher.record import rundir
    from distlaunch.launcher.report.write import write_report

    click.echo(write_report(rundir.resolve_run(run, settings.shared_dir)))


def _say_report(console: Console, run_dir: Path) -> None:
    """After a failed run: write its report and say where (best effort: the failure's own
    summary is already out, and a report that cannot be written must not hide it)."""
    from distlaunch.launcher.report.write import write_report

    try:
        console.say(f"the run as a picture: {write_report(run_dir)}")
    except LaunchError:
        pass


def _shell_join(argv: list[str]) -> str:
    import shlex

    return shlex.join(argv)


def main() -> None:
    """Entry point of the `distlaunch` console script."""
    try:
        _main()
    except SystemExit as exc:
        _exit_now(exc.code)
    _exit_now(0)


def _exit_now(code: object) -> NoReturn:
    """Exit with ``code`` as sys.exit would, without Python's finalization.

    By now every task is gone and every record written; what is left is the interpreter tearing
    down its modules (click's and the launcher's), 0.1 s on a quiet machine and over 0.5 s on a busy
    one, added to every command (and to `up`'s teardown). The atexit handlers still run (the
    terminal's echo drains there), then the standard streams are flushed. Every thread the
    launcher starts is a daemon or joined before this. A crash (an uncaught exception other than
    SystemExit) still exits the usual way, with its traceback.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a reader that is gone (| head): nothing more can reach it
    if code is None:
        code = 0
    elif not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
        sys.stderr.flush()
        code = 1
    os._exit(code & 0xFF)


def _main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(ExitCode.SIGNALLED + signal.SIGINT)
    except click.ClickException as exc:
        exc.show()
        sys.exit(ExitCode.USAGE)
    except LaunchError as exc:
        # RunFailed and Preempted have already printed their summary; the others are one line.
        if not isinstance(exc, (RunFailed, Preempted)):
            click.echo(f"distlaunch: error: {exc}", err=True)
        sys.exit(exit_code(exc))
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
