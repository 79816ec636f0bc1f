"""Inspecting and steering a run from another shell through its run directory: status, logs,
restart requests, down and collect."""
