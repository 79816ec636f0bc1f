"""Pure decisions made from a loaded spec before anything starts: one TaskPlan per process
(plan), ports, TF_CONFIG (tfconfig), network isolation, and what the program is
(program_scan, program_env)."""
