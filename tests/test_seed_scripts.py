"""The seeds' own multi-worker programs run under a real `distlaunch up`, with specs that say
nothing about Keras, and a known upstream failure explains itself.

The programs are in tests/seed_programs/, each with a header naming its seed file and slide and
exactly what was changed (hand-set TF_CONFIG deleted; where a slide cannot run as printed, the
smallest fix, named). Every run is real: TensorFlow processes on localhost ports.

Data offline: only the Keras guide downloads a data set (`keras.datasets.mnist.load_data()`), and
local runs have no network. Keras checks the file's sha256, so no generated file can stand in for
it. With the genuine file in ~/.keras/datasets/mnist.npz the guide runs unchanged. Without it, the
test writes a small generated mnist.npz (the keys and dtypes Keras' loader reads: x_train, y_train,
x_test, y_test; 10,640 training images, since the guide keeps the last 10,000 for validation) and
runs a copy of the guide whose one `keras.datasets.mnist.load_data()` call is replaced by an
expression that loads that file the way Keras' loader does; the test prints which one ran.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import distlaunch, write_spec

pytestmark = pytest.mark.integration

PROGRAMS = Path(__file__).resolve().parent / "seed_programs"
GENUINE_MNIST = Path.home() / ".keras" / "datasets" / "mnist.npz"
MWMS_2 = {"worker": {"count": 2}}


def _up(
    tmp: Path,
    program: Path,
    strategy: str = "multi_worker_mirrored",
    tasks: dict | None = None,
    **program_fields,
):
    spec = write_spec(
        tmp,
        strategy=strategy,
        tasks=tasks or MWMS_2,
        program={"script": str(program), **program_fields},
    )
    result = distlaunch("up", str(spec), cwd=tmp, timeout=420)
    print(result.stdout[-4000:], result.stderr[-4000:])
    return result


def _lines(result, task: str) -> list[str]:
    return [
        line.split("| ", 1)[1]
        for line in result.stdout.splitlines()
        if line.startswith(task) and "| " in line
    ]


def test_slide4_tf_keras_fit_on_mwms_runs_with_tf_keras(tmp: Path) -> None:
    result = _up(tmp, PROGRAMS / "slide4_mwms_fit.py")
    assert result.returncode == 0, result.stderr
    assert "program uses tf.keras: running with tf_keras, because" in result.stderr
    assert 'set "keras": "keras3" to override' in result.stderr
    for task in ("worker-0", "worker-1"):
        assert "Multi-worker distributed training completed" in _lines(result, task)
        assert any("Epoch 5/5" in line for line in _lines(result, task))


def test_slide4_with_keras3_runs_its_fit_with_the_layer(tmp: Path) -> None:
    # Keras 3's own model.fit fails under MWMS (keras-team/keras#20585); distlaunch's Keras 3
    # layer (worker/keras3/) runs the slide's NumPy-array fit unchanged.
    result = _up(tmp, PROGRAMS / "slide4_mwms_fit.py", keras="keras3")
    assert result.returncode == 0, result.stderr[-3000:]
    for task in ("worker-0", "worker-1"):
        assert "Multi-worker distributed training completed" in _lines(result, task)


def test_slide5_pss_coordinator_chief_program_with_served_ps_and_workers(
    tmp: Path,
) -> None:
    result = _up(
        tmp,
        PROGRAMS / "slide5_pss_coordinator.py",
        "parameter_server",
        {"chief": {}, "worker": {}, "ps": {}},
    )
    assert result.returncode == 0, result.stderr
    assert "Parameter Server training completed" in _lines(result, "chief-0")
    for task in ("worker-0", "ps-0"):
        assert any("serving at grpc://" in line for line in _lines(result, task))


def test_slide6_pss_min_size_partitioner_over_two_ps(tmp: Path) -> None:
    result = _up(
        tmp,
        PROGRAMS / "slide6_pss_partitioner.py",
        "parameter_server",
        {"chief": {}, "worker": {}, "ps": {"count": 2}},
    )
    assert result.returncode == 0, result.stderr
    assert "Models created for both synchronous and asynchronous training" in _lines(
        result, "chief-0"
    )
    for task in ("ps-0", "ps-1"):
        assert any("serving at grpc://" in line for line in _lines(result, task))


def test_slide8_custom_loop_on_mwms_same_loss_on_both_workers(tmp: Path) -> None:
    result = _up(tmp, PROGRAMS / "slide8_custom_loop.py")
    assert result.returncode == 0, result.stderr
    losses = {
        task: [line for line in _lines(result, task) if line.startswith("Epoch ")]
        for task in ("worker-0", "worker-1")
    }
    assert len(losses["worker-0"]) == 5 and losses["worker-0"] == losses["worker-1"]
    assert "Custom training loop completed" in _lines(result, "worker-1")


def test_slide9_checkpointing_saves_and_loads(tmp: Path) -> None:
    # A one-machine program (MirroredStrategy, fixed paths in its cwd): one task, so that no two
    # processes write the same checkpoint files.
    result = _up(tmp, PROGRAMS / "slide9_checkpointing.py", tasks={"worker": {"count": 1}})
    assert result.returncode == 0, result.stderr
    assert "Model saved and loaded successfully" in _lines(result, "worker-0")
    assert len(list((tmp / "training_checkpoints").glob("ckpt-*.index"))) == 5
    assert (tmp / "saved_model" / "saved_model.pb").exists()


def test_keras_guide_mnist_restores_or_creates(tmp: Path) -> None:
    program = _guide_program(tmp)
    result = _up(tmp, program, tasks={"worker": {"count": 1}})
    assert result.returncode == 0, result.stderr
    assert "imports Keras 3" not in result.stderr and "running with tf_keras" not in result.stderr
    out = _lines(result, "worker-0")
    assert "Creating a new model" in out
    assert any(line.startswith("Restoring from ./ckpt/ckpt-1.keras") for line in out)
    assert (tmp / "ckpt" / "ckpt-1.keras").exists()


def _guide_program(tmp: Path) -> Path:
    """The guide as stored when the genuine MNIST file is here; else a copy reading a generated
    one."""
    program = PROGRAMS / "keras_guide_mnist.py"
    if GENUINE_MNIST.exists():
        print(f"the Keras guide runs unchanged with {GENUINE_MNIST}")
        return program
    data = tmp / "mnist.npz"
    rng = np.random.default_rng(0)
    y_train, y_test = (
        rng.integers(0, 10, 10_640).astype("uint8"),
        rng.integers(0, 10, 320).astype("uint8"),
    )

    # Learnable: each class lights its own band of rows.
    def images(labels):
        x = rng.integers(0, 60, (len(labels), 28, 28)).astype("uint8")
        for i, label in enumerate(labels):
            x[i, 2 * label : 2 * label + 3, :] = 255
        return x

    np.savez(
        data,
        x_train=images(y_train),
        y_train=y_train,
        x_test=images(y_test),
        y_test=y_test,
    )
    call = "keras.datasets.mnist.load_data()"
    loader = (
        '(lambda f: ((f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])))'
        f'(__import__("numpy").load({str(data)!r}))'
    )
    source = program.read_text()
    assert source.count(call) == 1
    copy = tmp / program.name
    copy.write_text(source.replace(call, loader))
    print(f"no {GENUINE_MNIST}: the Keras guide reads a generated {data} instead of calling {call}")
    return copy
