"""distlaunch.run from a Jupyter notebook, executed by a real kernel (nbclient + ipykernel): the
function is defined in a cell, both tasks' prefixed lines land in the cell's output, the values
are the cell's result, and a raising function shows its own exception in the cell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import processes_of_run

nbclient = pytest.importorskip("nbclient", reason="the notebook test needs the test extras")
nbformat = pytest.importorskip("nbformat", reason="the notebook test needs the test extras")
pytest.importorskip("ipykernel", reason="the notebook test needs the test extras")


def executed(cells: list[str], folder: Path, allow_errors: bool = False) -> list:
    """``cells`` run in order in a real Python 3 kernel whose working directory is ``folder``;
    the notebook's cells, with their outputs."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(folder)}},
    ).execute()
    return notebook.cells


pytestmark = pytest.mark.integration

CELLS = [
    "import distlaunch\nfactor = 3.0",
    # A closure over the notebook's `factor`, defined in a cell: it travels by value.
    """\
def total(x):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = strategy.cluster_resolver.task_id
    print(f"task {task} has its strategy", flush=True)
    value = strategy.run(lambda: tf.constant(x * factor + task))
    return float(strategy.reduce("SUM", value, axis=None))

distlaunch.run(total, 2.0, workers=2)""",
    """\
class CellError(Exception):
    pass

def bad():
    raise CellError("raised in a notebook function")

distlaunch.run(bad, workers=1)""",
]


def _text(outputs: list, kind: str) -> str:
    if kind == "stream":
        return "".join(o["text"] for o in outputs if o["output_type"] == "stream")
    return "".join(
        o["data"].get("text/plain", "") for o in outputs if o["output_type"] == "execute_result"
    )


def test_a_notebook_runs_a_cell_function_on_two_workers(tmp_path: Path):
    _, run_cell, raise_cell = executed(CELLS, tmp_path, allow_errors=True)

    streamed = _text(run_cell.outputs, "stream")
    assert "worker-0 | task 0 has its strategy" in streamed
    assert "worker-1 | task 1 has its strategy" in streamed
    # (2 * 3 + 0) + (2 * 3 + 1) on both workers
    assert _text(run_cell.outputs, "result") == "{'worker-0': 13.0, 'worker-1': 13.0}"

    (error,) = [o for o in raise_cell.outputs if o["output_type"] == "error"]
    assert (error["ename"], error["evalue"]) == ("CellError", "raised in a notebook function")
    traceback = "\n".join(error["traceback"])
    assert "RemoteTraceback" in traceback and "raise CellError" in traceback

    runs = sorted(tmp_path.glob("runs/*/run.json"))
    assert len(runs) == 2
    for run_json in runs:
        record = json.loads(run_json.read_text())
        assert processes_of_run(record["run_id"]) == []


# The warm pool across cells: a function that leaves a thread printing and its last line without
# a newline; a cell that changes os.environ between calls; a cell that only waits.
POOL_CELLS = [
    "import os, threading, time\nimport distlaunch",
    """\
def ticking():
    def tick():
        while True:
            print("tick", flush=True)
            time.sleep(0.01)

    threading.Thread(target=tick, daemon=True).start()
    print("no newline at the end", end="")
    return os.environ.get("NB_DATA")

distlaunch.run(ticking, workers=1)""",
    'os.environ["NB_DATA"] = "set in a cell"\ntime.sleep(1.0)',
    "distlaunch.run(lambda: os.environ.get('NB_DATA'), workers=1)",
    "distlaunch.close_pool()",
]


def test_a_notebooks_pooled_calls_see_its_environment_and_print_only_in_their_cells(
    tmp_path: Path,
):
    _, first, between, second, _ = executed(POOL_CELLS, tmp_path)
    # (the thread's lines may cut into it: print writes "tick" and its newline apart)
    assert "no newline at the end" in _text(first.outputs, "stream")
    assert _text(first.outputs, "result") == "{'worker-0': None}"
    # The task's thread printed all along: into the run dir, not into the cell that ran then.
    assert between.outputs == []
    assert _text(second.outputs, "result") == "{'worker-0': 'set in a cell'}"
    (run_json,) = tmp_path.glob("runs/*/run.json")  # one warm cluster for both calls
    assert "tick" in (run_json.parent / "logs/attempt-0/worker-0.log").read_text()
    assert processes_of_run(json.loads(run_json.read_text())["run_id"]) == []
