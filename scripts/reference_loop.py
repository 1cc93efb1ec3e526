"""The reference for `jetctl bench loop`'s baseline: the simplest synchronous GRPO loop a user
would write for the quickstart's task, in one file, with nothing of jetctl's but the model
loader and the env (docs/architecture.md, "The bench's baseline", says how it was used).

    .venv/bin/python scripts/reference_loop.py --seconds 300 [--latency 2] [--seed 0]

SmolLM2-135M-Instruct + LoRA r16 (alpha 32) on q/k/v/o; per step: 2 questions of
`envs.arithmetic` (one turn) x G=8, the chat template rendered once per question, one
left-padded `model.generate` over all 16 rows (24 new tokens, temperature 1), the 16 answers
scored in parallel (each sleeps --latency first), GRPO advantages (r - mean) / (std + 1e-4)
per group, zero-advantage rows dropped, an on-policy PPO-clip token-mean loss over a
prefix-shared packed batch, AdamW lr 5e-4, gradient clipping at 1.0; torch on every core.
It prints one line per step and, at the end, seconds per step and when the rolling reward of
the last 10 steps first reached 0.5 and 0.8 (seconds from process start).
"""

import argparse
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

T0 = time.monotonic()

import torch
from peft import LoraConfig, get_peft_model

from envs.arithmetic import make_env
from jetctl.models import load_model

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=300)
p.add_argument("--latency", type=float, default=0.0)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
torch.set_num_threads(os.cpu_count() or 1)
torch.manual_seed(args.seed)
model, tok = load_model("builtin:smollm2-135m-instruct", attn_implementation="sdpa")
model = get_peft_model(model, LoraConfig(
    r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=5e-4)
env = make_env(max_turns=1)
tasks = iter(env.tasks(random.Random(args.seed)))
pool = ThreadPoolExecutor(16)
G, eos = 8, tok.eos_token_id


def score(task, text):
    time.sleep(args.latency)
    s = env.open(task)
    s.answer(text)
    return float(s.reward())


rewards, steps, ends = [], 0, []
reach = {0.5: None, 0.8: None}
while time.monotonic() - T0 < args.seconds:
    qs = [next(tasks) for _ in range(2)]
    prompts = [tok.apply_chat_template(q.data["messages"], add_generation_prompt=True,
                                       return_dict=True)["input_ids"] for q in qs]
    width = max(map(len, prompts))
    pads = [width - len(pr) for pr in prompts for _ in range(G)]
    ids = torch.tensor([[tok.pad_token_id] * (width - len(pr)) + pr for pr in prompts for _ in range(G)])
    mask = (torch.arange(width)[None] >= torch.tensor(pads)[:, None]).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
            top_k=None, max_new_tokens=24, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    comps = []
    for row in out[:, width:].tolist():
        comps.append(row[: row.index(eos) + 1] if eos in row else row)
    texts = tok.batch_decode(comps, skip_special_tokens=True)
    r = list(pool.map(score, [q for q in qs for _ in range(G)], texts))
    r = torch.tensor(r).view(2, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + 1e-4)).flatten()
    # pack: per question its prompt once, then each kept completion seeing the prompt and itself
    tokens, pos, owner, pred, tgt, a_tok = [], [], [], [], [], []
    for g, pr in enumerate(prompts):
        start = len(tokens)
        tokens += pr
        pos += range(len(pr))
        owner += [(g, -1)] * len(pr)
        for i in range(g * G, (g + 1) * G):
            if adv[i] == 0:
                continue
            for k, t in enumerate(comps[i]):
                pred.append(start + len(pr) - 1 if k == 0 else len(tokens) - 1)
                tokens.append(t)
                pos.append(len(pr) + k)
                owner.append((g, i))
                tgt.append(t)
                a_tok.append(float(adv[i]))
    rewards.append(float(r.mean()))
    if tgt:
        og = torch.tensor([o[0] for o in owner])
        ob = torch.tensor([o[1] for o in owner])
        vis = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
        vis &= (og[:, None] == og[None]) & ((ob[None] == -1) | (ob[None] == ob[:, None]))
        m4 = torch.zeros(vis.shape).masked_fill(~vis, torch.finfo(torch.float32).min)[None, None]
        keep, col = torch.unique(torch.tensor(pred), return_inverse=True)
        logits = model(input_ids=torch.tensor([tokens]), attention_mask=m4,
                       position_ids=torch.tensor([pos]), logits_to_keep=keep).logits[0, col]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tgt)[:, None]).squeeze(-1)
        ratio = torch.exp(lp - lp.detach())  # on-policy: the behaviour logprobs are these
        a = torch.tensor(a_tok)
        loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        steps += 1
    t = time.monotonic() - T0
    ends.append(t)
    roll = sum(rewards[-10:]) / len(rewards[-10:])
    for thr, at in reach.items():
        if at is None and len(rewards) >= 10 and roll >= thr:
            reach[thr] = t
    print(f"step {steps} t={t:.1f}s reward={rewards[-1]:.2f} rolling10={roll:.2f}", flush=True)
if len(ends) > 1:
    print(f"rounds {len(ends)} steps {steps} s/round {(ends[-1] - ends[0]) / (len(ends) - 1):.2f} "
          f"first round at {ends[0]:.1f} s; rolling 0.5 at {reach[0.5]} s, 0.8 at {reach[0.8]} s")
