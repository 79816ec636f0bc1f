"""`distlaunch status`: a run's state and one row per task, from its run.json; `--watch` redraws
the tasks' training progress (progress_view) every second, like top."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from distlaunch.launcher.control.liveness import launcher_alive
from distlaunch.launcher.diagnosis import progress_view
from distlaunch.launcher.record.state import RunRecord

# What `status` shows for a run recorded as running whose launcher is gone (killed outright).
LOST = "lost"
# How long `status` watches the local tasks' CPU time to tell their CPU use (seconds).
CPU_SAMPLE_S = 0.5
# `status --watch` redraws this often (seconds).
WATCH_INTERVAL_S = 1.0
_HOME_CLEAR = "\x1b[H\x1b[2J"


def run_state(record: RunRecord) -> str:
    """The run's state as `status` shows it: the recorded one, or LOST when the record says it
    runs but its launcher is gone."""
    if record.state.live and not launcher_alive(record):
        return LOST
    return record.state.value


def world_line(record: RunRecord) -> str | None:
    """An elastic run's world as `status` shows it (None: not elastic), e.g. ``world 2 of 2:3
    on h1, h2 (worlds 3 -> 2; out: h3 lost)``. Task names follow the world: ``worker-1`` is its
    second worker, on the host named here in slot order."""
    world = record.world
    if not isinstance(world, dict) or "size" not in world:
        return None
    line = f"world {world['size']} of {world.get('workers')}"
    hosts = world.get("hosts") or []
    if hosts:
        line += f" on {', '.join(map(str, hosts))}"
    more = []
    worlds = world.get("worlds") or []
    if len(worlds) > 1:
        more.append("worlds " + " -> ".join(map(str, worlds)))
    out = world.get("out") or {}
    if out:
        more.append("out: " + ", ".join(f"{name} {state}" for name, state in out.items()))
    return line + (f" ({'; '.join(more)})" if more else "")


def status_rows(
    record: RunRecord, now: float | None = None, use: Mapping[str, float] | None = None
) -> list[dict]:
    """One row per task: state, pid, attempt, restarts, uptime (s, while it runs), port, exit,
    its CPUs as the plan gave them and ``use``: how many CPUs it keeps busy (`cpu_use`; None
    where not measured)."""
    now = time.time() if now is None else now
    planned = {t.get("name"): t.get("cpus") for t in record.plan.get("tasks", [])}
    live = run_state(record) != LOST and record.state.live
    world = record.world.get("slots") if isinstance(record.world, dict) else None
    rows = []
    for name, task in record.tasks.items():
        if world is not None and task.role == "worker" and name not in world:
            continue  # a worker of an earlier, bigger world (world_line says which world runs)
        running = live and task.state is not None and task.state.live
        started = task.started_at
        rows.append(
            {
                "task": name,
                "state": task.state.value if task.state is not None else None,
                "pid": task.pid,
                "port": task.port,
                "attempt": task.attempt,
                "restarts": task.restarts,
                "uptime_s": round(now - started, 1) if running and started is not None else None,
                "exit": task.exit,
                "cpus": planned.get(name),
                "cpu_use": (use or {}).get(name) if running else None,
            }
        )
    return rows


def cpu_use(record: RunRecord, sample_s: float = CPU_SAMPLE_S) -> dict[str, float]:
    """How many CPUs each live local task keeps busy: the CPU time of its processes (taskinit's
    keeper and everything under it) over ``sample_s``. Tasks on other machines are not measured
    (their pid here is a local ssh or srun client)."""
    if not record.state.live or not launcher_alive(record):
        return {}
    local = {t.get("name") for t in record.plan.get("tasks", []) if t.get("transport") == "local"}
    pids = {
        name: task.pid
        for name, task in record.tasks.items()
        if name in local and task.pid and task.state is not None and task.state.live
    }
    first = {name: _cpu_time(pid) for name, pid in pids.items()}
    time.sleep(sample_s)
    return {
        name: round(max(_cpu_time(pid) - first[name], 0.0) / sample_s, 2)
        for name, pid in pids.items()
        if first[name] is not None
    }


def _cpu_time(pid: int) -> float | None:
    """User and system CPU seconds of ``pid`` and its descendants (None: it is gone)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for proc in tree:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue  # ended just now
        total += times.user + times.system
    return total


def cpu_text(row: Mapping) -> str:
    """A row's CPU use against its CPUs, as `status` prints it: ``0.98 of 1`` (1 CPU pinned),
    ``1.90 of all`` (not pinned); ``-`` where not measured."""
    cpus = row.get("cpus") or {}
    of = str(cpus.get("count")) if cpus.get("count") else "all"
    if row.get("cpu_use") is None:
        return f"- of {of}" if cpus else "-"
    return f"{row['cpu_use']:.2f} of {of}"


def watch(run_dir: Path, write: Callable[[str], None]) -> None:
    """Redraw the progress screen of the run in ``run_dir`` every WATCH_INTERVAL_S with
    ``write`` until the run is over (its last frame stays) or Ctrl-C."""
    try:
        while True:
            record = RunRecord.load(run_dir)
            state = run_state(record)
            rows = progress_view.task_progress(run_dir, record)
            stamp = time.strftime("%H:%M:%S")
            frame = progress_view.screen(record, state, run_dir, rows)
            write(f"{_HOME_CLEAR}distlaunch status --watch  {stamp}  (Ctrl-C quits)\n")
            write("\n".join(frame) + "\n")
            if state == LOST or not record.state.live:
                return
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        return
