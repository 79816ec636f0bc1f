"""The transports: how a planned task is started, watched and stopped on local processes, SSH
hosts or containers (`base` is the interface the supervisor depends on)."""
