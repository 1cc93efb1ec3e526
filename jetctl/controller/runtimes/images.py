"""Build the client images in `images/`: a base with jetctl (no torch) and one per task family.

    jetctl images build                  # FROM python:3.11-slim (needs a registry)
    jetctl images build --offline-base   # FROM a Debian made here by debootstrap + docker import
    jetctl images build web              # the base (if missing) and jetctl-web only

Steps (each shown with progress):

1. **Wheelhouse** `images/.build/wheels/`: `pip wheel` on the host, with the host's pip
   settings, of jetctl's client requirements (the project's dependencies less the
   server-only ones: torch, peft, ...; the client renders chat templates with the tokenizer
   and never imports torch) and of each family's `images/<family>/requirements.txt`, plus a
   wheel of jetctl itself (it carries envs/ and agents/). Inside `docker build` pip installs
   from these files only (`--no-index`): the build needs no package index.
2. **Offline base** (`--offline-base`): `debootstrap --variant=minbase` of the host's Debian
   release (python3 and python3-venv), from the Debian mirror in this machine's apt
   sources, imported as `jetctl-os:<codename>`. The host's Python and the image's are the
   same release's, so the host-built wheels fit.
3. `docker build` of `images/base` as `jetctl-base` (`--build-arg BASE=...`), then of every
   other `images/<family>/Dockerfile` as `jetctl-<family>` (`--build-arg BASE_IMAGE=jetctl-base`).
   Builds run on the host network: a family that installs Debian packages (web: Chromium)
   reaches the mirror the way the host does.

Left out: pushing to a registry, multi-arch builds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]  # the checkout: images/ sits beside jetctl/
IMAGES_DIR = REPO / "images"
BASE_FAMILY = "base"
IMAGE_PREFIX = "jetctl-"
DEFAULT_BASE = "python:3.11-slim"
OS_IMAGE = "jetctl-os"
# dependencies a client node never imports (training, checkpoints, plots, proto codegen)
SERVER_ONLY = frozenset({"torch", "peft", "accelerate", "gguf", "matplotlib", "grpcio-tools"})
DEBOOTSTRAP_PACKAGES = ("python3", "python3-venv", "ca-certificates")

Say = Callable[[str], None]


class ImageBuildError(Exception):
    """A build step failed; the message says which and how to fix it."""


@dataclass(frozen=True)
class Family:
    name: str
    dockerfile: Path

    @property
    def tag(self) -> str:
        return f"{IMAGE_PREFIX}{self.name}"


def families(images_dir: Path = IMAGES_DIR) -> list[Family]:
    """Every `images/<name>/Dockerfile`, the base first."""
    found = [
        Family(d.name, d / "Dockerfile")
        for d in sorted(images_dir.iterdir())
        if d.is_dir() and (d / "Dockerfile").is_file() and not d.name.startswith(".")
    ]
    found.sort(key=lambda f: f.name != BASE_FAMILY)
    if not found or found[0].name != BASE_FAMILY:
        raise ImageBuildError(f"{images_dir}/base/Dockerfile is missing")
    return found


def _req_name(requirement: str) -> str:
    m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else ""


def client_requirements() -> list[str]:
    """jetctl's own dependencies (no extras) less SERVER_ONLY, as pinned in pyproject.toml."""
    try:
        reqs = importlib.metadata.requires("jetctl") or []
    except importlib.metadata.PackageNotFoundError:
        raise ImageBuildError("jetctl is not installed: run ./scripts/setup.sh") from None
    out = []
    for r in reqs:
        spec, _, marker = r.partition(";")
        if "extra" in marker:
            continue
        if _req_name(spec) not in SERVER_ONLY:
            out.append(r.strip())
    return out


def family_requirements(family: Family) -> list[str]:
    path = family.dockerfile.parent / "requirements.txt"
    if not path.is_file():
        return []
    lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    return [ln for ln in lines if ln]


# --------------------------------------------------------------------------- wheelhouse


def build_wheelhouse(fams: list[Family], say: Say, build_dir: Path | None = None) -> Path:
    """`images/.build/wheels`: the requirements' wheels (kept while they do not change)
    and a fresh wheel of jetctl. Returns the folder."""
    build_dir = build_dir or IMAGES_DIR / ".build"
    wheels = build_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    reqs = client_requirements()
    extra = sorted({r for f in fams for r in family_requirements(f)})
    (wheels / "requirements.txt").write_text("\n".join(reqs) + "\n")
    stamp = hashlib.sha256(json.dumps([reqs, extra, sys.version]).encode()).hexdigest()
    stamp_file = wheels / ".requirements.sha256"
    if not stamp_file.is_file() or stamp_file.read_text() != stamp:
        say(f"wheelhouse: {len(reqs)} client requirements + {len(extra)} family ones (pip wheel)")
        req_file = build_dir / "all-requirements.txt"
        req_file.write_text("\n".join(reqs + extra) + "\n")
        _run(
            [sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels), "-r", str(req_file)],
            say,
            "pip wheel of the client requirements",
        )
        stamp_file.write_text(stamp)
    else:
        say("wheelhouse: requirements unchanged, wheels kept")
    for old in wheels.glob("jetctl-*.whl"):
        old.unlink()
    say("wheelhouse: a wheel of jetctl (with envs/ and agents/)")
    # the venv's setuptools builds it when it has one (no index needed for the build backend)
    has_backend = _importable("setuptools") and _importable("wheel")
    isolation = ["--no-build-isolation"] if has_backend else []
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            *isolation,
            "-w",
            str(wheels),
            str(REPO),
        ],
        say,
        "pip wheel of jetctl",
    )
    if not list(wheels.glob("jetctl-*.whl")):
        raise ImageBuildError(f"no jetctl wheel in {wheels} after pip wheel")
    return wheels


# --------------------------------------------------------------------------- offline base


@dataclass(frozen=True)
class AptSource:
    uri: str
    suite: str


def debian_sources(
    files: list[Path] | None = None,
) -> list[AptSource]:
    """(mirror URI, suite) pairs of this machine's apt sources: one-line `deb URI SUITE ...`
    lists and deb822 `.sources` files alike. Read at run time; nothing is hard-coded."""
    if files is None:
        files = [Path("/etc/apt/sources.list")]
        d = Path("/etc/apt/sources.list.d")
        if d.is_dir():
            files += sorted(d.glob("*.list")) + sorted(d.glob("*.sources"))
    out: list[AptSource] = []
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = _deb822(stanza)
                if "deb" not in fields.get("types", "").split():
                    continue
                if fields.get("enabled", "yes").lower() == "no":
                    continue
                for uri in fields.get("uris", "").split():
                    out += [AptSource(uri, s) for s in fields.get("suites", "").split()]
        else:
            for line in text.splitlines():
                parts = line.split("#", 1)[0].split()
                if len(parts) >= 3 and parts[0] == "deb":
                    rest = [p for p in parts[1:] if not p.startswith("[")]
                    if len(rest) >= 2:
                        out.append(AptSource(rest[0], rest[1]))
    return out


def _deb822(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    key = ""
    for line in stanza.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if line[0] in " \t" and key:
            fields[key] += " " + line.strip()
            continue
        k, _, v = line.partition(":")
        key = k.strip().lower()
        fields[key] = v.strip()
    return fields


def host_codename() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip().strip('"') or "bookworm"
    except OSError:
        pass
    return "bookworm"


def pick_mirror(codename: str, sources: list[AptSource]) -> str:
    """The mirror that serves `codename` itself (not -security or -updates)."""
    for src in sources:
        if src.suite == codename and src.uri.startswith(("http://", "https://", "file:/")):
            return src.uri
    raise ImageBuildError(
        f"no apt source serves {codename} (looked in /etc/apt/sources.list and "
        "sources.list.d): add one, or build without --offline-base"
    )


def release_sources(codename: str, sources: list[AptSource]) -> str:
    """sources.list lines for `codename` and its -updates / -security suites (main only)."""
    lines = [
        f"deb {s.uri} {s.suite} main"
        for s in sources
        if s.suite == codename or s.suite.startswith(f"{codename}-")
    ]
    return "\n".join(dict.fromkeys(lines)) + "\n"


def build_offline_base(client: Any, say: Say, rebuild: bool = False) -> str:
    """`jetctl-os:<codename>` from debootstrap + docker import; returns the tag."""
    import docker

    codename = host_codename()
    tag = f"{OS_IMAGE}:{codename}"
    if not rebuild:
        try:
            client.images.get(tag)
            say(f"offline base {tag} exists (pass --rebuild-base to make it again)")
            return tag
        except docker.errors.ImageNotFound:
            pass
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is not installed: apt-get install -y debootstrap")
    if os.geteuid() != 0:
        raise ImageBuildError(
            "debootstrap needs root: run `sudo jetctl images build --offline-base`"
        )
    sources = debian_sources()
    mirror = pick_mirror(codename, sources)
    with tempfile.TemporaryDirectory(prefix="jetctl-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        say(f"debootstrap {codename} (minbase + {', '.join(DEBOOTSTRAP_PACKAGES)}), ~1 minute")
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(DEBOOTSTRAP_PACKAGES)}",
                codename,
                str(rootfs),
                mirror,
            ],
            say,
            "debootstrap",
        )
        # the image's apt gets the host's sources of this release (updates and security
        # too), so a family's apt-get install gets the same fixed packages as the host
        (rootfs / "etc" / "apt" / "sources.list").write_text(release_sources(codename, sources))
        say(f"docker import as {tag}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        client.api.import_image(src=tar.stdout, repository=OS_IMAGE, tag=codename, stream_src=True)
        if tar.wait() != 0:
            raise ImageBuildError("tar of the debootstrap rootfs failed")
    return tag


# --------------------------------------------------------------------------- docker build


def docker_build(
    client: Any, family: Family, buildargs: dict[str, str], say: Say, images_dir: Path = IMAGES_DIR
) -> None:
    """`docker build -f images/<family>/Dockerfile -t jetctl-<family> images/`, streamed."""
    say(f"docker build {family.tag}")
    stream = client.api.build(
        path=str(images_dir),
        dockerfile=str(family.dockerfile.relative_to(images_dir)),
        tag=family.tag,
        buildargs=buildargs,
        rm=True,
        forcerm=True,
        network_mode="host",
        decode=True,
    )
    last: list[str] = []
    for chunk in _chunks(stream):
        if "error" in chunk:
            tail = "\n".join(last[-15:])
            raise ImageBuildError(f"docker build of {family.tag} failed: {chunk['error']}\n{tail}")
        text = str(chunk.get("stream") or chunk.get("status") or "").rstrip()
        for line in text.splitlines():
            if line.strip():
                last.append(line)
                say("  " + line[:160])


def _chunks(stream: Any) -> Iterator[dict[str, Any]]:
    for chunk in stream:
        if isinstance(chunk, dict):
            yield chunk


def build_images(
    names: list[str],
    *,
    offline_base: bool,
    base: str | None,
    rebuild_base: bool,
    say: Say,
    images_dir: Path = IMAGES_DIR,
) -> list[str]:
    """Build the base and the named families (all when `names` is empty); returns the tags."""
    from jetctl.controller.runtimes.docker import docker_client

    fams = families(images_dir)
    known = {f.name for f in fams}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ImageBuildError(
            f"no images/{unknown[0]}/Dockerfile; families: {', '.join(sorted(known))}"
        )
    wanted = [f for f in fams if not names or f.name in names or f.name == BASE_FAMILY]
    client = docker_client(timeout_s=600)
    build_wheelhouse(wanted, say, images_dir / ".build")
    if offline_base:
        base = build_offline_base(client, say, rebuild=rebuild_base)
    tags = []
    for fam in wanted:
        args = (
            {"BASE": base or DEFAULT_BASE}
            if fam.name == BASE_FAMILY
            else {"BASE_IMAGE": f"{IMAGE_PREFIX}{BASE_FAMILY}"}
        )
        docker_build(client, fam, args, say, images_dir)
        tags.append(fam.tag)
    return tags


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _run(argv: list[str], say: Say, what: str, env: dict[str, str] | None = None) -> None:
    """Run a command, streaming its output lines to `say`; ImageBuildError on failure."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    last: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            last = (last + [line])[-20:]
            say("  " + line[:160])
    if proc.wait() != 0:
        raise ImageBuildError(f"{what} failed (exit {proc.returncode}):\n" + "\n".join(last))
