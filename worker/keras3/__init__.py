"""Keras 3 `fit`, `evaluate` and `predict` under MultiWorkerMirroredStrategy, patched in memory.

Keras 3 (keras-team/keras#20585, open) does not support multi-worker MWMS in ``model.fit``. This
package makes a program written for one process train on N workers unchanged: it replaces a few
internals of ``keras.src`` (each patch a small named function in `patches` or `callbacks`, its
comment naming the upstream issue it answers) once ``keras`` has been imported, never before, so
nothing here imports TensorFlow earlier than the program would (MWMS needs its strategy created
before any TensorFlow op).

Every patch is guarded by the Keras versions it was written for and by the presence of the
internals it replaces (`guards`). When one is missing the task stops at the ``import keras`` in
one line (Keras version, what moved, ``"keras": "tf_keras"`` as the way out): it never trains
wrong. Outside multi-worker MWMS every patched function behaves exactly as the one it replaces.

`install` is what the launcher's bootstrap (launcher/host/bootstrap.py) calls when the plan runs a
Keras 3 program under MWMS; it imports nothing but the standard library.
"""

from __future__ import annotations

from .guards import LayerError
from .hook import install, installed

__all__ = ["LayerError", "install", "installed"]
