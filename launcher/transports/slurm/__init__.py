"""The `slurm` backend: every task a job step of the allocation (transport), and
`distlaunch sbatch` (sbatch)."""
