"""Tasks on SSH hosts: the transport and its shared connections (transport), the hosts'
preflight (preflight) and the probe it runs on each host (probe)."""
