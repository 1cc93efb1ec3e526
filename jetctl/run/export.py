"""`jetctl export`: a run's model at a checkpoint as a folder other tools load.

    jetctl export runs/word-problems --out out/adapter --adapter   # PEFT adapter folder
    jetctl export runs/word-problems --out out/merged --merged     # Hugging Face model folder

* adapter: `adapter_config.json` + `adapter_model.safetensors`, what
  `PeftModel.from_pretrained(base, DIR)` loads; `base_model_name_or_path` is the base
  model's folder on this machine (builtins: in the jetctl cache), and the tokenizer is saved
  beside it. Only for `finetune: lora`.
* merged: config, tokenizer, `model.safetensors` and `generation_config.json` with the
  LoRA merged into the base weights (`merge_and_unload`), what
  `AutoModelForCausalLM.from_pretrained(DIR)` and vLLM load; a full fine-tune is written the
  same way. Weights keep the recipe's `dtype`.

Both get a README.md model card: the recipe, the model, the step, the last training figures
from the server's step log and how to load the folder. tests/run/test_export.py checks that each
form's logits equal the server's model at that step within 1e-5 in float32.

Left out: quantized exports (GGUF, AWQ) and pushing to a hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from jetctl.server.trained import Checkpoint, RunSource, TrainedError, find_checkpoint, load_at

Form = Literal["adapter", "merged"]
# the server's step-log figures a model card shows (metrics/<model>.steps.jsonl)
CARD_FIGURES = ("step", "reward/mean", "reward/std", "response_length/mean", "trajectories",
                "loss", "learning_rate")


@dataclass(frozen=True)
class Exported:
    out: Path
    form: Form
    model: str
    checkpoint: Checkpoint


def export(
    source: RunSource, out: Path, form: Form, model: str | None = None, step: int | None = None,
) -> Exported:
    """Write the model at `step` (None: the latest checkpoint) to `out` in `form`."""
    name = source.model_name(model)
    cfg = source.recipe.models[name]
    if form == "adapter" and cfg.finetune != "lora":
        raise TrainedError(f"{name} is a full fine-tune (finetune: {cfg.finetune}): it has no "
                           "adapter; export it with --merged")
    if out.exists() and any(out.iterdir()):
        raise TrainedError(f"{out} is not empty: pass a new folder to --out")
    ckpt = find_checkpoint(source, name, "latest" if step is None else f"step-{step}")
    trained, tokenizer = load_at(cfg, ckpt, device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    if form == "adapter":
        trained.save_pretrained(out)
    else:
        merged = trained.merge_and_unload() if cfg.finetune == "lora" else trained
        merged.save_pretrained(out)
        merged.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    result = Exported(out, form, name, ckpt)
    (out / "README.md").write_text(model_card(source, result))
    return result


def _last_step_figures(source: RunSource, model: str, step: int) -> dict[str, Any]:
    """The server's step log record of `step` (or the last before it); {} when none."""
    if source.run_dir is None:
        return {}
    from jetctl.rundir import RunPaths

    log = RunPaths(source.run_dir).steps_log(model)
    best: dict[str, Any] = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if int(record.get("step", 0)) <= step:
                best = record
    return best


def _eval_lines(source: RunSource, step: int) -> list[str]:
    """A markdown table of what `jetctl eval` saved for the base model and this step."""
    from jetctl.run.eval import results_path
    from jetctl.rundir import read_json

    if source.run_dir is None:
        return ["- (not evaluated)"]
    rows = ["| checkpoint | split | task | pass@1 | pass@k | mean reward | well-formed | samples |",
            "|---|---|---|---|---|---|---|---|"]
    for label, at in (("base", 0), (f"step-{step}", step)):
        for path in sorted(results_path(source.run_dir, at, "*").parent.glob(f"step-{at}.*.json")):
            split = path.name.split(".")[1]
            for task, f in (read_json(path) or {}).items():
                rows.append(f"| {label} | {split} | {task} | {f['pass_at_1']:.3f} | "
                            f"{f['pass_at_k']:.3f} | {f['mean_reward']:.3f} | "
                            f"{f['well_formed']:.3f} | {f['samples']} |")
    return rows if len(rows) > 2 else ["- (not evaluated: run `jetctl eval` before exporting)"]


def model_card(source: RunSource, exported: Exported) -> str:
    cfg = source.recipe.models[exported.model]
    figures = _last_step_figures(source, exported.model, exported.checkpoint.step)
    shown = {k: figures[k] for k in CARD_FIGURES if isinstance(figures.get(k), (int, float))}
    load = (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(exported.out)!r})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(exported.out)!r})\n```"
        if exported.form == "merged" else
        "```python\nfrom peft import AutoPeftModelForCausalLM\n"
        f"model = AutoPeftModelForCausalLM.from_pretrained({str(exported.out)!r})\n```"
    )
    lines = [
        f"# {source.recipe.run.name} / {exported.model} at step {exported.checkpoint.step}",
        "",
        (f"Trained with jetctl (GRPO) from `{cfg.model}` ({cfg.finetune} fine-tuning), recipe "
        f"`{source.recipe_path}`; exported as a {exported.form} "
        f"{'PEFT adapter' if exported.form == 'adapter' else 'Hugging Face model'} "
        f"in {cfg.dtype}."),
        "",
    ]
    if cfg.model == "builtin:smollm2-135m-instruct":
        lines += [("The base is SmolLM2-135M-Instruct dequantized from a Q4_1 GGUF, not the "
                  "original bf16 weights (see jetctl's README)."), ""]
    lines += ["## Training figures at this step", ""]
    lines += [f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}"
              for k, v in sorted(shown.items())] or ["- (no step log found)"]
    lines += ["", "## Eval figures (held-out rows, `jetctl eval`)", ""]
    lines += _eval_lines(source, exported.checkpoint.step)
    lines += ["", "Evaluate with `jetctl eval RUN_DIR --checkpoint base,latest --split test`.",
              "", "## Load", "", load, ""]
    return "\n".join(lines)
