"""A changed checkpoint is refused, named, and the server falls back to the one before.

The trainer runs on builtin:tiny with a `SignedDir` root, as `jetctl server` does (its key
made 0600 by `auth.private_key` in the server's own folder). Each case changes the newest of
two checkpoints the way someone who can write the checkpoint folder (but not read the key)
would, and a fresh trainer must come back at version 1 with step 1's weights, without running
anything the file carried.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import stat
from pathlib import Path

import pytest

from jetctl import auth
from jetctl.recipe import CheckpointConfig
from jetctl.server import checkpoint as ckpt
from tests.server.trainer_support import config, make_trainer, same_weights, step, submit, weights

pytestmark = pytest.mark.unit


class _Payload:
    """Pickles to a call of os.system: what a planted optimizer.pt would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _resign_digest(step_dir: Path, file: str) -> None:
    """Update the manifest's sha256 of `file`, as a forger without the key can."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][file] = hashlib.sha256((step_dir / file).read_bytes()).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _plant_pickle(step_dir: Path, marker: Path) -> str:
    (step_dir / "optimizer.pt").write_bytes(pickle.dumps({"optimizer": _Payload(marker)}))
    _resign_digest(step_dir, "optimizer.pt")
    return "manifest.json"  # the digest now matches: the signature is what refuses it


def _flip_weights(step_dir: Path, marker: Path) -> str:
    path = step_dir / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    return "weights.safetensors"


def _bump_version(step_dir: Path, marker: Path) -> str:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["version"] = 99
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    return "manifest.json"


def _other_key(step_dir: Path, marker: Path) -> str:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["hmac"] = ckpt._mac(b"k" * 32, manifest)  # signed, but not by this server
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    return "manifest.json"


@pytest.mark.parametrize(
    "tamper", [_plant_pickle, _flip_weights, _bump_version, _other_key],
    ids=["pickle-in-optimizer", "weights-byte", "manifest-field", "foreign-signature"],
)
def test_a_changed_checkpoint_is_refused_and_the_previous_one_loads(
    tmp_path: Path, tamper: object, caplog: pytest.LogCaptureFixture
) -> None:
    key_path = tmp_path / "server-policy" / ckpt.CHECKPOINT_KEY
    root = ckpt.SignedDir(str(tmp_path / "ck"), auth.private_key(key_path))
    cfg = config(checkpoint=CheckpointConfig(every_steps=1, keep=5))
    first = make_trainer(tmp_path / "a", cfg, checkpoint_dir=root)  # type: ignore[arg-type]
    submit(first)
    step(first)
    at_step_1 = weights(first.model)
    submit(first)
    step(first)
    assert first.version == 2
    newest = tmp_path / "ck" / "step-00000002"
    marker = tmp_path / "pwned"
    named = tamper(newest, marker)  # type: ignore[operator]

    with caplog.at_level(logging.ERROR, logger="jetctl.server.checkpoint"):
        second = make_trainer(tmp_path / "b", cfg, checkpoint_dir=root)  # type: ignore[arg-type]

    assert second.version == 1, "fell back to the previous good checkpoint"
    assert same_weights(at_step_1, weights(second.model))
    assert not marker.exists(), "nothing in the checkpoint was run"
    refusal = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusal and str(newest / named) in refusal[0], refusal
    assert newest.is_dir(), "the refused checkpoint is left for a look, not deleted"
    assert ckpt.latest(root) == str(tmp_path / "ck" / "step-00000001")


def test_an_unsigned_root_still_never_unpickles(tmp_path: Path) -> None:
    """Without a key (a plain folder), a planted pickle whose digest matches is still only
    data: weights_only refuses it and the previous checkpoint loads."""
    cfg = config(checkpoint=CheckpointConfig(every_steps=1, keep=5))
    first = make_trainer(tmp_path / "a", cfg, checkpoint_dir=str(tmp_path / "ck"))
    for _ in range(2):
        submit(first)
        step(first)
    marker = tmp_path / "pwned"
    _plant_pickle(tmp_path / "ck" / "step-00000002", marker)
    second = make_trainer(tmp_path / "b", cfg, checkpoint_dir=str(tmp_path / "ck"))
    assert second.version == 1
    assert not marker.exists()


def test_the_key_is_private_and_a_planted_symlink_is_refused(tmp_path: Path) -> None:
    key_path = tmp_path / "server-policy" / ckpt.CHECKPOINT_KEY
    key = auth.private_key(key_path)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert auth.private_key(key_path) == key, "made once, then read"
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"x" * 32)
    planted = tmp_path / "other" / ckpt.CHECKPOINT_KEY
    planted.parent.mkdir()
    planted.symlink_to(decoy)
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP, never the decoy's bytes
        auth.private_key(planted)
    key_path.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        auth.private_key(key_path)
