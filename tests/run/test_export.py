"""`jetctl export` (jetctl/run/export.py): each exported form, loaded by transformers / peft on
their own, gives the logits of the server's model at that checkpoint.

The server's side is what a restarted server holds: `load_trainable` (the trainer's model,
with its per-thread adapter views) then `checkpoint.restore` of the step. Its weights are
set to random values first (lora_B starts at zero, which would make every form equal to the
base model and the test unable to fail), and the test checks that the trained logits are
far from the base model's. Tolerance 1e-5 in float32: merging LoRA into the weights
reorders the sums (W x + B A x vs (W + B A) x), rounding of order 1e-7 at these sizes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from jetctl.cli.main import build_app
from jetctl.recipe import load_recipe
from jetctl.server import checkpoint

try:  # the trainer's model builder is moving from trainer.py to step.py (another change)
    from jetctl.server.step import load_trainable
except ImportError:
    from jetctl.server.trainer import load_trainable  # type: ignore[attr-defined,no-redef]

pytestmark = pytest.mark.unit

RECIPE = """\
# jetctl up {path}
run: {{name: export-test, dir: {run_dir}}}
models:
  policy:
    model: builtin:tiny
    finetune: {finetune}{lora}
tasks:
  digits: {{env: envs.digits:make_env, agent: agents.digits:agent, model: policy}}
"""
STEP = 7
TOLERANCE = 1e-5
INPUT = torch.tensor([[5, 17, 42, 99, 3, 250, 8]])  # [1, T] token ids of builtin:tiny


def server_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT).logits.float()  # [1, T, V]


def train_a_run(tmp_path: Path, finetune: str) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A run dir with a checkpoint at STEP of randomised weights: (recipe, logits of the
    server restored from it, logits of the base model)."""
    run_dir = tmp_path / "run"
    recipe_path = tmp_path / "recipe.yaml"
    lora = "\n    lora: {r: 4, target_modules: [q_proj, v_proj]}" if finetune == "lora" else ""
    recipe_path.write_text(
        RECIPE.format(path=recipe_path, run_dir=run_dir, finetune=finetune, lora=lora))
    cfg = load_recipe(recipe_path, env={}).models["policy"]
    model, _ = load_trainable(cfg)
    base = server_logits(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and (finetune == "full" or "lora_" in name):
                p.add_(torch.randn_like(p) * 0.3)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    root = run_dir / "checkpoints" / "policy"
    checkpoint.save(root, model, optimizer, STEP, {"version": STEP}, keep=2)
    (run_dir / "run.json").write_text(json.dumps({"recipe": str(recipe_path)}))

    restored, _ = load_trainable(cfg)  # what a server restarted at STEP holds
    opt = torch.optim.AdamW([p for p in restored.parameters() if p.requires_grad])
    assert checkpoint.restore(root, restored, opt) is not None
    return recipe_path, server_logits(restored), base


def run_export(run_dir: Path, out: Path, form: str) -> None:
    result = CliRunner().invoke(
        build_app(), ["export", str(run_dir), "--out", str(out), f"--{form}", "--step", str(STEP)]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_merged_folder_loads_with_transformers_and_matches_the_server(
    tmp_path: Path, finetune: str
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, served, base = train_a_run(tmp_path, finetune)
    assert (served - base).abs().max() > 0.1, "the trained weights change the logits"
    out = tmp_path / "merged"
    run_export(tmp_path / "run", out, "merged")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "README.md"} <= names
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    assert (server_logits(loaded) - served).abs().max().item() < TOLERANCE
    assert AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    assert f"at step {STEP}" in (out / "README.md").read_text()
    # a new run can start from it: a folder is a model source
    from jetctl.models import load_model

    again, _ = load_model(str(out), attn_implementation="sdpa", progress=False)  # as the server
    assert (server_logits(again) - served).abs().max().item() < TOLERANCE


def test_adapter_folder_loads_with_peft_and_matches_the_server(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from jetctl.models import resolve_model_dir

    _, served, base = train_a_run(tmp_path, "lora")
    out = tmp_path / "adapter"
    run_export(tmp_path / "run", out, "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    base_model = AutoModelForCausalLM.from_pretrained(
        resolve_model_dir("builtin:tiny", progress=False), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base_model, out).eval()
    logits = server_logits(loaded)
    assert (logits - served).abs().max().item() < TOLERANCE
    assert (logits - base).abs().max().item() > 0.1


def test_adapter_of_a_full_fine_tune_is_refused_in_one_line(tmp_path: Path) -> None:
    train_a_run(tmp_path, "full")
    result = CliRunner().invoke(
        build_app(), ["export", str(tmp_path / "run"), "--out", str(tmp_path / "o"), "--adapter"])
    assert result.exit_code == 1
    assert "full fine-tune" in result.output and "--merged" in result.output
