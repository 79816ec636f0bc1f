"""Example training scripts, runnable as ``python -m distlaunch.worker.examples.<name>``."""
