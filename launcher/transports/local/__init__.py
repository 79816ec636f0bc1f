"""The `local` backend: tasks as child processes of the launcher (transport), their warm
standbys (standby), the check that their GPUs exist here (gpus), and local and SSH tasks in one
run (routing)."""
