"""The distlaunch image of the compose backend: built from this source checkout, reused while unchanged.

The image carries a label with a hash of everything its build reads (the Dockerfile, pyproject,
the launcher and worker sources, the base image's id, the CA bundle given to pip). `ensure_image`
rebuilds only when that hash differs from the one on the image under the tag, so the tag stays
stable and a warm machine starts a compose run without a build. When it does build, Docker's
layer cache keeps the dependency layer (TensorFlow) unless pyproject.toml changed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distlaunch.launcher.transports.compose import DEFAULT_BASE, DEFAULT_TAG
from distlaunch.launcher.transports.compose.docker import DockerError, docker

INPUTS_LABEL = "org.distlaunch.inputs"
# What docker/Dockerfile copies, relative to the source root: the image depends on these alone,
# and the build context holds nothing else (no run dirs, no .git).
CONTEXT_FILES = ("pyproject.toml", "README.md", "docker/Dockerfile")
CONTEXT_DIRS = ("launcher", "worker")
# Where the Dockerfile looks for an extra CA bundle for pip (optional).
EXTRA_CA = "docker/extra-ca.crt"
# The system CA bundle on Debian and Ubuntu, used when pip here names none (PIP_CERT).
SYSTEM_CA = Path("/etc/ssl/certs/ca-certificates.crt")


@dataclass(frozen=True)
class ImageRequest:
    """Which image a compose run uses: the tag it is kept under, and the base it is built on."""

    tag: str = DEFAULT_TAG
    base: str = DEFAULT_BASE


@dataclass(frozen=True)
class Image:
    """An image ready to run: its tag, id, and whether this call built it."""

    tag: str
    id: str
    built: bool


def source_root() -> Path:
    """The source checkout this launcher runs from; DockerError when it is not one (a plain install)."""
    root = Path(__file__).resolve().parents[3]
    missing = [name for name in CONTEXT_FILES if not (root / name).is_file()]
    if missing:
        raise DockerError(
            f"the compose backend builds its image from a source checkout of distlaunch, and {root} "
            f"has no {', '.join(missing)}: install distlaunch from a checkout (pip install -e)"
        )
    return root


def context_files(root: Path) -> dict[str, Path]:
    """The build context: relative name -> file, sorted, without bytecode caches."""
    files = {name: root / name for name in CONTEXT_FILES}
    for folder in CONTEXT_DIRS:
        for path in (root / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files[path.relative_to(root).as_posix()] = path
    return dict(sorted(files.items()))


def pip_ca_bundle() -> Path | None:
    """The CA bundle pip in the build should trust: pip's own here (PIP_CERT), else the system's.

    Behind a TLS-intercepting proxy the proxy's CA is only in the host's bundle, and a base image
    knows nothing of it; giving pip the host's bundle makes the build work wherever pip here works.
    """
    named = os.environ.get("PIP_CERT")
    for candidate in (Path(named) if named else None, SYSTEM_CA):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def inputs_hash(files: dict[str, Path], base_id: str, ca_bundle: Path | None) -> str:
    """The hash of everything a build reads: file names and contents, the base id, the CA bundle."""
    digest = hashlib.sha256()
    named = dict(files)
    if ca_bundle is not None:
        named[EXTRA_CA] = ca_bundle
    for name, path in sorted(named.items()):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(base_id.encode())
    return digest.hexdigest()


def ensure_image(
    request: ImageRequest,
    log: Path,
    ca_bundle: Path | None = None,
    announce: Callable[[str], None] | None = None,
) -> Image:
    """Return the image under ``request.tag``, building it first when its inputs changed.

    ``announce`` is told before a build starts (a cold one takes minutes); build output is
    appended to ``log``. Raises DockerError when the build fails.
    """
    root = source_root()
    files = context_files(root)
    # A base that is not here yet (the default, before its first pull) is hashed by name.
    base_id = (
        docker("image", "inspect", "--format", "{{.Id}}", request.base, check=False).strip()
        or request.base
    )
    wanted = inputs_hash(files, base_id, ca_bundle)
    label = '{{index .Config.Labels "' + INPUTS_LABEL + '"}}'
    current = docker(
        "image", "inspect", "--format", f"{{{{.Id}}}} {label}", request.tag, check=False
    ).split()
    if len(current) == 2 and current[1] == wanted:
        return Image(request.tag, current[0], built=False)
    if announce is not None:
        announce(f"image {request.tag}: building from {root} on {request.base} (output: {log})")
    with tempfile.TemporaryDirectory(prefix="distlaunch-image-") as context:
        staged = {**files, **({EXTRA_CA: ca_bundle} if ca_bundle is not None else {})}
        for name, path in staged.items():
            _stage(path, Path(context), name)
        docker(
            "build",
            # The build's RUN steps use the host's network: pip then works also with an engine
            # that sets up no NAT for its bridge (dockerd --iptables=false), and the image is the
            # same either way.
            "--network",
            "host",
            "--file",
            str(Path(context) / "docker" / "Dockerfile"),
            "--build-arg",
            f"BASE_IMAGE={request.base}",
            "--label",
            f"{INPUTS_LABEL}={wanted}",
            "--tag",
            request.tag,
            context,
            log=log,
        )
    image_id = docker("image", "inspect", "--format", "{{.Id}}", request.tag).strip()
    if current and current[0] != image_id:
        # The image this tag named before would stay behind untagged, with its own copy of the
        # dependency layer when pyproject changed. Refused (and kept) while a container uses it.
        docker("image", "rm", current[0], check=False)
    return Image(request.tag, image_id, built=True)


def _stage(source: Path, context: Path, name: str) -> None:
    """Copy one file into the build context with fixed modes (0644, folders 0755).

    Docker's build cache compares the modes of copied files: without this, a build under the
    launcher's private umask and one under the usual umask would miss each other's layers,
    TensorFlow's included.
    """
    target = context / name
    for folder in reversed(target.relative_to(context).parents[:-1]):
        (context / folder).mkdir(exist_ok=True)
        os.chmod(context / folder, 0o755)
    shutil.copyfile(source, target)
    os.chmod(target, 0o644)
