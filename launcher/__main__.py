"""`python -m distlaunch.launcher` runs the CLI (same as the `distlaunch` command)."""

from distlaunch.launcher.cli import main

main()
