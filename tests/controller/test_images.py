"""`jetctl images`: what goes into the client image and where the offline base comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jetctl.controller.runtimes.images import (
    AptSource,
    ImageBuildError,
    client_requirements,
    debian_sources,
    families,
    pick_mirror,
    release_sources,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_the_client_image_needs_no_torch_but_keeps_the_client_stack() -> None:
    names = {re.split(r"[<>=!~;\[ ]", r)[0].strip().lower() for r in client_requirements()}
    assert not names & {"torch", "peft", "accelerate", "gguf", "matplotlib", "grpcio-tools"}
    assert {"grpcio", "transformers", "tokenizers", "openai", "typer", "pydantic"} <= names
    assert "jinja2" in names, "chat templates need it; on the host only torch brings it"
    assert "docker" not in names and "pytest" not in names, "extras stay out"


def test_the_client_path_imports_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"  # importing torch now raises
        "import jetctl.cli.main, jetctl.client.node, jetctl.client.rollout\n"
        "jetctl.cli.main.build_app()\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_families_are_the_folders_with_a_dockerfile_base_first() -> None:
    fams = families(ROOT / "images")
    assert fams[0].name == "base" and fams[0].tag == "jetctl-base"
    assert {"web", "code", "api"} <= {f.name for f in fams}


def test_apt_sources_in_both_formats(tmp_path: Path) -> None:
    one_line = tmp_path / "sources.list"
    one_line.write_text(
        "# a comment\n"
        "deb [arch=amd64] http://mirror.example/debian bookworm main\n"
        "deb-src http://mirror.example/debian bookworm main\n"
    )
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\n"
        "# http://snapshot.example/archive/debian/20250520T000000Z\n"
        "URIs: http://other.example/debian\n"
        "Suites: bookworm bookworm-updates\n"
        "Components: main\n"
        "\n"
        "Types: deb\n"
        "URIs: http://other.example/debian-security\n"
        "Suites: bookworm-security\n"
    )
    found = debian_sources([one_line, deb822])
    assert found == [
        AptSource("http://mirror.example/debian", "bookworm"),
        AptSource("http://other.example/debian", "bookworm"),
        AptSource("http://other.example/debian", "bookworm-updates"),
        AptSource("http://other.example/debian-security", "bookworm-security"),
    ]
    assert pick_mirror("bookworm", found[1:]) == "http://other.example/debian"
    assert release_sources("bookworm", found[1:]).splitlines() == [
        "deb http://other.example/debian bookworm main",
        "deb http://other.example/debian bookworm-updates main",
        "deb http://other.example/debian-security bookworm-security main",
    ]
    with pytest.raises(ImageBuildError, match="no apt source serves trixie"):
        pick_mirror("trixie", found)


def test_no_mirror_host_is_written_in_the_images() -> None:
    for path in (ROOT / "images").rglob("*"):
        if path.is_file() and ".build" not in path.parts:
            text = path.read_text(errors="replace")
            assert "deb.debian.org" not in text and "snapshot.debian" not in text, path
