"""Running a plan: `distlaunch up` (up), the supervisor's event loop (supervisor) and the
restart policy that decides every way a run ends (policy)."""
