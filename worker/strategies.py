"""The task's tf.distribute strategy: one builder per strategy name.

Importing this module imports no TensorFlow (each builder does, when called); `ps` (which
imports TensorFlow) is only imported for a ParameterServerStrategy task.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import contract, preempt, runtime
from .runtime import DEFAULT_STRATEGY, TaskContext

if TYPE_CHECKING:
    import tensorflow as tf

# strategy()'s default variable_partitioner: under PSS with several ps tasks, shard large
# variables over them when the Keras flavour can train sharded variables (tf_keras).
AUTO_PARTITIONER = "auto"


@functools.cache
def strategy(variable_partitioner: Any = AUTO_PARTITIONER) -> tf.distribute.Strategy:
    """Build this task's tf.distribute strategy once, report "ready", and return it.

    Call it before any other TensorFlow op: collective ops must be configured at program
    startup. Building MultiWorkerMirroredStrategy blocks until every worker has joined, so
    "ready" really means the cluster is up. Later calls with the same arguments return the
    same strategy.

    Under ParameterServerStrategy only the chief gets a strategy (it coordinates the training);
    on a ps or worker task this call starts the task's TensorFlow server, reports "ready" and
    serves until the launcher stops the process: it never returns, so the same script runs on
    every task. ``variable_partitioner`` (a ``tf.distribute.experimental.partitioners``
    partitioner, or None) shards the chief's variables over the ps tasks; the default
    ``"auto"`` is ``MinSizePartitioner(max_shards=<number of ps>)`` for tf_keras with more
    than one ps, and no sharding otherwise: Keras 3 cannot train sharded variables. Other
    strategies ignore it. The evaluator, a sidecar outside the training cluster, always gets
    TensorFlow's default strategy.

    From here on SIGTERM is a stop notice (`preempt.watch`: it replaces the SIGTERM handler
    TensorFlow installed while the strategy was built), unless the program handles SIGTERM
    itself; under MWMS, tf_keras's BackupAndRestore may save before preemption off GCP too.
    """
    ctx = runtime.context()
    if ctx.role == contract.EVALUATOR:
        builder = _default_strategy
    else:
        builder = _STRATEGY_BUILDERS.get(ctx.strategy)
    if builder is None:
        raise ValueError(
            f"{contract.STRATEGY}={ctx.strategy!r} is not one of {sorted(_STRATEGY_BUILDERS)}"
        )
    runtime.report(contract.STATE_STARTING)
    built = builder(ctx, variable_partitioner)
    if ctx.role != contract.EVALUATOR:
        # Now, not when `fit` starts: TensorFlow's notifier took SIGTERM over while the strategy
        # was built, and would swallow a notice that came before `fit` (see `preempt`). (A PSS
        # ps or worker never gets here: it serves until it is stopped.)
        preempt.watch()
        if ctx.strategy == contract.MWMS:
            preempt.allow_tf_keras_save_before_preemption()
    runtime.report(contract.STATE_READY)
    return built


def _default_strategy(_ctx: TaskContext, _partitioner: Any) -> tf.distribute.Strategy:
    """One process, no cluster: TensorFlow's default (no-op) strategy."""
    import tensorflow as tf

    return tf.distribute.get_strategy()


def _multi_worker_mirrored_strategy(_ctx: TaskContext, _partitioner: Any) -> tf.distribute.Strategy:
    """Synchronous data parallelism over all chief and worker tasks; reads TF_CONFIG itself."""
    import tensorflow as tf

    return tf.distribute.MultiWorkerMirroredStrategy()


def _parameter_server_strategy(ctx: TaskContext, partitioner: Any) -> tf.distribute.Strategy:
    """The chief coordinates; ps and worker tasks only serve (this never returns on them)."""
    from . import ps  # imports TensorFlow

    if ctx.role in (contract.PS, contract.WORKER):
        ps.serve_forever()
    if isinstance(partitioner, str) and partitioner == AUTO_PARTITIONER:
        partitioner = ps.auto_partitioner(ctx.keras)
    return ps.coordinator_strategy(partitioner)


# One builder per strategy name; adding a strategy means adding one function and one entry.
_STRATEGY_BUILDERS: dict[str, Callable[[TaskContext, Any], tf.distribute.Strategy]] = {
    DEFAULT_STRATEGY: _default_strategy,
    contract.MWMS: _multi_worker_mirrored_strategy,
    contract.PSS: _parameter_server_strategy,
}
