"""GPUs: a task sees exactly the GPUs its spec gives it, inside the run's sandbox, and
MultiWorkerMirroredStrategy mirrors each worker over its own GPUs.

What a task sees is read through the CUDA driver itself (libcuda, by ctypes: no framework needed),
so the placement tests run on any machine with an NVIDIA driver. The tests marked `gpu` skip, with
the reason, where there is none; the check that a spec asks only for GPUs this machine has runs
everywhere (here it has none, on a GPU machine it has some).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import distlaunch as distlaunch_api
from conftest import distlaunch, write_spec


def visible_uuids() -> list[str]:
    """The CUDA driver's own view: the UUID of every device this process may use, in CUDA's
    order (none when CUDA_VISIBLE_DEVICES leaves none, or there is no driver)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return []
    if cuda.cuInit(0) != 0:  # 100, CUDA_ERROR_NO_DEVICE: CUDA_VISIBLE_DEVICES leaves none
        return []
    count = ctypes.c_int()
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
    uuids = []
    for i in range(count.value):
        device, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        assert cuda.cuDeviceGet(ctypes.byref(device), i) == 0
        assert cuda.cuDeviceGetUuid(raw, device) == 0
        h = bytes(raw).hex()
        uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    return uuids


# A task's program: what it sees, into the run dir (and on stdout).
PROBE = (
    "import json, os\n\n"
    + inspect.getsource(visible_uuids)
    + """
seen = {"uuids": visible_uuids(), "env": os.environ.get("CUDA_VISIBLE_DEVICES")}
if "DISTLAUNCH_RUN_DIR" in os.environ:
    name = f"probe-{os.environ['DISTLAUNCH_ROLE']}-{os.environ['DISTLAUNCH_INDEX']}.json"
    with open(os.path.join(os.environ["DISTLAUNCH_RUN_DIR"], name), "w") as f:
        json.dump(seen, f)
print(json.dumps(seen))
"""
)


def _probe(visible: str | None = None) -> list[str]:
    """The UUIDs a process started with CUDA_VISIBLE_DEVICES=``visible`` (None: unset, every
    GPU of this machine) may use."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)["uuids"]


@functools.cache
def _here() -> tuple[str, ...]:
    return tuple(_probe())


@pytest.fixture
def cuda_gpus() -> tuple[str, ...]:
    """This machine's GPUs as CUDA shows them to the tests; skip where there is none."""
    if not _here():
        pytest.skip("no NVIDIA GPU here (libcuda.so.1 missing or it shows no device)")
    return _here()


def _up_probes(tmp: Path, tasks: dict, env: dict | None = None) -> dict[str, list[str]]:
    """`up` the probe as ``tasks``; what each task saw, by task name."""
    (tmp / "task.py").write_text(PROBE)
    spec = write_spec(tmp, tasks=tasks)
    launcher_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    launcher_env.update(env or {})
    done = distlaunch("up", str(spec), cwd=tmp, env=launcher_env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp / "runs").iterdir()
    return {
        re.sub(r"^probe-(\w+)-(\d+)\.json$", r"\1-\2", p.name): json.loads(p.read_text())["uuids"]
        for p in run_dir.glob("probe-*.json")
    }


@pytest.mark.gpu
@pytest.mark.integration
def test_each_task_sees_exactly_its_own_gpu_and_a_cpu_task_sees_none(tmp, cuda_gpus):
    with_gpu = min(len(cuda_gpus), 2)
    seen = _up_probes(tmp, {"worker": [{"gpus": 1}] * with_gpu + [{}]})
    # What CUDA_VISIBLE_DEVICES=i means on this machine, asked outside distlaunch.
    expected = {f"worker-{i}": _probe(str(i)) for i in range(with_gpu)}
    assert all(len(uuids) == 1 for uuids in expected.values()), expected
    assert seen == {**expected, f"worker-{with_gpu}": []}
    # No two tasks share a GPU.
    assert len({uuids[0] for uuids in expected.values()}) == with_gpu


@pytest.mark.gpu
@pytest.mark.integration
def test_task_indices_count_within_the_launchers_own_visible_gpus(tmp, cuda_gpus):
    # The launcher may use only the last GPU (named by UUID, as CUDA allows): a task's GPU 0 is
    # that one. On a machine of one GPU it is GPU 0 itself, named another way.
    last = cuda_gpus[-1]
    seen = _up_probes(tmp, {"worker": [{"gpus": [0]}]}, {"CUDA_VISIBLE_DEVICES": last})
    assert seen == {"worker-0": [last]}


@pytest.mark.quick
@pytest.mark.integration
def test_a_spec_asking_for_more_gpus_than_this_machine_has_is_refused(tmp):
    have = len(_here())
    (tmp / "task.py").write_text(PROBE)
    spec = write_spec(tmp, tasks={"worker": {"count": have + 1, "gpus": 1}})
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = distlaunch("up", str(spec), cwd=tmp, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert "$.tasks.worker.gpus" in lines[0]
    assert ("has none" if have == 0 else f"has {have} ") in lines[0], lines[0]
    # Nothing started, nothing left: no run dir, no task output.
    assert not (tmp / "runs").exists() or not any((tmp / "runs").iterdir())
    assert done.stdout == ""
    # A dry run may be written for another machine.
    assert distlaunch("plan", str(spec), cwd=tmp, env=env).returncode == 0


@pytest.mark.gpu
@pytest.mark.integration
def test_distlaunch_run_gives_each_worker_its_own_gpu(tmp, cuda_gpus, monkeypatch):
    monkeypatch.chdir(tmp)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with_gpu = min(len(cuda_gpus), 2)
    seen = distlaunch_api.run(visible_uuids, workers=with_gpu, gpus=1, pool=False)
    assert seen == {f"worker-{i}": _probe(str(i)) for i in range(with_gpu)}


@pytest.mark.quick
@pytest.mark.integration
def test_distlaunch_run_asking_for_more_gpus_than_here_raises_start_error(tmp, monkeypatch):
    monkeypatch.chdir(tmp)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    have = len(_here())
    # Found when the launcher plans the run, as a port in use is: a StartError with the CLI's
    # one line (the spec as data is "<spec>").
    with pytest.raises(distlaunch_api.StartError) as caught:
        distlaunch_api.run(visible_uuids, workers=1, gpus=have + 1, pool=False)
    assert str(caught.value).startswith("<spec>: $.tasks.worker.gpus: "), str(caught.value)
    assert ("has none" if have == 0 else f"has {have} ") in str(caught.value)
    assert not (tmp / "runs").exists() or not any((tmp / "runs").iterdir())
    with pytest.raises(ValueError, match="gpus= expected an integer >= 0"):
        distlaunch_api.run(visible_uuids, gpus=-1)


# Each worker reports its strategy's replicas and devices, then trains the MNIST example.
MIRRORED = """
import distlaunch.worker as dw
strategy = dw.strategy()
print("replicas", strategy.num_replicas_in_sync, "devices", ",".join(strategy.extended.worker_devices))
from distlaunch.worker.examples.mnist_mlp import main
main(["--epochs", "1", "--steps-per-epoch", "10"])
"""


@functools.cache
def _tensorflow_gpus() -> int:
    """How many GPUs TensorFlow sees here (0 where its CUDA libraries are missing)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))",
        ],
        capture_output=True,
        text=True,
    )
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


@pytest.mark.gpu
@pytest.mark.integration
def test_mirrored_strategy_inside_each_worker_spans_its_gpus(tmp, cuda_gpus):
    if len(cuda_gpus) < 2:
        pytest.skip(f"needs 2 GPUs for 2 workers, this machine has {len(cuda_gpus)}")
    if _tensorflow_gpus() < 2:
        pytest.skip("TensorFlow sees fewer than 2 GPUs (its CUDA libraries: tensorflow[and-cuda])")
    per_worker = len(cuda_gpus) // 2
    (tmp / "task.py").write_text(MIRRORED)
    spec = write_spec(tmp, tasks={"worker": {"count": 2, "gpus": per_worker}})
    done = distlaunch("up", str(spec), cwd=tmp, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = re.findall(r"^worker-(\d) \| replicas (\d+) devices (\S+)$", done.stdout, re.M)
    assert sorted(r[0] for r in reports) == ["0", "1"], done.stdout[-3000:]
    for _, replicas, devices in reports:
        # Every replica of the cluster: each worker mirrors over all of its own GPUs.
        assert int(replicas) == 2 * per_worker
        listed = devices.split(",")
        assert len(listed) == per_worker and all("/device:GPU:" in d for d in listed), devices
    losses = re.findall(r"^worker-\d \| final loss (\S+)", done.stdout, re.M)
    assert len(losses) == 2 and losses[0] == losses[1], done.stdout[-3000:]
