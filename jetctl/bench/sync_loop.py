"""The baseline of `jetctl bench loop`: a plain synchronous RL loop in one process.

    python -m jetctl.bench.sync_loop SPEC.json OUT.json

What a user could write instead of a swarm, with the same model, env, agent, sampling and
optimizer as the recipe's task:

    load the model (+ the same LoRA adapter); repeat:
        run groups_per_step x G rollouts of the real agent, each in a thread, against an
        in-process OpenAI-style client; the calls they make are answered together by one
        left-padded `model.generate` per turn (environment answers run in parallel; where
        `generation.dtype` asks for another dtype, or `auto` picks one on this host, on a
        copy in that dtype refreshed after each step, as the swarm's engine generates)
        score them (the env's reward); keep the groups whose rewards differ
        once groups_per_step such groups are in: one GRPO PPO-clip step (jetctl's loss,
        behaviour logprobs from generation, token-mean), AdamW, gradient clipping

The chat is rendered with the tokenizer's chat template on every call (the simple thing;
the swarm reuses earlier turns' token ids instead). Generation and training share the
process's torch threads (all cores). Nothing is spooled, checkpointed or sent anywhere.

It writes per-group rewards with their times, step times and CPU seconds to OUT.json for
`jetctl.bench.loop` to compare with the swarm. Left out: timeouts, failed rollouts (a
failure raises), and everything else that keeps a long run alive.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

T0 = time.monotonic()  # the process started (model loading counts against the loop too)


@dataclass
class LoopSpec:
    """What to run (written by jetctl.bench.loop as JSON)."""

    model: dict[str, Any]  # the recipe's models.<m> (ModelConfig fields)
    task: dict[str, Any]  # the recipe's tasks.<t> (TaskConfig fields)
    seconds: float
    seed: int
    latency_s: float = 0.0
    threads: int = 0  # torch threads (0: all cores)


@dataclass
class _Call:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    done: threading.Event = field(default_factory=threading.Event)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"


class _Batcher:
    """Rollout threads park their model calls here; the main thread answers them all at once
    when every live rollout is parked (one generate per turn of the batch)."""

    def __init__(self, rollouts: int) -> None:
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._live = rollouts

    def ask(self, call: _Call) -> _Call:
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()
        call.done.wait()
        return call

    def finished(self) -> None:
        with self._cond:
            self._live -= 1
            self._cond.notify_all()

    def next_turn(self) -> list[_Call] | None:
        """The calls of the next turn, once every live rollout waits; None when all ended."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._pending) == self._live)
            if self._live == 0:
                return None
            calls, self._pending = self._pending, []
            return calls


class _Completions:
    def __init__(self, client: _Client) -> None:
        self._client = client

    def create(self, *, messages: list[dict[str, Any]], model: str = "", **kw: Any) -> Any:
        return self._client.complete(messages, model, kw)


class _Client:
    """The slice of `openai.OpenAI` agents use: `client.chat.completions.create(...)`."""

    def __init__(self, loop: SyncLoop, rollout: _Rollout) -> None:
        self._loop = loop
        self._rollout = rollout
        self.chat = type("Chat", (), {})()
        self.chat.completions = _Completions(self)

    def complete(self, messages: list[dict[str, Any]], model: str, kw: dict[str, Any]) -> Any:
        from openai.types.chat import ChatCompletion

        from jetctl.client.timeline import parse_tool_calls

        loop = self._loop
        tools = kw.get("tools")
        prompt: list[int] = loop.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        sampling = loop.task["sampling"]
        call = _Call(
            list(prompt),
            int(kw.get("max_tokens") or kw.get("max_completion_tokens") or sampling["max_tokens"]),
            float(kw.get("temperature", sampling["temperature"])),
            float(kw.get("top_p", sampling["top_p"])),
        )
        self._rollout.calls.append(loop.batcher.ask(call))
        text: str = loop.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
        reply = parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        finish = call.finish
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
            finish = "tool_calls"
        return ChatCompletion.model_validate({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model or "loop",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        })


@dataclass
class _Rollout:
    task: Any
    calls: list[_Call] = field(default_factory=list)
    reward: float = 0.0
    error: BaseException | None = None


class _LoopLLM:
    """Stands where the swarm passes `jetctl.env.LLM`: `client()` and `model`."""

    def __init__(self, loop: SyncLoop, rollout: _Rollout, model: str) -> None:
        self._client = _Client(loop, rollout)
        self.model = model
        self.base_url = "in-process://loop"

    def client(self) -> _Client:
        return self._client


class SyncLoop:
    def __init__(self, spec: LoopSpec) -> None:
        from jetctl.bench.latency import SlowEnv
        from jetctl.client.rollout import load_object
        from jetctl.models import load_model

        self.spec = spec
        self.task = spec.task
        mc = spec.model
        torch.set_num_threads(spec.threads or os.cpu_count() or 1)
        torch.manual_seed(spec.seed)
        self.model: Any
        self.tokenizer: Any
        self.model, self.tokenizer = load_model(
            mc["model"], dtype=mc["dtype"], device="cpu", attn_implementation="sdpa"
        )
        if mc["finetune"] == "lora":
            from peft import LoraConfig, get_peft_model

            lc = mc["lora"]
            self.model = get_peft_model(self.model, LoraConfig(
                r=lc["r"], lora_alpha=lc["alpha"], lora_dropout=lc["dropout"],
                target_modules=list(lc["target_modules"]), task_type="CAUSAL_LM",
            ))
        else:
            for p in self.model.parameters():
                p.requires_grad_(True)
        self.model.eval()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # generation.dtype, as the swarm's engine has it: generate from the engine's Replica
        # in that dtype, refreshed after each step (the trainable tensors, cast)
        from jetctl.server.engines.dtype import pick_generation_dtype
        from jetctl.server.engines.replica import Replica

        self.gen_dtype = pick_generation_dtype(
            mc["generation"]["dtype"], self.model, model_dtype=mc["dtype"], engine="hf",
            device="cpu", threads=spec.threads or None,
        )
        print(f"[loop] generation dtype: {self.gen_dtype.why}", file=sys.stderr, flush=True)
        self.replica: Replica | None = None
        self.gen_model = self.model
        if self.gen_dtype.dtype is not None:
            self.replica = Replica(
                self.model, device="cpu", version=0, timeout_s=60.0, dtype=self.gen_dtype.dtype)
            self.gen_model = self.replica.model
        opt = mc["optimizer"]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=opt["lr"], betas=tuple(opt["betas"]), weight_decay=opt["weight_decay"]
        )
        env = load_object(self.task["env"])(**self.task["env_args"])
        self.env = SlowEnv(env, spec.latency_s) if spec.latency_s > 0 else env
        self.agent = load_object(self.task["agent"])
        self.tasks = iter(self.env.tasks(random.Random(spec.seed)))
        eos = self.tokenizer.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        self.batcher = _Batcher(0)
        self.version = 0
        self.out: dict[str, Any] = {"groups": [], "steps": [], "gen_batches": [], "train_s": []}

    # --- rollouts ----------------------------------------------------------------------

    def _run_rollout(self, r: _Rollout) -> None:
        try:
            session = self.env.open(r.task)
            try:
                llm = _LoopLLM(self, r, self.task["model"])
                result = self.agent(r.task, llm, session)
                if inspect.iscoroutine(result):
                    raise TypeError("the bench's loop runs sync agents only")
                r.reward = float(session.reward())
            finally:
                session.close()
        except BaseException as e:  # noqa: BLE001  # re-raised by the main thread
            r.error = e
        finally:
            self.batcher.finished()

    def rollouts(self, n_groups: int) -> list[list[_Rollout]]:
        G = self.task["group_size"]
        groups = [[_Rollout(t) for _ in range(G)] for t in (next(self.tasks) for _ in range(n_groups))]
        flat = [r for g in groups for r in g]
        self.batcher = _Batcher(len(flat))
        threads = [threading.Thread(target=self._run_rollout, args=(r,), daemon=True) for r in flat]
        for t in threads:
            t.start()
        while (calls := self.batcher.next_turn()) is not None:
            self._generate(calls)
        for t in threads:
            t.join()
        for r in flat:
            if r.error is not None:
                raise r.error
        return groups

    @torch.no_grad()
    def _generate(self, calls: list[_Call]) -> None:
        from transformers import GenerationConfig

        width = max(len(c.prompt_ids) for c in calls)
        ids = torch.full((len(calls), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(calls), width), dtype=torch.long)
        for i, c in enumerate(calls):
            ids[i, width - len(c.prompt_ids):] = torch.tensor(c.prompt_ids)
            mask[i, width - len(c.prompt_ids):] = 1
        temperature = calls[0].temperature
        config = GenerationConfig(
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
            top_p=calls[0].top_p if temperature > 0 else None, top_k=None,
            max_new_tokens=max(c.max_tokens for c in calls), eos_token_id=self.eos,
            pad_token_id=self.pad, output_logits=True, return_dict_in_generate=True,
        )
        out = self.gen_model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config)
        new = out.sequences[:, width:]  # [B, T_new]
        logprobs = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
        logprobs = logprobs.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, T_new]
        self.out["gen_batches"].append(len(calls))
        for i, c in enumerate(calls):
            toks, lps = new[i].tolist()[: c.max_tokens], logprobs[i].tolist()[: c.max_tokens]
            for j, tok in enumerate(toks):
                if tok in self.eos:
                    toks, lps, c.finish = toks[: j + 1], lps[: j + 1], "stop"
                    break
            c.completion_ids, c.logprobs = toks, lps
            c.done.set()

    # --- training ----------------------------------------------------------------------

    def step(self, groups: list[list[_Rollout]]) -> None:
        from jetctl.server.algorithms.grpo import group_advantages, grpo_loss

        t0 = time.monotonic()
        rows: list[tuple[list[int], int, list[float], float]] = []  # ids, prompt len, old lp, A
        for g in groups:
            for r, a in zip(g, group_advantages([r.reward for r in g])):
                for c in r.calls:
                    rows.append((c.prompt_ids + c.completion_ids, len(c.prompt_ids), c.logprobs, a))
        n_scored = sum(len(lp) for _, _, lp, _ in rows)
        budget = self.spec.model["train"]["max_tokens_per_microbatch"]
        rows.sort(key=lambda row: len(row[0]))
        batches: list[list[tuple[list[int], int, list[float], float]]] = [[]]
        for row in rows:
            width = max([len(row[0])] + [len(x[0]) for x in batches[-1]])
            if batches[-1] and width * (len(batches[-1]) + 1) > budget:
                batches.append([])
            batches[-1].append(row)
        for batch in batches:
            width = max(len(x[0]) for x in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (seq, _, _, _) in enumerate(batch):
                ids[i, : len(seq)] = torch.tensor(seq)
                mask[i, : len(seq)] = 1
            logits = self.model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
            new_lp, old_lp, adv = [], [], []
            for i, (seq, p, lps, a) in enumerate(batch):
                # token t is predicted at position t - 1
                pos = torch.arange(p - 1, len(seq) - 1)
                lp = torch.log_softmax(logits[i, pos].float(), -1)
                new_lp.append(lp.gather(-1, torch.tensor(seq[p:]).unsqueeze(-1)).squeeze(-1))
                old_lp += lps
                adv += [a] * len(lps)
            loss, _ = grpo_loss(
                torch.cat(new_lp), torch.tensor(old_lp), torch.tensor(adv),
                clip_eps=self.spec.model["train"]["clip_eps"], normalizer=n_scored,
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.spec.model["optimizer"]["max_grad_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.replica is not None:
            self.replica.publish(self.version)
        self.out["train_s"].append(time.monotonic() - t0)
        self.out["steps"].append(time.monotonic() - T0)

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        per_step = self.spec.model["train"]["groups_per_step"]
        ready: list[list[_Rollout]] = []
        while time.monotonic() - T0 < self.spec.seconds:
            for g in self.rollouts(per_step):
                rewards = [r.reward for r in g]
                informative = max(rewards) != min(rewards)
                self.out["groups"].append({
                    "t": time.monotonic() - T0, "reward": sum(rewards) / len(rewards),
                    "n": len(g), "informative": informative, "version": self.version,
                })
                if informative:
                    ready.append(g)
            if len(ready) >= per_step:
                self.step(ready[:per_step])
                ready = ready[per_step:]
        self.out["wall_s"] = time.monotonic() - T0
        times = os.times()
        self.out["cpu"] = {"loop": times.user + times.system}
        return self.out


def main(argv: list[str]) -> int:
    spec_path, out_path = argv[1], argv[2]
    with open(spec_path) as f:
        spec = LoopSpec(**json.load(f))
    out = SyncLoop(spec).run()
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
