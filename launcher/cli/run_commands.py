"""The commands that start a run: up (here, supervised to its end) and sbatch (a Slurm batch job
that runs `up`)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from distlaunch.launcher.cli.app import cli
from distlaunch.launcher.cli.options import (
    EXCLUDE,
    HOSTS,
    IMAGE,
    SET,
    SPEC,
    BackendChoice,
    spec_options,
)
from distlaunch.launcher.core.errors import LaunchError, RunFailed, UsageError
from distlaunch.launcher.run.options import DEFAULTS, LaunchOptions
from distlaunch.launcher.transports.compose import DEFAULT_BASE

if TYPE_CHECKING:
    from distlaunch.launcher.core.console import Console


@cli.command()
@SPEC
@click.option(
    "--run-id",
    default=DEFAULTS.run_id,
    help="Use this run id; an existing run with this id is resumed.",
)
@click.option(
    "--resume",
    is_flag=True,
    default=DEFAULTS.resume,
    help="Resume the latest unfinished run of this spec.",
)
@click.option("--fresh", is_flag=True, help="Start a new run even if the last one did not finish.")
@click.option(
    "--backend",
    type=BackendChoice(),
    default=DEFAULTS.backend,
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
    options = LaunchOptions(backend=backend, run_id=run_id, resume=resume, overrides=overrides)
    loaded = load_spec(spec, spec_options(options.spec_overrides, only_hosts, exclude_hosts))
    console = Console(quiet_tf=loaded.spec.tf_log_level == "default")
    if not (resume or fresh or run_id):
        options = replace(options, resume=_offer_resume(loaded, console))
    target = choose_run(loaded, options.run_id, options.resume)
    # The one path `distlaunch.launch` takes too (launcher/api/child.py).
    try:
        claim_and_up(loaded, target, console, UpOptions(image, base_image, requeue))
    except RunFailed:
        _say_report(console, target.run_dir)
        raise


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


def _say_report(console: Console, run_dir: Path) -> None:
    """After a failed run: write its report and say where (best effort: the failure's own
    summary is already out, and a report that cannot be written must not hide it)."""
    from distlaunch.launcher.report.write import write_report

    try:
        console.say(f"the run as a picture: {write_report(run_dir)}")
    except LaunchError:
        pass


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
