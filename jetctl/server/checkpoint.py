"""Checkpoints: weights (safetensors), optimizer, trainer state; `manifest.json` written last.

A checkpoint directory counts only when its manifest exists and every file's sha256
matches it, so a kill -9 mid-checkpoint leaves the previous one as the latest. Files are
written into `step-N.partial/`, fsynced, the manifest last, then the directory is renamed.

Left out: fsspec/S3 targets (rename is not atomic there; the manifest would be the marker).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jetctl.server import weights as W

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Restored:
    version: int
    path: Path
    trainer_state: dict[str, Any]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(
    root: Path, model: Any, optimizer: torch.optim.Optimizer, version: int,
    trainer_state: dict[str, Any], keep: int, before_manifest: Callable[[], None] | None = None,
) -> Path:
    """Write `step-<version>/` (manifest last); `before_manifest` is a fault hook."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{version:08d}"
    tmp = root / f"step-{version:08d}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    payload = W.snapshot(model, version)
    _write(tmp / "weights.safetensors", payload.data)
    buf = io.BytesIO()
    torch.save(
        {"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, buf
    )
    _write(tmp / "optimizer.pt", buf.getvalue())
    _write(tmp / "trainer_state.json", json.dumps(trainer_state).encode())
    if payload.adapter_config_json:
        _write(tmp / "adapter_config.json", payload.adapter_config_json.encode())
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
    if before_manifest is not None:
        before_manifest()
    manifest = {"version": version, "kind": payload.kind, "time": time.time(), "files": files}
    _write(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())  # last
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    _prune(root, keep)
    return final


def _complete(path: Path) -> bool:
    mf = path / MANIFEST
    if not mf.is_file():
        return False
    try:
        manifest = json.loads(mf.read_text())
        return all(_sha256(path / n) == h for n, h in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under root."""
    if not root.is_dir():
        return None
    for path in sorted(root.glob("step-*"), reverse=True):
        if path.is_dir() and not path.name.endswith(".partial") and _complete(path):
            return path
    return None


def restore(root: Path, model: Any, optimizer: torch.optim.Optimizer) -> Restored | None:
    # a crash mid-checkpoint leaves step-N.partial/: never complete, never loaded
    for partial in root.glob("step-*.partial") if root.is_dir() else []:
        shutil.rmtree(partial, ignore_errors=True)
    path = latest(root)
    if path is None:
        return None
    state = W.decode(
        (path / "weights.safetensors").read_bytes(),
        json.loads((path / MANIFEST).read_text())["files"]["weights.safetensors"],
    )
    W.load_trainable_state(model, state)
    opt = torch.load(path / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(opt["optimizer"])
    torch.set_rng_state(opt["torch_rng"])
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    return Restored(int(trainer_state["version"]), path, trainer_state)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if not p.name.endswith(".partial"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
