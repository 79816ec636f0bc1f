"""The click group, the exit codes every error maps to, and the entry point (`main`)."""

from __future__ import annotations

import atexit
import enum
import os
import signal
import sys
from typing import NoReturn

import click

from distlaunch.launcher.cli.options import SHARED_DIR, Settings
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
from distlaunch.worker import contract


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="distlaunch")
@SHARED_DIR
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Turn one cluster spec file into a running TensorFlow multi-worker cluster."""
    ctx.ensure_object(Settings)


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
