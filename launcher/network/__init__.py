"""Keeping TensorFlow's unauthenticated ports to the run: the private network namespace of a
local run (netns) and the per-run firewall of remote hosts (firewall)."""
