"""`python -m distlaunch.launcher.cli` runs the CLI (same as the `distlaunch` command)."""

from distlaunch.launcher.cli import main

main()
