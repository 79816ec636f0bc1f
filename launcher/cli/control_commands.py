"""The commands on a run from another shell, by run id or directory: status, logs, stacks (to
inspect it), restart, down, collect (to control it) and report."""

from __future__ import annotations

import json

import click

from distlaunch.launcher.cli.app import cli
from distlaunch.launcher.cli.options import SHARED_DIR, Settings


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
    from distlaunch.launcher.control.status import (
        LOST,
        cpu_text,
        cpu_use,
        run_state,
        status_rows,
        world_line,
    )
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
            "world": record.world,
        }
        click.echo(json.dumps({**head, "run_dir": str(path), "tasks": rows}, indent=2))
        return
    click.echo(f"run {record.run_id}: {state} (attempt {record.attempt}) in {path}")
    if state == LOST:
        click.echo(
            f"  its launcher (pid {record.launcher_pid}) is gone; `distlaunch down {record.run_id}` stops what is left"
        )
    world = world_line(record)
    if world is not None:
        click.echo(f"  {world}")
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
