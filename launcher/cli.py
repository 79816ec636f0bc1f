"""The `distlaunch` command line. The only place where errors become exit codes.

Exit codes: 0 success, 1 a task failed, 2 bad spec or usage, 128+N interrupted by signal N.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from distlaunch.launcher import rundir
from distlaunch.launcher.console import Console
from distlaunch.launcher.errors import LaunchError, UsageError
from distlaunch.launcher.spec import json_schema, load_spec
from distlaunch.launcher.summary import tail

SPEC = click.argument("spec", type=click.Path(dir_okay=False, path_type=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="distlaunch")
def cli() -> None:
    """Turn one cluster spec file into a running TensorFlow multi-worker cluster."""


@cli.command()
@SPEC
def validate(spec: str) -> None:
    """Check SPEC and print a one-line verdict; exit 2 when it is malformed."""
    loaded = load_spec(spec)
    counts = ", ".join(f"{len(v)} {k}" for k, v in loaded.spec.tasks.by_role().items())
    click.echo(f"{spec}: ok ({loaded.spec.strategy}; {counts})")


@cli.command()
@SPEC
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(spec: str, as_json: bool) -> None:
    """Dry run: print every task's command, env and TF_CONFIG without starting anything.

    `auto` ports are picked as `up` would pick them; `up` picks again when it starts.
    """
    from distlaunch.launcher.up import build_plan, choose_run

    loaded = load_spec(spec)
    the_plan = build_plan(loaded, choose_run(loaded, None, False))
    data = the_plan.to_json()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"run {data['run_id']}: {data['strategy']}, {len(data['tasks'])} tasks, run dir {data['run_dir']}")
    for task in data["tasks"]:
        click.echo(f"\n{task['name']} on {task['host']}:{task['port']}")
        click.echo(f"  command: {_shell_join(task['argv'])}")
        click.echo(f"  cwd:     {task['cwd']}")
        click.echo(f"  gpus:    {','.join(map(str, task['gpus'])) or 'none (CPU only)'}")
        click.echo(f"  log:     {task['log_file']}")
        click.echo("  env:")
        for key, value in task["env"].items():
            click.echo(f"    {key}={value}")


@cli.command()
@SPEC
@click.argument("task")
def tfconfig(spec: str, task: str) -> None:
    """Print the TF_CONFIG of TASK (e.g. worker:1) for launching it by hand."""
    from distlaunch.launcher import tfconfig as tfc
    from distlaunch.launcher.up import build_plan, choose_run

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
    click.echo(json.dumps(json_schema(), indent=2))


@cli.command()
@SPEC
@click.option("--run-id", help="Use this run id; an existing run with this id is resumed.")
@click.option("--resume", is_flag=True, help="Resume the latest unfinished run of this spec.")
def up(spec: str, run_id: str | None, resume: bool) -> None:
    """Start every task of SPEC, stream their output, and supervise the run to its end."""
    from distlaunch.launcher.up import choose_run, up as run_up

    loaded = load_spec(spec)
    run_up(loaded, choose_run(loaded, run_id, resume), Console())


@cli.command()
@click.argument("run", required=False)
@click.option("--shared-dir", default="./runs", show_default=True, help="Where runs are looked up by id.")
@click.option("--json", "as_json", is_flag=True, help="Print run.json's task table as JSON.")
def status(run: str | None, shared_dir: str, as_json: bool) -> None:
    """Show the state of RUN (a run id or directory; default: the latest run)."""
    path = rundir.resolve_run(run, Path(shared_dir))
    record = rundir.read_json(path / rundir.RUN_JSON) or {}
    if as_json:
        click.echo(json.dumps({k: record.get(k) for k in ("run_id", "state", "attempt", "exit_code", "failure", "tasks")}, indent=2))
        return
    click.echo(f"run {record.get('run_id')}: {record.get('state')} (attempt {record.get('attempt')}) in {path}")
    if record.get("failure"):
        click.echo(f"  {record['failure']['summary']}")
    click.echo(f"  {'TASK':<12} {'STATE':<10} {'PID':>8} {'PORT':>6}  EXIT")
    for name, task in (record.get("tasks") or {}).items():
        click.echo(f"  {name:<12} {task.get('state', '?'):<10} {task.get('pid', ''):>8} {task.get('port', ''):>6}  {task.get('exit', '')}")


@cli.command()
@click.argument("run", required=False)
@click.argument("task", required=False)
@click.option("--shared-dir", default="./runs", show_default=True, help="Where runs are looked up by id.")
@click.option("-n", "--lines", default=50, show_default=True, help="How many lines per task.")
def logs(run: str | None, task: str | None, shared_dir: str, lines: int) -> None:
    """Print the last lines of TASK's log (every task's when omitted) in RUN's latest attempt."""
    path = rundir.resolve_run(run, Path(shared_dir))
    record = rundir.read_json(path / rundir.RUN_JSON) or {}
    log_dir = path / "logs" / f"attempt-{record.get('attempt', 0)}"
    files = sorted(log_dir.glob("*.log"))
    if task is not None:
        files = [f for f in files if f.stem == task.replace(":", "-")]
        if not files:
            raise UsageError(f"no log for task {task!r} in {log_dir}")
    for file in files:
        for line in tail(str(file), lines).splitlines():
            click.echo(f"{file.stem} | {line}")


def _shell_join(argv: list[str]) -> str:
    import shlex

    return shlex.join(argv)


def main() -> None:
    """Entry point of the `distlaunch` console script."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)
    except LaunchError as exc:
        # RunFailed has already printed its summary; the others are one line.
        from distlaunch.launcher.errors import RunFailed

        if not isinstance(exc, RunFailed):
            click.echo(f"distlaunch: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
