"""Known failures and what to do about them: one catalog entry per failure we can recognise.

Each entry is a recogniser (the exception's type and a pattern of its message, as the task's
error file or the end of its log shows them) and one line saying what happened and how to fix it.
The failure summary prints the first matching entry's line under its root-cause line. Adding a
known failure is one entry here and one test in tests/test_hints.py; the docs' Troubleshooting
page (docs/troubleshooting.md) lists the catalog, generated from it.

Decides nothing about the run and reads no file: it only matches text it is given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distlaunch.launcher.diagnosis.evidence import Evidence


@dataclass(frozen=True)
class Hint:
    """A known failure: its exception classes (``types``; empty: any) and the fix."""

    name: str
    types: tuple[str, ...]
    pattern: str  # a regular expression searched in the message (and traceback)
    text: str  # one line: what it is, and the fix

    def matches(self, evidence: Evidence) -> bool:
        """Whether ``evidence`` is this failure."""
        if self.types and evidence.short_type not in self.types:
            return False
        haystack = "\n".join([evidence.message, *(f"{w}\n{c}" for w, c in evidence.frames)])
        return re.search(self.pattern, haystack) is not None


_TF_KERAS_FIX = (
    'run tf.keras code with Keras 2: "keras": "tf_keras" (what "auto", the default, picks for a '
    "program that uses tf.keras and never imports keras), or keep Keras 3 and train with "
    "distlaunch.worker's dw.fit (a custom loop that works under it)"
)

CATALOG: tuple[Hint, ...] = (
    Hint(
        "keras3-fit-mwms",
        ("ValueError",),
        r"unsupported type \(<class '[\w.]*PerReplica'>\) to a Tensor"
        r"|Invalid reduction dimension 0 for input with 0 dimensions",
        "Keras 3 model.fit cannot run under MultiWorkerMirroredStrategy without distlaunch's "
        "Keras 3 layer (keras-team/keras#20585), and this task ran without it: the layer is on "
        'by default for Keras 3 programs, off where the spec says "keras": "tf_keras" and the '
        "program imports keras, or where KERAS3_LAYER_OFF leaves its patches out (a guard that "
        'fails stops the task at start in a line of its own). Fix: "keras": "keras3" (or '
        '"auto", the default) and no KERAS3_LAYER_OFF; or run tf.keras code on Keras 2 '
        '("keras": "tf_keras") or train with dw.fit',
    ),
    Hint(
        "keras3-fit-pss",
        ("ValueError",),
        r"you need to pass this dataset to\s+`?ClusterCoordinator.create_per_worker_dataset",
        "Keras 3 model.fit cannot run under ParameterServerStrategy (keras-team/keras#18624); a "
        "custom loop must pass its dataset through coordinator.create_per_worker_dataset. "
        f"Fix: {_TF_KERAS_FIX}",
    ),
    Hint(
        "collectives-after-startup",
        (),
        r"Collective ops must be configured at program startup",
        "a TensorFlow op ran before the MultiWorkerMirroredStrategy was created: create the "
        "strategy first thing in the program (before any tensor, dataset or model; dw.strategy())",
    ),
    Hint(
        "grpc-port-taken",
        (),
        r"Could not start gRPC server|Failed to add port to server|[Aa]ddress already in use",
        "the task's TensorFlow server could not bind its port: another process holds it (often a "
        'task left from an earlier run): use "port": "auto", or stop it (`distlaunch down RUN`)',
    ),
    Hint(
        "peers-never-joined",
        (),
        r"cluster registration failed|failed to register with the leader"
        r"|agent connect failed|Barrier timed out",
        "this task's peers never joined within the coordination timeout: another task crashed "
        "before connecting or started too late; look at the other tasks' logs for the first "
        "error, and make every task reach the strategy at start",
    ),
    Hint(
        "callbacks-same-path",
        (),
        r"unable to lock file|Unable to (synchronously )?create file|Failed to rename",
        "two tasks wrote the same file: under MultiWorkerMirroredStrategy every worker runs the "
        "callbacks: tf_keras's ModelCheckpoint/TensorBoard/BackupAndRestore/CSVLogger write "
        "the user's paths on the chief only, and so do Keras 3's under distlaunch's Keras 3 "
        "layer (on by default); a file the program writes itself must be written where "
        "dw.context().is_chief, other workers writing elsewhere",
    ),
    Hint(
        "keras3-savedmodel-path",
        ("ValueError",),
        r"Invalid filepath extension for saving",
        "Keras 3 saves only .keras and .h5 files: tf.keras code that saves a SavedModel folder "
        'needs tf_keras ("keras": "tf_keras" or "auto"), or save to "model.keras" / use '
        "model.export()",
    ),
    Hint(
        "model-not-compiled",
        ("AttributeError",),
        r"'NoneType' object has no attribute '(apply_gradients|minimize|learning_rate)'",
        "model.optimizer is None: the model was never compiled; call "
        "model.compile(optimizer=...) inside strategy.scope(), or create an optimizer of your own",
    ),
    Hint(
        "offline-download",
        (),
        r"URL fetch failure|Temporary failure in name resolution|Network is unreachable"
        r"|Name or service not known",
        "the task tried to download (a dataset?) but local runs are network-isolated: fetch the "
        'data before `up` (Keras caches it in ~/.keras/datasets), or set "isolation": "off"',
    ),
)


def find(evidence: Evidence | None) -> Hint | None:
    """The first catalog entry that recognises ``evidence``, or None."""
    if evidence is None:
        return None
    return next((hint for hint in CATALOG if hint.matches(evidence)), None)
