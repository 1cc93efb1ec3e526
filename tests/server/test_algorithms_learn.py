"""Every algorithm learns the digits task on builtin:tiny through the server's own step.

A plain on-policy loop, the trainer's parts only: HF `generate` samples G = 16 replies of 4
tokens to "Reply with the digit 7" (behaviour logprobs from the sampling distribution);
the reward is envs/digits' (the share of the reply that is the digit: builtin:tiny gives
each digit a token of its own); `jetctl.server.step.train_step` with the algorithm takes the
gradients, AdamW steps. The untrained model puts 0.1% on "7" (a vocabulary of 733), so the
first steps score near 0; every algorithm passes 0.8 (mean of 10 steps) after about 30
steps of 4 groups and is near 1 by step 50 (measured: 4-7 s each on an idle core). GRPO with truncated importance sampling
(`train.tis_cap`) as well: here the engine is the trainer's own model, so w_t stays near 1.
"""

from __future__ import annotations

import pytest
import torch

from jetctl.recipe import ModelConfig, OptimizerConfig, TrainConfig
from jetctl.server import algorithms
from jetctl.server.step import load_trainable, train_step
from jetctl.types import LLMCall, Trajectory

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

G, GROUPS, LENGTH, STEPS = 16, 4, 4, 50


def learn(train: TrainConfig) -> list[float]:
    """Mean reward of each step's rollouts."""
    cfg = ModelConfig(model="builtin:tiny", finetune="full", optimizer=OptimizerConfig(lr=1e-2),
                      train=train)
    model, tok = load_trainable(cfg, attn_implementation="sdpa")
    algorithm = algorithms.make(train)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    text = tok.apply_chat_template([{"role": "user", "content": "Reply with the digit 7"}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text)["input_ids"]
    seven = tok.convert_tokens_to_ids("7")
    torch.manual_seed(0)
    curve = []
    for step in range(STEPS):
        ids = torch.tensor([prompt] * (G * GROUPS))
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                temperature=1.0, top_k=0, max_new_tokens=LENGTH, min_new_tokens=LENGTH,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            )
        new = out.sequences[:, len(prompt):]  # [G * GROUPS, LENGTH]
        logprobs = torch.log_softmax(torch.stack(out.scores, 1).float(), -1)
        logprobs = logprobs.gather(-1, new[..., None]).squeeze(-1)  # [G * GROUPS, LENGTH]
        rewards = (new == seven).float().mean(1)  # envs.digits.score for 4 one-token digits
        curve.append(float(rewards.mean()))
        groups = [[
            Trajectory(id=f"{step}-{i}", group_id=f"{step}-{g}", task="digits", task_id="0",
                       calls=[LLMCall("policy", list(prompt), new[i].tolist(),
                                      logprobs[i].tolist(), model_version=step)],
                       reward=float(rewards[i]))
            for i in range(g * G, (g + 1) * G)
        ] for g in range(GROUPS)]
        result = train_step(model, groups, train, algorithm, max_grad_norm=1.0)
        if result.trained:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return curve


@pytest.mark.parametrize(
    "train",
    [TrainConfig(algorithm=name) for name in algorithms.names()]  # type: ignore[arg-type]
    + [TrainConfig(algorithm="grpo", tis_cap=2.0)],
    ids=[*algorithms.names(), "grpo+tis"],
)
def test_the_reward_rises(train: TrainConfig) -> None:
    curve = learn(train)
    first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
    print(f"{train.algorithm} tis_cap={train.tis_cap}: first 10 steps {first:.3f}, "
          f"last 10 {last:.3f}")
    assert first < 0.3 and last > 0.8, (first, last)
