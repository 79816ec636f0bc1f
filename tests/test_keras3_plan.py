"""How the plan runs a Keras 3 program (``"keras": "auto"``, the layer, the refusals) and the
layer's guards: decided from the source and the spec, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, distlaunch, write_spec
from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.plan import program_scan
from distlaunch.launcher.spec.model import load_spec
from distlaunch.worker.keras3 import LayerError, guards

KERAS3 = "import tensorflow as tf\nimport keras\nmodel = keras.Sequential()\nmodel.fit(x)\n"
TF_KERAS = "import tensorflow as tf\nmodel = tf.keras.Sequential()\nmodel.fit(x)\n"
PSS = {"strategy": "parameter_server", "tasks": {"chief": {}, "worker": {}, "ps": {}}}


def _loaded(tmp: Path, source: str, program: dict | None = None, **fields):
    (tmp / "job.py").write_text(source)
    return load_spec(write_spec(tmp, program={"script": "job.py", **(program or {})}, **fields))


@pytest.mark.quick
def test_auto_runs_keras3_programs_with_the_layer_and_tf_keras_ones_on_keras2(tmp: Path) -> None:
    choice = program_scan.choose(_loaded(tmp, KERAS3))
    assert choice.keras == "keras3" and choice.keras_layer
    assert "job.py:2 imports Keras 3 directly" in choice.keras_reason
    assert "with distlaunch's Keras 3 layer" in choice.keras_reason
    legacy = program_scan.choose(_loaded(tmp, TF_KERAS))
    assert legacy.keras == "tf_keras" and not legacy.keras_layer and legacy.keras_auto
    plan = distlaunch("plan", str(tmp / "spec.json"), cwd=tmp)
    assert "keras: tf_keras (auto: " in plan.stdout


@pytest.mark.quick
def test_plan_says_keras3_runs_with_the_layer(tmp: Path) -> None:
    _loaded(tmp, KERAS3)
    result = distlaunch("plan", str(tmp / "spec.json"), cwd=tmp)
    assert result.returncode == 0, result.stderr
    assert "keras: keras3 (auto: " in result.stdout
    assert "with distlaunch's Keras 3 layer" in result.stdout


@pytest.mark.quick
@pytest.mark.parametrize(
    ("source", "program", "where", "backend"),
    [
        (KERAS3, {"env": {"KERAS_BACKEND": "jax"}}, "program.env.KERAS_BACKEND", "jax"),
        ('import os\nos.environ["KERAS_BACKEND"] = "torch"\n' + KERAS3, {}, "job.py:2", "torch"),
    ],
)
def test_keras3_on_another_backend_is_refused_in_one_line(
    tmp: Path, source: str, program: dict, where: str, backend: str
) -> None:
    loaded = _loaded(tmp, source, program)
    with pytest.raises(SpecError) as caught:
        program_scan.choose(loaded)
    assert where in str(caught.value) and f"KERAS_BACKEND={backend}" in str(caught.value)
    result = distlaunch("plan", str(tmp / "spec.json"), cwd=tmp)
    assert result.returncode == 2 and f"the {backend} backend" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp / "runs").exists()


@pytest.mark.quick
def test_validate_refuses_keras3_fit_under_pss_as_plan_does_without_tensorflow(tmp: Path) -> None:
    _loaded(tmp, KERAS3, **PSS)
    # -X importtime lists every module the command imported (on stderr): TensorFlow is not one.
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "distlaunch.launcher", "validate", "spec.json"],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [ln for ln in result.stderr.splitlines() if not ln.startswith("import time:")]
    assert len(lines) == 1, lines
    assert "job.py:4 calls Keras 3 model.fit" in lines[0] and "keras-team/keras#18624" in lines[0]
    assert '"keras": "tf_keras"' in lines[0]
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in result.stderr.splitlines()]
    assert "distlaunch.launcher.plan.program_scan" in imported
    assert not any(name.split(".")[0] in ("tensorflow", "keras") for name in imported)
    # The same program under MWMS is valid: the layer runs it.
    _loaded(tmp, KERAS3)
    ok = distlaunch("validate", str(tmp / "spec.json"), cwd=tmp)
    assert ok.returncode == 0 and ": ok (multi_worker_mirrored" in ok.stdout, ok.stderr


@pytest.mark.quick
def test_keras3_fit_under_pss_is_refused_with_the_way_out(tmp: Path) -> None:
    _loaded(tmp, KERAS3, **PSS)
    result = distlaunch("plan", str(tmp / "spec.json"), cwd=tmp)
    assert result.returncode == 2
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert "job.py:4 calls Keras 3 model.fit" in line and "keras-team/keras#18624" in line
    assert '"keras": "tf_keras"' in line
    # dw.fit is distlaunch's own loop, which PSS runs.
    ours = "import keras\nfrom distlaunch import worker as dw\ndw.fit(model, data)\n"
    assert program_scan.scan(ours).fit_line is None
    # A program written for distlaunch picks its loop by the Keras it runs on.
    both = "import keras\nimport distlaunch.worker as dw\nif legacy:\n    model.fit(x)\n"
    assert program_scan.choose(_loaded(tmp, both, **PSS)).keras == "keras3"
    # tf.keras code under PSS runs on tf_keras, whose fit supports it.
    assert program_scan.choose(_loaded(tmp, TF_KERAS, **PSS)).keras == "tf_keras"


@pytest.mark.quick
def test_tensorboard_without_its_package_is_said_before_the_start(tmp, monkeypatch) -> None:
    source = KERAS3 + "cb = keras.callbacks.TensorBoard('logs')\n"
    monkeypatch.setattr(program_scan, "find_spec", lambda name: None)  # as where it is missing
    note = program_scan.choose(_loaded(tmp, source)).start_note("multi_worker_mirrored")
    assert note is not None and len(note.splitlines()) == 1
    assert (
        "job.py:5 uses Keras's TensorBoard callback" in note and "pip install tensorboard" in note
    )
    monkeypatch.setattr(program_scan, "find_spec", lambda name: object())  # installed
    assert program_scan.choose(_loaded(tmp, source)).start_note("multi_worker_mirrored") is None


@pytest.mark.quick
def test_a_guard_that_fails_says_version_what_moved_and_the_way_out() -> None:
    moved = guards.Patch("p", "keras-team/keras#1", "3.0", "4", ("os:no_such_thing",), lambda: None)
    with pytest.raises(LayerError) as caught:
        guards.check(moved, "3.15.1")
    line = str(caught.value)
    assert "Keras 3.15.1: os:no_such_thing moved or is gone" in line
    assert '"keras": "tf_keras"' in line and "\n" not in line
    fits = guards.Patch("p", "keras-team/keras#1", "3.5", "4", ("os:path.join",), lambda: None)
    guards.check(fits, "3.15.1")
    with pytest.raises(LayerError, match=r"Keras 3\.4\.0 is outside 3\.5 <= version < 4"):
        guards.check(fits, "3.4.0")
    assert guards.version_tuple("3.16.0.dev2025") == (3, 16, 0)


def test_a_keras_the_layer_was_not_written_for_stops_the_task_at_import(tmp: Path) -> None:
    """A real task start (the bootstrap, by path, as the launcher runs it) with a Keras older
    than the layer's range first on the path: one line and exit code 2 at `import keras`."""
    fake = tmp / "site" / "keras"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "__version__ = '3.2.0'\n"
        "class backend:\n    @staticmethod\n    def backend():\n        return 'tensorflow'\n"
    )
    (tmp / "job.py").write_text("import keras\nprint('trained anyway')\n")
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp / "site"),
        "DISTLAUNCH_KERAS": "keras3",
        "DISTLAUNCH_STRATEGY": "multi_worker_mirrored",
        "DISTLAUNCH_ERROR_FILE": str(tmp / "error.json"),
    }
    bootstrap = REPO / "launcher" / "host" / "bootstrap.py"
    done = subprocess.run(
        [sys.executable, str(bootstrap), str(tmp / "job.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and "trained anyway" not in done.stdout
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("distlaunch:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "Keras 3.2.0 is outside" in lines[0] and '"keras": "tf_keras"' in lines[0]
    assert "LayerError" in (tmp / "error.json").read_text()
