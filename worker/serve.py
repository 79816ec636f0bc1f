"""`python -m distlaunch.worker.serve`: a ps or worker task of a ParameterServerStrategy job.

The launcher runs this instead of the user's program on ps and worker tasks when the program
never starts a TensorFlow server itself (the tutorials' chief-side code): those tasks only serve,
and the chief runs the program. It serves until the launcher stops it, like `dw.strategy()` does
(or, where no launcher runs, until the chief's result: see distlaunch.worker.chief_result).
"""

from __future__ import annotations

from . import runtime, strategies

if __name__ == "__main__":
    runtime.install_error_hook()
    role = runtime.context().role
    strategies.strategy()  # on a ps or worker task: serves, never returns
    raise SystemExit(f"distlaunch.worker.serve is for ps and worker tasks, not {role}")
