"""Checkpoints: weights (safetensors), optimizer, trainer state; `manifest.json` written last.

`root` is a folder or an fsspec URL (`checkpoint.dir`: `file:///...`, `s3://bucket/run` with
s3fs installed, `memory://` in tests). A checkpoint directory `step-N/` counts only when its
manifest exists and every file's sha256 matches it, so a kill -9 mid-checkpoint leaves the
previous one as the latest.

* In a local folder the files are written into `step-N.partial/`, fsynced, the manifest
  last, then the directory is renamed: `step-N/` appears whole or not at all.
* Elsewhere (object stores have no atomic rename) the files are written straight into
  `step-N/`, the manifest last: the manifest is the commit marker, and a `step-N/` without
  one is a torn write, removed at the next restore.

Left out: retries of a failed remote write (the step fails loudly and the trainer's error
stops the server, which the controller restarts from the last complete checkpoint).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from jetctl.server import weights as W

MANIFEST = "manifest.json"
PARTIAL = ".partial"


@dataclass(frozen=True)
class Restored:
    version: int
    path: str  # the checkpoint's directory, as a path of its filesystem
    trainer_state: dict[str, Any]


class _Root:
    """The filesystem and path of a checkpoint root given as a folder or an fsspec URL."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.fs, path = fsspec.core.url_to_fs(os.fspath(root))
        self.path = path.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)

    def join(self, *parts: str) -> str:
        return posixpath.join(self.path, *parts)

    def steps(self) -> list[str]:
        """Names of the step-* entries under the root, oldest first (partial ones included)."""
        if not self.fs.isdir(self.path):
            return []
        names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False)]
        return sorted(n for n in names if n.startswith("step-"))

    def remove(self, name: str) -> None:
        path = self.join(name)
        if self.local:
            shutil.rmtree(path, ignore_errors=True)
        elif self.fs.exists(path):
            self.fs.rm(path, recursive=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_local(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(
    root: str | os.PathLike[str], model: Any, optimizer: torch.optim.Optimizer, version: int,
    trainer_state: dict[str, Any], keep: int, before_manifest: Callable[[], None] | None = None,
) -> str:
    """Write `step-<version>/` (manifest last); `before_manifest` is a fault hook."""
    target = _Root(root)
    payload = W.snapshot(model, version)
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, buf)
    files = {
        "weights.safetensors": payload.data,
        "optimizer.pt": buf.getvalue(),
        "trainer_state.json": json.dumps(trainer_state).encode(),
    }
    if payload.adapter_config_json:
        files["adapter_config.json"] = payload.adapter_config_json.encode()
    manifest = {
        "version": version, "kind": payload.kind, "time": time.time(),
        "files": {name: _sha256(data) for name, data in sorted(files.items())},
    }
    name = f"step-{version:08d}"
    if target.local:
        final = Path(target.join(name))
        tmp = Path(target.join(name + PARTIAL))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for file, data in files.items():
            _write_local(tmp / file, data)
        if before_manifest is not None:
            before_manifest()
        _write_local(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())  # last
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    else:
        target.remove(name)
        final_path = target.join(name)
        target.fs.makedirs(final_path, exist_ok=True)
        for file, data in files.items():
            target.fs.pipe_file(posixpath.join(final_path, file), data)
        if before_manifest is not None:
            before_manifest()
        target.fs.pipe_file(  # last: the commit marker
            posixpath.join(final_path, MANIFEST), json.dumps(manifest, indent=1).encode()
        )
    _prune(target, keep)
    return target.join(name)


def _complete(target: _Root, name: str) -> bool:
    if name.endswith(PARTIAL):
        return False
    try:
        manifest = json.loads(target.fs.cat_file(target.join(name, MANIFEST)))
        return all(
            _sha256(target.fs.cat_file(target.join(name, file))) == digest
            for file, digest in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError):  # FileNotFoundError: no manifest yet
        return False


def latest(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint under root, as a path of its filesystem."""
    target = _Root(root)
    for name in reversed(target.steps()):
        if _complete(target, name):
            return target.join(name)
    return None


def restore(
    root: str | os.PathLike[str], model: Any, optimizer: torch.optim.Optimizer
) -> Restored | None:
    target = _Root(root)
    # a crash mid-checkpoint leaves step-N.partial/ (local) or a step-N/ without a manifest
    # (remote): never complete, never loaded, removed here
    for name in target.steps():
        if name.endswith(PARTIAL) or not target.fs.exists(target.join(name, MANIFEST)):
            target.remove(name)
    found = latest(root)
    if found is None:
        return None
    fs = target.fs
    manifest = json.loads(fs.cat_file(posixpath.join(found, MANIFEST)))
    state = W.decode(
        fs.cat_file(posixpath.join(found, "weights.safetensors")),
        manifest["files"]["weights.safetensors"],
    )
    W.load_trainable_state(model, state)
    # saved on a GPU, resumed anywhere: load onto the CPU, and the optimizer moves each
    # state tensor to its parameter's device
    opt = torch.load(io.BytesIO(fs.cat_file(posixpath.join(found, "optimizer.pt"))),
                     map_location="cpu", weights_only=False)
    optimizer.load_state_dict(opt["optimizer"])
    torch.set_rng_state(opt["torch_rng"])
    trainer_state = json.loads(fs.cat_file(posixpath.join(found, "trainer_state.json")))
    return Restored(int(trainer_state["version"]), found, trainer_state)


def _prune(target: _Root, keep: int) -> None:
    done = [n for n in target.steps() if not n.endswith(PARTIAL)]
    for old in done[:-keep]:
        target.remove(old)
