"""The pytest plugin (entry point `pytest11`): the ``tf_cluster`` fixture runs a function on a real
multi-worker TensorFlow cluster of local processes, shaped by the ``tf_cluster`` marker.

::

    @pytest.mark.tf_cluster(workers=2)
    def test_step(tf_cluster):
        values = tf_cluster.run(train, 3)          # {"worker-0": ..., "worker-1": ...}
        assert tf_cluster.tf_config("worker-1")["task"] == {"type": "worker", "index": 1}

The runs go under the test's tmp_path. Whatever the test does (fails, leaves a call running),
every run it started is stopped at its end and no process of them is left; a failing test's
report names the run dirs. Loading the plugin imports neither TensorFlow nor the launcher (but
the launch options, which import nothing): the marker takes `distlaunch.LaunchOptions`' fields.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from distlaunch.launcher.run.options import DEFAULTS, LaunchOptions

if TYPE_CHECKING:
    from distlaunch.launcher.api.call import Call

MARKER = "tf_cluster"
_MARKER_HELP = (
    "tf_cluster(workers=2, chief=0, ps=0, evaluator=0, strategy=None, timeout_s=None, ...): the "
    "cluster of the tf_cluster fixture, and any other option of distlaunch.LaunchOptions but "
    "spec (strategy: parameter_server when ps > 0, else multi_worker_mirrored)"
)
# The report section of a failing test that used the fixture.
SECTION = "distlaunch tf_cluster"


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (no warning under --strict-markers)."""
    config.addinivalue_line("markers", _MARKER_HELP)


class TfCluster:
    """The ``tf_cluster`` fixture: runs functions on its cluster, and controls the latest run."""

    def __init__(self, shape: LaunchOptions, shared_dir: Path) -> None:
        self.shape = shape
        self.shared_dir = shared_dir
        self.calls: list[Call] = []  # every call started, this cluster's and its siblings'

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` on every task and return their values, or raise the first
        failure, as `distlaunch.run` does. Every keyword argument is ``fn``'s (``workers=``,
        ``env=`` too): the cluster's shape is the marker's (or `sized`'s)."""
        from distlaunch.launcher.api import launch as api

        with api.owning():
            return self.start(fn, *args, **kwargs).result()

    def start(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Call:
        """Start the call and return it at once (``.result()`` waits): ``kill`` and ``restart``
        act on it meanwhile. Every keyword argument is ``fn``'s, as for `run`."""
        from distlaunch.launcher.api import call as api_call
        from distlaunch.launcher.api import launch as api

        s = self.shape
        spec = api_call.cluster_spec(
            "tf_cluster", s.workers, s.chief, s.ps, s.evaluator, s.strategy_name, self.shared_dir,
            gpus=s.gpus,
        )  # fmt: skip
        with api.owning():
            call = api_call.submit(fn, args, kwargs, replace(s, spec=spec))
            self.calls.append(call)
        return call

    def sized(self, **shape: Any) -> TfCluster:
        """A cluster of another shape (``workers=1``) with the same runs folder and cleanup."""
        sibling = TfCluster(replace(self.shape, **shape), self.shared_dir)
        sibling.calls = self.calls
        return sibling

    @property
    def run_dirs(self) -> list[Path]:
        """The run dirs of every call, oldest first."""
        return [c.run.run_dir for c in self.calls]

    def tf_config(self, task: str) -> dict[str, Any]:
        """The TF_CONFIG ``task`` (``worker-1`` or ``worker:1``) got in the latest run."""
        record = self._record()
        name = task.replace(":", "-")
        for planned in record["plan"]["tasks"]:
            if planned["name"] == name:
                return planned["tf_config"]
        raise KeyError(f"no task {task!r} in {record['run_id']}")

    def output(self, task: str) -> str:
        """Everything ``task`` printed in the latest run (its latest attempt)."""
        return self._latest().run.logs(task)

    def wait_for_output(self, task: str, text: str, timeout_s: float = 240) -> None:
        """Wait until ``task`` of the latest run has printed ``text``; TimeoutError after
        ``timeout_s``, RuntimeError when the run ends first."""
        call = self._latest()
        deadline = time.monotonic() + timeout_s
        while text not in call.run.logs(task):
            if call.run.result is not None:
                raise RuntimeError(f"run {call.run.run_id} ended before {task} printed {text!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{task} did not print {text!r} within {timeout_s:g} s")
            time.sleep(0.05)

    def kill(self, task: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL) to ``task``'s process group in the latest run, as a crash or
        the OOM killer would end it; the run then handles it like any failure."""
        name = task.replace(":", "-")
        rows = [r for r in self._latest().run.tasks if r["task"] == name]
        if not rows or not rows[0]["pid"] or rows[0]["state"] not in ("starting", "running"):
            raise RuntimeError(f"{task} is not running in the latest run")
        os.killpg(rows[0]["pid"], sig)  # every task leads its own process group

    def restart(self, task: str) -> str:
        """Restart ``task`` of the latest run the way its strategy needs, as `distlaunch
        restart` does."""
        return self._latest().run.restart(task)

    def close(self) -> list[str]:
        """Stop every call still running, then stop whatever of them is left; return what was
        found left (nothing, when all went well)."""
        from distlaunch.launcher.control.down import down

        for call in self.calls:
            call.run.stop()
        left = []
        for run_dir in self.run_dirs:
            if (run_dir / "run.json").is_file():
                result = down(run_dir, grace_s=1.0)
                if result.stopped:
                    left.append(f"{run_dir.name}: {result.stopped} processes left, now stopped")
        return left

    def _latest(self) -> Call:
        if not self.calls:
            raise RuntimeError("tf_cluster has not run anything yet")
        return self.calls[-1]

    def _record(self) -> dict[str, Any]:
        path = self._latest().run.run_dir / "run.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise RuntimeError(f"the latest run has not started yet ({path})") from None


@pytest.fixture
def tf_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TfCluster]:
    """A TensorFlow cluster of local processes for this test, shaped by its ``tf_cluster`` marker
    (default: 2 workers under MultiWorkerMirroredStrategy)."""
    marker = request.node.get_closest_marker(MARKER)
    shape = LaunchOptions(*marker.args, **marker.kwargs) if marker else DEFAULTS
    cluster = TfCluster(shape, tmp_path / "tf_cluster")
    request.node.stash[_CLUSTER] = cluster
    yield cluster
    left = cluster.close()
    if left:
        pytest.fail("tf_cluster: " + "; ".join(left), pytrace=False)


_CLUSTER = pytest.StashKey[TfCluster]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failing test that used tf_cluster: its report names the run dirs (logs, errors)."""
    report = yield
    cluster = item.stash.get(_CLUSTER, None)
    if report.failed and cluster is not None and cluster.run_dirs:
        report.sections.append((SECTION, "run dirs:\n" + "\n".join(map(str, cluster.run_dirs))))
    return report
