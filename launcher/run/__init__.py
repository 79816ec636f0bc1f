"""Running a plan: `distlaunch up` (up), the supervisor's event loop (supervisor) and the
restart policy that decides every way a run ends (policy); the loop's collaborators, one concern
each: the tasks and their processes (task, crew), the run's record (journal), restarts (restarts),
deadlines (deadlines), stop notices (notice), what an exit means (exits), each event decided and
carried out (events), warm standbys (warm); and the options of a launch (options)."""
