"""Training under a distributed strategy: a Keras 3 loop (`fit`) and tf_keras callbacks.

Keras 3 `model.fit` supports neither MultiWorkerMirroredStrategy (keras-team/keras#20585) nor
ParameterServerStrategy (keras-team/keras#18624), so `fit` is a custom loop: under MWMS every
worker runs it in lockstep; under PSS only the chief runs it and schedules the steps onto the
workers. `tf_keras` `model.fit` works under both and only needs `keras_callbacks()`. Both write
the same per-epoch metrics file, TensorBoard scalars and status heartbeat, resume from the run's
checkpoint directory, and mark the run's training done when they finish.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from . import contract, elastic, preempt, progress, ps, resume, runtime

if TYPE_CHECKING:
    import keras

# Per-example weighted losses: (y_true, y_pred, sample_weight or None) -> tensor [batch].
PerExampleLoss = Callable[[Any, Any, Any], tf.Tensor]

# Checkpoints kept in the chief's directory; older ones are deleted by the CheckpointManager.
_CHECKPOINTS_TO_KEEP = 3


def fit(
    model: keras.Model,
    dataset: tf.data.Dataset | Callable[[tf.distribute.InputContext], tf.data.Dataset],
    *,
    global_batch_size: int,
    epochs: int,
    steps_per_epoch: int,
    checkpoint_every: int | None = None,
    strategy: tf.distribute.Strategy | None = None,
    loss: Any = None,
) -> list[dict[str, Any]]:
    """Train a Keras 3 ``model`` compiled inside ``strategy.scope()``.

    ``dataset`` is either a repeating tf.data.Dataset batched at the GLOBAL batch size, or a
    function ``input_context -> dataset`` batched at ``input_context``'s per-replica size.
    The model's compiled optimizer and loss are used; ``loss`` (a Keras loss object, name or
    per-example function) overrides the compiled one. ``strategy`` defaults to the one the
    model was built under.

    MultiWorkerMirroredStrategy (and the default strategy): every worker calls `fit`; a dataset
    is sharded by data unless its options already name an auto-shard policy, a function shards
    by itself. ParameterServerStrategy: only the chief gets here (ps and worker tasks serve) and
    schedules each step onto a free worker; a step is one worker's batch of
    ``global_batch_size``. A dataset is copied whole to every worker (PSS does not shard: give
    it an unseeded shuffle), a function runs on every worker.

    With DISTLAUNCH_CHECKPOINT_DIR set, the model, optimizer and an exact step counter are
    checkpointed every ``checkpoint_every`` steps (default: every epoch) and at the end, and
    training resumes from the chief's latest checkpoint, skipping the steps already done. Each
    epoch prints ``epoch E/EPOCHS step S loss L`` (under MWMS the same on every worker), appends
    to the metrics file, writes the chief's TensorBoard scalars and refreshes the "ready"
    heartbeat. At the end the chief writes the run's "training done" marker. Returns the
    metrics list, earlier attempts included.

    In an elastic run (contract.ELASTIC_BATCH set) the batch follows the world size
    (worker/elastic.py): ``global_batch_size`` and the dataset are the program's, written for
    the range's maximum; under "global" they stay (a global batch that does not divide over this
    world stops every worker in one line, exit code 2, before training); under "per_worker" the
    global batch becomes ``global_batch_size / MAX * world`` and a dataset is rebatched to it (a
    function's per-replica batches likewise). One line says the world and its batch. The
    checkpoint does not depend on the world size: a run resumes at any size.

    On a stop notice (SIGTERM, see `preempt`) every MWMS worker saves the same step (under PSS
    the chief stops scheduling, lets the steps in flight finish and saves) and the process
    exits EXIT_PREEMPTED: `fit` does not return.
    """
    if min(global_batch_size, steps_per_epoch, checkpoint_every or 1) < 1 or epochs < 0:
        raise ValueError(
            "global_batch_size, steps_per_epoch and checkpoint_every must be >= 1, epochs >= 0"
        )
    if model.optimizer is None:
        raise ValueError("compile the model, inside strategy.scope(), before calling fit")
    strategy = strategy or model.distribute_strategy
    ps.refuse_sharded(model.trainable_variables)
    ctx = runtime.context()
    global_batch_size, dataset = _batch_of_this_world(global_batch_size, dataset, ctx)
    per_example_loss = _per_example_loss(model.loss if loss is None else loss)
    with strategy.scope():
        # An exact step counter: Keras 3's optimizer.iterations is not one under every strategy
        # (under PSS it loses concurrent increments); assign_add on a tf.Variable is atomic.
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="distlaunch_step")
        if not model.optimizer.built:
            # Build the slots now, under the strategy, so that restore fills them directly.
            model.optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step)
    start, keep_all = _restore(checkpoint, step, ctx)

    scheduled = ps.is_parameter_server(strategy)
    train_step = _make_train_step(
        strategy, model, per_example_loss, global_batch_size, step, with_notice=not scheduled
    )
    steps: _LocalSteps | ps.ScheduledSteps
    preempt.watch()
    if scheduled:
        # Only the chief restored: there is no agreement between workers to check.
        steps = ps.ScheduledSteps(strategy, train_step, dataset, step)
    else:
        _check_workers_agree_on_step(strategy, start)
        steps = _LocalSteps(train_step, iter(_distribute(strategy, dataset)), start)
    saver = _Saver(checkpoint, ctx, keep_all)
    log = _EpochLog(ctx, start)
    heartbeat = progress.Heartbeat(total_steps=epochs * steps_per_epoch)
    every = checkpoint_every or steps_per_epoch
    current = start
    # A resumed partial epoch only runs its remaining steps: the data is not replayed to the
    # point of interruption, the steps are counted.
    for epoch in range(start // steps_per_epoch, epochs):
        epoch_end = (epoch + 1) * steps_per_epoch
        loss_sum: float | tf.Tensor = 0.0
        ran = 0
        while current < epoch_end:
            # Run to the next checkpoint or the end of the epoch, whichever comes first: under
            # PSS all scheduled steps are done when `run` returns, so the checkpoint is exact.
            target = min(epoch_end, (current // every + 1) * every)
            loss_sum += steps.run(target - current, heartbeat)
            ran += target - current
            # The counter, not `target`: PSS runs a step at least once (again on another worker
            # when its worker dies mid-step), so the counter can be ahead.
            current = int(step.numpy())
            if steps.noticed:
                _save_and_stop(saver, current, heartbeat)
            if target % every == 0:
                saver.save(current)
                heartbeat.update(checkpoint_step=saver.last_step)
        if ran:  # else re-run steps had already carried the counter past this whole epoch
            mean = float(loss_sum) / ran
            log.append(epoch + 1, epochs, current, mean)
            heartbeat.update(loss=mean)
        heartbeat.beat(current, force=True)
    if current > start and saver.last_step != current:
        saver.save(current)
        heartbeat.update(checkpoint_step=saver.last_step)
        heartbeat.beat(current, force=True)
    if ctx.is_chief:
        progress.mark_training_done(current)
    return log.entries


def keras_callbacks(*, checkpoint_every: int | None = None) -> list[Any]:
    """Return callbacks that make ``model.fit`` a well-behaved distlaunch task, for the Keras
    the task runs (tf_keras, or Keras 3 under MWMS with distlaunch.worker.keras3's layer).

    With DISTLAUNCH_CHECKPOINT_DIR set: ``BackupAndRestore`` backing up into
    ``<checkpoint dir>/backup`` every ``checkpoint_every`` steps (default: every epoch); only the
    chief keeps its copy and every worker restores (Keras 3: at the step the backup holds). Under
    MWMS tf_keras's also saves on a stop notice (``save_before_preemption``, see `preempt`) and
    under Keras 3 the layer saves it (patches.patch_stop_notice); either reports the saved step
    and exits 75. Always: a callback
    that prints ``epoch E/EPOCHS step S loss L``, writes the metrics file, the chief's
    TensorBoard scalars and the "ready" heartbeat like `fit` does, prints ``distlaunch: resumed
    from ...`` after a restore, and writes the "training done" marker on the chief at the end.
    In an elastic run it says the world in one line, unless ``dw.global_batch_size`` (with
    which the dataset follows the elastic batch rule) said it already.

    Under ParameterServerStrategy tf_keras allows no batch-level callbacks: backups happen at
    epoch ends only (``checkpoint_every`` is ignored), and the heartbeat comes from a thread.
    """
    ctx = runtime.context()
    elastic.say_world(ctx)
    coordinated = ctx.strategy == contract.PSS
    if ctx.keras == contract.TF_KERAS:
        import tf_keras as keras_module  # imported here so that Keras 3 scripts never load Keras 2
    else:
        import keras as keras_module

        if coordinated:
            raise ValueError(
                "Keras 3 model.fit does not support ParameterServerStrategy "
                '(keras-team/keras#18624): set "keras": "tf_keras" or train with dw.fit'
            )

    class _DistlaunchCallback(keras_module.callbacks.Callback):
        """Metrics, heartbeat, resume line and done marker for tf_keras fit (after the restore)."""

        def __init__(self, backup_dir: Path | None) -> None:
            super().__init__()
            self._backup_dir = backup_dir
            self._heartbeat = progress.Heartbeat()
            self._background = progress.BackgroundHeartbeat() if coordinated else None
            self._log: _EpochLog | None = None

        def _step(self) -> int:
            return int(self.model.optimizer.iterations.numpy())

        def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
            start = self._step()
            steps, epochs = self.params.get("steps"), self.params.get("epochs")
            if steps and epochs:
                self._heartbeat.update(total_steps=steps * epochs)
            if start > 0 and self._backup_dir is not None:
                print(f"distlaunch: resumed from {self._backup_dir} at step {start}", flush=True)
            self._log = _EpochLog(ctx, start)
            if self._background is not None:
                self._background.start()

        def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            assert self._log is not None
            if not logs or "loss" not in logs:
                return  # an epoch of no step (its dataset ran out first): no loss to log
            step = self._step()
            self._log.append(epoch + 1, self.params["epochs"], step, float(logs["loss"]))
            self._heartbeat.update(loss=float(logs["loss"]))
            if self._backup_dir is not None and (coordinated or checkpoint_every is None):
                self._heartbeat.update(checkpoint_step=step)  # BackupAndRestore saved this epoch
            self._heartbeat.beat(step, force=True)

        def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
            if self._background is not None:
                self._background.stop()
            if ctx.is_chief:
                progress.mark_training_done(self._step())

    class _StepHeartbeatCallback(_DistlaunchCallback):
        """Also refreshes the heartbeat, with the step, between batches."""

        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            if self._heartbeat.due():
                if logs and "loss" in logs:
                    self._heartbeat.update(loss=float(logs["loss"]))
                self._heartbeat.beat(self._step(), force=True)

    backup_dir = contract.keras_backup_dir(ctx.checkpoint_dir) if ctx.checkpoint_dir else None
    callbacks: list[Any] = []
    if backup_dir is not None:
        # delete_checkpoint=False: like `fit`, a finished run keeps its state, so running the
        # same run again with more epochs continues instead of starting over.
        more = {"save_before_preemption": ctx.strategy == contract.MWMS}
        callbacks.append(
            keras_module.callbacks.BackupAndRestore(
                backup_dir=str(backup_dir),
                save_freq="epoch" if coordinated else checkpoint_every or "epoch",
                delete_checkpoint=False,
                **(more if ctx.keras == contract.TF_KERAS else {}),
            )
        )
    callbacks.append((_DistlaunchCallback if coordinated else _StepHeartbeatCallback)(backup_dir))
    return callbacks


def _save_and_stop(saver: _Saver, current: int, heartbeat: progress.Heartbeat) -> None:
    """Every worker agreed on a notice after step ``current``: save it (all together) and exit."""
    started = time.monotonic()
    if saver.last_step != current:
        saver.save(current)
    heartbeat.update(checkpoint_step=saver.last_step)
    heartbeat.beat(current, force=True)
    preempt.stop(saver.last_step, time.monotonic() - started)


def _batch_of_this_world(
    global_batch_size: int,
    dataset: tf.data.Dataset | Callable[[tf.distribute.InputContext], tf.data.Dataset],
    ctx: runtime.TaskContext,
) -> tuple[int, tf.data.Dataset | Callable[[tf.distribute.InputContext], tf.data.Dataset]]:
    """The global batch of a step in this world and the input batched for it (`elastic`): the
    program's own outside an elastic run, or when the rule keeps the global batch."""
    try:
        batch = elastic.world_batch(global_batch_size, ctx)
    except elastic.ElasticBatchError as exc:
        elastic.refuse(exc)
    elastic.say(batch)
    size = batch.global_size
    if size == global_batch_size:
        return size, dataset
    if isinstance(dataset, tf.data.Dataset):
        # Batches of the program's size, cut and joined into batches of this world's: the same
        # examples in the same order (drop_remainder: a repeating dataset keeps a static shape).
        return size, dataset.rebatch(size, drop_remainder=True)
    if callable(dataset):
        make = dataset

        def per_replica(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
            # The function batched for the program's global batch; each replica's part of this
            # world's global batch is what the step takes.
            part = input_context.get_per_replica_batch_size(size)
            return make(input_context).rebatch(part, drop_remainder=True)

        return size, per_replica
    return size, dataset  # _distribute names what is wrong with it


def _per_example_loss(loss: Any) -> PerExampleLoss:
    """Turn a compiled Keras 3 loss into a function of unreduced, weighted per-example losses.

    Global averaging must happen over the GLOBAL batch (tf.nn.compute_average_loss), so the
    loss's own per-replica reduction is switched off.
    """
    import keras  # Keras 3; imported here so that tf_keras scripts never load it

    if loss is None:
        raise ValueError("the model has no compiled loss: compile it with one or pass loss=")
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        unreduced = type(loss).from_config({**loss.get_config(), "reduction": None})
        return lambda y, y_pred, weight: unreduced(y, y_pred, sample_weight=weight)
    if callable(loss):
        fn = loss

        def weighted(y: Any, y_pred: Any, weight: Any) -> tf.Tensor:
            values = fn(y, y_pred)
            return values if weight is None else values * tf.cast(weight, values.dtype)

        return weighted
    raise TypeError(f"unsupported loss {loss!r}: give a keras.losses.Loss, a name or a function")


def _make_train_step(
    strategy: tf.distribute.Strategy,
    model: keras.Model,
    per_example_loss: PerExampleLoss,
    global_batch_size: int,
    step: tf.Variable,
    with_notice: bool,
) -> Callable[..., tf.Tensor]:
    """Return a tf.function that runs one synchronous step and returns the global mean loss.

    ``with_notice``: it takes a second argument, ``notice`` (float32 scalar: 1 when this task has
    had a stop notice), and returns ``[loss, number of replicas with a notice]``, reduced in the
    step's one all-reduce. Without (PSS: the coordinator schedules ``train_step(iterator)``), an
    argument of neither kind: a defaulted argument breaks the coordinator's function binding.
    """
    import keras

    def one_step(iterator: Any, notice: tf.Tensor | None) -> tf.Tensor:
        def replica_step(batch: Any) -> tf.Tensor:
            x, y, weight = keras.utils.unpack_x_y_sample_weight(batch)
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                # Scaled by the GLOBAL batch size so that summing over replicas gives the mean.
                loss = tf.nn.compute_average_loss(
                    per_example_loss(y, y_pred, weight), global_batch_size=global_batch_size
                )
                if model.losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            gradients = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss if notice is None else tf.stack([tf.cast(loss, tf.float32), notice])

        per_replica_loss = strategy.run(replica_step, args=(next(iterator),))
        step.assign_add(1)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_loss, axis=None)

    if with_notice:
        return tf.function(lambda iterator, notice: one_step(iterator, notice))
    return tf.function(lambda iterator: one_step(iterator, None))


def _distribute(
    strategy: tf.distribute.Strategy,
    dataset: tf.data.Dataset | Callable[[tf.distribute.InputContext], tf.data.Dataset],
) -> tf.distribute.DistributedDataset:
    """Split the input over the workers and their replicas."""
    if isinstance(dataset, tf.data.Dataset):
        policy = dataset.options().experimental_distribute.auto_shard_policy
        if policy == tf.data.experimental.AutoShardPolicy.AUTO:
            # AUTO tries to shard by file first, which fails or skews when there are fewer
            # files than workers; sharding by element is always correct, only slower to read.
            options = tf.data.Options()
            options.experimental_distribute.auto_shard_policy = (
                tf.data.experimental.AutoShardPolicy.DATA
            )
            dataset = dataset.with_options(options)
        return strategy.experimental_distribute_dataset(dataset)
    if callable(dataset):
        return strategy.distribute_datasets_from_function(dataset)
    raise TypeError(f"dataset must be a tf.data.Dataset or a function, not {type(dataset)}")


def _restore(
    checkpoint: tf.train.Checkpoint, step: tf.Variable, ctx: runtime.TaskContext
) -> tuple[int, bool]:
    """Restore the chief's latest checkpoint, if any; return the step to continue from and
    whether the checkpoint index was damaged (`resume`: the newest whole checkpoint is used,
    and this attempt then deletes none: the index no longer says which are whose)."""
    if ctx.checkpoint_dir is None:
        return 0, False
    point = resume.find(ctx.checkpoint_dir)  # CheckpointDamaged: nothing whole to resume from
    if point.path is None:
        return 0, False
    if point.damage:
        print(f"distlaunch: {point.damage}; no checkpoint is deleted in this attempt", flush=True)
    # Fails loudly if the model or optimizer no longer matches what the checkpoint holds.
    checkpoint.restore(str(point.path)).assert_existing_objects_matched()
    start = int(step.numpy())
    print(f"distlaunch: resumed from {point.path} at step {start}", flush=True)
    return start, bool(point.damage)


def _check_workers_agree_on_step(strategy: tf.distribute.Strategy, start: int) -> None:
    """Fail on every worker if the workers resumed from different steps.

    That happens when a worker cannot see the chief's checkpoint directory (no shared file
    system): training would go on silently with different weights on different workers.
    All steps are equal exactly when n * sum(s^2) == sum(s)^2.
    """
    replicas = strategy.num_replicas_in_sync
    if replicas == 1:
        return

    @tf.function  # collectives run eagerly are slow and warn
    def sums() -> tf.Tensor:
        def replica_fn() -> tf.Tensor:
            mine = tf.constant([start, start * start], tf.float64)
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, mine)

        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    total, total_sq = sums().numpy()
    if replicas * total_sq != total * total:
        raise RuntimeError(
            f"workers resumed from different steps (this one from {start}, mean "
            f"{total / replicas:g}): every worker must see the chief's checkpoint directory"
        )


class _Saver:
    """Checkpoints following the chief-vs-others rule of `checkpoint_dir_for_this_task`."""

    def __init__(
        self, checkpoint: tf.train.Checkpoint, ctx: runtime.TaskContext, keep_all: bool = False
    ) -> None:
        self._dir = runtime.checkpoint_dir_for_this_task(ctx)
        self._is_chief = ctx.is_chief
        # keep_all (a damaged index): max_to_keep=None deletes nothing.
        keep = None if keep_all else _CHECKPOINTS_TO_KEEP
        self._manager = (
            tf.train.CheckpointManager(
                checkpoint, str(self._dir), max_to_keep=keep, checkpoint_name="ckpt"
            )
            if self._dir is not None
            else None
        )
        self.last_step: int | None = None

    def save(self, step: int) -> None:
        """Save as checkpoint ``ckpt-<step>``; every worker must call this at the same step."""
        if self._manager is None or self._dir is None:
            return
        self._manager.save(checkpoint_number=step)
        if not self._is_chief:
            shutil.rmtree(self._dir, ignore_errors=True)
        self.last_step = step


class _LocalSteps:
    """Training steps this worker runs itself (MWMS: in lockstep with the others).

    Each step also tells every worker whether any has had a stop notice (`preempt`); once one
    has, `run` stops after that step on every worker alike and ``noticed`` is set.
    """

    def __init__(self, train_step: Callable[..., tf.Tensor], iterator: Any, start: int) -> None:
        self._train_step = train_step
        self._iterator = iterator
        self._done = start
        self._flags = (tf.constant(0.0), tf.constant(1.0))
        self.noticed = False

    def run(self, steps: int, heartbeat: progress.Heartbeat) -> tf.Tensor:
        """Run up to ``steps`` steps and return the sum of their losses."""
        total = tf.zeros([])
        for _ in range(steps):
            loss, notices = tf.unstack(
                self._train_step(self._iterator, self._flags[preempt.noticed()])
            )
            total += loss
            self._done += 1
            heartbeat.beat(self._done)
            if notices > 0:  # the same value on every worker: the same step's all-reduce
                self.noticed = True
                break
        return total


class _EpochLog:
    """Per-epoch reporting: the printed line, the metrics file and, on the chief, TensorBoard."""

    def __init__(self, ctx: runtime.TaskContext, start_step: int) -> None:
        self._metrics = progress.MetricsLog(contract.env_path(contract.METRICS_FILE), start_step)
        self._scalars = progress.Scalars("train", enabled=ctx.is_chief)

    @property
    def entries(self) -> list[dict[str, Any]]:
        """The metrics entries, earlier attempts' included."""
        return self._metrics.entries

    def append(self, epoch: int, epochs: int, step: int, loss: float) -> None:
        """Print the epoch line and record the epoch's mean loss."""
        print(f"epoch {epoch}/{epochs} step {step} loss {loss:.6f}", flush=True)
        self._metrics.append({"epoch": epoch, "step": step, "loss": loss})
        self._scalars.write(step, {"loss": loss})
