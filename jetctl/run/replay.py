"""Replay one training step from the run's record, and pack a step into a portable bundle.

    jetctl replay RUN_DIR --model M --step N       # the run's own store and checkpoints
    jetctl bundle RUN_DIR --model M --step N --out step-N.tar
    jetctl replay step-N.tar                        # anywhere with the base model
    jetctl up RECIPE --replay-from RUN_DIR          # every step again (jetctl/run/rerun.py)

A step row of `metrics/<model>.steps.jsonl` records the ids of the groups trained, in the
order they were trained (`replay/group_ids`), the trainer's torch threads (`replay/threads`:
CPU sums are split per thread) and, with LoRA, the sha256 of the adapter after the step
(`replay/weights_sha256`, `weights.digest`). Replaying step N:

    the state before N   the newest checkpoint of version <= N-1, then every recorded step
                         after it up to N-1 retrained (its groups from the store, in order)
    step N               its groups from the store, in order -> `train_step` (the trainer's
                         one step) -> the optimizer's step
    compare              loss, grad norm and the adapter's digest with the row's, bit for bit

On the CPU in float32 with deterministic algorithms, with the row's thread count, the same
code and the same base model, the replay is bitwise identical; any difference (a changed
stored token, other weights) is reported. This proves that the stored data is what was
trained.

A bundle (`FORMAT`, docs/architecture.md "Replaying a step") holds step N's groups as they
were stored, the weights and optimizer state before it, the model's recipe section and the
code revision: a step replays from it without the run dir.

Which steps of a run dir replay, running or finished: those whose groups the store still
holds, and those of every step between them and the checkpoint they start from. The server
drops a trained group's tokens at a checkpoint (`forget_payloads`) as
`checkpoint.keep_trained_groups` says: by default once `checkpoint.keep` checkpoints are
newer than its step, so every step after the oldest checkpoint kept replays; `all` keeps
every group, and every step of the run replays (from the seeded start, if need be). A step
whose groups were dropped is refused with the setting that keeps them.

Left out: `lora.dropout > 0` draws from the RNG
the engine shares while sampling, so such a run does not replay. Full fine-tuning records no
weights digest (too big to hash each step): loss and grad norm are compared alone. The env's
and tools' I/O of each rollout is not in a bundle (the client's spool has it).
"""

from __future__ import annotations

import io
import json
import sqlite3
import subprocess
import tarfile
import tempfile
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jetctl.recipe import ModelConfig

FORMAT = "jetctl-step-bundle/1"
BUNDLE_JSON = "bundle.json"
GROUPS_DIR = "groups"  # groups/<i>.pb: the i-th group trained, its TrajectoryGroup protobuf


class ReplayError(Exception):
    """A step that cannot be replayed; the message says why and what to do."""


@dataclass(frozen=True)
class StepRecord:
    """What the run recorded of one optimizer step (its row in the step log)."""

    step: int  # the version after it
    group_ids: tuple[str, ...]  # in training order
    loss: float
    grad_norm: float
    threads: int
    weights_sha256: str | None  # the adapter after the step; None: full fine-tuning

    @classmethod
    def of(cls, row: dict[str, Any]) -> StepRecord:
        return cls(
            step=int(row["step"]), group_ids=tuple(row["replay/group_ids"]),
            loss=float(row["loss"]), grad_norm=float(row["grad_norm"]),
            threads=int(row["replay/threads"]), weights_sha256=row.get("replay/weights_sha256"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "loss": self.loss, "grad_norm": self.grad_norm,
                "replay/group_ids": list(self.group_ids), "replay/threads": self.threads,
                "replay/weights_sha256": self.weights_sha256}


@dataclass(frozen=True)
class Replayed:
    """What the replay computed of the step."""

    loss: float
    grad_norm: float
    weights_sha256: str


@dataclass(frozen=True)
class Comparison:
    recorded: StepRecord
    replayed: Replayed

    @property
    def differences(self) -> list[str]:
        """One line per figure that differs (bitwise); empty when identical."""
        r, p = self.recorded, self.replayed
        out = [f"{name}: recorded {a!r}, replayed {b!r}"
               for name, a, b in (("loss", r.loss, p.loss), ("grad_norm", r.grad_norm, p.grad_norm))
               if a != b]
        if r.weights_sha256 is not None and r.weights_sha256 != p.weights_sha256:
            out.append(f"weights sha256: recorded {r.weights_sha256[:16]}, "
                       f"replayed {p.weights_sha256[:16]}")
        return out

    @property
    def identical(self) -> bool:
        return not self.differences


# ----------------------------------------------------------------------------- the record


def read_records(steps_log: Path) -> dict[int, StepRecord]:
    """step -> its record, for every step row that took an optimizer step and records its
    groups (rows written before `replay/group_ids` existed are left out)."""
    records: dict[int, StepRecord] = {}
    if not steps_log.is_file():
        return records
    for line in steps_log.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if row.get("stepped") == 1.0 and "replay/group_ids" in row:
            records[int(row["step"])] = StepRecord.of(row)  # a resumed run's later row wins
    return records


def stored_groups(store_path: Path, record: StepRecord) -> list[bytes]:
    """The payloads of the step's groups, in training order, from the server's store."""
    found = _read_payloads(store_path, record.group_ids)
    missing = [gid for gid, p in found.items() if p is None]
    if missing:
        raise ReplayError(
            f"step {record.step}: the store no longer holds the tokens of {len(missing)} of "
            f"its {len(found)} groups ({missing[0]}, ...): the server dropped them at a "
            "checkpoint, as the model's checkpoint.keep_trained_groups says (default: as "
            "many checkpoints as checkpoint.keep); set keep_trained_groups: all in the "
            "model's checkpoint: section so that every step of a run replays, or bundle a "
            "step while its groups are there"
        )
    return [p for p in found.values() if p is not None]


def dropped_steps(
    store_path: Path, records: dict[int, StepRecord], steps: Sequence[int],
) -> list[int]:
    """The steps of `steps` (recorded ones) some of whose groups' tokens the store no longer
    holds (or never held): what a replay or a re-train cannot take again."""
    ids = sorted({gid for s in steps for gid in records[s].group_ids})
    kept: set[str] = set()
    db = sqlite3.connect(f"file:{store_path}?mode=ro", uri=True)
    try:
        for start in range(0, len(ids), 500):  # well under sqlite's bound on parameters
            chunk = ids[start : start + 500]
            kept.update(gid for (gid,) in db.execute(
                f"SELECT id FROM groups WHERE payload IS NOT NULL AND id IN "
                f"({','.join('?' * len(chunk))})", chunk))
    finally:
        db.close()
    return [s for s in steps if not kept.issuperset(records[s].group_ids)]


def replayable(
    store_path: Path, records: dict[int, StepRecord], checkpoints: Sequence[int],
) -> list[int]:
    """The recorded steps that replay from the run dir: from the newest checkpoint before
    each (`checkpoints`: their versions; none: the seeded start), every step from there to
    it recorded and its groups held."""
    gone = set(dropped_steps(store_path, records, sorted(records)))
    out = []
    for s in sorted(records):
        start = max((v for v in checkpoints if v <= s - 1), default=0)
        if all(t in records and t not in gone for t in range(start + 1, s + 1)):
            out.append(s)
    return out


def _read_payloads(path: Path, group_ids: Collection[str]) -> dict[str, bytes | None]:
    """group id -> its stored payload (None once dropped at a checkpoint, or never stored),
    read-only: a `TrajectoryStore` opens its file for writing and starts a writer, which a
    replay beside a live server must not. The `groups` table is jetctl/server/store.py's."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute(
            f"SELECT id, payload FROM groups WHERE id IN ({','.join('?' * len(group_ids))})",
            list(group_ids),
        ).fetchall()
    finally:
        db.close()
    found = {gid: (bytes(p) if p is not None else None) for gid, p in rows}
    return {gid: found.get(gid) for gid in group_ids}


# ----------------------------------------------------------------------------- the step


@contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Deterministic kernels and the recorded torch thread count, restored afterwards."""
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])


class Replayer:
    """The trainer's model and optimizer, outside a server, stepped on recorded groups."""

    def __init__(self, cfg: ModelConfig) -> None:
        from jetctl.server.step import load_trainable
        from jetctl.server.trainer import make_optimizer

        if cfg.finetune == "lora" and cfg.lora.dropout > 0:
            raise ReplayError(
                f"lora.dropout is {cfg.lora.dropout}: its masks come from the RNG the engine "
                "shares while sampling, so the step cannot be replayed (dropout 0 replays)")
        self.cfg = cfg
        self.model, _ = load_trainable(cfg)  # as the server loads it (attention kernel too)
        self.optimizer = make_optimizer(
            [p for p in self.model.parameters() if p.requires_grad], cfg)
        self.version = 0

    def step(self, payloads: Sequence[bytes]) -> Replayed:
        """One optimizer step on the groups, as the trainer's `_train` takes it."""
        from jetctl.proto.convert import group_from_bytes
        from jetctl.server import algorithms
        from jetctl.server import weights as W
        from jetctl.server.step import train_step

        groups = [group_from_bytes(p).trajectories for p in payloads]
        result = train_step(self.model, groups, self.cfg.train, algorithms.make(self.cfg.train),
                            max_grad_norm=self.cfg.optimizer.max_grad_norm)
        if not result.trained:
            raise ReplayError("the groups carry no signal: the replayed step trains nothing")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return Replayed(result.scalars["loss"], result.scalars["grad_norm"], W.digest(self.model))

    def restore(self, checkpoint_root: Any, at_most: int) -> int:
        """The newest checkpoint of version <= at_most, if any; returns the version."""
        from jetctl.server import checkpoint as ckpt

        restored = ckpt.restore_at_most(checkpoint_root, self.model, self.optimizer, at_most)
        self.version = 0 if restored is None else restored.version
        return self.version

    def load(self, weights: bytes, optimizer: bytes, version: int) -> None:
        """The state a bundle carries (safetensors weights, torch-saved optimizer state)."""
        from safetensors.torch import load as st_load

        from jetctl.server import weights as W

        W.load_trainable_state(self.model, st_load(weights))
        state = torch.load(io.BytesIO(optimizer), map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state)
        self.version = version

    def state(self) -> tuple[bytes, bytes]:
        """(weights, optimizer state) as a bundle keeps them."""
        from jetctl.server import weights as W

        buf = io.BytesIO()
        torch.save(self.optimizer.state_dict(), buf)
        return W.snapshot(self.model, self.version).data, buf.getvalue()


def rebuild_before(
    cfg: ModelConfig, store_path: Path, records: dict[int, StepRecord], checkpoint_root: Any,
    step: int,
) -> Replayer:
    """The trainer's state just before `step`: the newest checkpoint of version <= step-1,
    then the recorded steps after it retrained in order."""
    if step not in records:
        known = sorted(records)
        raise ReplayError(f"no recorded step {step} (recorded steps: "
                          f"{spans(known) if known else 'none'})")
    _check_groups_held(store_path, records, checkpoint_root, step)
    replayer = Replayer(cfg)
    start = replayer.restore(checkpoint_root, at_most=step - 1)
    for s in range(start + 1, step):
        if s not in records:
            raise ReplayError(f"step {s} (between the checkpoint of step {start} and step "
                              f"{step}) has no record to retrain")
        with deterministic(records[s].threads):
            replayer.step(stored_groups(store_path, records[s]))
    return replayer


def _check_groups_held(
    store_path: Path, records: dict[int, StepRecord], checkpoint_root: Any, step: int,
) -> None:
    """Refuse, before loading anything, a step whose replay needs groups the store dropped:
    naming them, the steps that do replay, and the setting that keeps them."""
    from jetctl.server import checkpoint as ckpt

    versions = ckpt.versions(checkpoint_root)
    start = max((v for v in versions if v <= step - 1), default=0)
    needed = list(range(start + 1, step + 1))
    gone = dropped_steps(store_path, records, [s for s in needed if s in records])
    if not gone:
        return
    origin = f"the checkpoint of step {start}" if start else "the seeded start"
    ok = replayable(store_path, records, versions)
    raise ReplayError(
        f"step {step} replays from {origin}, through steps {spans(needed)}, and the store "
        f"no longer holds the groups of steps {spans(gone)}: the server "
        "dropped their tokens at a checkpoint, as the model's checkpoint.keep_trained_groups "
        "says (default: as many checkpoints as checkpoint.keep). Steps that replay from this "
        f"run dir: {spans(ok) if ok else 'none'}. Set keep_trained_groups: all in the "
        "model's checkpoint: section so that every step of a run replays, or bundle a step "
        "while its groups are there")


def replay_run_step(
    cfg: ModelConfig, store_path: Path, steps_log: Path, checkpoint_root: Any, step: int,
) -> Comparison:
    """Step `step` of a run recomputed from its store and checkpoints, against its record."""
    records = read_records(steps_log)
    replayer = rebuild_before(cfg, store_path, records, checkpoint_root, step)
    record = records[step]
    with deterministic(record.threads):
        replayed = replayer.step(stored_groups(store_path, record))
    return Comparison(record, replayed)


def spans(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: list[str] = []
    for s in steps:
        if out and out[-1].split("-")[-1] == str(s - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


# ----------------------------------------------------------------------------- bundles


def code_revision() -> str:
    """The git commit of the jetctl checkout ('+dirty' with local changes), else its version."""
    from jetctl import __version__

    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"jetctl {__version__}"
    return rev + ("+dirty" if dirty else "")


def write_bundle(
    cfg: ModelConfig, model_name: str, store_path: Path, steps_log: Path, checkpoint_root: Any,
    step: int, out: Path,
) -> Path:
    """Step `step` of a run as a bundle tar (`FORMAT`) at `out`."""
    from jetctl.proto.convert import group_from_bytes

    records = read_records(steps_log)
    replayer = rebuild_before(cfg, store_path, records, checkpoint_root, step)
    record = records[step]
    payloads = stored_groups(store_path, record)
    weights, optimizer = replayer.state()
    meta = {
        "format": FORMAT,
        "model": model_name,
        "step": step,
        "code_revision": code_revision(),
        "torch": torch.__version__,
        "record": record.to_json(),
        "model_config": cfg.model_dump(mode="json", exclude_unset=True),  # as written
        "groups": [_group_summary(group_from_bytes(p), cfg) for p in payloads],
    }
    files = {
        BUNDLE_JSON: json.dumps(meta, indent=1).encode(),
        "weights.safetensors": weights,
        "optimizer.pt": optimizer,
        **{f"{GROUPS_DIR}/{i:04d}.pb": p for i, p in enumerate(payloads)},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def _group_summary(group: Any, cfg: ModelConfig) -> dict[str, Any]:
    """A group's facts for people reading bundle.json (the .pb file is what is replayed)."""
    from jetctl.server import algorithms

    rewards = [t.reward for t in group.trajectories]
    return {
        "id": group.id,
        "task": group.task,
        "rewards": rewards,
        "advantages": algorithms.make(cfg.train).advantages(rewards),
        "trajectories": [
            {"id": t.id, "client_revision": t.client_revision,
             "calls": [{"model_version": c.model_version, "prompt_tokens": len(c.prompt_ids),
                        "completion_tokens": len(c.completion_ids)} for c in t.calls]}
            for t in group.trajectories
        ],
    }


def replay_bundle(path: Path) -> Comparison:
    """The bundled step recomputed from the bundle alone (and the base model)."""
    with tempfile.TemporaryDirectory(prefix="jetctl-bundle-") as tmp:
        root = Path(tmp)
        try:
            with tarfile.open(path) as tar:
                tar.extractall(root, filter="data")
            meta = json.loads((root / BUNDLE_JSON).read_text())
        except (OSError, tarfile.TarError, ValueError) as e:
            raise ReplayError(f"{path} is not a readable step bundle ({e})") from None
        if meta.get("format") != FORMAT:
            raise ReplayError(f"{path} is a bundle of format {meta.get('format')!r}; this "
                              f"jetctl reads {FORMAT!r}")
        cfg = ModelConfig.model_validate(meta["model_config"])
        record = StepRecord.of(meta["record"])
        replayer = Replayer(cfg)
        replayer.load((root / "weights.safetensors").read_bytes(),
                      (root / "optimizer.pt").read_bytes(), version=record.step - 1)
        payloads = [p.read_bytes() for p in sorted((root / GROUPS_DIR).glob("*.pb"))]
    with deterministic(record.threads):
        replayed = replayer.step(payloads)
    return Comparison(record, replayed)
