"""The commands that write what other tools run: a docker-compose file and Kubernetes manifests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from distlaunch.launcher.cli.app import cli
from distlaunch.launcher.cli.options import IMAGE, SPEC
from distlaunch.launcher.transports.compose import DEFAULT_TAG


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
    from distlaunch.launcher.spec.model import load_spec, refuse_elastic
    from distlaunch.launcher.transports.compose import file as compose
    from distlaunch.launcher.transports.compose.transport import write_compose_file
    from distlaunch.launcher.transports.local.cpus import this_machine

    loaded = load_spec(spec)
    refuse_elastic(loaded.spec, loaded.shown, "compose")
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
