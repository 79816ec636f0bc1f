"""core/json_text.dumps writes what json.dumps(indent=...) writes, byte for byte."""

from __future__ import annotations

import enum
import json

import pytest

from distlaunch.launcher.core import json_text


class Mode(enum.StrEnum):
    LOCAL = "local"


class Level(enum.IntEnum):
    TWO = 2


CASES = [
    {},
    [],
    0,
    "x",
    None,
    {"a": [], "b": {}, "c": [[]], "d": [{}], "e": [1, [2, [3, {}]]]},
    {"é": 'ü\n"q"\t\x00', "n": [1.5, -0.0, 1e308, 2**70, True, False, None]},
    {7: "int key", 2.5: "float key", True: "bool key", None: "null key", "s": {3: [4]}},
    {"mode": Mode.LOCAL, Mode.LOCAL: [Mode.LOCAL], "level": Level.TWO, "t": (1, (2, 3))},
    [{"cluster": {"worker": [f"127.0.0.1:{20000 + n}" for n in range(50)]}} for _ in range(3)],
]


@pytest.mark.quick
@pytest.mark.parametrize("indent", [2, 0, 4])
@pytest.mark.parametrize("data", CASES, ids=range(len(CASES)))
def test_the_text_is_json_dumps_with_indent(data, indent):
    assert json_text.dumps(data, indent) == json.dumps(data, indent=indent)


@pytest.mark.quick
def test_what_json_cannot_write_is_refused_alike():
    with pytest.raises(TypeError):
        json.dumps({"a": [object()]}, indent=2)
    with pytest.raises(TypeError):
        json_text.dumps({"a": [object()]})
