"""`"keras": "auto"` and the PSS role split, decided from the program's source (never run here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import distlaunch, write_spec
from distlaunch.launcher.plan import program_scan
from distlaunch.launcher.plan.placement import on_hosts
from distlaunch.launcher.plan.plan import Plan, make_plan
from distlaunch.launcher.spec.model import LoadedSpec, load_spec

TF_KERAS = "import tensorflow as tf\nmodel = tf.keras.Sequential()\n"


@pytest.mark.quick
@pytest.mark.parametrize(
    ("source", "tf_keras", "keras3"),
    [
        (TF_KERAS, 2, None),
        ("import tensorflow\nm = tensorflow.keras.Model()\n", 2, None),
        ("from tensorflow import keras\n", 1, None),
        ("from tensorflow.keras.layers import Dense\n", 1, None),
        ("import tensorflow.keras as k\n", 1, None),
        # tf_keras imported by the script itself is Keras 2 code too.
        ("import tensorflow as tf\nimport tf_keras\n", 2, None),
        ("from tf_keras import layers\n", 1, None),
        ("import keras\n", None, 1),
        ("from keras import layers\nimport tensorflow as tf\nx = tf.keras\n", 3, 1),
        # Comments, strings and other objects' `keras` attributes are not code using tf.keras.
        ("# tf.keras\nprint('import keras; tf.keras')\nobj.keras = 1\n", None, None),
    ],
)
def test_scan_finds_tf_keras_and_keras3(
    source: str, tf_keras: int | None, keras3: int | None
) -> None:
    facts = program_scan.scan(source)
    assert (facts.tf_keras_line, facts.keras3_line) == (tf_keras, keras3)


@pytest.mark.quick
def test_scan_finds_who_serves() -> None:
    assert program_scan.scan("import distlaunch.worker as dw\n").imports_distlaunch
    assert program_scan.scan("from distlaunch import worker\n").imports_distlaunch
    assert (
        program_scan.scan("import tensorflow as tf\ntf.distribute.Server(c).join()\n").server_line
        == 2
    )
    facts = program_scan.scan(TF_KERAS)
    assert not facts.imports_distlaunch and facts.server_line is None


def _loaded(tmp: Path, source: str, **fields):
    (tmp / "job.py").write_text(source)
    program = {"script": "job.py", **fields.pop("program", {})}
    return load_spec(write_spec(tmp, program=program, **fields))


def _plan(loaded: LoadedSpec, ports: dict[tuple[str, int], int], tmp: Path) -> Plan:
    """The plan of run ``r`` with the tasks where the local backend puts them, at ``ports``."""
    return make_plan(loaded, on_hosts(loaded).with_ports(ports), "r", tmp / "runs" / "r")


@pytest.mark.quick
def test_auto_runs_tf_keras_programs_with_tf_keras(tmp: Path) -> None:
    choice = program_scan.choose(_loaded(tmp, TF_KERAS))
    assert choice.keras == "tf_keras" and choice.keras_auto
    assert "job.py:2 uses tf.keras" in choice.keras_reason and "Keras 2 code" in choice.keras_reason
    note = choice.start_note("multi_worker_mirrored")
    assert note.startswith("program uses tf.keras: running with tf_keras, because ")
    assert note.endswith('set "keras": "keras3" to override')
    plan = _plan(_loaded(tmp, TF_KERAS), {("worker", 0): 1, ("worker", 1): 2}, tmp)
    assert all(
        t.env["TF_USE_LEGACY_KERAS"] == "1" and t.env["DISTLAUNCH_KERAS"] == "tf_keras"
        for t in plan.tasks
    )


@pytest.mark.quick
@pytest.mark.parametrize(
    ("source", "fields", "why"),
    [
        (TF_KERAS + "import keras\n", {}, "job.py:3 imports Keras 3 directly"),
        ("import keras\n", {}, "imports Keras 3"),
        ("print('no keras at all')\n", {}, "does not use tf.keras"),
        ("def broken(:\n", {}, "does not parse"),
        (TF_KERAS, {"program": {"keras": "keras3"}}, 'set by "keras" in the spec'),
    ],
)
def test_auto_keeps_keras3_otherwise(tmp: Path, source: str, fields: dict, why: str) -> None:
    loaded = _loaded(tmp, source, **fields)
    choice = program_scan.choose(loaded)
    assert choice.keras == "keras3" and not choice.keras_auto and why in choice.keras_reason
    plan = _plan(loaded, {("worker", 0): 1, ("worker", 1): 2}, tmp)
    assert all(
        "TF_USE_LEGACY_KERAS" not in t.env and t.env["DISTLAUNCH_KERAS"] == "keras3"
        for t in plan.tasks
    )


@pytest.mark.quick
def test_spec_default_is_auto_and_tf_keras_stays(tmp: Path) -> None:
    assert _loaded(tmp, TF_KERAS).spec.program.keras == "auto"
    choice = program_scan.choose(_loaded(tmp, "import keras\n", program={"keras": "tf_keras"}))
    assert choice.keras == "tf_keras" and not choice.keras_auto


PSS = {
    "strategy": "parameter_server",
    "tasks": {"chief": {}, "worker": {}, "ps": {"count": 2}},
}
PSS_PORTS = {("chief", 0): 1, ("worker", 0): 2, ("ps", 0): 3, ("ps", 1): 4}


@pytest.mark.quick
def test_pss_ps_and_workers_serve_when_the_program_does_not(tmp: Path) -> None:
    plan = _plan(_loaded(tmp, TF_KERAS, **PSS), PSS_PORTS, tmp)
    assert plan.task("chief-0").argv[-1].endswith("job.py")
    for name in ("worker-0", "ps-0", "ps-1"):
        assert plan.task(name).argv[1:] == ("-m", "distlaunch.worker.serve")
    assert "never creates a tf.distribute.Server" in plan.program.serve_reason


@pytest.mark.quick
@pytest.mark.parametrize(
    "source",
    [
        "import distlaunch.worker as dw\n",
        "import tensorflow as tf\ntf.distribute.Server\n",
    ],
)
def test_pss_programs_that_serve_run_on_every_task(tmp: Path, source: str) -> None:
    plan = _plan(_loaded(tmp, source, **PSS), PSS_PORTS, tmp)
    assert all(t.argv[-1].endswith("job.py") for t in plan.tasks)


@pytest.mark.quick
def test_module_source_is_found_without_importing_its_packages(tmp: Path) -> None:
    package = tmp / "pkg_never_imported"
    package.mkdir()
    # Importing the package would fail: finding its module must not import it.
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "train.py").write_text(TF_KERAS)
    found = program_scan.module_file("pkg_never_imported.train", tmp)
    assert found == package / "train.py"
    assert "pkg_never_imported" not in sys.modules
    assert program_scan.module_file("pkg_never_imported.absent", tmp) is None
    (package / "__main__.py").write_text("")
    assert program_scan.module_file("pkg_never_imported", tmp) == package / "__main__.py"
    loaded = load_spec(write_spec(tmp, program={"module": "pkg_never_imported.train"}))
    assert program_scan.choose(loaded).keras == "tf_keras"
    missing = load_spec(write_spec(tmp, program={"module": "no_such_module_here"}))
    choice = program_scan.choose(missing)
    assert choice.keras == "keras3" and "not found" in choice.keras_reason


def test_plan_shows_the_choice_and_why(tmp: Path) -> None:
    (tmp / "job.py").write_text(TF_KERAS)
    spec = write_spec(tmp, program={"script": "job.py"}, **PSS)
    result = distlaunch("plan", str(spec), cwd=tmp)
    assert result.returncode == 0, result.stderr
    assert "keras: tf_keras (auto: " in result.stdout and "job.py:2 uses tf.keras" in result.stdout
    assert "roles: ps and worker tasks run `python -m distlaunch.worker.serve`" in result.stdout
    data = json.loads(distlaunch("plan", "--json", str(spec), cwd=tmp).stdout)
    assert data["program"]["keras"] == "tf_keras" and data["program"]["serve_ps_workers"] is True


@pytest.mark.quick
@pytest.mark.parametrize(
    ("source", "saves"),
    [
        ("import tensorflow as tf\ntf.distribute.MultiWorkerMirroredStrategy()\n", False),
        ("import distlaunch.worker as dw\ndw.fit(None, None)\n", True),
        (
            "import tensorflow as tf\n"
            "h = tf.distribute.experimental.PreemptionCheckpointHandler(None, None)\n",
            True,
        ),
        ("from tf_keras.callbacks import BackupAndRestore\n", True),
        ("import tf_keras\ntf_keras.callbacks.BackupAndRestore('/tmp/b')\n", True),
        ("x = 'PreemptionCheckpointHandler'  # a string is no handler\n", False),
    ],
)
def test_whether_a_program_can_save_on_a_stop_notice(source: str, saves: bool) -> None:
    facts = program_scan.scan(source)
    assert (facts.imports_distlaunch or facts.handler_line is not None) is saves
