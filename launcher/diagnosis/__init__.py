"""Why a run failed or stalls: the root-cause summary, its evidence and hints, where tasks are
(stacks), whether they make progress (watchdog, progress_view), OOM kills and whether the
cluster formed."""
