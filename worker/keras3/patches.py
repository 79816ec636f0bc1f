"""The layer's patches of Keras 3's TensorFlow trainer, losses and metrics (see the package doc).

Each ``patch_*`` function is one patch: it keeps the function it replaces and calls it unchanged
outside multi-worker MWMS (one process, MirroredStrategy on one machine, no strategy), so a
program's single-process run is Keras's own. `PATCHES` lists them with their guards
(`guards.Patch`); `apply_all` checks every guard first and only then puts any patch in, so a Keras
the layer does not fit is never half patched. This module imports ``keras.src`` and TensorFlow:
the hook (`hook`) imports it only once the program has imported ``keras``.
"""

from __future__ import annotations

import functools
import threading
import time

import keras
import tensorflow as tf

from .. import preempt
from . import callbacks, guards
from .guards import LayerError
from .where import multi_worker

_TRAINER = "keras.src.backend.tensorflow.trainer"
_LOSS = "keras.src.losses.loss"
_METRIC = "keras.src.metrics.metric"
_CALLBACKS = "keras.src.callbacks"

# The per-replica sample counts of the step being traced (see patch_loss_weighted_by_samples):
# thread-local, as MirroredStrategy traces each local replica's step in a thread of its own.
_step = threading.local()
# Results a merged metric produced (by tensor ref) while the step traced: reduce_per_replica
# passes them through instead of all-reducing values every worker already agrees on.
_merged = threading.local()
# Set while a merged result is computed: results inside it (sub-metrics) are not merged again.
_merging = threading.local()
# The log key a training step's outputs carry the count of workers with a stop notice under
# (patch_loss_weighted_by_samples puts it in, the training function takes it out again), and
# whether every worker has learnt of one after the last step (patch_stop_notice acts on it).
NOTICE_KEY = "_distlaunch_notices"
notice = {"agreed": False}


def _current_multi_worker() -> bool:
    return tf.distribute.has_strategy() and multi_worker(tf.distribute.get_strategy())


def patch_symbolic_build_from_local_batch() -> None:
    """keras-team/keras#20585: ``TensorFlowTrainer._maybe_symbolic_build`` builds the model from
    ``strategy.reduce("MEAN", batch, axis=None)`` of the first distributed batch, which under
    multi-worker MWMS cannot convert a ``PerReplica`` (and would all-reduce real data, on every
    `evaluate` too, failing where the workers' shares differ in shape). Build from this worker's
    own first replica's share instead: only its shapes matter."""
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    original = trainer.TensorFlowTrainer._maybe_symbolic_build

    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None or iterator is None or not multi_worker(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda x: (
                    strategy.experimental_local_results(x)[0]
                    if isinstance(x, tf.distribute.DistributedValues)
                    else x
                ),
                batch,
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


def patch_reduce_logs_over_workers() -> None:
    """keras-team/keras#20585: ``reduce_per_replica`` reduces the step's logs under multi-worker
    MWMS with ``strategy.reduce("MEAN", v, axis=0)``, which fails on the scalar losses and
    metrics every step returns. Reduce the whole value over the replicas (``axis=None``), and pass
    through the merged metric results (`patch_metrics_merged_across_workers`), which every
    replica already holds."""
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer

    original = trainer.reduce_per_replica

    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not multi_worker(strategy):
            return original(values, strategy, reduction)
        merged = getattr(_merged, "refs", set())

        def reduce(v):
            parts = (
                strategy.experimental_local_results(v)
                if isinstance(v, tf.distribute.DistributedValues)
                else (v,)
            )
            if all(isinstance(p, tf.Tensor) and p.ref() in merged for p in parts):
                return parts[0]
            return strategy.reduce("MEAN", v, axis=None)

        return tree.map_structure(reduce, values)

    trainer.reduce_per_replica = reduce_per_replica


def patch_loss_weighted_by_samples() -> None:
    """Keras 3 scales each replica's mean loss by ``1 / replicas``
    (``keras.src.losses.loss.scale_loss_for_distribution``; keras-team/keras#20585 for the
    multi-worker case): where the global batch does not split evenly over the workers (64 over
    3: 22/21/21), or a last batch is short, a short share's samples weigh more than one process
    would weigh them. Scale by ``samples here / samples in the step`` instead (one small
    all-reduce per step), so the summed gradients are the one-process mean's; ``unscale`` gives
    back this replica's own mean for the loss metrics. The same all-reduce carries this task's
    stop-notice flag (a local variable set between steps), so every worker learns after the same
    training step that some worker had a notice (`patch_stop_notice` saves and stops there): no
    collective of its own, no thread, as `dw.fit` does (worker/preempt.py)."""
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.data_adapters import data_adapter_utils

    make_function = trainer.TensorFlowTrainer._make_function
    scale, unscale = (
        loss_module.scale_loss_for_distribution,
        loss_module.unscale_loss_for_distribution,
    )

    @functools.wraps(make_function)
    def _make_function(self, step_function):
        if not multi_worker(self.distribute_strategy):
            return make_function(self, step_function)
        training = step_function == self.train_step
        # Every worker makes it at the same point of fit (under the program's scope, if fit is
        # called in one, a MirroredVariable: its local copies are still this task's own to set).
        flag = tf.Variable(0.0, trainable=False, name="distlaunch_notice") if training else None

        @functools.wraps(step_function)
        def counted_step(data):
            x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
            first = next((t for t in tree.flatten(x) if t is not None), None)
            if first is None:
                return step_function(data)
            here = tf.cast(tf.shape(first)[0], tf.float32)
            context = tf.distribute.get_replica_context()
            mine = tf.stack([here, flag.read_value() if flag is not None else tf.constant(0.0)])
            total, notices = tf.unstack(context.all_reduce(tf.distribute.ReduceOp.SUM, mine))
            _step.counts = (here, total)
            _merged.refs = set()
            try:
                outputs = step_function(data)
            finally:
                _step.counts = None
            if flag is None or not isinstance(outputs, dict):
                return outputs
            _merged.refs.add(notices.ref())  # the same on every replica: no reduce of its own
            return {**outputs, NOTICE_KEY: notices}

        function = make_function(self, counted_step)
        if flag is None:
            return function

        @functools.wraps(function)
        def train_function(iterator):
            if preempt.noticed() and not flag.numpy():
                flag.assign(1.0)
            logs = function(iterator)
            if isinstance(logs, dict) and NOTICE_KEY in logs:
                logs = dict(logs)
                if float(logs.pop(NOTICE_KEY)) > 0:
                    notice["agreed"] = True
            return logs

        return train_function

    @functools.wraps(scale)
    def scale_loss_for_distribution(value):
        counts = getattr(_step, "counts", None)
        if counts is None or tf.distribute.in_cross_replica_context():
            return scale(value)
        here, total = counts
        return value * tf.cast(tf.math.divide_no_nan(here, total), value.dtype)

    @functools.wraps(unscale)
    def unscale_loss_for_distribution(value):
        counts = getattr(_step, "counts", None)
        if counts is None or tf.distribute.in_cross_replica_context():
            return unscale(value)
        here, total = counts
        return value * tf.cast(tf.math.divide_no_nan(total, here), value.dtype)

    trainer.TensorFlowTrainer._make_function = _make_function
    loss_module.scale_loss_for_distribution = scale_loss_for_distribution
    loss_module.unscale_loss_for_distribution = unscale_loss_for_distribution


def patch_metrics_merged_across_workers() -> None:
    """Keras 3's ``Metric.result()`` inside a step reads this replica's own state (Keras 2's
    ``result_wrapper`` merged it across replicas; keras-team/keras#20585): per-step logs, and
    what callbacks see of them, differ per worker. Called in a replica context of multi-worker
    MWMS, a metric's result is now computed from its state variables summed (or averaged, as
    each variable aggregates) over every replica in one all-reduce, so every worker logs the
    same values and takes the same decisions (the step's logs: every metric in one all-reduce).
    Wraps ``result`` of every Metric class, present
    and future; a result computed inside another's merge (CompileMetrics' sub-metrics) is not
    merged twice."""
    from keras.src import tree
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.metrics import metric as metric_module
    from keras.src.trainers import trainer as base_trainer

    Metric = metric_module.Metric

    def wrap(cls: type) -> None:
        original = cls.__dict__.get("result")
        if original is None or getattr(original, "_distlaunch_merged", False):
            return

        @functools.wraps(original)
        def result(self):
            if getattr(_merging, "active", False) or not _in_multi_worker_replica_context():
                return original(self)
            return _merged_call(lambda: original(self), list(self.variables))

        result._distlaunch_merged = True  # type: ignore[attr-defined]
        cls.result = result

    def every_subclass(cls: type) -> list[type]:
        out = [cls]
        for sub in cls.__subclasses__():
            out.extend(every_subclass(sub))
        return out

    for cls in every_subclass(Metric):
        wrap(cls)

    # The step's logs (get_metrics_result, what train_step and test_step return): every metric's
    # state in one all-reduce, not one per metric.
    get_metrics_result = base_trainer.Trainer.get_metrics_result

    @functools.wraps(get_metrics_result)
    def merged_metrics_result(self):
        if getattr(_merging, "active", False) or not _in_multi_worker_replica_context():
            return get_metrics_result(self)
        variables = [v for metric in self.metrics for v in metric.variables]
        return _merged_call(lambda: get_metrics_result(self), variables)

    def _merged_call(compute, variables):
        merged = _merged_values(variables)
        _merging.active = True
        try:
            with StatelessScope(state_mapping=list(zip(variables, merged))):
                out = compute()
        finally:
            _merging.active = False
        refs = getattr(_merged, "refs", None)
        if refs is not None:
            refs.update(t.ref() for t in tree.flatten(out) if isinstance(t, tf.Tensor))
        return out

    base_trainer.Trainer.get_metrics_result = merged_metrics_result
    previous = Metric.__dict__.get("__init_subclass__")

    @classmethod  # type: ignore[misc]
    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(Metric, cls).__init_subclass__(**kwargs)
        wrap(cls)

    Metric.__init_subclass__ = __init_subclass__


def patch_predict_shards_by_data() -> None:
    """Keras 3's ``predict`` under multi-worker MWMS distributes the dataset with its own
    auto-shard policy: a dataset read from files is sharded by FILE, so each worker predicts other
    files and the gathered outputs are not the one-process order (tf_keras forced DATA sharding
    for predict; keras-team/keras#20585). Force DATA sharding, as tf_keras did: every worker
    reads every batch and keeps its share of it, and the concatenation over workers restores the
    order."""
    from keras.src.backend.tensorflow import trainer

    original = trainer.TensorFlowTrainer.predict

    @functools.wraps(original)
    def predict(self, x, *args, **kwargs):
        if isinstance(x, tf.data.Dataset) and multi_worker(self.distribute_strategy):
            options = tf.data.Options()
            policy = tf.data.experimental.AutoShardPolicy.DATA
            options.experimental_distribute.auto_shard_policy = policy
            x = x.with_options(options)
        return original(self, x, *args, **kwargs)

    trainer.TensorFlowTrainer.predict = predict


def patch_stop_notice() -> None:
    """A stop notice (SIGTERM from the launcher) under Keras 3 ``fit`` is lost: TensorFlow's
    notifier only records it (worker/preempt.py), Keras 3's ``BackupAndRestore`` has no
    ``save_before_preemption`` (tf_keras's had), and the run resumes from the last periodic
    backup (keras-team/keras#20585). From ``fit``'s start the task takes SIGTERM as a notice
    (`preempt.watch`, after the program built its strategy); once every worker has learnt of
    one after the same step (`patch_loss_weighted_by_samples`), each saves the program's
    ``BackupAndRestore`` callbacks at the end of that step, all together, and exits as a
    preempted task does (`preempt.stop`, EXIT_PREEMPTED); a resume restarts at that step."""
    from keras.src.callbacks import backup_and_restore, callback_list

    cls = callback_list.CallbackList
    begin, batch_end = cls.on_train_begin, cls._on_train_batch_end

    def _multi_worker(callbacks) -> bool:
        model = getattr(callbacks, "model", None)
        return multi_worker(getattr(model, "distribute_strategy", None))

    @functools.wraps(begin)
    def on_train_begin(self, logs=None):
        notice["agreed"] = False
        if _multi_worker(self):
            preempt.watch()
        return begin(self, logs)

    @functools.wraps(batch_end)
    def _on_train_batch_end(self, batch, logs=None):
        batch_end(self, batch, logs)
        if not notice["agreed"]:
            return
        started = time.monotonic()
        backups = [c for c in self.callbacks if isinstance(c, backup_and_restore.BackupAndRestore)]
        for backup in backups:
            backup._save_model()
        step = int(self.model.optimizer.iterations.numpy()) if backups else None
        preempt.stop(step, time.monotonic() - started)

    cls.on_train_begin, cls._on_train_batch_end = on_train_begin, _on_train_batch_end


def _in_multi_worker_replica_context() -> bool:
    return not tf.distribute.in_cross_replica_context() and _current_multi_worker()


def _merged_values(variables: list) -> list:
    """The variables' values over every replica, as each aggregates (one all-reduce per kind)."""
    context = tf.distribute.get_replica_context()
    values = [tf.identity(v.value) for v in variables]
    for kind, op in (("sum", tf.distribute.ReduceOp.SUM), ("mean", tf.distribute.ReduceOp.MEAN)):
        picked = [i for i, v in enumerate(variables) if v.aggregation == kind]
        if picked:
            reduced = context.all_reduce(op, [values[i] for i in picked])
            for i, value in zip(picked, reduced):
                values[i] = value
    return values


PATCHES = (
    guards.Patch(
        "symbolic-build",
        "keras-team/keras#20585",
        "3.5",
        "4",
        (
            f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build",
            f"{_TRAINER}:TensorFlowTrainer._symbolic_build",
        ),
        patch_symbolic_build_from_local_batch,
    ),
    guards.Patch(
        "reduce-logs",
        "keras-team/keras#20585",
        "3.3",
        "4",
        (f"{_TRAINER}:reduce_per_replica",),
        patch_reduce_logs_over_workers,
    ),
    guards.Patch(
        "loss-by-samples",
        "keras-team/keras#20585",
        "3.3",
        "4",
        (
            f"{_TRAINER}:TensorFlowTrainer._make_function",
            f"{_LOSS}:scale_loss_for_distribution",
            f"{_LOSS}:unscale_loss_for_distribution",
            "keras.src.trainers.data_adapters.data_adapter_utils:unpack_x_y_sample_weight",
        ),
        patch_loss_weighted_by_samples,
    ),
    guards.Patch(
        "merged-metrics",
        "keras-team/keras#20585",
        "3.0",
        "4",
        (
            f"{_METRIC}:Metric.variables",
            "keras.src.trainers.trainer:Trainer.get_metrics_result",
            "keras.src.backend.common.stateless_scope:StatelessScope",
        ),
        patch_metrics_merged_across_workers,
    ),
    guards.Patch(
        "predict-by-data",
        "keras-team/keras#20585",
        "3.0",
        "4",
        (f"{_TRAINER}:TensorFlowTrainer.predict",),
        patch_predict_shards_by_data,
    ),
    *callbacks.PATCHES,
    guards.Patch(
        "stop-notice",
        "keras-team/keras#20585 (Keras 3 BackupAndRestore cannot save on a stop notice)",
        "3.0",
        "4",
        (
            "keras.src.callbacks.callback_list:CallbackList.on_train_begin",
            "keras.src.callbacks.callback_list:CallbackList._on_train_batch_end",
            f"{_CALLBACKS}.backup_and_restore:BackupAndRestore._save_model",
        ),
        patch_stop_notice,
    ),
)


def apply_all(names: tuple[str, ...] | None = None) -> None:
    """Check every patch's guards, then apply them all (or only ``names``: hook.OFF_ENV leaves
    some out). LayerError when Keras is not the TensorFlow
    backend or a guard fails."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise LayerError(
            f"Keras 3 runs on the {backend} backend (KERAS_BACKEND={backend}); distlaunch runs "
            "Keras 3 under MultiWorkerMirroredStrategy on the tensorflow backend only: unset "
            'KERAS_BACKEND or set "keras": "tf_keras"'
        )
    chosen = [p for p in PATCHES if names is None or p.name in names]
    for patch in chosen:
        guards.check(patch, keras.__version__)
    for patch in chosen:
        patch.apply()
