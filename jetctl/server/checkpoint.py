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

Nothing in a checkpoint is unpickled: `optimizer.pt` is loaded with `torch.load(...,
weights_only=True)` (tensors, numbers, strings, lists and dicts only), the weights are
safetensors and the rest JSON. A root given as a `SignedDir` (the server does this, its key in
its own folder, never in a checkpoint folder nor in any path a client container mounts) also
signs each manifest: `manifest.json` carries `hmac`, HMAC-SHA256 under the key of the manifest's
other fields, file digests included. A checkpoint whose manifest is unsigned, wrongly signed,
or whose file does not match its digest is refused with a `CheckpointRefused` naming the file,
logged, left where it is (for a look), and the restore falls back to the previous good one.

Left out: retries of a failed remote write (the step fails loudly and the trainer's error
stops the server, which the controller restarts from the last complete checkpoint); key
rotation (a new key refuses every checkpoint the old one signed).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import pickle
import posixpath
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from jetctl.server import weights as W

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PARTIAL = ".partial"
HMAC_FIELD = "hmac"
CHECKPOINT_KEY = "checkpoint.key"  # in the server's own folder, server-<model>/
_REQUIRED = ("weights.safetensors", "optimizer.pt", "trainer_state.json")


class CheckpointRefused(Exception):
    """A checkpoint that fails its check: `file` (a path of its filesystem) says which."""

    def __init__(self, file: str, why: str) -> None:
        super().__init__(f"checkpoint file {file} refused: {why}")
        self.file = file
        self.why = why


@dataclass(frozen=True)
class SignedDir(os.PathLike[str]):
    """A checkpoint root (folder or fsspec URL) whose manifests are signed with `key`.

    It is a path (`os.fspath` gives the root), so whatever holds a checkpoint root holds
    this instead and `save`/`restore` sign and check; a plain path is unsigned (tests and
    benchmarks that write their own checkpoints)."""

    root: str
    key: bytes

    def __fspath__(self) -> str:
        return self.root

    def __repr__(self) -> str:  # never the key
        return f"SignedDir({self.root!r})"


@dataclass(frozen=True)
class Restored:
    version: int
    path: str  # the checkpoint's directory, as a path of its filesystem
    trainer_state: dict[str, Any]
    refused: tuple[CheckpointRefused, ...] = ()  # newer checkpoints passed over, newest first


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
    manifest: dict[str, Any] = {
        "version": version, "kind": payload.kind, "time": time.time(),
        "files": {name: _sha256(data) for name, data in sorted(files.items())},
    }
    if isinstance(root, SignedDir):
        manifest[HMAC_FIELD] = _mac(root.key, manifest)
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


def _mac(key: bytes, manifest: dict[str, Any]) -> str:
    """HMAC-SHA256 of the manifest's fields but `hmac`, in one canonical JSON form."""
    body = {k: v for k, v in manifest.items() if k != HMAC_FIELD}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def verify(target: _Root, name: str, key: bytes | None) -> dict[str, Any]:
    """The manifest of checkpoint `name` once its signature (with `key`) and every file's
    digest hold; raises CheckpointRefused naming the file that does not."""
    path = target.join(name, MANIFEST)
    try:
        manifest = json.loads(target.fs.cat_file(path))
        files = dict(manifest["files"])
    except FileNotFoundError:
        raise CheckpointRefused(path, "missing (a torn write)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointRefused(path, f"unreadable ({e})") from None
    if key is not None:
        got = manifest.get(HMAC_FIELD)
        if not isinstance(got, str):
            raise CheckpointRefused(path, "not signed (this server signs every checkpoint)")
        if not hmac.compare_digest(got, _mac(key, manifest)):
            raise CheckpointRefused(path, "its signature does not match: it was changed, "
                                    "or signed with another server's key")
    if set(files) != set(_REQUIRED) | (set(files) & {"adapter_config.json"}):
        raise CheckpointRefused(path, f"lists files {sorted(files)}, not {sorted(_REQUIRED)}")
    for file, digest in files.items():
        file_path = target.join(name, file)
        try:
            data = target.fs.cat_file(file_path)
        except OSError as e:
            raise CheckpointRefused(file_path, f"unreadable ({e})") from None
        if _sha256(data) != digest:
            raise CheckpointRefused(file_path, "its sha256 differs from the manifest's: "
                                    "it was changed after the checkpoint was written")
    return dict(manifest)


def _key(root: str | os.PathLike[str]) -> bytes | None:
    return root.key if isinstance(root, SignedDir) else None


def _candidates(root: str | os.PathLike[str]) -> list[str]:
    """Names of the checkpoints that may be complete, newest first."""
    return [n for n in reversed(_Root(root).steps()) if not n.endswith(PARTIAL)]


def versions(root: str | os.PathLike[str]) -> list[int]:
    """Versions of the checkpoints under root that have a manifest, oldest first (not
    verified: the trainer's retention of trained groups counts them after each save)."""
    target = _Root(root)
    return [_version_of(n) for n in target.steps()
            if not n.endswith(PARTIAL) and target.fs.exists(target.join(n, MANIFEST))]


def latest(root: str | os.PathLike[str]) -> str | None:
    """The newest checkpoint under root that passes `verify`, as a path of its filesystem."""
    target = _Root(root)
    for name in _candidates(root):
        try:
            verify(target, name, _key(root))
        except CheckpointRefused:
            continue
        return target.join(name)
    return None


@dataclass(frozen=True)
class _Loaded:
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    torch_rng: torch.Tensor
    trainer_state: dict[str, Any]


def _load(target: _Root, name: str, key: bytes | None) -> _Loaded:
    """Checkpoint `name` read and checked, nothing applied yet; raises CheckpointRefused."""
    manifest = verify(target, name, key)
    fs, folder = target.fs, target.join(name)
    weights = W.decode(fs.cat_file(posixpath.join(folder, "weights.safetensors")),
                       manifest["files"]["weights.safetensors"])
    opt_path = posixpath.join(folder, "optimizer.pt")
    try:
        # saved on a GPU, resumed anywhere: load onto the CPU, and the optimizer moves each
        # state tensor to its parameter's device. weights_only: tensors and plain containers
        # only, a pickled callable is refused rather than called
        opt = torch.load(io.BytesIO(fs.cat_file(opt_path)), map_location="cpu",
                         weights_only=True)
        state = json.loads(fs.cat_file(posixpath.join(folder, "trainer_state.json")))
        return _Loaded(weights, opt["optimizer"], opt["torch_rng"], state)
    except (pickle.UnpicklingError, RuntimeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointRefused(opt_path, f"does not load as plain state ({e})") from None


def restore(
    root: str | os.PathLike[str], model: Any, optimizer: torch.optim.Optimizer
) -> Restored | None:
    """Load the newest checkpoint that passes its checks into `model` and `optimizer`; the
    newer ones refused are logged (naming the file) and listed in `Restored.refused`."""
    target = _Root(root)
    # a crash mid-checkpoint leaves step-N.partial/ (local) or a step-N/ without a manifest
    # (remote): never complete, never loaded, removed here
    for name in target.steps():
        if name.endswith(PARTIAL) or not target.fs.exists(target.join(name, MANIFEST)):
            target.remove(name)
    return restore_at_most(root, model, optimizer, at_most=None)


def restore_at_most(
    root: str | os.PathLike[str], model: Any, optimizer: torch.optim.Optimizer,
    at_most: int | None,
) -> Restored | None:
    """`restore`, of the newest checkpoint of version <= `at_most` (`jetctl replay`: the
    state before a step), removing nothing (a live server may be writing a newer one)."""
    target = _Root(root)
    refused: list[CheckpointRefused] = []
    for name in _candidates(root):
        if at_most is not None and _version_of(name) > at_most:
            continue
        try:
            loaded = _load(target, name, _key(root))
        except CheckpointRefused as e:
            log.error("%s; falling back to the checkpoint before it", e)
            refused.append(e)
            continue
        W.load_trainable_state(model, loaded.weights)
        optimizer.load_state_dict(loaded.optimizer)
        torch.set_rng_state(loaded.torch_rng)
        version = int(loaded.trainer_state["version"])
        return Restored(version, target.join(name), loaded.trainer_state, tuple(refused))
    if refused:
        log.error("no checkpoint under %s passes its checks: starting from the base model",
                  target.path)
    return None


def _version_of(name: str) -> int:
    return int(name.removeprefix("step-"))


# Versions something in this process is reading from its files (an in-run eval's child loads
# one: jetctl/server/evals.py). `keep` does not count them; the first save after they are let
# go prunes them. One process serves one model, so a version names one checkpoint.
_PINNED: Counter[int] = Counter()
_PINNED_LOCK = threading.Lock()


@contextmanager
def pinned(version: int) -> Iterator[None]:
    """Keep checkpoint `version` out of pruning while the block runs."""
    with _PINNED_LOCK:
        _PINNED[version] += 1
    try:
        yield
    finally:
        with _PINNED_LOCK:
            _PINNED[version] -= 1
            if _PINNED[version] <= 0:
                del _PINNED[version]


def _prune(target: _Root, keep: int) -> None:
    done = [n for n in target.steps() if not n.endswith(PARTIAL)]
    with _PINNED_LOCK:
        held = set(_PINNED)
    for old in done[:-keep]:
        if _version_of(old) in held:
            log.info("checkpoint %s kept past checkpoint.keep while it is read (in-run eval)", old)
            continue
        target.remove(old)
