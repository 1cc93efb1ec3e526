"""Re-train a run from its record: `jetctl up RECIPE --replay-from RUN_DIR [--run-dir OUT]`.

For each model of the recipe, the optimizer steps the run recorded are taken again from the
seeded start, in order, each on the groups its step row names (`replay/group_ids`, in the
order they were trained), read from the run's store, with the row's torch threads and
deterministic algorithms (jetctl/run/replay.py's `Replayer`: the trainer's own step). No server,
no clients, no generation. The re-trained run is a run dir of its own (`OUT`): its
checkpoints every `checkpoint.every_steps` and at the end, a step log whose rows name the
groups, the loss, grad norm and weights digest re-computed, and `rerun/identical` (1.0 when
the step is bitwise the recorded one), and a run.json that names the run replayed.

    steps      1 .. the last recorded (at most train.max_steps, when the recipe sets it)
    each step  its groups from the store -> train_step -> optimizer step -> compare with
               the row's loss, grad norm and (LoRA) adapter digest

Reproducible: on the CPU in float32 with the recorded thread count, the same code and base
model, every re-trained step is bitwise the recorded one, and two re-trains of one run reach
bitwise the same weights. Not reproduced: generation (the groups are what the run's engine
made; a re-train never samples), and steps trained on a GPU (the server's trainer does not
ask for deterministic algorithms, and a GPU's kernels may sum in another order from run to
run: the record is compared and the differences reported, not promised; untested on a GPU).

Needs every step's groups: a run whose recipe set `checkpoint.keep_trained_groups: all`.
Left out: starting from one of the run's checkpoints rather than the seeded start; a run
with `lora.dropout > 0` (refused, as by `jetctl replay`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jetctl.recipe import ModelConfig, Recipe
from jetctl.run.replay import (
    Comparison,
    Replayer,
    ReplayError,
    deterministic,
    dropped_steps,
    read_records,
    spans,
    stored_groups,
)
from jetctl.rundir import RunPaths, write_json_atomic


@dataclass(frozen=True)
class Retrained:
    """One model re-trained from the record."""

    model: str
    steps: int  # the version reached
    weights_sha256: str  # the trainable weights after the last step
    checkpoint: str  # the last checkpoint written
    first_difference: Comparison | None  # the first step that differs from the record

    @property
    def identical(self) -> bool:
        return self.first_difference is None

    @property
    def verdict(self) -> str:
        if self.first_difference is None:
            return "identical to the record at every step"
        return f"differs from the record from step {self.first_difference.recorded.step} on"


def default_out(source: Path) -> Path:
    """Where a re-train goes without --run-dir: beside the run replayed."""
    return source.parent / f"{source.name}-replay"


def check_dirs(rec: Recipe, source: Path, out: Path) -> None:
    """Refuse a re-train that would write into the run it reads, or mix with another one."""
    if out.resolve() == source.resolve():
        raise ReplayError(f"the re-trained run would be written into {source}, the run it "
                          "replays: pass --run-dir for the new run")
    for name, cfg in rec.models.items():
        if cfg.checkpoint.dir is not None:
            raise ReplayError(
                f"models.{name}.checkpoint.dir is {cfg.checkpoint.dir}: a re-train writes "
                "its checkpoints in its own run dir, never where the run replayed keeps "
                "its own: remove checkpoint.dir from the recipe you re-train with")
        if RunPaths(out).steps_log(name).exists():
            raise ReplayError(f"{out} already holds a re-trained {name} "
                              f"({RunPaths(out).steps_log(name)}): pass another --run-dir")


def retrain_model(
    name: str, cfg: ModelConfig, source: Path, out: Path,
    on_step: Callable[[str, Comparison], None] | None = None,
) -> Retrained:
    """Model `name` of run dir `source` re-trained into run dir `out` (see the module)."""
    from jetctl.server import checkpoint as ckpt

    src, dst = RunPaths(source), RunPaths(out)
    records = read_records(src.steps_log(name))
    if not records or not src.store(name).is_file():
        raise ReplayError(f"{source} holds no recorded step of {name} and its store "
                          f"({src.steps_log(name)}, {src.store(name)}): pass the run dir "
                          "`jetctl up` made with this recipe")
    last = max(records)
    if cfg.train.max_steps is not None:
        last = min(last, cfg.train.max_steps)
    steps = range(1, last + 1)
    unrecorded = [s for s in steps if s not in records]
    if unrecorded:
        raise ReplayError(f"{name}: steps {spans(unrecorded)} have no record of their "
                          "groups (rows written before jetctl recorded replay/group_ids)")
    dropped = dropped_steps(src.store(name), records, steps)
    if dropped:
        raise ReplayError(
            f"{name}: the store of {source} no longer holds the groups of steps "
            f"{spans(dropped)}: the server dropped them at its checkpoints, as "
            "checkpoint.keep_trained_groups said; a run re-trains from its record only "
            "when its recipe set keep_trained_groups: all in the model's checkpoint: section")
    replayer = Replayer(cfg)
    root = str(dst.checkpoints(name))
    first_difference: Comparison | None = None
    saved, digest = "", ""
    for s in steps:
        record = records[s]
        with deterministic(record.threads):
            replayed = replayer.step(stored_groups(src.store(name), record))
        comparison, digest = Comparison(record, replayed), replayed.weights_sha256
        if first_difference is None and not comparison.identical:
            first_difference = comparison
        _log(dst.steps_log(name), comparison)
        if on_step is not None:
            on_step(name, comparison)
        if s % cfg.checkpoint.every_steps == 0 or s == last:
            saved = ckpt.save(root, replayer.model, replayer.optimizer, s,
                              {"version": s, "time": time.time(), "replay_from": str(source)},
                              keep=cfg.checkpoint.keep)
    return Retrained(name, last, digest, saved, first_difference)


def retrain(
    rec: Recipe, recipe_path: Path, source: Path, out: Path,
    on_step: Callable[[str, Comparison], None] | None = None,
) -> list[Retrained]:
    """Every model of the recipe re-trained from run dir `source` into `out`."""
    check_dirs(rec, source, out)
    paths = RunPaths(out)
    paths.make()
    write_json_atomic(paths.run_json, {
        "recipe": str(recipe_path.resolve()), "replay_from": str(source.resolve()),
        "state": "running", "started_at": time.time(),
    })
    done = [retrain_model(name, cfg, source, out, on_step) for name, cfg in rec.models.items()]
    write_json_atomic(paths.run_json, {
        "recipe": str(recipe_path.resolve()), "replay_from": str(source.resolve()),
        "state": "finished", "finished_at": time.time(),
    })
    return done


def _log(steps_log: Path, c: Comparison) -> None:
    """The re-trained step's row, beside the recorded figures it is compared with."""
    r, p = c.recorded, c.replayed
    row = {
        "step": r.step, "stepped": 1.0, "time": time.time(), "loss": p.loss,
        "grad_norm": p.grad_norm, "replay/group_ids": list(r.group_ids),
        "replay/threads": r.threads, "replay/weights_sha256": p.weights_sha256,
        "rerun/identical": float(c.identical), "rerun/recorded_loss": r.loss,
        "rerun/recorded_grad_norm": r.grad_norm,
    }
    steps_log.parent.mkdir(parents=True, exist_ok=True)
    with steps_log.open("a") as f:
        f.write(json.dumps(row) + "\n")
