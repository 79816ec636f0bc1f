"""Stop notices inside a task: what TensorFlow does with SIGTERM, and how `dw.fit` saves on one.

What TensorFlow 2.21 does. Building MultiWorkerMirroredStrategy enables the coordination
service, and with it (EagerContextDistributedManager::EnableCollectiveOps) every task creates a
"sigterm" PreemptionNotifier (tsl/distributed_runtime/preemption/preemption_notifier.cc). It
replaces the process's SIGTERM disposition with a C handler (``std::signal``) that only sets a
flag; a thread polls the flag once a second and, once it is set, logs ``SIGTERM caught at
<time>`` and writes the key TF_DEFAULT_PREEMPTION_NOTICE_KEY (value ``/job:J/task:I``) into the
coordination service's key-value store. Nothing else happens: only
``tf.distribute.experimental.PreemptionCheckpointHandler`` (which installs a Python SIGTERM
handler of its own and agrees on a step through more keys and a watcher thread per worker) or
the ``check_preemption`` op read that key. So, once the strategy is built:

- SIGTERM no longer ends an MWMS task: a TERM, grace, KILL teardown always ends in SIGKILL after
  the whole grace, and all that was trained since the last checkpoint is lost;
- a handler installed from Python afterwards replaces TensorFlow's (a process has one
  disposition per signal): TensorFlow then logs nothing and writes no key.

What we build on it: our own agreement, not TensorFlow's handler. The handler only works around a
train step wrapped in ``handler.run``, saves with its own CheckpointManager layout, and ends the
process itself (exit 42 by default, which launchers read as a failure). `dw.fit` already runs
one all-reduce per step (the loss); the task's notice flag goes into that same all-reduce. After
step S every worker knows whether any worker has had a notice, and all of them learn it at the
same S: they save checkpoint ``ckpt-S`` together, report "preempted" with the saved step and the
save's duration in their status file, and exit EXIT_PREEMPTED (worker/contract.py). No extra
collective, no thread, no clock: a notice that arrives during step S is acted on after step S+1.
A checkpoint becomes the latest only once it is whole (CheckpointManager rewrites the
``checkpoint`` index file atomically after the data files), so a save cut short by the launcher's
deadline leaves the previous checkpoint as the one a resume starts from.

`watch` installs the Python SIGTERM handler, right after the strategy is built (so that it
replaces TensorFlow's) and again when `fit` starts; a program that installed its own SIGTERM
handler (e.g. TensorFlow's PreemptionCheckpointHandler) keeps it. A SIGTERM is not a notice when
the launcher is stopping the attempt at once (its teardown after Ctrl-C, `down --now` or a
failure, marked by contract.stop_now_path): the task then dies of it, as a program that does not
handle SIGTERM does, instead of spending the grace period on a save nobody waits for.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from . import contract, runtime

_notice_at: float | None = None  # time.monotonic() of the first notice


def _on_notice(_signum: int, _frame: object) -> None:
    # Only note it (a second notice changes nothing): the training loop acts between steps.
    global _notice_at
    ctx = runtime.context()
    if ctx.run_dir is not None and contract.stop_now_path(ctx.run_dir, ctx.attempt).exists():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if _notice_at is None:
        _notice_at = time.monotonic()


def watch() -> None:
    """Take SIGTERM as a stop notice from now on, unless the program handles SIGTERM itself.

    Call it in the main thread after the strategy is built (TensorFlow's notifier, installed while
    it is built, is replaced: see the module docstring). Elsewhere, a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    # None: a handler set from C (TensorFlow's notifier); SIG_DFL: nobody's. A Python handler that
    # is not ours is the program's own: it decides what a notice means.
    if current in (None, signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_notice)


# The tf_keras module whose check decides whether BackupAndRestore saves before preemption.
_TF_KERAS_STATE = "tf_keras.src.distribute.worker_training_state"


def allow_tf_keras_save_before_preemption() -> None:
    """Let tf_keras's ``BackupAndRestore(save_before_preemption=True)`` save on a notice off GCP.

    tf_keras turns that option on only under MWMS on GCP (it asks GCP's metadata server, which
    takes up to 5 s to fail elsewhere); it then wraps each batch in TensorFlow's
    PreemptionCheckpointHandler, which works wherever the coordination service runs. Under
    distlaunch the launcher is the one that sends the notice, so the check becomes "under MWMS".
    The handler saves at a step the workers agree on; the task then reports that step and exits
    EXIT_PREEMPTED (`_restore_from_the_chief`).

    Call it under MWMS, whatever the spec's ``keras`` says: a script that imports ``tf_keras``
    itself runs with the Keras 3 setting, and may import it only after ``dw.strategy()``. If
    tf_keras is not loaded yet, the check is replaced when it is (a Keras 3 program never pays
    for importing tf_keras).
    """
    module = sys.modules.get(_TF_KERAS_STATE)
    if module is not None:
        _allow_under_mwms(module)
    elif _ON_TF_KERAS_IMPORT not in sys.meta_path:
        sys.meta_path.insert(0, _ON_TF_KERAS_IMPORT)


def _allow_under_mwms(worker_training_state: ModuleType) -> None:
    import tensorflow as tf

    def mwms(strategy: tf.distribute.Strategy) -> bool:
        return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)

    worker_training_state.support_on_demand_checkpoint_callback = mwms
    _restore_from_the_chief(worker_training_state)


def _restore_from_the_chief(worker_training_state: ModuleType) -> None:
    """Make every worker restore tf_keras's backup from the chief's copy when the handler is on.

    With ``save_before_preemption`` on, tf_keras's ``WorkerTrainingState.restore`` does nothing:
    the PreemptionCheckpointHandler restored while it was built, but through the manager it was
    given, the WRITE manager, which on a non-chief worker points at that worker's temporary copy
    (``workertemp_<task>``). A regular backup deletes that copy, so after one a non-chief worker
    restores nothing and starts at step 0 while the chief resumes: their collectives no longer
    match ("Collective instance ... expected type 1 ... but got type 0") and the run fails; a
    worker of a new world (an elastic resize) never had a copy at all. Here every worker restores
    the chief's backup, as tf_keras does without the handler, and the handler's step counter
    (which the notice agreement compares across workers) is set from what was restored.

    The handler's exit after its save on a notice becomes `stop`'s, as every distlaunch program
    ends on a notice: the saved step (the optimizer's, the step a resume starts from) in the
    status file and exit EXIT_PREEMPTED, instead of a bare exit 42 that says no step.
    """
    cls = getattr(worker_training_state, "WorkerTrainingState", None)
    original = getattr(cls, "restore", None)
    if cls is None or original is None:
        raise ImportError(
            f"distlaunch: {_TF_KERAS_STATE}.WorkerTrainingState.restore is gone in this "
            "tf_keras: BackupAndRestore cannot be made to resume every worker from the chief"
        )
    if getattr(original, "_distlaunch", False):
        return  # patched already

    def restore(self: Any) -> None:
        if not getattr(self, "_enable_save_before_preemption", False):
            original(self)
            return
        handler = self.preemption_handler
        needed = ("_run_counter", "_checkpointed_runs", "_exit_fn")
        if not all(hasattr(handler, name) for name in needed):
            raise RuntimeError(
                "distlaunch: tf_keras's PreemptionCheckpointHandler lacks one of "
                f"{', '.join(needed)} in this TensorFlow: cannot resume every worker from the chief"
            )
        self.read_checkpoint_manager.restore_or_initialize()
        handler._run_counter = int(handler._checkpointed_runs.numpy())
        model = self._model

        def saved_on_a_notice() -> NoReturn:
            step = int(model.optimizer.iterations.numpy())
            stop(step, float(getattr(handler, "_checkpoint_time", 0.0)))

        handler._exit_fn = saved_on_a_notice

    restore._distlaunch = True  # type: ignore[attr-defined]
    cls.restore = restore


class _OnTfKerasImport(importlib.abc.MetaPathFinder):
    """Finds tf_keras's worker_training_state as usual, and replaces its check once it ran."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _TF_KERAS_STATE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_then_allow(module: ModuleType) -> None:
            run(module)
            _allow_under_mwms(module)

        spec.loader.exec_module = run_then_allow  # type: ignore[method-assign]
        return spec


_ON_TF_KERAS_IMPORT = _OnTfKerasImport()


def noticed() -> bool:
    """Whether this task has had a stop notice."""
    return _notice_at is not None


def stop(saved_step: int | None, save_s: float) -> NoReturn:
    """Report "preempted" (``saved_step``: the checkpoint saved on the notice, None without a
    checkpoint dir; ``save_s``: how long that save took) and exit EXIT_PREEMPTED at once.

    ``os._exit``: the checkpoint is on disk, and an interpreter shutdown could wait on peers
    that have exited already (TensorFlow's coordination service) past the launcher's deadline.
    """
    since = time.monotonic() - (_notice_at or time.monotonic())
    fields = {contract.SAVED_STEP: saved_step, contract.SAVE_S: round(save_s, 3)}
    runtime.report(contract.STATE_PREEMPTED, notice_to_saved_s=round(since, 3), **fields)
    where = f"saved step {saved_step} in {save_s:.2f} s" if saved_step is not None else "no save"
    print(f"distlaunch: stop notice: {where}; exiting {contract.EXIT_PREEMPTED}", flush=True)
    sys.stderr.flush()
    os._exit(contract.EXIT_PREEMPTED)
