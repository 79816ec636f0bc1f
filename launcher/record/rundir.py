"""The run directory: `<shared_dir>/<run_id>/` with run.json, events.jsonl, logs/ and checkpoints/.

Everything another shell needs to inspect or control a run (`status`, `logs`, `down`) is written
here; files are replaced atomically so a reader never sees half a JSON document.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from distlaunch.launcher.core.errors import UsageError

RUN_JSON = "run.json"
# The batch script `distlaunch sbatch` writes into a run dir before the run starts.
BATCH_SCRIPT = "job.sbatch"
EVENTS = "events.jsonl"
# The file a launcher holds an exclusive flock on for its whole life: one launcher per run dir.
LOCK = "launcher.lock"
# A run id names a folder in the shared dir: spelled like a spec's name, so that it can never be
# "", "..", a path or an option.
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

# With "permissions": "private", the launcher and every task it starts (they inherit it, or get
# it from the SSH helper or the container's entrypoint) create owner-only files: checkpoints,
# status and error files, and whatever the program itself writes.
PRIVATE_UMASK = 0o077


# The time in a run id `new_run_id` made: it sorts as the time does.
_STAMP = r"(\d{8}-\d{6})-[0-9a-f]{4}"


def new_run_id(name: str) -> str:
    """Return a fresh run id: the spec's name, the UTC time and a short random suffix."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    # os.urandom is what secrets.token_hex reads; importing secrets would load hashlib and random
    # (OpenSSL: ~5 ms) on the way to a run's first task (bench/startup.py).
    return f"{name}-{stamp}-{os.urandom(2).hex()}"


def check_run_id(run_id: str) -> None:
    """Refuse a run id that is not a plain folder name (UsageError)."""
    if not RUN_ID.fullmatch(run_id):
        raise UsageError(
            f"--run-id {run_id!r}: expected 1-128 letters, digits, '.', '-' or '_', "
            "starting with a letter or digit"
        )


def check_existing(run_dir: Path, private: bool) -> None:
    """Refuse to resume a run dir someone else could have planted or can change: a symbolic
    link, not a folder, not the user's own, or (for a private run) open to others."""
    info = os.lstat(run_dir)
    if stat.S_ISLNK(info.st_mode):
        raise UsageError(f"run dir {run_dir} is a symbolic link; a run dir is never followed")
    if not stat.S_ISDIR(info.st_mode):
        raise UsageError(f"run dir {run_dir} is not a directory")
    if info.st_uid != os.getuid():
        raise UsageError(
            f"run dir {run_dir} belongs to uid {info.st_uid}, not to you (uid {os.getuid()})"
        )
    mode = stat.S_IMODE(info.st_mode)
    if private and mode & 0o077:
        raise UsageError(f"run dir {run_dir} has mode {mode:04o}; a private run's dir must be 0700")


@contextmanager
def claim(run_dir: Path, previous_attempt: int | None, private: bool) -> Iterator[None]:
    """Own ``run_dir`` for the block: create it (a new run, ``previous_attempt`` None) or check
    that its run.json is still at ``previous_attempt`` (a resumed run), under an exclusive lock that a
    second launcher of the same run cannot take (UsageError). The kernel drops the lock when this
    process ends, however it ends. A new run dir that never got a run.json is removed again,
    with the folders above it that were made for it: a run that did not start leaves nothing.
    """
    # A run dir that `distlaunch sbatch` made for its batch script is this run's already.
    created = previous_attempt is None and not (run_dir / BATCH_SCRIPT).is_file()
    # The run dir and the missing folders above it, deepest first.
    made = [p for p in (run_dir, *run_dir.parents) if not os.path.lexists(p)]
    if created:
        try:
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            # Exclusive: an existing folder (or a link planted in its place) is never reused.
            run_dir.mkdir(mode=0o700 if private else 0o777)
        except FileExistsError:
            raise UsageError(f"run dir {run_dir} already exists; pick another --run-id") from None
        except OSError as exc:
            raise UsageError(f"cannot create run dir {run_dir}: {exc.strerror}") from None
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(run_dir / LOCK, flags, file_mode(run_dir))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"run {run_dir.name} is in use by another launcher; "
                f"`distlaunch down {run_dir.name}` stops it"
            ) from None
        if previous_attempt is not None:
            record = read_json(run_dir / RUN_JSON) or {}
            if record.get("attempt") != previous_attempt:
                raise UsageError(
                    f"run {run_dir.name} changed while this launcher started; run the command again"
                )
        yield
    finally:
        os.close(fd)
        if created and not (run_dir / RUN_JSON).exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            for folder in made[1:]:
                try:
                    folder.rmdir()
                except OSError:
                    break


def make_dirs(run_dir: Path, attempt: int, private: bool = True) -> None:
    """Create the run's folders: owner-only when ``private`` (logs and run.json are sensitive),
    else as the umask allows. Files made later take their folder's mode (see `file_mode`)."""
    for sub in (
        "",
        "logs",
        f"logs/attempt-{attempt}",
        "checkpoints",
        "errors",
        f"errors/attempt-{attempt}",
        "status",
        "metrics",
    ):
        path = run_dir / sub
        path.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)


def file_mode(directory: Path) -> int:
    """The mode of a new file in ``directory``: the folder's read and write bits (0700 gives 0600).

    The run dir's mode, set once from the spec's `permissions`, so decides every launcher file's,
    whichever command writes it (`up`, a resumed `up`, `down`).
    """
    return stat.S_IMODE(os.stat(directory).st_mode) & 0o666


def create_file(path: str | Path) -> None:
    """Create ``path`` empty, with its folder's file mode, unless it exists."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, file_mode(Path(path).parent)))


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temp file + rename), with its folder's file mode."""
    # dumps, then one write: json.dump writes every token separately, many times slower.
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file + rename), with its folder's file mode."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, file_mode(path.parent))
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        # A full disk fails the write or the close: leave no half-written temp file behind.
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path) -> Any:
    """Read a JSON file; None when it is missing or unreadable (a task may be mid-write)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def append_event(run_dir: Path, **event: Any) -> None:
    """Append one event line (time first) to the run's events.jsonl."""
    line = json.dumps({"time": round(time.time(), 3), **event}, default=str)
    fd = os.open(run_dir / EVENTS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, file_mode(run_dir))
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def runs_in(shared_dir: Path) -> list[Path]:
    """Return the run directories under ``shared_dir``, oldest first (by run.json start time)."""
    if not shared_dir.is_dir():
        return []
    found = []
    for child in shared_dir.iterdir():
        record = read_json(child / RUN_JSON)
        if isinstance(record, dict):
            found.append((record.get("started_at") or 0, child))
    return [path for _, path in sorted(found)]


def runs_of(shared_dir: Path, name: str) -> list[tuple[str, Path]]:
    """The runs of spec ``name`` under ``shared_dir`` as (start time, run dir), newest first,
    found by their ids alone (`new_run_id`'s: the name, the UTC second it started, a random
    suffix): no run.json is read, so a shared dir that keeps thousands of runs costs one listing.

    A run given its own `--run-id` is not among them; two runs started in one second share a
    time (their run.json says which started first)."""
    try:
        entries = os.listdir(shared_dir)
    except OSError:  # no shared dir yet (or not a folder): no runs
        return []
    pattern = re.compile(re.escape(name) + "-" + _STAMP)
    found = [(m.group(1), entry) for entry in entries if (m := pattern.fullmatch(entry))]
    return [(stamp, shared_dir / entry) for stamp, entry in sorted(found, reverse=True)]


def resolve_run(ref: str | None, shared_dir: Path) -> Path:
    """Find a run by id or directory; the latest run under ``shared_dir`` when ``ref`` is None."""
    if ref is None:
        runs = runs_in(shared_dir)
        if not runs:
            raise UsageError(f"no runs under {shared_dir}; pass a run id or directory")
        return runs[-1]
    for candidate in (Path(ref), shared_dir / ref):
        if (candidate / RUN_JSON).is_file():
            return candidate.resolve()
    raise UsageError(f"no run {ref!r}: expected a run directory or a run id under {shared_dir}")


# `distlaunch restart` asks a live launcher to restart a task: a request file in the run's
# control/ folder, then this signal; the supervisor takes the requests when it wakes.
CONTROL_DIR = "control"
CONTROL_SIGNAL = signal.SIGUSR1
# What a Slurm batch job of `distlaunch sbatch --requeue` gets shortly before its time limit: the
# supervisor stops the run as for SIGTERM, then the slurm backend requeues the job.
PRE_TIMEOUT_SIGNAL = signal.SIGUSR2
_RESTART_PREFIX = "restart-"


def add_restart_request(run_dir: Path, task: str) -> None:
    """Leave a request to restart ``task`` for the run's launcher."""
    control = run_dir / CONTROL_DIR
    control.mkdir(mode=0o700, exist_ok=True)
    create_file(control / f"{_RESTART_PREFIX}{task}")


def take_restart_requests(run_dir: Path) -> list[str]:
    """The tasks whose restart was requested, oldest name first; the requests are removed."""
    control = run_dir / CONTROL_DIR
    names = []
    for request in sorted(control.glob(f"{_RESTART_PREFIX}*")) if control.is_dir() else ():
        request.unlink(missing_ok=True)
        names.append(request.name.removeprefix(_RESTART_PREFIX))
    return names
