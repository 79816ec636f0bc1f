"""ParameterServerStrategy: the servers that ps and worker tasks run, and the chief's side.

Under PSS only the chief runs the user's program: it builds the strategy, keeps the variables
on the ps tasks and schedules training steps onto the worker tasks through a
`tf.distribute.coordinator.ClusterCoordinator`. The ps and worker tasks only serve.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any, NoReturn

import tensorflow as tf

from . import chief_result, contract, preempt, progress, runtime

# How often the chief checks whether its scheduled steps are done while it waits for them.
_POLL_S = 0.01
# Steps the chief schedules ahead of those done, per worker (see ScheduledSteps.run).
_AHEAD_PER_WORKER = 4


def serve_forever() -> NoReturn:
    """Start this ps or worker task's TensorFlow server, report "ready" and serve until killed,
    or, where no launcher stops it (END_WITH_CHIEF), until the chief's result is final.

    The launcher stops the task with SIGTERM when the chief is done; the process must then end
    at once. `server.join()` blocks in C++, where a Python signal handler would never run, so
    SIGTERM keeps (or gets back) its default action: end the process.
    """
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    name = contract.task_name(resolver.task_type, resolver.task_id)
    print(f"distlaunch: {name} serving at {server.target}; the chief runs the program", flush=True)
    # The launcher may count a task whose heartbeat goes stale as hung: keep beating while the
    # main thread is blocked in join().
    progress.BackgroundHeartbeat().start()
    chief_result.watch_in_background(name)
    server.join()
    raise RuntimeError(f"the TensorFlow server of {name} stopped")


def auto_partitioner(keras: str) -> Any:
    """The "auto" variable partitioner: with several ps tasks,
    ``MinSizePartitioner(max_shards=<number of ps>)`` for tf_keras, and None for Keras 3
    (``keras``), which cannot train sharded variables (see `refuse_sharded`); unsharded
    variables are still spread over the ps tasks, whole, round-robin."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    num_ps = len(resolver.cluster_spec().as_dict().get(contract.PS, []))
    if num_ps > 1 and keras == contract.TF_KERAS:
        return tf.distribute.experimental.partitioners.MinSizePartitioner(max_shards=num_ps)
    return None


def coordinator_strategy(variable_partitioner: Any) -> tf.distribute.ParameterServerStrategy:
    """Return the chief's ParameterServerStrategy over TF_CONFIG's cluster, its variables
    sharded by ``variable_partitioner`` (a partitioner, or None)."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return tf.distribute.ParameterServerStrategy(
        resolver, variable_partitioner=variable_partitioner
    )


def refuse_sharded(variables: list[Any]) -> None:
    """Raise ValueError if a partitioner sharded any of these Keras 3 variables.

    Keras 3 takes one tf.Variable per weight: its gradients read the variable's handle and its
    optimizer updates the variable in place, and a ShardedVariable has neither (seen with Keras
    3.15: AttributeError 'ShardedVariable' object has no attribute 'handle').
    """
    sharded = [
        v.path
        for v in variables
        if isinstance(getattr(v, "value", v), tf.__internal__.distribute.ShardedVariable)
    ]
    if sharded:
        raise ValueError(
            "Keras 3 cannot train variables sharded by a variable_partitioner "
            f"({', '.join(sharded)}): "
            "call distlaunch.worker.strategy(variable_partitioner=None); PSS still spreads whole "
            "variables over the ps tasks"
        )


def is_parameter_server(strategy: tf.distribute.Strategy) -> bool:
    """Return whether ``strategy`` is a ParameterServerStrategy (its steps must be scheduled)."""
    return isinstance(strategy, tf.distribute.ParameterServerStrategy)


class ScheduledSteps:
    """Training steps that the chief schedules onto the workers, which run them asynchronously.

    Each step takes the next batch from its worker's own copy of the dataset; a dead worker's
    steps are re-queued to the others by the coordinator, and an error from a ps (its variables
    are gone) propagates out of `run`.
    """

    def __init__(
        self,
        strategy: tf.distribute.ParameterServerStrategy,
        train_step: Callable[[Any], tf.Tensor],
        dataset: tf.data.Dataset | Callable[[tf.distribute.InputContext], tf.data.Dataset],
        step: tf.Variable,
    ) -> None:
        """``train_step(iterator)`` is a tf.function returning the step's loss; ``step`` is the
        exact step counter it increments (read for the heartbeat while steps run)."""
        # Steps scheduled ahead of those done: enough to keep every worker busy, few enough that
        # a stop notice is not kept waiting behind a queue of them (they cannot be taken back).
        self._window = _AHEAD_PER_WORKER * runtime.context().num_workers
        self.noticed = False
        # One coordinator per strategy: TensorFlow hands back the same one on later calls.
        self._coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        self._train_step = train_step
        self._step = step
        self._iterator = iter(
            self._coordinator.create_per_worker_dataset(_per_worker(strategy, dataset))
        )

    def run(self, steps: int, heartbeat: progress.Heartbeat) -> float:
        """Schedule ``steps`` steps, wait for all of them, and return the sum of their losses.

        At most a window of steps runs ahead of those done. On a stop notice (`preempt`) no more
        are scheduled: those in flight finish, and ``noticed`` is set.
        Waiting polls `done()` rather than blocking in `join()` so that the heartbeat goes on;
        `done()` raises the first error of a failed step (e.g. UnavailableError for a dead ps).
        """
        start = int(self._step.numpy())
        losses: list[Any] = []
        while len(losses) < steps and not preempt.noticed():
            room = self._window - (len(losses) - (int(self._step.numpy()) - start))
            if room <= 0:
                self._coordinator.done()  # raises a failed step's error
                self._wait(heartbeat)
                continue
            losses += [
                self._coordinator.schedule(self._train_step, args=(self._iterator,))
                for _ in range(min(room, steps - len(losses)))
            ]
        self.noticed = preempt.noticed()
        while not self._coordinator.done():
            self._wait(heartbeat)
        return float(sum(self._coordinator.fetch(losses)))

    def _wait(self, heartbeat: progress.Heartbeat) -> None:
        if heartbeat.due():
            heartbeat.beat(int(self._step.numpy()))
        time.sleep(_POLL_S)


def _per_worker(
    strategy: tf.distribute.ParameterServerStrategy,
    dataset: tf.data.Dataset | Callable[[tf.distribute.InputContext], tf.data.Dataset],
) -> Any:
    """Return what `create_per_worker_dataset` builds on every worker from ``dataset``.

    A dataset is serialized and rebuilt whole on each worker (PSS does not shard: shuffle
    without a fixed seed so the workers see different orders); a function is called on each
    worker with an InputContext, whose batch size per replica is the global batch size (a PSS
    step is one worker's batch).
    """
    if isinstance(dataset, tf.data.Dataset):
        return dataset
    if callable(dataset):
        return lambda: strategy.distribute_datasets_from_function(dataset)
    raise TypeError(f"dataset must be a tf.data.Dataset or a function, not {type(dataset)}")
