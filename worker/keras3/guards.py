"""The guards every patch of the layer passes before it goes in: Keras versions and internals.

A patch replaces a function of ``keras.src`` it was written against. It goes in only when the
installed Keras is in the range it was written for and every internal it replaces or calls is
where it was; otherwise the task stops in one line (`LayerError`): never a patch over code it was
not written for, never a run that trains wrong. The layer is tested on `TESTED`; a version in a
patch's range but not tested still loads (`plan` says it is untested).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Keras versions the layer's tests ran on (docs/keras3.md lists them too).
TESTED = ("3.15.1",)
WAY_OUT = 'set "keras": "tf_keras" in the spec to run the program on Keras 2'


class LayerError(ImportError):
    """The layer cannot stand in for what Keras 3 lacks here: one line, with the way out."""


@dataclass(frozen=True)
class Patch:
    """One in-memory patch: its name, the upstream issue it answers, the Keras versions it was
    written for (``low`` inclusive, ``high`` exclusive), the internals it needs as
    ``module:attr.attr`` and the function that puts it in."""

    name: str
    issue: str
    low: str
    high: str
    needs: Sequence[str]
    apply: Callable[[], None]


def version_tuple(text: str) -> tuple[int, ...]:
    """``"3.15.1"`` -> ``(3, 15, 1)``; a suffix such as ``.dev0`` or ``rc1`` ends the numbers."""
    out = []
    for part in text.split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def check(patch: Patch, version: str) -> None:
    """Raise LayerError (one line) unless ``patch`` fits Keras ``version`` and finds its
    internals."""
    have = version_tuple(version)
    if not version_tuple(patch.low) <= have < version_tuple(patch.high):
        raise LayerError(
            f"Keras {version} is outside {patch.low} <= version < {patch.high}, the versions the "
            f"{patch.name} patch ({patch.issue}) was written for; {WAY_OUT}"
        )
    for need in patch.needs:
        if resolve(need) is None:
            raise LayerError(
                f"Keras {version}: {need} moved or is gone, and the {patch.name} patch "
                f"({patch.issue}) replaces it; {WAY_OUT}"
            )


def resolve(need: str) -> object | None:
    """The object ``module:attr.attr`` names, None where it is missing."""
    module_name, _, attrs = need.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError:
        return None
    for attr in filter(None, attrs.split(".")):
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj
