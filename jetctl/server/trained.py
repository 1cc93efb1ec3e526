"""The model a run trained, at a checkpoint: what `jetctl eval` and `jetctl export` load.

    source = open_source(Path("runs/word-problems"))     # a run dir or a recipe file
    ckpt = find_checkpoint(source, "policy", "latest")   # "base" | "latest" | "step-N" | N
    model, tokenizer = load_at(source.recipe.models["policy"], ckpt)

A run dir is read through its `run.json` (the recipe it ran); a recipe file through its
`run.dir` (default `runs/<run.name>`). Checkpoints are the server's own (`step-N/` with a
manifest, jetctl/server/checkpoint.py); only complete ones count, and the weights' sha256 is
checked against the manifest when they are loaded. `base` is the model before training (the
recipe's model, with a fresh LoRA adapter: its B matrices are zero, so it is the base model).

Left out: checkpoints of models that are not in the recipe any more.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetctl.recipe import ModelConfig, Recipe

STEP_RE = re.compile(r"^(?:step-)?(\d+)$")


class TrainedError(Exception):
    """A run, model or checkpoint that cannot be found; the message says what to do."""


@dataclass(frozen=True)
class RunSource:
    recipe: Recipe
    recipe_path: Path
    run_dir: Path | None  # None: a recipe whose run dir does not exist (base only)

    def model_name(self, model: str | None) -> str:
        """`model`, or the recipe's only model; a clear error otherwise."""
        names = list(self.recipe.models)
        if model is None:
            if len(names) != 1:
                raise TrainedError(f"the recipe has models {names}: pass --model")
            return names[0]
        if model not in self.recipe.models:
            raise TrainedError(f"no model {model!r} in the recipe (models: {', '.join(names)})")
        return model

    def checkpoint_root(self, model: str) -> str:
        cfg = self.recipe.models[model]
        if cfg.checkpoint.dir:
            return cfg.checkpoint.dir
        if self.run_dir is None:
            raise TrainedError(
                f"{self.recipe.run_dir} does not exist: run `jetctl up {self.recipe_path}` first "
                "(or use --checkpoint base)"
            )
        from jetctl.rundir import RunPaths

        return str(RunPaths(self.run_dir).checkpoints(model))


@dataclass(frozen=True)
class Checkpoint:
    label: str  # base | latest | step-N, as asked
    step: int  # 0 for base
    path: str | None  # the step-N directory; None for base


def open_source(target: Path) -> RunSource:
    """A recipe file, or a run dir (its run.json names the recipe)."""
    from jetctl.recipe import RecipeError, load_recipe
    from jetctl.rundir import RunPaths, read_json

    if target.is_dir():
        recorded = str((read_json(RunPaths(target).run_json) or {}).get("recipe") or "")
        if not recorded:
            raise TrainedError(f"{target} has no run.json naming its recipe: pass a run dir "
                               "that `jetctl up` made, or the recipe")
        recipe_path, run_dir = Path(recorded), target.resolve()
    elif target.is_file():
        recipe_path, run_dir = target, None
    else:
        raise TrainedError(f"{target} is neither a recipe file nor a run dir")
    try:
        recipe = load_recipe(recipe_path)
    except (RecipeError, OSError) as exc:
        raise TrainedError(f"cannot load the recipe {recipe_path}: {exc}") from exc
    if run_dir is None and Path(recipe.run_dir).is_dir():
        run_dir = Path(recipe.run_dir).resolve()
    return RunSource(recipe, recipe_path, run_dir)


def find_checkpoint(source: RunSource, model: str, which: str) -> Checkpoint:
    """`base`, `latest`, or `step-N` / `N` among the model's complete checkpoints."""
    from jetctl.server import checkpoint

    if which == "base":
        return Checkpoint("base", 0, None)
    root = source.checkpoint_root(model)
    if which == "latest":
        found = checkpoint.latest(root)
        if found is None:
            raise TrainedError(f"no complete checkpoint under {root}: has the run taken "
                               f"checkpoint.every_steps steps yet?")
        return Checkpoint("latest", _step_of(found), found)
    match = STEP_RE.match(which)
    if match is None:
        raise TrainedError(f"--checkpoint {which!r}: use base, latest or step-N")
    step = int(match.group(1))
    path = posixpath.join(root, f"step-{step:08d}")
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(posixpath.join(fs_path, "manifest.json")):
        have = [f"step-{_step_of(p)}" for p in (fs.ls(posixpath.dirname(fs_path), detail=False)
                                                 if fs.isdir(posixpath.dirname(fs_path)) else [])
                if posixpath.basename(p.rstrip("/")).startswith("step-") and not p.endswith(".partial")]
        raise TrainedError(f"no complete checkpoint step-{step} under {root} (have: "
                           f"{', '.join(have) or 'none'})")
    return Checkpoint(f"step-{step}", step, path)


def _step_of(path: str) -> int:
    return int(posixpath.basename(path.rstrip("/")).removeprefix("step-"))


def load_weights(model: Any, path: str) -> None:
    """Load a checkpoint's trainable weights into `model` (checked against the manifest)."""
    import fsspec

    from jetctl.server import weights as W

    fs, root = fsspec.core.url_to_fs(path)
    manifest = json.loads(fs.cat_file(posixpath.join(root, "manifest.json")))
    state = W.decode(fs.cat_file(posixpath.join(root, "weights.safetensors")),
                     manifest["files"]["weights.safetensors"])
    W.load_trainable_state(model, state)


def build_model(cfg: ModelConfig, *, device: str | None = None) -> tuple[Any, Any]:
    """The recipe's model as a plain transformers (+ peft) model, in eval mode, without the
    server's per-thread adapter views: (model, tokenizer)."""
    import torch

    from jetctl.models import load_model

    torch.manual_seed(cfg.seed)
    model: Any
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=device or cfg.device,
                                  attn_implementation="sdpa", progress=False)
    if cfg.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lc = cfg.lora
        model = get_peft_model(model, LoraConfig(
            r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
            target_modules=list(lc.target_modules), task_type="CAUSAL_LM",
        ))
    model.eval()
    return model, tokenizer


def load_at(cfg: ModelConfig, ckpt: Checkpoint, *, device: str | None = None) -> tuple[Any, Any]:
    """(model at the checkpoint, tokenizer)."""
    model, tokenizer = build_model(cfg, device=device)
    if ckpt.path is not None:
        load_weights(model, ckpt.path)
    return model, tokenizer
