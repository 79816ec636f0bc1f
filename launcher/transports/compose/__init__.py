"""The `compose` backend: every task in a container of its own (transport), the run as a
compose file (file), the docker command line (docker) and the distlaunch image (image)."""

# The image a run's containers use (and `distlaunch k8s` names) unless told otherwise, and what it
# is built from. Here, not in image.py, so that the CLI's option defaults import nothing else.
DEFAULT_TAG = "distlaunch:local"
DEFAULT_BASE = "python:3.11-slim"
