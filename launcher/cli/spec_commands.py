"""The commands that read a spec and start nothing: validate, plan, tfconfig, schema."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from distlaunch.launcher.cli.app import cli
from distlaunch.launcher.cli.options import EXCLUDE, HOSTS, SET, SPEC, spec_options
from distlaunch.launcher.core import backends, json_text
from distlaunch.launcher.core.errors import UsageError
from distlaunch.worker import contract

if TYPE_CHECKING:
    from distlaunch.launcher.spec.model import Elastic


@cli.command()
@SPEC
@SET
def validate(spec: str, overrides: tuple[str, ...]) -> None:
    """Check SPEC and print a one-line verdict; exit 2 when it is malformed or names a program
    distlaunch cannot run (Keras 3 on another backend, Keras 3 model.fit under PSS)."""
    from distlaunch.launcher.plan import program_scan
    from distlaunch.launcher.spec.model import load_spec

    loaded = load_spec(spec, spec_options(overrides))
    # The refusals `plan` and `up` make from the program's source (read, never imported: no
    # TensorFlow start here).
    program_scan.choose(loaded)
    counts = ", ".join(f"{len(v)} {k}" for k, v in loaded.spec.tasks.by_role().items())
    elastic = loaded.spec.elastic
    if elastic is not None:
        counts += f"; elastic {elastic.range_text}"
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

    loaded = load_spec(spec, spec_options(overrides, only_hosts, exclude_hosts))
    the_plan = build_plan(loaded, choose_run(loaded, None, False))
    data = the_plan.to_json()
    rules = firewall.run_rules(the_plan, jumped_hosts(loaded.hosts))
    data["network"] = firewall.plan_json(loaded.spec.network.protect, rules)
    data["elastic"] = _elastic_json(loaded.spec.elastic, data["tasks"])
    if as_json:  # json.dumps(data, indent=2)'s text: with N tasks of N addresses each, faster
        click.echo(json_text.dumps(data, indent=2))
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
    if data["elastic"] is not None:
        click.echo(_elastic_line(data["elastic"]))
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


def _elastic_json(elastic: Elastic | None, tasks: list[dict]) -> dict | None:
    """`plan --json`'s ``elastic``: the spec's section with MAX filled in, the worker slots a
    world is chosen from (every worker task planned, in order) and the first world (the first
    MAX of them); None when the worker count is fixed."""
    if elastic is None:
        return None
    slots = [
        {"task": t["name"], "host": t["host"], "host_name": t["host_name"]}
        for t in tasks
        if t["role"] == contract.WORKER
    ]
    return {
        **elastic.to_json(),
        "slots": slots,
        "first_world": [slot["task"] for slot in slots[: elastic.max_workers]],
    }


def _elastic_line(elastic: dict) -> str:
    """`plan`'s line on an elastic run: its range, the sizes it takes, where the first world
    runs and the slots it leaves spare."""
    low, high, accepted = elastic["min_workers"], elastic["max_workers"], elastic["accepted"]
    sizes = (
        ""
        if accepted == list(range(low, high + 1))
        else f" (sizes {', '.join(map(str, accepted))})"
    )
    first = set(elastic["first_world"])
    placed = {s["task"]: f"{s['task']} on {s['host_name'] or s['host']}" for s in elastic["slots"]}
    world = ", ".join(v for k, v in placed.items() if k in first)
    spare = ", ".join(v for k, v in placed.items() if k not in first)
    return (
        f"elastic: workers {low}:{high}{sizes}, first world: {world}"
        f"{f', spare: {spare}' if spare else ''}; batch {elastic['batch']}"
    )


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


def _shell_join(argv: list[str]) -> str:
    import shlex

    return shlex.join(argv)
