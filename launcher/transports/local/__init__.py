"""The `local` backend: tasks as child processes of the launcher (transport), their warm
standbys (standby), and local and SSH tasks in one run (routing)."""
