"""What a run leaves for every other shell: the run directory (rundir), run.json's schema and
the run's state (state), and how a task or a run ends (endings). It sits below the
transports, which write the record."""
