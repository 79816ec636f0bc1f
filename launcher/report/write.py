"""`distlaunch report`: write a run's report.html (the one file it writes in the run dir), or
give it as an HTML fragment for a notebook."""

from __future__ import annotations

import os
from pathlib import Path

from distlaunch.launcher.core.errors import UsageError
from distlaunch.launcher.record import rundir
from distlaunch.launcher.report import render
from distlaunch.launcher.report.story import read_story

REPORT = "report.html"


def write_report(run_dir: Path) -> Path:
    """Write ``run_dir``'s report.html (replacing an earlier one) and return its path;
    UsageError when the run dir holds no readable run.json or the file cannot be written."""
    html = render.page(read_story(run_dir))
    path = run_dir / REPORT
    try:
        # The run dir's own file mode (0600 in a private run's), as every launcher file has.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, rundir.file_mode(run_dir))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(html)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    return path


def inline_html(run_dir: Path) -> str:
    """The report of ``run_dir`` as one HTML fragment (a notebook cell's output); nothing is
    written."""
    return render.fragment(read_story(run_dir))
