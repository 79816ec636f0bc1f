"""`distlaunch.run(fn, *args, workers=2, ...)`: call a function on every task of a cluster.

The function and its arguments travel as one cloudpickle payload (functions of ``__main__`` and
notebook cells, closures and lambdas by value), streamed into a file (a large argument is never
copied in memory) that the launcher moves into the run dir before any task starts; every task
runs `distlaunch.worker.call`, which calls it and writes the task's result file; the caller reads
them once the run has ended, then removes the call's files (``keep=True`` keeps them).
Everything in between is `launch`: the same spec validation, plan, supervision and teardown as
`distlaunch up`. A call without a spec of its own takes a lease on the warm pool instead
(launcher/api/pool.py): the same run, kept for the next call of the same shape, its files
numbered by call.

The run's tasks have no server deadline (timeouts.startup_s) unless a spec asks for one: a
function may never make a strategy, or work long before it does.
"""

from __future__ import annotations

import json
import linecache
import os
import pickle
import re
import sys
import tempfile
import types
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import cloudpickle

from distlaunch.launcher.api import launch as api
from distlaunch.launcher.api import pool as api_pool
from distlaunch.launcher.api.results import PicklingError, RemoteTraceback, RunResult, TaskError
from distlaunch.launcher.run.options import DEFAULTS, LaunchOptions, SpecInput
from distlaunch.worker import contract
from distlaunch.worker.call import PAYLOAD, SERVE_ARG, payload_path, result_path

# The program of every task.
CALL_MODULE = "distlaunch.worker.call"
# The roles that train, and so get `gpus=`: ps servers and the evaluator stay on the CPU.
_GPU_ROLES = (contract.CHIEF, contract.WORKER)


def run(
    fn: Callable[..., Any],
    *args: Any,
    workers: int | tuple[int, int] = DEFAULTS.workers,
    chief: int = DEFAULTS.chief,
    ps: int = DEFAULTS.ps,
    evaluator: int = DEFAULTS.evaluator,
    strategy: str | None = DEFAULTS.strategy,
    gpus: int = DEFAULTS.gpus,
    spec: SpecInput | None = DEFAULTS.spec,
    timeout_s: float | None = DEFAULTS.timeout_s,
    restart: Mapping[str, Any] | str | None = DEFAULTS.restart,
    env: Mapping[str, str] | None = DEFAULTS.env,
    quiet: bool = DEFAULTS.quiet,
    pool: bool | None = DEFAULTS.pool,
    keep: bool = DEFAULTS.keep,
    **kwargs: Any,
) -> Any:
    """Call ``fn(*args, **kwargs)`` on every task of a local cluster and return what they returned.

    The options (the cluster's ``workers``, ``chief``, ``ps``, ``evaluator``, ``strategy`` and
    ``gpus``, or a ``spec`` of its own; ``timeout_s``, ``restart``, ``env``, ``quiet``,
    ``pool``, ``keep``) are the fields of `LaunchOptions`, each with its default and meaning
    there. Run dirs go under ./runs (or the spec's shared dir). Each task runs ``fn`` with its
    TF_CONFIG set and no strategy made yet: ``fn`` builds its strategy as a script would. Under
    ParameterServerStrategy ``fn`` runs on the chief only; the ps and worker tasks serve. Each
    task sees this process's environment and working directory of the moment of the call (plus
    TF_CONFIG, ``env`` and the run's own variables), and a ``sys.argv`` of its own
    (``[<path of distlaunch/worker/call.py>]``), pooled or not.

    Returns ``{"worker-0": v0, "worker-1": v1}`` in TF_CONFIG order (chief, workers, evaluator),
    or under ParameterServerStrategy the chief's value alone. The call returns once ``fn`` has
    returned on every task: what it left running (a thread) ends with its task.

    Each task's lines are printed with its prefix on sys.stdout while the call runs. The call's
    payload (the function and its arguments, sent as a file) and its result files are removed
    from the run dir once read. Launch options are these keyword names; an argument of ``fn``
    that has one of these names goes through ``functools.partial``.

    Raises: PicklingError (before anything starts) naming the function or argument that cannot
    be pickled; the first failed task's own exception (same type; the remote traceback chained as
    its cause, the task named in a note); TaskError when that exception does not unpickle here,
    when a task ended before ``fn`` returned there (``sys.exit``, ``os._exit``, ``exit()`` in a
    library, whatever the status: "worker-0 exited with status 0 before returning"), or when
    the task was killed (a signal, the OOM killer, a hang), with the CLI's root-cause line;
    PicklingError naming the task and the type of a return value that cannot be pickled, or
    that does not unpickle here; RunFailed when the run was stopped or could not finish;
    StartError, SpecError when it could not start. An interrupt (Ctrl-C), at any moment, stops
    the call's run before it goes on up: nothing of it is left running.
    """
    with api.owning():
        options = LaunchOptions(
            workers=workers, chief=chief, ps=ps, evaluator=evaluator, strategy=strategy,
            gpus=gpus, spec=spec, timeout_s=timeout_s, restart=restart, env=env, quiet=quiet,
            pool=pool, keep=keep,
        )  # fmt: skip
        return submit(fn, args, kwargs, options).result()


class Call:
    """A `distlaunch.run` call in flight: its `Run`, and its tasks' values once it has ended."""

    def __init__(
        self,
        handle: api.Run,
        fn: Callable[..., Any],
        lease: api_pool.Lease | None = None,
        keep: bool = False,
    ) -> None:
        self.run = handle
        self._fn = fn
        self._lease = lease  # a call on the warm pool's run: it goes on after this call
        self._keep = keep

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the end (TimeoutError after ``timeout`` s; the run goes on) and return the
        tasks' values, or raise the first failure, as `run` does. Any other interruption of the
        wait (Ctrl-C) stops the run, as `Run.stop` does."""
        number = 0 if self._lease is None else self._lease.number
        try:
            if self._lease is None:
                result = self.run.wait(timeout)
            else:
                ended = self._lease.wait(timeout)
                if ended is None:  # every task finished the call; the run serves on
                    return _collect(self.run, number, self._keep)
                result = ended
        except (TimeoutError, TaskError):
            raise
        except BaseException:
            api.stop_interrupted(self.run)
            api_pool.forget(self.run)
            raise
        return _values(self.run, result, self._fn, number, self._keep)


def start(
    fn: Callable[..., Any],
    *args: Any,
    workers: int | tuple[int, int] = DEFAULTS.workers,
    chief: int = DEFAULTS.chief,
    ps: int = DEFAULTS.ps,
    evaluator: int = DEFAULTS.evaluator,
    strategy: str | None = DEFAULTS.strategy,
    gpus: int = DEFAULTS.gpus,
    spec: SpecInput | None = DEFAULTS.spec,
    timeout_s: float | None = DEFAULTS.timeout_s,
    restart: Mapping[str, Any] | str | None = DEFAULTS.restart,
    env: Mapping[str, str] | None = DEFAULTS.env,
    quiet: bool = DEFAULTS.quiet,
    pool: bool | None = DEFAULTS.pool,
    keep: bool = DEFAULTS.keep,
    **kwargs: Any,
) -> Call:
    """`run` without the wait: start the call and return it (`Call.result` waits). An
    interrupt before it returns stops what it started."""
    with api.owning():
        options = LaunchOptions(
            workers=workers, chief=chief, ps=ps, evaluator=evaluator, strategy=strategy,
            gpus=gpus, spec=spec, timeout_s=timeout_s, restart=restart, env=env, quiet=quiet,
            pool=pool, keep=keep,
        )  # fmt: skip
        return submit(fn, args, kwargs, options)


def submit(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    options: LaunchOptions = DEFAULTS,
) -> Call:
    """`start` with the function's arguments apart from the launch ``options`` (``kwargs`` may
    use any name: ``workers``, ``env``...), for callers that pass a user's arguments on (the
    pytest fixture)."""
    o = options
    program: dict[str, Any] = {"module": CALL_MODULE, "workdir": str(Path.cwd())}
    if o.env:
        program["env"] = dict(o.env)
    console: api.ConsoleTarget = None if o.quiet else "stdout"
    # The warm pool's runs are of a call's own cluster with nothing else asked of the run.
    own = (o.spec, o.restart, o.timeout_s, o.backend, o.run_id, o.resume, o.overrides)
    elastic = isinstance(o.workers, tuple)  # a range: a run of its own, never the pool's
    warm = (
        own == (None, None, None, None, None, False, ())
        and not elastic
        and api_pool.enabled(o.pool)
    )
    spec = o.spec
    if spec is None:
        spec = cluster_spec(
            _run_name(fn), o.workers, o.chief, o.ps, o.evaluator, o.strategy_name, gpus=o.gpus
        )
    payload = write_payload(fn, tuple(args), dict(kwargs), pooled=warm)
    try:
        if warm:
            assert isinstance(spec, dict)
            lease = _lease(spec, {**program, "args": [SERVE_ARG]}, payload, console)
            if lease is not None:
                return Call(lease.run, fn, lease, o.keep)
        overrides = [*o.overrides, f"program={json.dumps(program)}"]
        if elastic and o.spec is not None:  # the spec's worker role is the range's slots
            overrides.append(f"elastic.workers={json.dumps(_range_text(o.workers))}")
        if o.timeout_s is not None:
            overrides.append(f"timeouts.run_s={o.timeout_s}")
        if o.restart is not None:
            restart = o.restart
            policy = {"policy": restart} if isinstance(restart, str) else dict(restart)
            overrides.append(f"restart={json.dumps(policy)}")
        launch = replace(o, spec=spec, overrides=tuple(overrides))
        handle = api.launch_with_files(launch, console, {PAYLOAD: payload})
    except BaseException:
        payload.unlink(missing_ok=True)  # the run was refused, or never asked for
        raise
    return Call(handle, fn, keep=o.keep)


def _lease(
    spec: dict[str, Any], program: dict[str, Any], payload: Path, console: api.ConsoleTarget
) -> api_pool.Lease | None:
    """The call on the warm pool: its entry of this shape (the tasks, strategy, program and
    working directory; not the function's name), or a new one started with this call."""
    key = json.dumps([spec["tasks"], spec["strategy"], program, spec["shared_dir"]], sort_keys=True)
    # The tasks that run the function: under PSS the ps and worker tasks only serve.
    roles = (contract.CHIEF, contract.EVALUATOR)
    if spec["strategy"] != contract.PSS:
        roles = (contract.CHIEF, contract.WORKER, contract.EVALUATOR)
    tasks = tuple(
        f"{role}-{i}" for role in roles for i in range(spec["tasks"].get(role, {}).get("count", 0))
    )
    overrides = (f"program={json.dumps(program)}",)

    def start() -> api.Run:
        options = LaunchOptions(spec=spec, overrides=overrides)
        return api.launch_with_files(options, console, {PAYLOAD: payload})

    return api_pool.take(key, tasks, payload, console, start)


def write_payload(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], pooled: bool
) -> Path:
    """The call as the tasks load it (worker/call.py), streamed into a file of its own (its
    path is returned); PicklingError naming what cannot be pickled. A ``pooled`` call carries
    this process's environment and working directory of now, which a serving task takes on (a
    one-shot task has them from its start)."""
    if not callable(fn):
        raise TypeError(f"distlaunch.run: expected a function, got a {type(fn).__name__}")
    context: dict[str, Any] = {"sys_path": [p for p in sys.path if p]}
    if pooled:
        context.update(environ=dict(os.environ), cwd=os.getcwd())
    fd, name = tempfile.mkstemp(prefix="distlaunch-call-", suffix=".pkl")
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as stream:
            pickle.dump(context, stream)
            cloudpickle.dump((fn, args, kwargs), stream)
    except Exception:  # noqa: BLE001 - find out which part it was, below
        path.unlink(missing_ok=True)
        _name_unpicklable(fn, args, kwargs)
        raise
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _name_unpicklable(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    parts: list[tuple[str, Any]] = [(f"the function {_name(fn)}", fn)]
    parts += [(f"argument {i} (a {type(a).__name__})", a) for i, a in enumerate(args)]
    parts += [(f"keyword argument {k!r} (a {type(v).__name__})", v) for k, v in kwargs.items()]
    for what, value in parts:
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any pickling error is this one line
            raise PicklingError(
                f"distlaunch.run: cannot pickle {what}: {exc}; nothing was started"
            ) from None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def cluster_spec(
    name: str,
    workers: int | tuple[int, int],
    chief: int,
    ps: int,
    evaluator: int,
    strategy: str,
    shared_dir: str | Path = "./runs",
    gpus: int = 0,
) -> dict[str, Any]:
    """The spec of a local cluster of these counts (a role of count 0 is left out) for a call,
    each chief and worker with ``gpus`` GPUs; its program is the call's runner.

    ``workers`` as a range ``(MIN, MAX)`` makes MAX worker tasks and an ``elastic`` section of
    that range with every other setting at its default. (With a spec of the call's own, `submit`
    sets the spec's ``elastic.workers`` to the range instead: the spec's worker role is then the
    slots, and validation checks MAX against it.)"""
    elastic = None
    if isinstance(workers, tuple):
        elastic = {"workers": _range_text(workers)}
        workers = workers[1]
    counts = {
        contract.CHIEF: chief,
        contract.WORKER: workers,
        contract.PS: ps,
        contract.EVALUATOR: evaluator,
    }
    for what, count in {**counts, "gpus": gpus}.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"distlaunch.run: {what}= expected an integer >= 0, got {count!r}")
    return {
        "name": name,
        "strategy": strategy,
        "program": {"module": CALL_MODULE},
        "tasks": {
            role: {"count": n, **({"gpus": gpus} if gpus and role in _GPU_ROLES else {})}
            for role, n in counts.items()
            if n
        },
        "timeouts": {"startup_s": None},  # no deadline: see the module docstring
        "shared_dir": str(shared_dir),
        **({"elastic": elastic} if elastic else {}),
    }


def _range_text(workers: tuple[int, int]) -> str:
    """``workers=(MIN, MAX)`` as the spec writes it ("2:3"); ValueError for another tuple (the
    range's own rules, MIN <= MAX <= the slots, are the spec's: SpecError)."""
    ok = len(workers) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in workers
    )
    if not ok:
        raise ValueError(
            f"distlaunch.run: workers= expected a count or a range (MIN, MAX) of integers >= 1, "
            f"got {workers!r}"
        )
    return f"{workers[0]}:{workers[1]}"


def _run_name(fn: Callable[..., Any]) -> str:
    """``run-<function name>``: what run ids start with."""
    short = getattr(fn, "__name__", None) or type(fn).__name__  # not the <locals> path
    name = re.sub(r"[^A-Za-z0-9_.-]+", "", short.replace("<lambda>", "lambda"))[:48]
    return f"run-{name or 'fn'}"


def _values(
    handle: api.Run, result: RunResult, fn: Callable[..., Any], call: int, keep: bool
) -> Any:
    """Every task's return value; or the first failure raised, as the module docstring says."""
    if not result.ok:
        if result.failure is not None:
            _raise_task_failure(handle, result, fn, call)
        api.check(handle, result)
    return _collect(handle, call, keep)


def _collect(handle: api.Run, call: int, keep: bool) -> Any:
    """Every task's return value of the run's ``call`` (0: a one-shot run's); then the call's
    files are removed unless ``keep``."""
    strategy, tasks = api.reads().task_attempts(handle.run_dir)
    pss = strategy == contract.PSS
    names = [n for n, (role, _) in tasks.items() if not pss or role == contract.CHIEF]
    paths = {n: result_path(handle.run_dir, tasks[n][1], n, call) for n in names}
    values = {n: _value(handle, n, paths[n]) for n in names}
    if not keep:
        payload_path(handle.run_dir, call).unlink(missing_ok=True)
        for path in paths.values():
            path.unlink(missing_ok=True)
    return values[names[0]] if pss else values


def _value(handle: api.Run, task: str, path: Path) -> Any:
    """``task``'s return value from its result file; TaskError when it ended without one (it
    exited before its function returned), PicklingError when the value does not unpickle."""
    try:
        data = pickle.loads(path.read_bytes())
    except FileNotFoundError:
        data = None
    if not isinstance(data, dict) or not data.get("ok"):
        if isinstance(data, dict) and data.get("kind") == "exit":
            _raise_exit(handle, task, data["code"])
        code = api.reads().exit_code_of(handle.run_dir, task)
        _raise_exit(handle, task, code)
    try:
        return cloudpickle.loads(data["value"])
    except Exception as exc:  # noqa: BLE001 - a class this process cannot import or rebuild
        raise PicklingError(
            f"distlaunch.run: the return value of {task} does not unpickle here: "
            f"{type(exc).__name__}: {exc} (run dir {handle.run_dir})"
        ) from exc


def _raise_exit(handle: api.Run, task: str, code: int | None) -> None:
    status = f"status {code}" if code is not None else "no recorded status"
    raise TaskError(
        f"{task} exited with {status} before returning (run {handle.run_id}, run dir "
        f"{handle.run_dir})",
        task=task,
        run_dir=str(handle.run_dir),
    )


def _raise_task_failure(
    handle: api.Run, result: RunResult, fn: Callable[..., Any], call: int
) -> None:
    failure = result.failure
    assert failure is not None
    task, run_dir = failure.task, str(handle.run_dir)
    _, tasks = api.reads().task_attempts(handle.run_dir)
    path = result_path(handle.run_dir, tasks[task][1] if task in tasks else 0, task, call)
    try:
        data = pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError):
        data = None
    if not isinstance(data, dict) or data.get("ok") is not False:
        # Killed (a signal, the OOM killer, a hang) or failed outside the function.
        raise TaskError(failure.summary, task=task, run_dir=run_dir, failure=failure)
    if data["kind"] == "exit":
        _raise_exit(handle, task, data["code"])
    if data["kind"] == "result":
        raise PicklingError(
            f"distlaunch.run: {task} returned a {data['type']}, which cannot be pickled: "
            f"{data['message']}"
        )
    text = restore_files(data["traceback"], fn)
    exc = _unpickled(data.get("exception"))
    if exc is None:
        raise TaskError(
            f"{task} raised {data['type']}: {data['message']} (the exception does not unpickle "
            f"here; its traceback is in .traceback_text and in {run_dir})",
            task=task,
            run_dir=run_dir,
            failure=failure,
            type_name=data["type"],
            traceback_text=text,
        )
    exc.add_note(
        f"distlaunch.run: raised in task {task} of run {handle.run_id} (run dir {run_dir})"
    )
    raise exc from RemoteTraceback(text)


# A frame of a function that travelled by value: cloudpickle drops its file name.
_DYNAMIC_FRAME = re.compile(r'^  File "<dynamic-code>", line (\d+), in (.+)$')


def restore_files(text: str, fn: Callable[..., Any]) -> str:
    """``text`` (a task's traceback) with the frames of ``fn`` and the functions it defines
    named by their file and line again, with their source line where this process has it (a
    notebook cell's too): cloudpickle sends a function by value without its file name."""
    codes: dict[tuple[str, int], str] = {}
    pending = [getattr(fn, "__code__", None)]
    while pending:
        code = pending.pop()
        if not isinstance(code, types.CodeType):
            continue
        for _start, _end, line in code.co_lines():
            if line is not None:
                codes.setdefault((code.co_name, line), code.co_filename)
        pending += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    out: list[str] = []
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        found = _DYNAMIC_FRAME.match(line.rstrip("\n"))
        file = found and codes.get((found[2], int(found[1])))
        if not found or not file:
            out.append(line)
            continue
        out.append(f'  File "{file}", line {found[1]}, in {found[2]}\n')
        source = linecache.getline(file, int(found[1])).strip()
        has_source = i + 1 < len(lines) and lines[i + 1].startswith("    ")
        if source and not has_source:
            out.append(f"    {source}\n")
    return "".join(out)


def _unpickled(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        exc = cloudpickle.loads(data)
    except Exception:  # noqa: BLE001 - a class this process cannot import or rebuild
        return None
    return exc if isinstance(exc, BaseException) else None
