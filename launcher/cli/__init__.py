"""The `distlaunch` command line. The only place where errors become exit codes (`exit_codes`).

Exit codes: 0 success, 1 a task failed, 2 bad spec or usage (or an SSH host failed preflight or
`collect`, Docker cannot start a compose run, or the network sandbox cannot be made: nothing was
started, the fix is in the spec or on the host), 128+N interrupted by signal N.

The commands are grouped by concern, each group a module that adds its commands to the one click
group (`app.cli`): the spec's (validate, plan, tfconfig, schema), a run's (up, sbatch), the
export's (compose, k8s) and those that inspect or control a run from another shell (status, logs,
stacks, restart, down, collect, report). `options` holds what several commands share. Every
command imports what it needs in its body: `--help`, and a command's start, pay only for their
own (the spec's parsing, the run dir, the supervisor... are imported by those that use them).
"""

from __future__ import annotations

# Each module registers its commands on `cli` as it is imported.
from distlaunch.launcher.cli import control_commands as control_commands
from distlaunch.launcher.cli import export_commands as export_commands
from distlaunch.launcher.cli import run_commands as run_commands
from distlaunch.launcher.cli import spec_commands as spec_commands
from distlaunch.launcher.cli.app import ExitCode, cli, exit_code, exit_codes, main

__all__ = ["ExitCode", "cli", "exit_code", "exit_codes", "main"]
