"""What several commands share: the options and arguments declared once, and the settings of
click's context object (the shared dir)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from distlaunch.launcher.core import backends
from distlaunch.launcher.transports.compose import DEFAULT_TAG

if TYPE_CHECKING:
    from distlaunch.launcher.spec.sources import SpecOptions


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


def spec_options(
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
