"""`LaunchOptions` is the one place that names a launch option's default: every way of starting a
run (distlaunch.run, start, submit, launch, up, the pytest plugin's marker, `distlaunch up`) takes
its defaults from it, and says nothing of its own."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import distlaunch
from distlaunch.launcher.api import call, launch
from distlaunch.launcher.cli import cli
from distlaunch.launcher.root import pytest_plugin
from distlaunch.launcher.run.options import DEFAULTS, MWMS, PSS, LaunchOptions
from distlaunch.worker import contract

pytestmark = pytest.mark.quick

FIELDS = {f.name: f.default for f in dataclasses.fields(LaunchOptions)}


def _options_of(fn) -> dict[str, object]:
    """The parameters of ``fn`` that are launch options with a default, and their defaults (a
    required one, as `launch`'s spec, has none to differ)."""
    params = inspect.signature(fn).parameters
    return {
        name: p.default
        for name, p in params.items()
        if name in FIELDS and p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("fn", [call.run, call.start, launch.launch, launch.up])
def test_each_signature_names_the_options_defaults(fn) -> None:
    found = _options_of(fn)
    assert found, f"{fn.__name__} takes no launch option"
    for name, default in found.items():
        assert default == FIELDS[name], f"{fn.__name__}({name}=...) differs from LaunchOptions"


def test_run_and_start_take_every_call_option() -> None:
    # The options a call takes are the same in both, and all of them but the spec's run choice.
    which_run = {"backend", "run_id", "resume", "overrides"}
    assert set(_options_of(call.run)) == set(FIELDS) - which_run
    assert set(_options_of(call.start)) == set(_options_of(call.run))
    assert set(_options_of(launch.launch)) == which_run


def test_submit_and_the_plugin_take_the_object_itself() -> None:
    assert inspect.signature(call.submit).parameters["options"].default == LaunchOptions()
    # The marker's options are LaunchOptions' (a marker without arguments: the defaults).
    fixture = inspect.getsource(pytest_plugin.tf_cluster)
    assert "LaunchOptions(*marker.args, **marker.kwargs)" in fixture
    assert pytest_plugin.TfCluster.__init__.__annotations__["shape"] == "LaunchOptions"
    assert DEFAULTS == LaunchOptions()


def test_the_up_command_takes_its_defaults_from_the_options() -> None:
    params = {p.name: p for p in cli.commands["up"].params}
    for name in ("run_id", "resume", "backend"):
        assert params[name].default == FIELDS[name]


def test_no_limit_and_not_set_are_none() -> None:
    assert DEFAULTS.timeout_s is None and DEFAULTS.spec is None and DEFAULTS.backend is None


def test_the_strategy_follows_the_ps_count_unless_named() -> None:
    assert (MWMS, PSS) == (contract.MWMS, contract.PSS)
    assert LaunchOptions().strategy_name == contract.MWMS
    assert LaunchOptions(ps=1, chief=1).strategy_name == contract.PSS
    assert LaunchOptions(ps=1, strategy=contract.MWMS).strategy_name == contract.MWMS


def test_backend_joins_the_overrides_before_validation() -> None:
    options = LaunchOptions(backend="compose", overrides=("tasks.worker.count=1",))
    assert options.spec_overrides == ("tasks.worker.count=1", "backend=compose")
    assert LaunchOptions(overrides=("a=1",)).spec_overrides == ("a=1",)


def test_the_options_are_exported_and_frozen() -> None:
    assert distlaunch.LaunchOptions is LaunchOptions
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULTS.workers = 3  # type: ignore[misc]
