"""`jetctl eval`: a task's held-out rows through its agent, env and reward, no training.

    report = evaluate(open_source(Path("runs/word-problems")), ["base", "latest"],
                      split="test", samples=4)

For each checkpoint (jetctl/server/trained.py: `base`, `latest`, `step-N`) the model is loaded in
this process, and every row of the split runs `samples` times (K) through the task's own
agent and env session, the env's reward scoring it, exactly as in training but with the
model answering from here: the agent's `llm.client()` is an in-process stand-in for the
OpenAI client whose calls are parked until every live rollout has made one (the turn barrier,
jetctl/turns.py), then answered by one left-padded `model.generate` (the recipe's `sampling:`
fills what the agent leaves out). Nothing is sent to a server or trained.

Figures per task and checkpoint (rows n, K samples each, reward r, "correct": r >= 1):

* pass_at_1 = mean over rows of (correct samples / K)   (the unbiased pass@1 estimator)
* pass_at_k = fraction of rows with at least one correct sample
* mean_reward, well_formed (an answer could be extracted from the reply, by the reward's
  own extraction), tokens_per_answer (completion tokens per rollout)
* two checkpoints: the difference of mean reward with a 95% interval, paired by row
  (mean of the per-row differences d_i, +- 1.96 sd(d) / sqrt(n)).

A rollout whose reward raises is failed: counted in `failed`, left out of every figure.
`max_rows` scores the split's first rows only (the cost of an in-run eval).

The figures are kept in RUN_DIR/eval/step-N.<split>.json, `{task: figures}` (`save_results`;
`latest_results` reads each task's newest for `jetctl status`). A task's `eval: {every_steps:
N}` has its server run this module's CLI after due checkpoints (jetctl/server/evals.py).

Left out: tasks that are not dataset tasks (their env has no fixed rows to hold out), and
generation on a server (the model is loaded here, on the recipe's device).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jetctl.client.rollout import read_reward
from jetctl.envs.dataset import DatasetEnv
from jetctl.recipe import TaskConfig
from jetctl.rewards import DEFAULT_EXTRACT, AnswerReward, RewardError, well_formed
from jetctl.server.trained import Checkpoint, RunSource, TrainedError, find_checkpoint, load_at
from jetctl.turns import TurnBarrier

Z_95 = 1.96
MIN_SHARED_PREFIX = 16  # tokens; a shorter common prefix is not worth a separate forward
CORRECT = 1.0 - 1e-9


@dataclass
class _Call:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    done: threading.Event = field(default_factory=threading.Event)
    completion_ids: list[int] = field(default_factory=list)


@dataclass
class _Rollout:
    task: Any
    calls: list[_Call] = field(default_factory=list)
    reward: float | None = None
    completion: str = ""
    error: str = ""


class _Completions:
    def __init__(self, answer: Callable[[list[dict[str, Any]], dict[str, Any]], Any]) -> None:
        self._answer = answer

    def create(self, *, messages: list[dict[str, Any]], model: str = "", **kw: Any) -> Any:
        return self._answer(messages, kw)


class _AsyncCompletions(_Completions):
    async def create(self, *, messages: list[dict[str, Any]], model: str = "", **kw: Any) -> Any:  # type: ignore[override]
        return await asyncio.to_thread(self._answer, messages, kw)


class _Client:
    """The slice of `openai.OpenAI` an agent uses: `client.chat.completions.create(...)`."""

    def __init__(self, completions: _Completions) -> None:
        self.chat = type("Chat", (), {"completions": completions})()

    async def close(self) -> None:
        pass


class _EvalLLM:
    """Stands where a rollout gets `jetctl.env.LLM`."""

    def __init__(self, answer: Callable[[list[dict[str, Any]], dict[str, Any]], Any],
                 model: str) -> None:
        self._answer = answer
        self.model = model
        self.base_url = "in-process://eval"
        self.roles: tuple[str, ...] = ()

    def client(self) -> _Client:
        return _Client(_Completions(self._answer))

    def async_client(self) -> _Client:
        return _Client(_AsyncCompletions(self._answer))


@dataclass(frozen=True)
class TaskFigures:
    pass_at_1: float
    pass_at_k: float
    mean_reward: float
    well_formed: float
    tokens_per_answer: float
    rows: int
    samples: int  # K
    failed: int
    step: int
    row_rewards: list[float] = field(repr=False, default_factory=list)  # per row, mean of K


@dataclass(frozen=True)
class Difference:
    mean_reward: float  # second - first
    ci95: float  # half width
    first: str
    second: str


class Runner:
    """One model answering the rollouts of one checkpoint."""

    def __init__(self, model: Any, tokenizer: Any, task: TaskConfig, seed: int) -> None:
        self.model, self.tokenizer, self.task = model, tokenizer, task
        eos = tokenizer.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        self.seed = seed
        self.batcher: TurnBarrier[_Call] = TurnBarrier(0)

    def _answer(self, rollout: _Rollout) -> Callable[[list[dict[str, Any]], dict[str, Any]], Any]:
        def answer(messages: list[dict[str, Any]], kw: dict[str, Any]) -> Any:
            from openai.types.chat import ChatCompletion

            sampling = self.task.sampling
            prompt = self.tokenizer.apply_chat_template(
                messages, tools=kw.get("tools"), add_generation_prompt=True, tokenize=True,
                return_dict=True)["input_ids"]
            call = _Call(
                list(prompt),
                int(kw.get("max_tokens") or kw.get("max_completion_tokens") or sampling.max_tokens),
                float(kw.get("temperature", sampling.temperature)),
                float(kw.get("top_p", sampling.top_p)),
            )
            rollout.calls.append(self.batcher.ask(call))
            text = self.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
            return ChatCompletion.model_validate({
                "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": "eval",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}],
            })
        return answer

    def _run_one(self, env: DatasetEnv, agent: Callable[..., Any], r: _Rollout) -> None:
        try:
            session = env.open(r.task)
            try:
                out = agent(r.task, _EvalLLM(self._answer(r), self.task.model or ""), session)
                if inspect.iscoroutine(out):
                    asyncio.run(out)
                r.completion = getattr(session, "completion", None) or ""
                raw = session.reward()
                r.reward = read_reward(raw)[0]  # a team's per-role rewards: their mean
            finally:
                session.close()
        except RewardError as exc:
            r.error = str(exc)
        except Exception as exc:  # noqa: BLE001  # the agent's failure is this rollout's data
            r.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.batcher.finished()

    def run(self, env: DatasetEnv, agent: Callable[..., Any], rollouts: list[_Rollout]) -> None:
        self.batcher = TurnBarrier(len(rollouts))
        threads = [threading.Thread(target=self._run_one, args=(env, agent, r), daemon=True)
                   for r in rollouts]
        for t in threads:
            t.start()
        while (calls := self.batcher.next_turn()) is not None:
            self._generate(calls)
        for t in threads:
            t.join()

    def _generate(self, calls: list[_Call]) -> None:
        """One `generate` for the calls of a turn. The prompts' common prefix (the system
        message and worked examples every row shares) is computed once and its KV cache
        repeated for each row; each row is `prefix + left padding + its own suffix` (the
        attention mask skips the padding; positions come from the mask). The same replies as
        padding whole prompts (tests/run/test_eval.py compares them greedily; on SmolLM2 the
        first step's logits differed by 3e-5 at most, float32 rounding of other shapes)."""
        import torch
        from transformers import DynamicCache, GenerationConfig

        prefix = _common_prefix([c.prompt_ids for c in calls]) if len(calls) > 1 else []
        if len(prefix) < MIN_SHARED_PREFIX:
            prefix = []
        n = len(prefix)
        width = max(len(c.prompt_ids) for c in calls) - n
        ids = torch.full((len(calls), n + width), self.pad, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(calls), n + width), dtype=torch.long)
        for i, c in enumerate(calls):
            suffix = c.prompt_ids[n:]
            ids[i, :n] = torch.tensor(prefix, dtype=torch.long)
            mask[i, :n] = 1
            ids[i, n + width - len(suffix):] = torch.tensor(suffix)
            mask[i, n + width - len(suffix):] = 1
        temperature = calls[0].temperature
        config = GenerationConfig(
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
            top_p=calls[0].top_p if temperature > 0 else None, top_k=None,
            max_new_tokens=max(c.max_tokens for c in calls), eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        device = next(self.model.parameters()).device
        extra: dict[str, Any] = {}
        with torch.no_grad():
            if n:
                cache = DynamicCache(config=self._config())
                self.model(input_ids=ids[:1, :n].to(device), cache=cache, use_cache=True)
                cache.batch_repeat_interleave(len(calls))
                extra["cache"] = cache
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=config, **extra)
        new = out[:, n + width:].tolist()  # [B, T_new]
        for c, toks in zip(calls, new):
            toks = toks[: c.max_tokens]
            for j, tok in enumerate(toks):
                if tok in self.eos:
                    toks = toks[: j + 1]
                    break
            c.completion_ids = toks
            c.done.set()

    def _config(self) -> Any:
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return base.config


def _common_prefix(prompts: list[list[int]]) -> list[int]:
    """The longest prefix every prompt shares, one token short of the shortest prompt (each
    row keeps a suffix of at least one token to start its generation from)."""
    shortest = min(len(p) for p in prompts)
    n = 0
    while n < shortest - 1 and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return prompts[0][:n]


def dataset_env(task: TaskConfig, split: str) -> DatasetEnv:
    from jetctl.client.rollout import load_object

    make_env = load_object(task.env)
    env = make_env(**{**task.env_args, "split": split})
    if not isinstance(env, DatasetEnv):
        raise TrainedError(f"{task.env} is not a dataset env (jetctl.envs.dataset): jetctl "
                           "eval needs fixed rows to hold out")
    return env


def figures(env: DatasetEnv, rollouts: list[_Rollout], samples: int, step: int) -> TaskFigures:
    reward_fn = env.reward_fn()
    extract = reward_fn.extract if isinstance(reward_fn, AnswerReward) else DEFAULT_EXTRACT
    ok = [r for r in rollouts if r.reward is not None]
    by_row: dict[str, list[float]] = {}
    for r in ok:
        by_row.setdefault(r.task.id, []).append(float(r.reward or 0.0))
    row_correct = [sum(x >= CORRECT for x in rs) / len(rs) for rs in by_row.values()]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    return TaskFigures(
        pass_at_1=mean(row_correct),
        pass_at_k=mean([float(c > 0) for c in row_correct]),
        mean_reward=mean([float(r.reward or 0.0) for r in ok]),
        well_formed=mean([float(well_formed(r.completion, extract)) for r in ok]),
        tokens_per_answer=mean([float(sum(len(c.completion_ids) for c in r.calls)) for r in ok]),
        rows=len(by_row), samples=samples, failed=len(rollouts) - len(ok), step=step,
        row_rewards=[mean(rs) for rs in by_row.values()],
    )


def difference(first: str, a: TaskFigures, second: str, b: TaskFigures) -> Difference:
    """b - a in mean reward, with a 95% interval paired by row (same rows, same order)."""
    d = [y - x for x, y in zip(a.row_rewards, b.row_rewards)]
    n = len(d)
    mean_d = sum(d) / n if n else float("nan")
    sd = math.sqrt(sum((x - mean_d) ** 2 for x in d) / (n - 1)) if n > 1 else float("nan")
    return Difference(mean_d, Z_95 * sd / math.sqrt(n) if n > 1 else float("nan"), first, second)


def evaluate(
    source: RunSource, checkpoints: list[str], *, tasks: list[str] | None = None,
    split: str = "test", samples: int = 4, batch: int = 64, seed: int = 0,
    max_rows: int | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, dict[str, TaskFigures]]:
    """{checkpoint label: {task: figures}} for the tasks (default: every dataset task), over
    the split's first `max_rows` rows (None: all; the split's order is fixed, so the same
    rows each time)."""
    import torch

    from jetctl.client.rollout import load_object

    names = tasks or [n for n, t in source.recipe.tasks.items() if t.env.startswith("jetctl.envs.dataset:")]
    if not names:
        raise TrainedError("the recipe has no dataset task (env: jetctl.envs.dataset:make_env)")
    unknown = [n for n in names if n not in source.recipe.tasks]
    if unknown:
        raise TrainedError(f"no task {unknown[0]!r} (tasks: {', '.join(source.recipe.tasks)})")
    if samples < 1:
        raise TrainedError(f"--samples ({samples}) must be at least 1")
    if max_rows is not None and max_rows < 1:
        raise TrainedError(f"--max-rows ({max_rows}) must be at least 1")
    report: dict[str, dict[str, TaskFigures]] = {}
    for label in checkpoints:
        report[label] = {}
        for name in names:
            task = source.recipe.tasks[name]
            model_name = source.model_name(task.model)
            ckpt: Checkpoint = find_checkpoint(source, model_name, label)
            model, tokenizer = load_at(source.recipe.models[model_name], ckpt)
            torch.manual_seed(seed)
            env = dataset_env(task, split)
            agent = load_object(task.agent)
            n_rows = len(env.rows) if max_rows is None else min(max_rows, len(env.rows))
            rollouts = [_Rollout(env.task(i)) for i in range(n_rows) for _ in range(samples)]
            runner = Runner(model, tokenizer, task, seed)
            for start in _chunks(len(rollouts), batch):
                runner.run(env, agent, rollouts[start:start + batch])
                if on_progress is not None:
                    on_progress(f"{label} {name}", min(start + batch, len(rollouts)), len(rollouts))
            report[label][name] = figures(env, rollouts, samples, ckpt.step)
    return report


def _chunks(n: int, size: int) -> Iterator[int]:
    return iter(range(0, n, size))


def results_path(run_dir: Path, step: int, split: str) -> Path:
    """Where `jetctl eval` keeps a run's figures at a step (read by the export's model card)."""
    from jetctl.rundir import RunPaths

    return RunPaths(run_dir).eval_results(step, split)


def save_results(source: RunSource, report: dict[str, dict[str, TaskFigures]], split: str) -> None:
    """Each checkpoint's figures beside the run (nothing when the recipe has no run dir):
    `{task: figures}` per step and split; the tasks scored now replace their own entries
    and keep the others' (two tasks' in-run evals of one step share the file)."""
    from jetctl.rundir import read_json, write_json_atomic

    if source.run_dir is None:
        return
    for tasks in as_json(report).values():
        step = next(iter(tasks.values()))["step"]
        path = results_path(source.run_dir, step, split)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**(read_json(path) or {}), **tasks})


def latest_results(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per task, the figures of the newest step evaluated (`jetctl eval` or an in-run eval):
    `{task: {step, split, pass_at_1, mean_reward, ...}}`; {} when nothing was evaluated.
    At one step, the test split's figures win over another split's."""
    from jetctl.rundir import RunPaths, read_json

    found: dict[str, tuple[tuple[int, bool], dict[str, Any]]] = {}
    for step, split, path in RunPaths(run_dir).eval_result_files():
        rank = (step, split == "test")
        for task, figures in (read_json(path) or {}).items():
            if isinstance(figures, dict) and (task not in found or rank > found[task][0]):
                found[task] = (rank, {**figures, "split": split})
    return {task: figures for task, (_, figures) in sorted(found.items())}


def as_json(report: dict[str, dict[str, TaskFigures]]) -> dict[str, Any]:
    return {label: {task: {k: v for k, v in asdict(f).items() if k != "row_rewards"}
                    for task, f in tasks.items()} for label, tasks in report.items()}
