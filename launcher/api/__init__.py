"""The Python API behind the package root `distlaunch`: `launch`/`up` and the `Run` handle
(launch), `run(fn)` (call), a run's launcher process (child) and what the two say
(protocol), what a `Run` reads (reads), and its results and errors (results)."""
