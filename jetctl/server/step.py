"""One optimizer step's gradients, top to bottom: groups in, clipped `.grad` and scalars out.

    advantages      per group, the algorithm's, from its rollouts' rewards
    sequences       each rollout's LLM calls as training sequences (timeline merge, merge.py)
    packing         sequences -> micro-batches under max_tokens_per_microbatch (merge.py)
    per micro-batch:
      reference     forward with the adapter off (only when train.kl_coef > 0)
      forward       log p(target) of every scored token, in the trainer's adapter view
      TIS           with train.tis_cap: w_t = min(exp(logp_trainer_t - logp_engine_t), C)
      loss          the algorithm's (algorithms/), normalized over the whole step
      backward      gradients accumulate in .grad
    clipping        global grad norm <= max_grad_norm
    scalars         the step row's loss / kl / ratio / merge figures

`train_step` is what the trainer runs between gathering a batch and its locked optimizer
step (trainer.py), and what `jetctl bench merge` and `jetctl bench gpu` time: there is no
other copy of the step. It leaves the optimizer, the version, publishing and checkpoints to
the trainer, and `.grad` set for it (the trainer zeroes it after its optimizer step).

`load_trainable` builds the model the server trains (and the benchmarks measure).

Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"): the engine's logprobs (recorded at generation, the
behaviour logprobs) differ from the trainer's for the same weights (kernels, dtype, batch
shape). The trainer keeps no logprobs of its own from the generating version, so with TIS on
logp_trainer is this step's forward, detached: the algorithm's ratio is taken against it (1
at the current weights) and the gap to the engine becomes the weight w_t, capped at C. That
is exact for groups made at the current version (lag 0); for a stale group w_t also carries
the policy's change since, still capped at C, and clipping no longer bounds it.

Left out: a KL reference for full fine-tuning (a second copy of the model; the recipe refuses
`train.kl_coef > 0` with `finetune: full`); several optimizer steps per batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from jetctl.kernels.tree_attention import uses_tree_attention
from jetctl.models import AttnImplementation, Progress
from jetctl.recipe import ModelConfig, TrainConfig
from jetctl.server import merge
from jetctl.server.adapter import adapter_mode
from jetctl.server.algorithms.base import Algorithm, LossStats, StepTotals, tis_weights
from jetctl.types import Trajectory


@dataclass
class StepResult:
    """What one step left besides the gradients. `scalars` is empty when no group carried
    signal (then nothing was backpropagated and the trainer takes no optimizer step)."""

    scalars: dict[str, float]
    loss: float = 0.0
    sequences: int = 0
    groups_without_signal: int = 0  # every advantage 0: no sequence, no gradient
    response_tokens: int = 0  # generated tokens of the rollouts trained on
    scored_tokens: int = 0
    tokens_fed: int = 0  # real tokens fed to the model after merging / packing
    tokens_padded: int = 0  # B * T over micro-batches: what is computed, padding included
    microbatches: int = 0
    pack_s: float = 0.0  # timeline merge + packing
    forward_s: float = 0.0  # reference forwards and losses included
    backward_s: float = 0.0
    stats: list[LossStats] = field(default_factory=list)  # per micro-batch

    @property
    def trained(self) -> bool:
        return self.sequences > 0


def train_step(
    model: Any,
    groups: Sequence[Sequence[Trajectory]],
    train: TrainConfig,
    algorithm: Algorithm,
    *,
    max_grad_norm: float,
    advantages: Sequence[Sequence[float]] | None = None,
) -> StepResult:
    """The gradients of one optimizer step over `groups` (the rollouts of each group; one
    advantage per rollout). `advantages`, when given, replaces the algorithm's (a benchmark's
    fixed workload, e.g. a lone agent). See the module docstring for the order."""
    t0 = time.perf_counter()
    # advantages and sequences: a group whose advantages are all 0 moves nothing
    sequences: list[merge.TrainSequence] = []
    tokens_naive = 0  # what training call by call would feed (the merge statistic)
    response_tokens = flat = 0
    for i, group in enumerate(groups):
        advs = algorithm.advantages([t.reward for t in group]) if advantages is None \
            else advantages[i]
        if all(a == 0.0 for a in advs):
            flat += 1
            continue
        for t, a in zip(group, advs):
            response_tokens += sum(len(c.completion_ids) for c in t.calls)
            sequences += merge.timeline_sequences(t, a, train.merge)
            tokens_naive += sum(
                len(c.prompt_ids) + len(c.completion_ids) for c in t.calls if c.completion_ids)
    if not sequences:
        return StepResult({}, groups_without_signal=flat)

    # packing; the loss is normalized over the whole step, so the totals come first
    microbatches = merge.pack(sequences, train.merge, train.max_tokens_per_microbatch)
    totals = StepTotals(
        tokens=sum(mb.num_targets for mb in microbatches),
        sequences=len(sequences),
        trajectories=len({s.trajectory_id for s in sequences if s.num_targets}),
    )
    pack_s = time.perf_counter() - t0

    loss_total = forward_s = backward_s = 0.0
    stats: list[LossStats] = []
    tis: list[tuple[int, float, float]] = []  # (tokens, mean w_t, share truncated at C)
    for mb in microbatches:
        t1 = time.perf_counter()
        ref_lp = None
        if train.kl_coef > 0:  # the reference: the base model, the LoRA adapter off
            with torch.no_grad(), adapter_mode("reference"):
                ref_lp = token_logprobs(model, mb)
        with adapter_mode("train"):  # lora.dropout applies in this thread only
            new_lp = token_logprobs(model, mb)  # [N]
        device = new_lp.device
        old_lp = mb.old_logprobs.to(device)  # [N] the engine's (behaviour) logprobs
        weights = None
        if train.tis_cap is not None:  # the ratio against the trainer, the gap as a weight
            old_lp, weights = new_lp.detach(), tis_weights(new_lp, old_lp, train.tis_cap)
            tis.append((mb.num_targets, float(weights.mean()),
                        float((weights >= train.tis_cap * (1 - 1e-6)).float().mean())))
        loss, st = algorithm.loss(
            new_lp, old_lp, mb.advantages.to(device), mb.seq_index.to(device), totals,
            ref_logprobs=ref_lp, weights=weights,
        )
        t2 = time.perf_counter()
        loss.backward()
        backward_s += time.perf_counter() - t2
        forward_s += t2 - t1
        loss_total += float(loss.detach())
        stats.append(st)
        del new_lp, ref_lp, loss

    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)

    w = [mb.num_targets / max(totals.tokens, 1) for mb in microbatches]  # token shares
    tokens_packed = sum(mb.num_tokens for mb in microbatches)
    scalars = {
        "loss": loss_total,
        "grad_norm": float(grad_norm),
        "kl": sum(wi * st.approx_kl for wi, st in zip(w, stats)),
        "kl_ref": sum(wi * st.ref_kl for wi, st in zip(w, stats)),
        "clip_fraction": sum(wi * st.clip_fraction for wi, st in zip(w, stats)),
        "importance_ratio/mean": sum(wi * st.ratio_mean for wi, st in zip(w, stats)),
        "importance_ratio/min": min(st.ratio_min for st in stats),
        "importance_ratio/max": max(st.ratio_max for st in stats),
        "num_tokens": float(tokens_packed),
        "merge/tokens_naive": float(tokens_naive),
        "merge/tokens_packed": float(tokens_packed),
        "merge/ratio": tokens_naive / max(tokens_packed, 1),
        "microbatches": float(len(microbatches)),
        "scored_tokens": float(totals.tokens),
    }
    if tis:
        scalars["tis/weight_mean"] = sum(n * m for n, m, _ in tis) / totals.tokens
        scalars["tis/truncated"] = sum(n * c for n, _, c in tis) / totals.tokens
    return StepResult(
        scalars=scalars,
        loss=loss_total,
        sequences=len(sequences),
        groups_without_signal=flat,
        response_tokens=response_tokens,
        scored_tokens=totals.tokens,
        tokens_fed=tokens_packed,
        tokens_padded=sum(mb.padded_tokens for mb in microbatches),
        microbatches=len(microbatches),
        pack_s=pack_s,
        forward_s=forward_s,
        backward_s=backward_s,
        stats=stats,
    )


# ----------------------------------------------------------------------------- the forward


def token_logprobs(model: nn.Module, mb: merge.MicroBatch) -> torch.Tensor:
    """log p(target | context) for every target of ``mb``: [N], on the model's device, fp32.

    The model must accept ``logits_to_keep`` (every transformers causal LM does): logits are
    projected only at the scored positions, and log-softmax runs only on the N scored rows,
    upcast to fp32, instead of the full [B, T, V]. A model loaded with
    ``attn_implementation="jetctl_tree"`` gets a tree row's layout as well.
    """
    device = next(model.parameters()).device
    mask = mb.attention_mask.to(device)
    dtype = _model_dtype(model)
    if mask.dim() == 4 and mask.dtype != dtype:
        # finfo(float32).min does not survive a cast to fp16/bf16 (it becomes -inf); remake it
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
            mask != 0, torch.finfo(dtype).min
        )
    pred = mb.pred_index.to(device)  # [N, 2]
    keep, column = torch.unique(pred[:, 1], return_inverse=True)  # [K], [N]
    # the trie's segments go to the jetctl_tree kernel as a keyword of this call (it skips
    # the scores the mask would hide); other kernels use the dense mask and never see it
    use_layout = mb.tree_layout is not None and uses_tree_attention(model)
    tree = {"tree_layout": mb.tree_layout} if use_layout else {}
    out = model(
        input_ids=mb.input_ids.to(device),
        attention_mask=mask,
        position_ids=mb.position_ids.to(device),
        logits_to_keep=keep,
        use_cache=False,
        **tree,
    )
    logits = out.logits[pred[:, 0], column]  # [N, V]
    # log-softmax in at least fp32 (bf16/fp16 models); float64 stays float64
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(logits, dim=-1)  # [N, V]
    return logp.gather(-1, mb.targets.to(device)[:, None]).squeeze(-1)  # [N]


def _model_dtype(model: nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)  # PreTrainedModel / PeftModel: the compute dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(model.parameters()).dtype


# ----------------------------------------------------------------------------- the model


def load_trainable(
    cfg: ModelConfig,
    attn_implementation: AttnImplementation = "jetctl_tree",
    progress: bool | Progress = False,
) -> tuple[Any, Any]:
    """The model the server trains (LoRA-wrapped when finetune is lora) and its tokenizer.

    `jetctl_tree`: sdpa for generation and padded micro-batches, and only the visible scores
    of tree-packed ones (merge: tree); the same values as eager up to fp32 rounding order.
    """
    from jetctl.models import load_model
    from jetctl.server import adapter

    torch.manual_seed(cfg.seed)
    base, tokenizer = load_model(
        cfg.model, dtype=cfg.dtype, device=cfg.device, attn_implementation=attn_implementation,
        progress=progress,
    )
    model: Any = base
    if cfg.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lc = cfg.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                target_modules=list(lc.target_modules), task_type="CAUSAL_LM",
            ),
        )
        adapter.install(model, lc.dropout)  # dropout in the trainer's thread only
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    model.eval()  # shared with the engine; training-only behaviour is per thread (adapter.py)
    return model, tokenizer
