"""Chief-aware Keras 3 callbacks under multi-worker MWMS, as Keras 2's were.

Keras 3's ``BackupAndRestore``, ``ModelCheckpoint``, ``TensorBoard`` and ``CSVLogger`` write the
same paths from every worker (an HDF5 lock ``BlockingIOError``, then a crash loop; no upstream
issue of its own beyond keras-team/keras#20585). Every worker must still save: reading a metric's
or optimizer's state in a save can be a collective all workers join. So, as tf_keras's
``distributed_file_utils.write_dirpath`` did, the chief writes the user's paths and every other
worker writes the same files into ``<dir>/workertemp_<task id>`` and removes that folder when it
is done with it; only the chief deletes a backup at the end. ``EarlyStopping`` needs nothing here:
the logs it reads are merged across workers (patches.patch_metrics_merged_across_workers), so every
worker stops at the same epoch.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any

from .. import contract
from . import guards
from .where import is_chief, multi_worker, write_dir

_CALLBACKS = "keras.src.callbacks"


def _strategy(callback: Any) -> Any:
    model = getattr(callback, "model", None) or getattr(callback, "_model", None)
    return getattr(model, "distribute_strategy", None)


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def patch_backup_and_restore_chief_writes() -> None:
    """Keras 3's ``BackupAndRestore`` saves ``latest.weights.h5`` from every worker into one
    folder and every worker deletes it at the end. Non-chief workers save into their temporary
    folder (removed after each save); only the chief deletes the backup when training ends.
    Every worker restores from the chief's backup."""
    from keras.src.callbacks import backup_and_restore

    cls = backup_and_restore.BackupAndRestore
    save, end = cls._save_model, cls.on_train_end
    names = (
        "_weights_path",
        "_training_metadata_path",
        "_prev_weights_path",
        "_prev_training_metadata_path",
    )

    @functools.wraps(save)
    def _save_model(self):
        strategy = _strategy(self)
        # Keras makes the folder when it is missing; made here first, as another worker's
        # temporary folder inside it may make it at the same moment (FileExistsError).
        os.makedirs(write_dir(self.backup_dir, strategy), exist_ok=True)
        if is_chief(strategy):
            return save(self)
        kept = {name: getattr(self, name) for name in ("backup_dir", *names)}
        temp = write_dir(self.backup_dir, strategy)
        for name in names:
            setattr(self, name, os.path.join(temp, os.path.basename(kept[name])))
        self.backup_dir = temp
        try:
            return save(self)
        finally:
            for name, value in kept.items():
                setattr(self, name, value)
            _remove(temp)

    @functools.wraps(end)
    def on_train_end(self, logs=None):
        if is_chief(_strategy(self)):
            return end(self, logs)
        return None

    cls._save_model = _save_model
    cls.on_train_end = on_train_end


# Steps of the restored epoch a backup already holds: the next epoch loop of fit skips them.
_resume = {"skip": 0}
STEP_KEY = "distlaunch_steps_in_epoch"


def patch_backup_and_restore_resumes_at_its_step() -> None:
    """Keras 3's ``BackupAndRestore(save_freq=N)`` saves mid-epoch but restores at the start of
    the saved epoch (its metadata's ``batch`` is never read; tf_keras resumed at the step): the
    steps of that epoch done before the failure run twice, and the optimizer counts them twice.
    The backup now also records how many steps of its epoch it holds, and after a restore the
    first epoch of ``fit`` skips those steps and their batches (the data as an uninterrupted run
    sees it). A save after an epoch's last step (``save_freq`` or a stop notice there) records
    the next epoch with no step done: Keras would resume the finished epoch with every step
    skipped, an epoch of no step whose logs hold no loss."""
    import json

    from keras.src.callbacks import backup_and_restore
    from keras.src.trainers import epoch_iterator

    cls = backup_and_restore.BackupAndRestore
    save, load, batch_end, epoch_end = (
        cls._save_model,
        cls._load_model,
        cls.on_train_batch_end,
        cls.on_epoch_end,
    )
    enumerate_steps = epoch_iterator.EpochIterator._enumerate_iterator

    @functools.wraps(batch_end)
    def on_train_batch_end(self, batch, logs=None):
        self._distlaunch_steps = batch + 1
        return batch_end(self, batch, logs)

    @functools.wraps(epoch_end)
    def on_epoch_end(self, epoch, logs=None):
        self._distlaunch_steps = 0
        return epoch_end(self, epoch, logs)

    @functools.wraps(save)
    def _save_model(self):
        save(self)
        if not is_chief(_strategy(self)) or not os.path.exists(self._training_metadata_path):
            return  # a non-chief worker's copy is gone already; the user's file is the chief's
        with open(self._training_metadata_path) as f:
            metadata = json.load(f)
        steps = getattr(self, "_distlaunch_steps", 0)
        if steps and steps == self.params.get("steps"):
            metadata["epoch"], steps = metadata["epoch"] + 1, 0
        metadata[STEP_KEY] = steps
        metadata[contract.KERAS_BACKUP_STEP] = int(self.model.optimizer.iterations.numpy())
        with open(self._training_metadata_path, "w") as f:
            json.dump(metadata, f)

    @functools.wraps(load)
    def _load_model(self):
        load(self)
        if multi_worker(_strategy(self)) and os.path.exists(self._training_metadata_path):
            with open(self._training_metadata_path) as f:
                _resume["skip"] = int(json.load(f).get(STEP_KEY, 0))

    @functools.wraps(enumerate_steps)
    def _enumerate_iterator(self):
        skip, _resume["skip"] = _resume["skip"], 0
        for begin, end, iterator in enumerate_steps(self):
            if end < skip:
                for _ in range(end - begin + 1):
                    next(iterator)  # the batch this step took before the restart
                continue
            yield begin, end, iterator

    cls.on_train_batch_end, cls.on_epoch_end = on_train_batch_end, on_epoch_end
    cls._save_model, cls._load_model = _save_model, _load_model
    epoch_iterator.EpochIterator._enumerate_iterator = _enumerate_iterator


def patch_model_checkpoint_chief_writes() -> None:
    """Keras 3's ``ModelCheckpoint`` saves to the user's path from every worker. Non-chief
    workers save into their temporary folder beside it and remove it after each save; the
    best-only decision reads the merged logs, so it is the same on every worker."""
    from keras.src.callbacks import model_checkpoint

    cls = model_checkpoint.ModelCheckpoint
    save = cls._save_model

    @functools.wraps(save)
    def _save_model(self, epoch, batch, logs):
        strategy = _strategy(self)
        if is_chief(strategy):
            os.makedirs(os.path.dirname(self.filepath) or ".", exist_ok=True)
            return save(self, epoch, batch, logs)
        kept = self.filepath
        folder = write_dir(os.path.dirname(kept) or ".", strategy)
        os.makedirs(folder, exist_ok=True)  # see BackupAndRestore's: the chief may make its parent
        self.filepath = os.path.join(folder, os.path.basename(kept))
        try:
            return save(self, epoch, batch, logs)
        finally:
            self.filepath = kept
            _remove(folder)

    cls._save_model = _save_model


def patch_csv_logger_chief_writes() -> None:
    """Keras 3's ``CSVLogger`` opens the user's file on every worker. Non-chief workers write
    theirs into their temporary folder, removed when training ends."""
    from keras.src.callbacks import csv_logger

    cls = csv_logger.CSVLogger
    begin, end = cls.on_train_begin, cls.on_train_end

    @functools.wraps(begin)
    def on_train_begin(self, logs=None):
        strategy = _strategy(self)
        if not is_chief(strategy):
            self._distlaunch_user_file = self.filename
            folder = write_dir(os.path.dirname(self.filename) or ".", strategy)
            os.makedirs(folder, exist_ok=True)
            self.filename = os.path.join(folder, os.path.basename(self.filename))
        return begin(self, logs)

    @functools.wraps(end)
    def on_train_end(self, logs=None):
        try:
            return end(self, logs)
        finally:
            user = self.__dict__.pop("_distlaunch_user_file", None)
            if user is not None:
                _remove(os.path.dirname(self.filename))
                self.filename = user

    cls.on_train_begin, cls.on_train_end = on_train_begin, on_train_end


def patch_tensorboard_chief_writes() -> None:
    """Keras 3's ``TensorBoard`` writes event files under the user's log dir from every worker.
    Non-chief workers write theirs into their temporary folder, removed when training ends."""
    from keras.src.callbacks import tensorboard

    cls = tensorboard.TensorBoard
    set_model, end = cls.set_model, cls.on_train_end

    @functools.wraps(set_model)
    def _set_model(self, model):
        set_model(self, model)
        strategy = getattr(model, "distribute_strategy", None)
        if not is_chief(strategy):
            self._log_write_dir = write_dir(self.log_dir, strategy)
            self._train_dir = os.path.join(self._log_write_dir, "train")
            self._val_dir = os.path.join(self._log_write_dir, "validation")

    @functools.wraps(end)
    def on_train_end(self, logs=None):
        try:
            return end(self, logs)
        finally:
            if self._log_write_dir != self.log_dir:
                _remove(self._log_write_dir)

    cls.set_model, cls.on_train_end = _set_model, on_train_end


_ISSUE = "keras-team/keras#20585 (Keras 3 callbacks are not chief-aware)"
PATCHES = (
    guards.Patch(
        "backup-and-restore",
        _ISSUE,
        "3.0",
        "4",
        tuple(
            f"{_CALLBACKS}.backup_and_restore:BackupAndRestore.{a}"
            for a in ("_save_model", "on_train_end", "on_train_begin")
        ),
        patch_backup_and_restore_chief_writes,
    ),
    guards.Patch(
        "backup-resumes-at-step",
        "keras-team/keras#20585 (BackupAndRestore restores at the epoch, not the step)",
        "3.0",
        "4",
        (
            f"{_CALLBACKS}.backup_and_restore:BackupAndRestore._load_model",
            f"{_CALLBACKS}.backup_and_restore:BackupAndRestore._save_model",
            "keras.src.trainers.epoch_iterator:EpochIterator._enumerate_iterator",
        ),
        patch_backup_and_restore_resumes_at_its_step,
    ),
    guards.Patch(
        "model-checkpoint",
        _ISSUE,
        "3.0",
        "4",
        (
            f"{_CALLBACKS}.model_checkpoint:ModelCheckpoint._save_model",
            f"{_CALLBACKS}.model_checkpoint:ModelCheckpoint._get_file_path",
        ),
        patch_model_checkpoint_chief_writes,
    ),
    guards.Patch(
        "csv-logger",
        _ISSUE,
        "3.0",
        "4",
        (
            f"{_CALLBACKS}.csv_logger:CSVLogger.on_train_begin",
            f"{_CALLBACKS}.csv_logger:CSVLogger.on_train_end",
        ),
        patch_csv_logger_chief_writes,
    ),
    guards.Patch(
        "tensorboard",
        _ISSUE,
        "3.0",
        "4",
        (
            f"{_CALLBACKS}.tensorboard:TensorBoard.set_model",
            f"{_CALLBACKS}.tensorboard:TensorBoard.on_train_end",
        ),
        patch_tensorboard_chief_writes,
    ),
)
