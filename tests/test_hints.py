"""The known-failure catalog: each entry recognises its failure as a task's log shows it, only it.

Adding a known failure is one entry in launcher/diagnosis/hints.py and one row in SEEN below: the
end of a real log of that failure (trimmed) and the entry's name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distlaunch.launcher.diagnosis import evidence, hints
from distlaunch.launcher.diagnosis.summary import Failure, details, headline

pytestmark = pytest.mark.quick

TB = (
    "Traceback (most recent call last):\n"
    '  File "/job/train.py", line 25, in <module>\n'
    "    history = model.fit(x, y)\n"
)
ROW = "array([[0.51, 0.22, 0.93, 0.44, 0.15, 0.66, 0.37, 0.88, 0.19, 0.70],\n"
PER_REPLICA = (
    '  File "/venv/tensorflow/python/framework/constant_op.py", line 108, in convert\n'
    "    return ops.EagerTensor(value, ctx.device_name, dtype)\n"
    "ValueError: Attempt to convert a value (PerReplica:{\n"
    + "".join(f"  {i}: <tf.Tensor: shape=(32, 10), dtype=float64, numpy=\n{ROW}" for i in (0, 1))
    + "}) with an unsupported type (<class 'tensorflow.python.distribute.values.PerReplica'>) "
    "to a Tensor.\n"
)
ERRORS = "tensorflow.python.framework.errors_impl."

# (catalog entry, what a log of that failure ends with after TB)
SEEN = [
    ("keras3-fit-mwms", PER_REPLICA),
    (
        "keras3-fit-mwms",
        "ValueError: Invalid reduction dimension 0 for input with 0 dimensions.\n",
    ),
    (
        "keras3-fit-pss",
        (
            "ValueError: When using a `tf.data.Dataset` with ParameterServerStrategy, To use this "
            "dataset, you need to pass this dataset to "
            "`ClusterCoordinator.create_per_worker_dataset`.\n"
        ),
    ),
    (
        "collectives-after-startup",
        "RuntimeError: Collective ops must be configured at program startup\n",
    ),
    ("grpc-port-taken", f"{ERRORS}UnknownError: Could not start gRPC server\n"),
    (
        "peers-never-joined",
        (
            f"{ERRORS}DeadlineExceededError: Stopping coordination service as cluster registration "
            "failed. This may be due to 1) some tasks crashed earlier\n"
        ),
    ),
    (
        "callbacks-same-path",
        (
            "OSError: [Errno 11] Unable to synchronously create file (unable to lock file, "
            "errno = 11, error message = 'Resource temporarily unavailable')\n"
        ),
    ),
    (
        "keras3-savedmodel-path",
        (
            "ValueError: Invalid filepath extension for saving. Please add either a `.keras` "
            "extension for the native Keras format (recommended) or a `.h5` extension.\n"
        ),
    ),
    (
        "model-not-compiled",
        (
            'AttributeError: in user code:\n\n    File "/job/train.py", line 40, in train_step  *\n'
            "        model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))\n\n"
            "    AttributeError: 'NoneType' object has no attribute 'apply_gradients'\n"
        ),
    ),
    (
        "offline-download",
        (
            "Exception: URL fetch failure on https://storage.googleapis.com/tensorflow/"
            "tf-keras-datasets/mnist.npz: None -- [Errno -3] Temporary failure in name resolution\n"
        ),
    ),
]


@pytest.mark.parametrize(("name", "log"), SEEN, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SEEN)])
def test_each_known_failure_is_recognised(name: str, log: str) -> None:
    found = evidence.from_log("2026 some earlier line\n" + TB + log)
    assert found is not None
    hint = hints.find(found)
    assert hint is not None and hint.name == name


def test_every_catalog_entry_has_a_case_and_one_line() -> None:
    assert {h.name for h in hints.CATALOG} == {name for name, _ in SEEN}
    assert all("\n" not in h.text for h in hints.CATALOG)


def test_an_unknown_failure_gets_no_hint() -> None:
    assert hints.find(evidence.from_log(TB + "KeyError: 'labels'\n")) is None
    # The right words under the wrong exception type are not the known failure.
    assert (
        hints.find(
            evidence.from_log(
                TB + "KeyError: 'unsupported type (<class 'x.PerReplica'>) to a Tensor'\n"
            )
        )
        is None
    )


def _failure(tmp: Path, log: str, error: dict | None = None) -> Failure:
    (tmp / "worker-0.log").write_text(log)
    if error is not None:
        (tmp / "worker-0.json").write_text(json.dumps(error))
    return Failure(
        "worker-0",
        "exit code 1",
        str(tmp / "worker-0.log"),
        str(tmp / "worker-0.json"),
        7.0,
    )


def test_summary_from_a_log_names_the_exception_and_the_hint_not_the_tensor(
    tmp_path: Path,
) -> None:
    failure = _failure(tmp_path, "Epoch 1/5\n" + TB + PER_REPLICA + "W0000 shutting down\n")
    line = headline("r1", failure)
    assert line.startswith(
        "run r1 failed: worker-0 exit code 1 after 7.0 s: ValueError: Attempt to convert a value"
    )
    body = details(failure).splitlines()
    assert body[0].startswith(
        "  hint: Keras 3 model.fit cannot run under MultiWorkerMirroredStrategy"
    )
    assert "(keras-team/keras#20585)" in body[0]
    assert len(body) + 1 <= 12
    text = "\n".join(body)
    assert 'File "/job/train.py", line 25' in text and "history = model.fit(x, y)" in text
    assert "0.51, 0.22" not in text and "more lines" in text


def test_summary_prefers_the_error_file_and_clips_long_lines(tmp_path: Path) -> None:
    message = "x" * 1000 + "\nlast line"
    failure = _failure(
        tmp_path,
        "no traceback here\n",
        {"type": "KeyError", "message": message, "traceback": TB + "KeyError: ...\n"},
    )
    assert len(headline("r1", failure)) < 300
    body = details(failure).splitlines()
    assert "worker-0.json" in body[0] and "hint" not in body[0]
    assert all(len(line) <= evidence.MAX_LINE + 4 for line in body[1:])
    assert body[-1] == "  | last line"


def test_clip_collapses_array_reprs() -> None:
    assert (
        evidence.clip("numpy=array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])>") == "numpy=array([...])>"
    )
    assert len(evidence.clip("a" * 500)) == evidence.MAX_LINE
