"""pyproject.toml lists every package of the source tree, and nothing else.

setuptools installs only the packages it is given: a package folder missing from
``[tool.setuptools] packages`` works in an editable checkout and is absent from a wheel.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def folder_of(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools takes ``package`` from: its nearest mapped ancestor's, plus the rest."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        mapped = package_dir.get(".".join(parts[:cut]))
        if mapped is not None:
            return REPO.joinpath(mapped, *parts[cut:])
    return REPO.joinpath(*parts)


def package_folders(package_dir: dict[str, str]) -> dict[Path, str]:
    """Every folder under a mapped folder that holds Python files, and the package it is."""
    roots = {REPO / folder: name for name, folder in package_dir.items()}
    found = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            if path.is_dir() and "__pycache__" not in path.parts and any(path.glob("*.py")):
                # the nearest mapped folder names it (launcher/root is `distlaunch`, not launcher's)
                base = max((r for r in roots if r == path or r in path.parents), key=_depth)
                found[path] = ".".join([roots[base], *path.relative_to(base).parts])
    return found


def _depth(path: Path) -> int:
    return len(path.parts)


def test_pyproject_lists_every_package_folder_and_nothing_else() -> None:
    package_dir = SETUPTOOLS["package-dir"]
    on_disk = package_folders(package_dir)
    listed = {folder_of(p, package_dir): p for p in SETUPTOOLS["packages"]}
    missing = sorted(name for path, name in on_disk.items() if path not in listed)
    extra = sorted(name for path, name in listed.items() if path not in on_disk)
    assert not missing, f"pyproject.toml's packages lack {missing}"
    assert not extra, f"pyproject.toml's packages name no package folder: {extra}"


def test_every_package_folder_has_an_init() -> None:
    # A folder of modules without __init__.py is a namespace package: setuptools skips it.
    bare = [
        str(path.relative_to(REPO))
        for path in package_folders(SETUPTOOLS["package-dir"])
        if not (path / "__init__.py").is_file()
    ]
    assert not bare, f"package folders without __init__.py: {bare}"
