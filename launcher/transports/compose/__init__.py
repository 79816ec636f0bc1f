"""The `compose` backend: every task in a container of its own (transport), the run as a
compose file (file), the docker command line (docker) and the distlaunch image (image)."""
