"""When the layer goes in: right after ``keras`` is imported, by a post-import hook.

Importing ``keras`` imports TensorFlow; a program under MWMS must create its strategy before any
TensorFlow op, so the layer may not import either earlier than the program does. `install` puts a
finder first on ``sys.meta_path`` that waits for the program's own ``import keras`` (also the one
behind ``tf.keras``), lets it run, then applies the patches before the import statement returns.
Where ``keras`` is already imported (a warm standby imports it before the program starts) the
patches go in at once. This module imports the standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from types import ModuleType

from .guards import LayerError

# Comma-separated patch names to leave out (`patches.PATCHES`): shows the upstream bug a patch
# answers; the layer's tests run each patch off once this way.
OFF_ENV = "KERAS3_LAYER_OFF"
_lock = threading.Lock()
_state = {"installed": False, "applied": False}


def install() -> None:
    """Apply the layer when ``keras`` is (or once it is) imported; idempotent."""
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
    if "keras" in sys.modules and hasattr(sys.modules["keras"], "__version__"):
        _apply()
        return
    sys.meta_path.insert(0, _KerasFinder())


def installed() -> bool:
    """Whether the patches are in (``keras`` was imported after `install`)."""
    return _state["applied"]


def _apply() -> None:
    with _lock:
        if _state["applied"]:
            return
        _state["applied"] = True
    from . import patches  # imports keras.src: only once keras itself is in

    off = {name for name in os.environ.get(OFF_ENV, "").split(",") if name}
    try:
        patches.apply_all(tuple(p.name for p in patches.PATCHES if p.name not in off))
    except LayerError as exc:
        refuse(exc)


def refuse(exc: LayerError) -> None:
    """Stop the task in one line (recorded in the error file for the launcher), exit code 2."""
    from distlaunch.worker import runtime

    try:
        runtime._write_error_file(LayerError, exc, None)
    except OSError:
        pass  # the line below still says it
    print(f"distlaunch: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class _KerasFinder(importlib.abc.MetaPathFinder):
    """Finds ``keras`` with the finders after it and wraps its loader to apply the layer once
    the module has run."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib protocol
        if fullname != "keras":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, finder: _KerasFinder) -> None:
        self._inner = inner
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _apply()

    def __getattr__(self, name: str):  # get_resource_reader, is_package, ... as the real loader
        return getattr(self._inner, name)
