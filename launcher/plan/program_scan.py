"""What the program is, read from its source: which Keras it uses and whether it serves by itself.

Decides two things for a plan, before anything starts, from the entry script's source (or the
module's, located the way ``python -m`` would find it, without importing it or its packages):

- ``"keras": "auto"``: code written against ``tf.keras`` / ``tensorflow.keras`` is Keras 2 code
  (written for tf_keras's ``model.fit``, which runs under both strategies). Such a program, when
  it does not import Keras 3 itself, runs with ``tf_keras`` (``TF_USE_LEGACY_KERAS=1``);
  everything else keeps Keras 3, under MultiWorkerMirroredStrategy with distlaunch's Keras 3
  layer (distlaunch.worker.keras3: Keras 3's own ``model.fit`` does not support it,
  keras-team/keras#20585). Refused before anything starts, in one line: Keras 3 on another
  backend than TensorFlow (``KERAS_BACKEND``), and Keras 3's ``model.fit`` under
  ParameterServerStrategy (keras-team/keras#18624).
- Under ParameterServerStrategy the ps and worker tasks only run a TensorFlow server. A program
  that never starts one itself (the tutorials' chief-side code) would build a second coordinator
  on those tasks, so they run ``python -m distlaunch.worker.serve`` instead and only the chief
  runs the program. Programs that import ``distlaunch.worker`` or create a
  ``tf.distribute.Server`` do the split themselves and run on every task.

It also finds what the program writes to its environment before its first TensorFlow import
(launcher/plan/program_env.py): what a warm standby repeats for its own imports, or why the program
restarts cold.

The source is parsed with ``ast``: comments, strings and names that merely contain "keras" never
count. Nothing here runs the program or touches a process; a source that cannot be found or
parsed leaves the spec's meaning as it was before auto existed (Keras 3, program on every task).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from importlib.util import find_spec
from pathlib import Path

from distlaunch.launcher.core.errors import SpecError
from distlaunch.launcher.plan import program_env
from distlaunch.launcher.plan.program_env import StandbyEnv
from distlaunch.launcher.spec.model import LoadedSpec
from distlaunch.worker import contract

AUTO = "auto"
# The module ps and worker tasks run when the program does not serve by itself.
SERVE_MODULE = "distlaunch.worker.serve"
_TF_MODULES = program_env.TF_MODULES
# What saves a checkpoint when a task gets a stop notice, besides distlaunch.worker's dw.fit.
_NOTICE_HANDLERS = ("PreemptionCheckpointHandler", "BackupAndRestore")
UPSTREAM = {
    contract.MWMS: ("MultiWorkerMirroredStrategy", "keras-team/keras#20585"),
    contract.PSS: ("ParameterServerStrategy", "keras-team/keras#18624"),
}


@dataclass(frozen=True)
class Facts:
    """What a program's source shows; lines are 1-based, None when absent."""

    tf_keras_line: int | None = None  # first use of tf.keras / tensorflow.keras
    keras3_line: int | None = None  # first `import keras` / `from keras ... import`
    imports_distlaunch: bool = (
        False  # imports distlaunch.worker (dw.strategy() serves on ps/worker)
    )
    server_line: int | None = None  # creates a tf.distribute.Server itself
    # imports TensorFlow, a Keras or distlaunch.worker: what a warm standby imports in advance
    imports_tensorflow: bool = False
    standby_env: StandbyEnv = StandbyEnv()  # what it writes to the env before that import
    # names a way to save on a stop notice: TensorFlow's PreemptionCheckpointHandler or a Keras
    # BackupAndRestore (or imports distlaunch.worker, whose dw.fit saves on one)
    handler_line: int | None = None
    # first `X.fit(...)` call whose X is not distlaunch.worker (a Keras model's fit)
    fit_line: int | None = None
    # first use of a Keras TensorBoard callback (needs the tensorboard package)
    tensorboard_line: int | None = None


@dataclass(frozen=True)
class ProgramChoice:
    """How the tasks run the program, and why, as `plan` shows it and `up` announces it."""

    keras: str  # contract.KERAS3 or contract.TF_KERAS
    keras_reason: str
    keras_auto: bool = False  # auto picked tf_keras: `up` says so at start
    serve_ps_workers: bool = False  # PSS ps/worker tasks run SERVE_MODULE, not the program
    serve_reason: str = ""
    # False only when the source shows no TensorFlow import: a warm standby would then spend an
    # import (and its memory) the program never makes
    uses_tensorflow: bool = True
    # the env the program writes before that import: a standby repeats it for its own imports, or
    # (standby_env.cold says why) cannot, and the program restarts cold
    standby_env: StandbyEnv = StandbyEnv()
    # Whether the program can save on a stop notice (launcher/run/supervisor.py waits for the save
    # only then); True when the source is unknown
    saves_on_notice: bool = True
    # Keras 3 under MWMS: the bootstrap puts distlaunch.worker.keras3 in before the program runs
    keras_layer: bool = False
    # one line each that `up` says before the tasks start (e.g. TensorBoard without tensorboard)
    notes: tuple[str, ...] = ()

    @property
    def warm_restarts(self) -> bool:
        """Whether a warm standby can stand in for the program
        (launcher/transports/local/standby.py)."""
        return self.uses_tensorflow and not self.standby_env.cold

    def start_note(self, strategy: str) -> str | None:
        """What `up` prints before the tasks start: that auto switched the program to tf_keras,
        and the `notes`, one line each; None when there is nothing to say."""
        lines = list(self.notes)
        if self.keras_auto:
            lines.insert(
                0,
                f"program uses tf.keras: running with tf_keras, because {_why_tf_keras(strategy)}; "
                'set "keras": "keras3" to override',
            )
        return "\n".join(lines) or None

    def to_json(self) -> dict:
        """JSON-ready data for the plan."""
        return {
            "keras": self.keras,
            "keras_reason": self.keras_reason,
            "serve_ps_workers": self.serve_ps_workers,
            "serve_reason": self.serve_reason,
            "uses_tensorflow": self.uses_tensorflow,
            # names only: a value written in the source may be a secret
            "standby_env": sorted({w.name for w in self.standby_env.writes}),
            "standby_cold": self.standby_env.cold,
            "saves_on_notice": self.saves_on_notice,
            "keras_layer": self.keras_layer,
            "notes": list(self.notes),
        }


def choose(loaded: LoadedSpec) -> ProgramChoice:
    """Decide the Keras flavour and the PSS role split of ``loaded``'s program (reads its
    source)."""
    program = loaded.spec.program
    source, where = program_source(loaded)
    facts = None
    if source is not None:
        try:
            facts = scan(source, where, _program_dir(loaded))
        except (SyntaxError, ValueError) as exc:
            where = f"{where} does not parse ({exc.__class__.__name__})"
    strategy = loaded.spec.strategy
    keras, reason, auto = _keras(program.keras, facts, where, strategy)
    layer = keras == contract.KERAS3 and strategy == contract.MWMS
    if keras == contract.KERAS3:
        _refuse_keras3(loaded, facts, where)
        if layer and (facts is None or facts.keras3_line or facts.tf_keras_line):
            reason += "; under MultiWorkerMirroredStrategy with distlaunch's Keras 3 layer"
            reason += _untested_keras()
    notes = _tensorboard_note(loaded, facts, where, keras)
    serve, serve_reason = _serving(facts, where, loaded.spec.strategy)
    uses_tf = facts is None or facts.imports_tensorflow
    env = (
        facts.standby_env
        if facts is not None
        else StandbyEnv(
            cold=f"what the program sets before importing TensorFlow is unknown ({where})"
        )
    )
    saves = facts is None or facts.imports_distlaunch or facts.handler_line is not None
    return ProgramChoice(
        keras, reason, auto, serve, serve_reason, uses_tf, env, saves, layer, notes
    )


def _refuse_keras3(loaded: LoadedSpec, facts: Facts | None, where: str) -> None:
    """SpecError (one line) for a Keras 3 program distlaunch cannot run: another backend than
    TensorFlow, or Keras 3's model.fit under ParameterServerStrategy."""
    program = loaded.spec.program
    backend, at = program.env.get("KERAS_BACKEND"), "program.env.KERAS_BACKEND"
    if facts is not None:
        for write in facts.standby_env.writes:
            if write.name == "KERAS_BACKEND" and write.op in (
                program_env.SET,
                program_env.SETDEFAULT,
            ):
                backend, at = write.value, f"{where}:{write.line}"
    if backend and backend.lower() != "tensorflow":
        raise SpecError(
            loaded.shown,
            at,
            f"Keras 3 on the {backend} backend (KERAS_BACKEND={backend}): distlaunch runs "
            "TensorFlow clusters; use the tensorflow backend (unset KERAS_BACKEND) or "
            '"keras": "tf_keras"',
        )
    # A program that imports distlaunch.worker picks its loop by the Keras it runs on (the
    # examples call model.fit on tf_keras only, dw.fit otherwise): its own choice.
    if (
        loaded.spec.strategy == contract.PSS
        and facts is not None
        and facts.fit_line
        and not facts.imports_distlaunch
    ):
        raise SpecError(
            loaded.shown,
            "program.keras",
            f"{where}:{facts.fit_line} calls Keras 3 model.fit, which ParameterServerStrategy "
            'does not support (keras-team/keras#18624): set "keras": "tf_keras" (tf.keras '
            "model.fit runs under it) or train with dw.fit",
        )


def _untested_keras() -> str:
    """``"; Keras X is untested ..."`` where this Python's Keras is not one the layer's tests ran
    on, else ``""`` (read from the installed metadata; nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from distlaunch.worker.keras3.guards import TESTED

    try:
        have = version("keras")
    except PackageNotFoundError:
        return ""
    if have in TESTED:
        return ""
    return f" (Keras {have} is untested: the layer was tested on {', '.join(TESTED)})"


def _tensorboard_note(
    loaded: LoadedSpec, facts: Facts | None, where: str, keras: str
) -> tuple[str, ...]:
    """The line `up` says when the program uses Keras's TensorBoard callback and the tensorboard
    package is missing (TensorFlow 2.21 no longer installs it), checked for this Python when the
    tasks run it."""
    if facts is None or facts.tensorboard_line is None or loaded.spec.program.python:
        return ()
    if find_spec("tensorboard") is not None:
        return ()
    return (
        f"{where}:{facts.tensorboard_line} uses Keras's TensorBoard callback and the "
        "tensorboard package is not installed: it fails at the end of the first epoch; "
        "pip install tensorboard",
    )


def standby_env(rest: Sequence[str], cwd: str) -> StandbyEnv:
    """What a standby for a task running ``SCRIPT ARGS...`` or ``-m MODULE ARGS...`` (``rest``)
    from ``cwd`` must write to its env before its imports, read from the program's source now."""
    path = module_file(rest[1], Path(cwd)) if rest[0] == "-m" else Path(cwd, rest[0])
    if path is None:
        return StandbyEnv(cold=f"module {rest[1]} is not found by this Python")
    # Where `python -m` or `python SCRIPT` puts sys.path[0].
    folder = Path(cwd) if rest[0] == "-m" else path.resolve().parent
    try:
        source = path.read_text(encoding="utf-8")
        return scan(source, str(path), folder).standby_env
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as exc:
        return StandbyEnv(cold=f"{path} cannot be read ({exc.__class__.__name__})")


def program_source(loaded: LoadedSpec) -> tuple[str | None, str]:
    """Return the program's source and its file name, or None and why it could not be read."""
    program = loaded.spec.program
    if loaded.script is not None:
        path: Path | None = loaded.script
    else:
        path = module_file(program.module or "", loaded.workdir)
        if path is None:
            return None, f"module {program.module} is not found by this Python"
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path} cannot be read ({exc.__class__.__name__})"


def _program_dir(loaded: LoadedSpec) -> Path:
    """The program's sys.path[0]: the script's folder, or the workdir for a module."""
    return loaded.script.resolve().parent if loaded.script is not None else loaded.workdir


def _own_module(name: str, folder: Path | None) -> tuple[str, str] | None:
    """The source and file of module ``name`` where it is the program's own (in ``folder``)."""
    if folder is None:
        return None
    path = module_file(name, folder)
    if path is None or not path.resolve().is_relative_to(folder.resolve()):
        return None
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError):
        return None


def module_file(name: str, workdir: Path) -> Path | None:
    """The file ``python -m name`` would run from ``workdir``, found without importing anything.

    ``importlib.util.find_spec`` imports a dotted name's parent packages (running their
    ``__init__``, maybe TensorFlow); this asks the import system's finders level by level instead,
    with ``workdir`` first on the path as ``python -m`` puts it.
    """
    parts = name.split(".")
    search: list[str] | None = [str(workdir), *sys.path]
    spec = None
    for depth in range(len(parts)):
        if search is None:  # a plain module cannot have submodules
            return None
        spec = _find(".".join(parts[: depth + 1]), search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or []) or None
    if spec is not None and spec.submodule_search_locations is not None:
        spec = _find(f"{name}.__main__", list(spec.submodule_search_locations))
    if spec is None or not spec.has_location or not spec.origin:
        return None
    return Path(spec.origin)


def _find(fullname: str, path: list[str]) -> ModuleSpec | None:
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, path, None)
        except (
            ImportError,
            ValueError,
            OSError,
        ):  # this finder cannot say: ask the next one
            spec = None
        if spec is not None:
            return spec
    return None


# Keras 2 by import: TensorFlow's own keras, and tf_keras, which a script may import itself.
_KERAS2_MODULES = ("tensorflow.keras", "tf_keras")


def scan(source: str, filename: str = "<program>", folder: Path | None = None) -> Facts:
    """Return what ``source`` shows about Keras, serving and its env writes before TensorFlow
    (SyntaxError if it does not parse); ``folder``: the program's sys.path[0], where its own
    modules are."""
    tree = ast.parse(source, filename)
    tf_names = {"tensorflow"}  # names bound to the tensorflow module: `import tensorflow as tf`
    tf_keras: list[int] = []
    keras3: list[int] = []
    server: list[int] = []
    handler: list[int] = []
    fits: list[int] = []
    tensorboard: list[int] = []
    distlaunch_names: set[str] = set()  # names bound to distlaunch.worker (`dw`): dw.fit is ours
    imports_distlaunch = False
    imports_tensorflow = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tensorflow" and alias.asname:
                    tf_names.add(alias.asname)
                if program_env.is_module(alias.name, "keras"):
                    keras3.append(node.lineno)
                if any(program_env.is_module(alias.name, m) for m in _KERAS2_MODULES):
                    tf_keras.append(node.lineno)
                imports_distlaunch |= program_env.is_module(alias.name, "distlaunch")
                if program_env.is_module(alias.name, "distlaunch"):
                    distlaunch_names.add(alias.asname or alias.name.split(".")[0])
                imports_tensorflow |= any(program_env.is_module(alias.name, m) for m in _TF_MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = {alias.name for alias in node.names}
            if program_env.is_module(node.module, "keras"):
                keras3.append(node.lineno)
            if any(program_env.is_module(node.module, m) for m in _KERAS2_MODULES) or (
                node.module == "tensorflow" and "keras" in names
            ):
                tf_keras.append(node.lineno)
            imports_distlaunch |= program_env.is_module(node.module, "distlaunch")
            if program_env.is_module(node.module, "distlaunch"):
                distlaunch_names |= {alias.asname or alias.name for alias in node.names}
            imports_tensorflow |= any(program_env.is_module(node.module, m) for m in _TF_MODULES)
            if names & set(_NOTICE_HANDLERS):
                handler.append(node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if (
                node.attr == "keras"
                and isinstance(node.value, ast.Name)
                and node.value.id in tf_names
            ):
                tf_keras.append(node.lineno)
            if node.attr == "Server":
                server.append(node.lineno)
            if node.attr in _NOTICE_HANDLERS:
                handler.append(node.lineno)
            if node.attr == "TensorBoard":
                tensorboard.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "Server":
            server.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "TensorBoard":
            tensorboard.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in _NOTICE_HANDLERS:
            handler.append(node.lineno)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "fit"
            and not (
                isinstance(node.func.value, ast.Name) and node.func.value.id in distlaunch_names
            )
        ):
            fits.append(node.lineno)
    return Facts(
        tf_keras_line=min(tf_keras, default=None),
        keras3_line=min(keras3, default=None),
        imports_distlaunch=imports_distlaunch,
        server_line=min(server, default=None),
        imports_tensorflow=imports_tensorflow,
        handler_line=min(handler, default=None),
        fit_line=min(fits, default=None),
        tensorboard_line=min(tensorboard, default=None),
        standby_env=program_env.before_tensorflow(
            tree, filename, lambda name: _own_module(name, folder)
        ),
    )


def _why_tf_keras(strategy: str) -> str:
    what, _ = UPSTREAM.get(strategy, UPSTREAM[contract.MWMS])
    return f"tf.keras code is Keras 2 code, written for tf_keras's model.fit under {what}"


def _keras(setting: str, facts: Facts | None, where: str, strategy: str) -> tuple[str, str, bool]:
    """(flavour, reason, whether auto picked tf_keras)."""
    if setting != AUTO:
        return setting, 'set by "keras" in the spec', False
    if facts is None:
        return contract.KERAS3, f"auto: Keras 3, TensorFlow's default ({where})", False
    if facts.keras3_line is not None:
        return (
            contract.KERAS3,
            f"auto: {where}:{facts.keras3_line} imports Keras 3 directly",
            False,
        )
    if facts.tf_keras_line is not None:
        reason = (
            f"auto: {where}:{facts.tf_keras_line} uses tf.keras or tf_keras (Keras 2) and "
            f"nothing imports keras; {_why_tf_keras(strategy)}"
        )
        return contract.TF_KERAS, reason, True
    return contract.KERAS3, f"auto: {where} does not use tf.keras", False


def _serving(facts: Facts | None, where: str, strategy: str) -> tuple[bool, str]:
    """(whether PSS ps/worker tasks run SERVE_MODULE, why)."""
    if strategy != contract.PSS:
        return False, ""
    if facts is None:
        return False, f"every task runs the program ({where})"
    if facts.imports_distlaunch:
        return (
            False,
            (
                "every task runs the program: it imports distlaunch.worker, whose strategy() "
                "serves on ps and worker tasks"
            ),
        )
    if facts.server_line is not None:
        return (
            False,
            f"every task runs the program: it starts its own server ({where}:{facts.server_line})",
        )
    return True, (
        f"ps and worker tasks run `python -m {SERVE_MODULE}` (a TensorFlow server) and the "
        "chief runs "
        f"the program: {where} never creates a tf.distribute.Server"
    )
