"""The baseline of `jetctl bench loop`: a plain synchronous RL loop in one process.

    python -m jetctl.bench.sync_loop SPEC.json OUT.json

The fastest simple thing a user could write instead of a swarm, with the same model, env,
agent, sampling and optimizer as the recipe's task:

    load the model (+ the same LoRA adapter), give torch every core; repeat:
        run round_groups x G rollouts of the real agent (2 x G by default: the issue's
        reference loop, whatever the recipe's groups_per_step), each in a thread, against an
        in-process OpenAI-style client; the calls they make are answered together by one
        left-padded `model.generate` per turn over the whole batch (the turn barrier of
        jetctl/turns.py, as `jetctl eval` does; the chat template is rendered once per
        distinct conversation: a group's G first calls share one; a later turn's prompt
        extends the rollout's earlier ids, as the client node's proxy builds it);
        environment answers run in parallel (where `generation.dtype` asks for another dtype,
        or `auto` picks one on this host, generation runs on a copy in that dtype refreshed
        after each step, as the swarm's engine does)
        score them (the env's reward); the algorithm's advantages per group (train.algorithm,
        GRPO by default); rows whose advantage is 0 are dropped; every group is trained as
        it comes: one step of the algorithm's loss (jetctl.server.algorithms; behaviour
        logprobs from generation, or with train.tis_cap the trainer's own with the gap as a
        capped weight, as the server's step does) over the batch, each rollout's calls as
        one row, packed in one row with each group's shared prefix once (a 4-D mask) or,
        where that computes more (long multi-turn rollouts: the mask is dense), as
        right-padded rows; logits only where a token is scored; AdamW, gradient clipping

A round whose groups all scored the same has nothing to learn from and takes no step.
`dynamic_sampling` (off by default) instead collects the recipe's groups_per_step groups
whose rewards differ before each step, as the swarm's trainer does. Nothing is spooled, checkpointed or
sent anywhere.

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

from jetctl.client.timeline import ChatRenderer, PromptPlan, Timeline
from jetctl.turns import TurnBarrier

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
    dynamic_sampling: bool = False  # step only on groups_per_step groups whose rewards differ
    round_groups: int = 2  # groups generated per round (one generate per turn over them all)
    until: float | None = None  # stop once the mean reward of the last `window` groups reaches it
    window: int = 20


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

        from jetctl.client.timeline import Turn, normalize_message, parse_tool_calls, tools_key
        from jetctl.types import LLMCall

        loop = self._loop
        messages = [normalize_message(m) for m in messages]
        tools = kw.get("tools") or None
        plan = loop.prompt(self._rollout, messages, tools)
        sampling = loop.task["sampling"]
        call = _Call(
            list(plan.ids),
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
        # the rollout's timeline, as the client node keeps it: the next call's prompt extends
        # this one's ids (token in, token out), so its calls train as one row
        self._rollout.timeline.turns.append(Turn(
            messages, tools_key(tools), plan.prompt_text, reply.as_message(),
            LLMCall(model or "loop", call.prompt_ids, call.completion_ids, call.logprobs,
                    loop.version, finish),
            plan.reused,
        ))
        return ChatCompletion.model_validate({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model or "loop",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        })


@dataclass
class _Rollout:
    task: Any
    calls: list[_Call] = field(default_factory=list)
    timeline: Timeline = field(default_factory=lambda: Timeline("loop"))
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
    def __init__(self, spec: LoopSpec, started: float = T0) -> None:
        """`started`: the monotonic time the figures count from (default: process start)."""
        from jetctl.bench.latency import SlowEnv
        from jetctl.client.rollout import load_object
        from jetctl.models import load_model

        self.spec = spec
        self.t0 = started
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
        from jetctl.recipe import TrainConfig
        from jetctl.server import algorithms

        self.algorithm = algorithms.make(TrainConfig.model_validate(mc["train"]))
        self.agent = load_object(self.task["agent"])
        self.tasks = iter(self.env.tasks(random.Random(spec.seed)))
        eos = self.tokenizer.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        self.batcher: TurnBarrier[_Call] = TurnBarrier(0)
        self.renderer = ChatRenderer(self.tokenizer, self.eos)
        self._rendered: dict[str, PromptPlan] = {}  # first-turn conversation -> its plan, one round
        self._render_lock = threading.Lock()
        self.version = 0
        self.out: dict[str, Any] = {
            "groups": [], "steps": [], "gen_batches": [], "train_s": [], "step_groups": [],
            "layouts": [],
        }
        # a token's share of the forward and backward (2 flops per weight) in units of one
        # attention score pair's (4 flops per layer and hidden unit): what layout() weighs
        cfg = self.model.config
        self.pair_per_token = sum(p.numel() for p in self.model.parameters()) / (
            2 * cfg.num_hidden_layers * cfg.hidden_size)

    # --- rollouts ----------------------------------------------------------------------

    def prompt(self, r: _Rollout, messages: list[dict[str, Any]], tools: Any) -> PromptPlan:
        """The prompt ids of a call: a later turn extends the rollout's earlier ids (as the
        client node's proxy does); a first turn is rendered once per round (the G rollouts of
        a group ask with the same messages)."""
        if r.timeline.turns:
            return self.renderer.prompt_ids(r.timeline, messages, tools)
        key = json.dumps([messages, tools], sort_keys=True, default=str)
        with self._render_lock:
            plan = self._rendered.get(key)
        if plan is None:
            plan = self.renderer.prompt_ids(r.timeline, messages, tools)
            with self._render_lock:
                self._rendered[key] = plan
        return plan

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
        self._rendered = {}
        self.batcher = TurnBarrier(len(flat))
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

    def step(self, groups: list[list[_Rollout]]) -> bool:
        """One optimizer step on the groups' rows whose advantage is not 0; False (no step)
        when there are none."""
        from jetctl.server.algorithms.base import StepTotals, tis_weights

        t0 = time.monotonic()
        packed_groups: list[list[_Row]] = []
        rollouts = 0
        for g in groups:
            rows = []
            for r, a in zip(g, self.algorithm.advantages([r.reward for r in g])):
                mine = timeline_rows(r.calls, a, rollouts) if a != 0 else []
                rollouts += bool(mine)
                rows += mine
            if rows:
                packed_groups.append(rows)
        if not packed_groups:
            return False
        totals = StepTotals(
            tokens=sum(len(row.scored) for rows in packed_groups for row in rows),
            sequences=rollouts, trajectories=rollouts,  # a rollout's calls: one sequence
        )
        tis_cap = self.spec.model["train"].get("tis_cap")
        for chunk in _chunks(packed_groups, self.spec.model["train"]["max_tokens_per_microbatch"]):
            batch = pack(chunk) if self.layout(chunk) == "tree" else pack_padded(chunk)
            self.out["layouts"].append(batch.layout)
            new_lp = packed_logprobs(self.model, batch)
            old_lp, weights = batch.old_logprobs, None
            if tis_cap is not None:  # as the server's step: the trainer's own, the gap a weight
                old_lp, weights = new_lp.detach(), tis_weights(new_lp, old_lp, tis_cap)
            loss, _ = self.algorithm.loss(
                new_lp, old_lp, batch.advantages, batch.seq_index, totals, weights=weights)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.spec.model["optimizer"]["max_grad_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.replica is not None:
            self.replica.publish(self.version)
        self.out["train_s"].append(time.monotonic() - t0)
        self.out["steps"].append(time.monotonic() - self.t0)
        self.out["step_groups"].append(len(packed_groups))  # groups with a signal, trained
        return True

    def layout(self, chunk: list[list[_Row]]) -> str:
        """"tree" (one row, each group's shared prefix once, a 4-D mask over the whole row)
        or "padded" (a right-padded row per rollout, causal attention), whichever computes
        less: tokens, plus the attention pairs each computes (a 4-D mask is dense: every
        pair of the row) weighed against a token's linear work. One-turn groups share most
        of each row and pack as a tree; long multi-turn rollouts share little and pad."""
        tree_tokens = sum(
            _common_prefix(rows) + sum(len(r.tokens) - _common_prefix(rows) for r in rows)
            for rows in chunk)
        width = max(len(r.tokens) for rows in chunk for r in rows)
        n = sum(len(rows) for rows in chunk)
        tree = tree_tokens + tree_tokens**2 / self.pair_per_token
        padded = n * width + n * width**2 / self.pair_per_token  # a padded row's mask is 4-D too
        return "tree" if tree <= padded else "padded"

    # --- the loop ----------------------------------------------------------------------

    def reached(self) -> bool:
        """`until` is set and the rolling reward of the last `window` groups has reached it."""
        w, groups = self.spec.window, self.out["groups"]
        if self.spec.until is None or len(groups) < w:
            return False
        return sum(g["reward"] for g in groups[-w:]) / w >= self.spec.until

    def run(self) -> dict[str, Any]:
        per_step = self.spec.model["train"]["groups_per_step"]
        ready: list[list[_Rollout]] = []
        while time.monotonic() - self.t0 < self.spec.seconds:
            groups = self.rollouts(self.spec.round_groups)
            for g in groups:
                rewards = [r.reward for r in g]
                self.out["groups"].append({
                    "t": time.monotonic() - self.t0, "reward": sum(rewards) / len(rewards),
                    "n": len(g), "informative": max(rewards) != min(rewards),
                    "version": self.version,
                })
            if self.reached():
                break
            if not self.spec.dynamic_sampling:
                self.step(groups)
                continue
            ready += [g for g in groups if len({r.reward for r in g}) > 1]
            if len(ready) >= per_step:
                self.step(ready[:per_step])
                ready = ready[per_step:]
        self.out["wall_s"] = time.monotonic() - self.t0
        times = os.times()
        self.out["cpu"] = {"loop": times.user + times.system}
        return self.out


# --- packing: each rollout one row, each group's shared prefix once ----------------------


@dataclass
class _Row:
    """A rollout's calls as one token sequence: the last call's prompt and completion, each
    earlier call's completion inside it (its prompt extends them), those tokens scored."""

    tokens: list[int]
    scored: list[int]  # indices in `tokens` of generated tokens
    logprobs: list[float]  # behaviour logprobs of the scored tokens
    advantage: float
    rollout: int = 0  # the rollout it belongs to (per-sequence losses: GSPO)

    @classmethod
    def one_call(cls, prompt: list[int], completion: list[int], logprobs: list[float],
                 advantage: float, rollout: int = 0) -> _Row:
        return cls(list(prompt) + list(completion),
                   list(range(len(prompt), len(prompt) + len(completion))),
                   list(logprobs[: len(completion)]), advantage, rollout)

    @property
    def prompt(self) -> list[int]:
        """The tokens before the first generated one."""
        return self.tokens[: self.scored[0]]


def timeline_rows(calls: list[_Call], advantage: float, rollout: int) -> list[_Row]:
    """A rollout's calls as rows: a call whose prompt extends the row so far (every turn of
    the loop's agents: the prompt is the earlier ids, then the feedback) joins it; any other
    call (the agent rewrote its history) starts a row of its own."""
    rows: list[_Row] = []
    for c in calls:
        if not c.completion_ids:
            continue
        last = rows[-1] if rows else None
        if last is not None and c.prompt_ids[: len(last.tokens)] == last.tokens:
            start = len(c.prompt_ids)
            last.tokens = list(c.prompt_ids) + list(c.completion_ids)
            last.scored += range(start, start + len(c.completion_ids))
            last.logprobs += c.logprobs[: len(c.completion_ids)]
        else:
            rows.append(_Row.one_call(c.prompt_ids, c.completion_ids, c.logprobs, advantage,
                                      rollout))
    return rows


@dataclass
class Packed:
    """Groups packed in one row: a group's common prompt prefix once, then each row's rest
    (its tokens after the prefix), each seeing only the prefix and itself (a 4-D additive
    mask), positions continuing from the prefix."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    mask: torch.Tensor  # [1, 1, T, T] 0 where visible, finfo.min elsewhere
    pred: torch.Tensor  # [N] position whose logits score each generated token
    targets: torch.Tensor  # [N]
    old_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    seq_index: torch.Tensor  # [N] the rollout each token belongs to (its calls: one sequence)
    rows: torch.Tensor | None = None  # [N] padded: the row of each scored token
    layout: str = "tree"  # tree: one row, `mask` 4-D; padded: [B, T], `mask` 2-D (0/1)


def _common_prefix(rows: list[_Row]) -> int:
    first = rows[0].prompt
    n = min(len(r.prompt) for r in rows)
    for r in rows[1:]:
        i = 0
        while i < n and r.tokens[i] == first[i]:
            i += 1
        n = i
    return n


def pack(groups: list[list[_Row]]) -> Packed:
    tokens: list[int] = []
    positions: list[int] = []
    group_of: list[int] = []
    branch_of: list[int] = []  # -1: the group's shared prefix
    pred: list[int] = []
    targets: list[int] = []
    old: list[float] = []
    adv: list[float] = []
    seq: list[int] = []
    for gi, rows in enumerate(groups):
        shared = _common_prefix(rows)
        last_shared = len(tokens) + shared - 1
        tokens += rows[0].tokens[:shared]
        positions += range(shared)
        group_of += [gi] * shared
        branch_of += [-1] * shared
        for bi, row in enumerate(rows):
            start = len(tokens)
            rest = row.tokens[shared:]
            tokens += rest
            positions += range(shared, shared + len(rest))
            group_of += [gi] * len(rest)
            branch_of += [bi] * len(rest)
            for i in row.scored:
                # token i is predicted at i - 1; the first of a branch with no prompt of its
                # own, at the prefix's last token
                at = start + i - shared - 1
                pred.append(at if at >= start else last_shared)
                targets.append(row.tokens[i])
            old += row.logprobs
            adv += [row.advantage] * len(row.scored)
            seq += [row.rollout] * len(row.scored)
    g = torch.tensor(group_of)
    b = torch.tensor(branch_of)
    n = len(tokens)
    visible = (
        torch.ones(n, n, dtype=torch.bool).tril()
        & (g[:, None] == g[None, :])
        & ((b[None, :] == -1) | (b[None, :] == b[:, None]))
    )
    mask = torch.zeros(n, n).masked_fill_(~visible, torch.finfo(torch.float32).min)
    return Packed(
        input_ids=torch.tensor([tokens]), position_ids=torch.tensor([positions]),
        mask=mask[None, None], pred=torch.tensor(pred), targets=torch.tensor(targets),
        old_logprobs=torch.tensor(old), advantages=torch.tensor(adv), seq_index=torch.tensor(seq),
    )


def pack_padded(groups: list[list[_Row]]) -> Packed:
    """The rows right-padded to one width, a 2-D 0/1 mask: each row attends causally to
    its own tokens, positions from 0."""
    rows = [r for g in groups for r in g]
    width = max(len(r.tokens) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    at: list[int] = []
    which: list[int] = []
    for i, r in enumerate(rows):
        ids[i, : len(r.tokens)] = torch.tensor(r.tokens)
        mask[i, : len(r.tokens)] = 1
        at += [j - 1 for j in r.scored]
        which += [i] * len(r.scored)
    return Packed(
        input_ids=ids, position_ids=torch.arange(width).expand(len(rows), width), mask=mask,
        pred=torch.tensor(at), targets=torch.tensor([t for r in rows for t in
                                                       (r.tokens[j] for j in r.scored)]),
        old_logprobs=torch.tensor([x for r in rows for x in r.logprobs]),
        advantages=torch.tensor([r.advantage for r in rows for _ in r.scored]),
        seq_index=torch.tensor([r.rollout for r in rows for _ in r.scored]),
        rows=torch.tensor(which), layout="padded",
    )


def _chunks(groups: list[list[_Row]], budget: int) -> list[list[list[_Row]]]:
    """Whole groups per micro-batch, at most `budget` tokens each (a larger group alone)."""
    out: list[list[list[_Row]]] = [[]]
    used = 0
    for rows in groups:
        size = sum(len(r.tokens) for r in rows)  # an upper bound
        if out[-1] and used + size > budget:
            out.append([])
            used = 0
        out[-1].append(rows)
        used += size
    return out


def packed_logprobs(model: Any, batch: Packed) -> torch.Tensor:
    """log p(target | context) for every completion token: [N], float32; the vocabulary
    projection runs only at the scored positions."""
    if batch.layout == "padded":
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        hidden = base.get_decoder()(
            input_ids=batch.input_ids, attention_mask=batch.mask, use_cache=False,
        ).last_hidden_state  # [B, T, H]
        logits = base.get_output_embeddings()(hidden[batch.rows, batch.pred])  # [N, V]
        return torch.log_softmax(logits.float(), -1).gather(-1, batch.targets[:, None]).squeeze(-1)
    keep, column = torch.unique(batch.pred, return_inverse=True)  # [K], [N]
    out = model(
        input_ids=batch.input_ids, attention_mask=batch.mask, position_ids=batch.position_ids,
        logits_to_keep=keep, use_cache=False,
    )
    logp = torch.log_softmax(out.logits[0, column].float(), dim=-1)  # [N, V]
    return logp.gather(-1, batch.targets[:, None]).squeeze(-1)


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
