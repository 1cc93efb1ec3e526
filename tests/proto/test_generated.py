"""The committed gRPC code in jetctl/proto/_gen/ matches what scripts/gen_proto.py makes now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    committed = ROOT / "jetctl" / "proto" / "_gen"
    fresh = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert fresh == sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    stale = [n for n in fresh if (tmp_path / n).read_text() != (committed / n).read_text()]
    assert not stale, f"{stale} are stale: run `python scripts/gen_proto.py` and commit"
