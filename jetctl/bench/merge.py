"""`jetctl bench merge`: naive vs linear vs tree training steps, side by side, from one run.

Four workloads are built as real Trajectory objects whose LLMCall token ids come from the
model's tokenizer and chat template (prompts re-rendered turn by turn with token-id reuse,
as the client proxy records them; completions are fixed pseudo-random text; behaviour
logprobs are fixed pseudo-random numbers):

1. a tool agent, 4 calls (search, read, test, answer);
2. a tool agent, 12 calls with long tool observations;
3. a GRPO group, G = 8 completions of one ~1k-token prompt;
4. three agents discussing a shared ~2k-token document, 3 rounds (one group).

For every (workload, mode) a fresh spawned process loads the model as the server does
(``finetune: lora`` with the recipe's LoRA defaults, fp32, ``--attn jetctl_tree``: sdpa
that computes a tree-packed row segment by segment, jetctl/kernels/tree_attention.py;
``off`` / ``linear`` rows run plain sdpa under it) and runs exactly the trainer's
code: ``jetctl.server.step.train_step`` (``merge.timeline_sequences`` -> ``merge.pack``
under ``max_tokens_per_microbatch`` -> token_logprobs -> GRPO loss -> backward per
micro-batch -> gradient clipping), on the model ``step.load_trainable`` builds.
It reports tokens fed per optimizer step, forward and backward seconds (median over
repeats), and peak memory: the kernel's resident-set high-water mark (``VmHWM``) of that
process, reset through ``/proc/self/clear_refs`` just before the measured steps, so it
covers the steps only, with the loaded model resident (``ru_maxrss`` of the whole process
where the reset is not allowed). A fresh process per mode keeps one mode's allocator
leftovers out of the next mode's figure.

Run it: ``jetctl bench merge`` (~10 min on 2 cores), ``--quick`` for small workloads.

Left out: the optimizer step (the same in every mode; gradient clipping runs, timed in
neither figure), generation, and GPU memory (``torch.cuda.max_memory_allocated`` would be the figure there).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import resource
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from jetctl.types import LLMCall, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from jetctl.server.merge import MergeMode

MODES: tuple[MergeMode, ...] = ("off", "linear", "tree")
Attention = Literal["jetctl_tree", "sdpa", "eager"]  # jetctl.models.AttnImplementation
Finetune = Literal["lora", "full"]


# ----------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Sizes:
    """Token sizes of the workloads (approximate: text is cut at word boundaries)."""

    tools: int  # tool schemas in the system prompt of workloads 1 and 2
    task: int  # the user's task in workloads 1 and 2
    action: int  # an assistant turn (thought + tool call) in workloads 1 and 2
    observation_short: int  # tool output in workload 1
    observation_long: int  # tool output in workload 2
    grpo_prompt: int  # workload 3
    grpo_completion: tuple[int, int]  # workload 3: completion lengths drawn in [lo, hi]
    document: int  # workload 4
    message: int  # workload 4: one agent's turn
    rounds: int  # workload 4: every agent speaks once per round


DEFAULT_SIZES = Sizes(
    tools=3, task=40, action=30, observation_short=60, observation_long=110,
    grpo_prompt=1024, grpo_completion=(48, 160), document=2048, message=30, rounds=3,
)
QUICK_SIZES = Sizes(
    tools=1, task=12, action=10, observation_short=16, observation_long=40,
    grpo_prompt=160, grpo_completion=(8, 24), document=256, message=12, rounds=3,
)

WORKLOAD_NAMES = {
    1: "tool agent, 4 turns",
    2: "tool agent, 12 turns, long observations",
    3: "GRPO group, G=8, 1k-token prompt",
    4: "3 agents, shared 2k-token document",
}


@dataclass
class Workload:
    """One optimizer step's worth of trajectories, each with its advantage."""

    number: int
    name: str
    trajectories: list[tuple[Trajectory, float]]


_WORDS = [
    "the", "model", "returns", "a", "value", "when", "config", "file", "path", "is", "missing",
    "and", "we", "need", "to", "check", "which", "function", "reads", "it", "before", "tests",
    "run", "again", "because", "error", "handling", "in", "loader", "changed", "last", "week",
    "so", "parser", "should", "raise", "clear", "message", "about", "invalid", "field", "names",
    "while", "cache", "keeps", "old", "results", "from", "previous", "build", "step", "then",
    "server", "restarts", "worker", "pool", "after", "timeout", "during", "upload", "of", "large",
    "batch", "data", "into", "store", "table", "with", "index", "on", "user", "id", "column",
    "query", "plan", "shows", "full", "scan", "over", "rows", "that", "match", "filter", "by",
    "date", "range", "report", "summary", "lists", "total", "count", "average", "latency", "per",
    "request", "and", "memory", "usage", "peak", "under", "load", "test", "results",
]

_TOOLS = [
    ("search_code", "Search the repository for a regular expression.",
     {"pattern": "string", "path": "string"}),
    ("read_file", "Read a file of the repository, optionally a line range.",
     {"path": "string", "start": "integer", "end": "integer"}),
    ("run_tests", "Run the test suite or one test file and return the output.",
     {"target": "string", "timeout_s": "integer"}),
    ("edit_file", "Replace a unique snippet of a file with new text.",
     {"path": "string", "old": "string", "new": "string"}),
    ("list_dir", "List the files of a directory.", {"path": "string"}),
]


def _tool_schema(name: str, description: str, params: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    p: {"type": t, "description": f"the {p}"} for p, t in params.items()
                },
                "required": list(params)[:1],
            },
        },
    }


class _Text:
    """Deterministic English-like text cut to about ``n`` tokens of a given tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, rng: random.Random) -> None:
        self.tok = tokenizer
        self.rng = rng

    def count(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def words(self, n_tokens: int) -> str:
        words: list[str] = []
        text = ""
        while self.count(text) < n_tokens:
            for _ in range(max(4, (n_tokens - self.count(text)) // 2)):
                w = self.rng.choice(_WORDS)
                words.append(w.capitalize() + "." if self.rng.random() < 0.08 else w)
            text = " ".join(words)
        lo, hi = 1, len(words)  # the fewest words that reach n_tokens (binary search)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.count(" ".join(words[:mid])) >= n_tokens:
                hi = mid
            else:
                lo = mid + 1
        return " ".join(words[:lo])

    def code(self, n_tokens: int) -> str:
        """Lines that look like a file, a listing or a test log (tool observations)."""
        lines: list[str] = []
        while self.count("\n".join(lines)) < n_tokens:
            a, b = self.rng.choice(_WORDS), self.rng.choice(_WORDS)
            kind = self.rng.randrange(4)
            if kind == 0:
                lines.append(f"def {a}_{b}(path, limit={self.rng.randrange(100)}):")
            elif kind == 1:
                lines.append(f"    return {a}.{b}(path)  # {self.words(6)}")
            elif kind == 2:
                lines.append(f"src/{a}/{b}.py:{self.rng.randrange(1, 400)}: {a} = {b}")
            else:
                verdict = "PASSED" if self.rng.random() < 0.7 else "FAILED"
                lines.append(f"tests/test_{a}.py::test_{b} {verdict}")
        return "\n".join(lines)


class _Chat:
    """A conversation recorded call by call as a proxy records it (token-id reuse).

    Each call's prompt is the previous prompt + completion ids + the tokens of the text the
    chat template adds since then (new turns and the generation prompt), so the history of
    a timeline is append-only in token ids, as it is for a client that reuses ids.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        messages: list[dict[str, Any]],
        rng: random.Random,
        tools: list[dict[Any, Any] | Callable[..., Any]] | None = None,
    ) -> None:
        self.tok = tokenizer
        self.messages = list(messages)
        self.tools = tools
        self.rng = rng
        self.text = ""  # rendered text the ids below stand for
        self.ids: list[int] = []

    def _render(self, generation_prompt: bool) -> str:
        out = self.tok.apply_chat_template(
            self.messages, tools=self.tools, tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        assert isinstance(out, str)
        return out

    def _extend(self, text: str) -> list[int]:
        if not text.startswith(self.text):
            raise ValueError(
                "the chat template re-rendered earlier turns; the history is not append-only"
            )
        new = self.tok(text[len(self.text):], add_special_tokens=False)["input_ids"]
        self.text = text
        self.ids = self.ids + list(new)
        return list(new)

    def add(self, *messages: dict[str, Any]) -> None:
        self.messages.extend(messages)

    def call(self, reply: dict[str, Any]) -> LLMCall:
        """Record one LLM call whose completion is ``reply`` (an assistant message)."""
        self._extend(self._render(generation_prompt=True))
        prompt_ids = list(self.ids)
        self.messages.append({"role": "assistant", **reply})
        full = self._render(generation_prompt=False)
        eos = self.tok.eos_token or "<|im_end|>"
        # generation stops at eos; the template's text after it belongs to the next prompt
        cut = full.index(eos, len(self.text)) + len(eos)
        completion_ids = self._extend(full[:cut])
        logprobs = [-self.rng.uniform(0.01, 2.5) for _ in completion_ids]
        return LLMCall("policy", prompt_ids, completion_ids, logprobs, model_version=0)


def _tool_agent(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, sizes: Sizes, actions: int,
    observation: int, tid: str,
) -> Trajectory:
    text = _Text(tokenizer, rng)
    tools: list[dict[Any, Any] | Callable[..., Any]] = [
        _tool_schema(*t) for t in _TOOLS[: sizes.tools]
    ]
    chat = _Chat(
        tokenizer,
        [
            {"role": "system", "content": "You are a careful software engineer. Use the tools "
             "to inspect and fix the repository, then explain the fix."},
            {"role": "user", "content": text.words(sizes.task)},
        ],
        rng,
        tools,
    )
    calls = []
    for i in range(actions):
        name, _, params = _TOOLS[i % len(tools)]
        args = {
            p: (rng.randrange(1, 300) if t == "integer" else text.words(3))
            for p, t in params.items()
        }
        calls.append(chat.call({
            "content": text.words(max(sizes.action - 16, 4)),
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}],
        }))
        chat.add({"role": "tool", "content": text.code(observation)})
    calls.append(chat.call({"content": text.words(sizes.action + 10)}))
    return Trajectory(id=tid, group_id=f"g-{tid}", task="repo", task_id="0", calls=calls)


def _grpo_group(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, sizes: Sizes
) -> list[Trajectory]:
    text = _Text(tokenizer, rng)
    messages = [{"role": "user", "content": "Read the report and answer the question at the "
                 "end in <answer></answer> tags.\n\n" + text.words(sizes.grpo_prompt)
                 + "\n\nQuestion: which step restarts the worker pool?"}]
    trajs = []
    for g in range(8):  # G = 8
        chat = _Chat(tokenizer, messages, rng)
        answer = text.words(rng.randint(*sizes.grpo_completion)) + " <answer>restart</answer>"
        trajs.append(Trajectory(id=f"r{g}", group_id="grpo", task="report", task_id="0",
                                calls=[chat.call({"content": answer})]))
    return trajs


def _discussion(
    tokenizer: PreTrainedTokenizerBase, rng: random.Random, sizes: Sizes
) -> list[Trajectory]:
    """Three agents; the document sits in the shared system message, roles follow it."""
    text = _Text(tokenizer, rng)
    system = (
        "Three reviewers discuss the design document below, one message each per turn, "
        "and agree on the changes.\n\n# Design document\n\n" + text.words(sizes.document)
    )
    roles = ["author", "critic", "editor"]
    chats = [
        _Chat(tokenizer, [{"role": "system", "content": system},
                          {"role": "user", "content": f"You are the {r}. " + text.words(12)}], rng)
        for r in roles
    ]
    calls: list[list[LLMCall]] = [[] for _ in roles]
    unseen: list[list[str]] = [[] for _ in roles]  # messages of the others since a turn
    for _ in range(sizes.rounds):
        for a, chat in enumerate(chats):
            if unseen[a]:
                chat.add({"role": "user", "content": "\n\n".join(unseen[a])})
                unseen[a] = []
            said = text.words(sizes.message)
            calls[a].append(chat.call({"content": said}))
            for b in range(len(roles)):
                if b != a:
                    unseen[b].append(f"[{roles[a]}] {said}")
    return [Trajectory(id=r, group_id="team", task="review", task_id="0", role=r, calls=c)
            for r, c in zip(roles, calls)]


def build_workloads(
    tokenizer: PreTrainedTokenizerBase, numbers: list[int], *, quick: bool = False, seed: int = 0
) -> list[Workload]:
    """The requested workloads (1-4), rendered with ``tokenizer``'s chat template."""
    from jetctl.server.algorithms.grpo import group_advantages

    sizes = QUICK_SIZES if quick else DEFAULT_SIZES
    out = []
    for n in numbers:
        rng = random.Random(seed * 100 + n)
        trajs: list[tuple[Trajectory, float]]
        if n == 1:
            agent = _tool_agent(tokenizer, rng, sizes, 3, sizes.observation_short, "agent4")
            trajs = [(agent, 1.0)]
        elif n == 2:
            agent = _tool_agent(tokenizer, rng, sizes, 11, sizes.observation_long, "agent12")
            trajs = [(agent, 1.0)]
        elif n == 3:
            group = _grpo_group(tokenizer, rng, sizes)
            advs = group_advantages([1.0, 0.0, 0.0, 1.0, 0.2, 0.0, 1.0, 0.0])
            trajs = list(zip(group, advs))
        elif n == 4:
            team = _discussion(tokenizer, rng, sizes)
            trajs = list(zip(team, group_advantages([1.0, 0.0, 0.5])))
        else:
            raise ValueError(f"unknown workload {n}: choose from {sorted(WORKLOAD_NAMES)}")
        out.append(Workload(n, WORKLOAD_NAMES[n], trajs))
    return out


# ----------------------------------------------------------------------------- one step


@dataclass(frozen=True)
class StepFigures:
    """One forward+backward pass over a workload in one mode (the trainer's path)."""

    tokens_naive: int  # sum over calls of len(prompt + completion)
    tokens_fed: int  # real tokens fed to the model after merging / packing
    tokens_padded: int  # B * T summed over micro-batches (what is computed)
    scored_tokens: int
    microbatches: int
    pack_s: float  # timeline_sequences + pack (masks included)
    forward_s: float
    backward_s: float
    loss: float


def train_step(
    model: Any, workload: Workload, mode: MergeMode, max_tokens_per_microbatch: int,
    clip_eps: float,
) -> StepFigures:
    """The server's own step (``jetctl.server.step.train_step``, GRPO with the workload's
    fixed advantages) in ``mode``; the optimizer step is left to the caller."""
    from jetctl.recipe import OptimizerConfig, TrainConfig
    from jetctl.server import algorithms
    from jetctl.server import step as server_step

    tc = TrainConfig(merge=mode, clip_eps=clip_eps,
                     max_tokens_per_microbatch=max_tokens_per_microbatch)
    result = server_step.train_step(
        model, [[t for t, _ in workload.trajectories]], tc, algorithms.make(tc),
        max_grad_norm=OptimizerConfig().max_grad_norm,
        advantages=[[a for _, a in workload.trajectories]],
    )
    tokens_naive = sum(len(c.prompt_ids) + len(c.completion_ids)
                       for t, _ in workload.trajectories for c in t.calls)
    return StepFigures(
        tokens_naive=tokens_naive,
        tokens_fed=result.tokens_fed,
        tokens_padded=result.tokens_padded,
        scored_tokens=result.scored_tokens,
        microbatches=result.microbatches,
        pack_s=result.pack_s,
        forward_s=result.forward_s,
        backward_s=result.backward_s,
        loss=result.loss,
    )


def trainable_model(source: str, finetune: Finetune, attn: Attention) -> Any:
    """The model exactly as the server loads it (``step.load_trainable``, the recipe's
    defaults otherwise), with a choice of attention."""
    from jetctl.recipe import ModelConfig
    from jetctl.server.step import load_trainable

    model, _ = load_trainable(ModelConfig(model=source, finetune=finetune), attn)
    return model


# ----------------------------------------------------------------------------- memory


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _proc_status_kib("VmHWM") is not None


# ----------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class ModeResult:
    """A (workload, mode) cell of the table, measured in its own process."""

    workload: int
    mode: str
    tokens_naive: int
    tokens_fed: int
    tokens_padded: int
    scored_tokens: int
    microbatches: int
    pack_s: float  # median over repeats
    forward_s: float  # median over repeats
    backward_s: float  # median over repeats
    loss: float
    peak_rss_mib: float  # VmHWM over the measured steps (model resident), or ru_maxrss
    base_rss_mib: float  # RSS with the model loaded, just before the steps
    peak_method: str  # "VmHWM" (reset before the steps) or "ru_maxrss" (whole process)
    same_as: str = ""  # a mode with identical micro-batches, whose measurement this reuses

    @property
    def step_s(self) -> float:
        """Forward + backward seconds of one optimizer step."""
        return self.forward_s + self.backward_s

    @property
    def step_mib(self) -> float:
        """Peak memory the steps added on top of the loaded model."""
        return self.peak_rss_mib - self.base_rss_mib


@dataclass(frozen=True)
class RunOptions:
    model: str
    finetune: Finetune
    attn: Attention
    max_tokens_per_microbatch: int
    clip_eps: float
    repeats: int


def measure(workload: Workload, mode: MergeMode, opts: RunOptions) -> ModeResult:
    """Load the model, then time ``opts.repeats`` steps; meant for a fresh process."""
    import torch

    torch.set_num_threads(max(1, min(os.cpu_count() or 1, 4)))  # as the server does
    model = trainable_model(opts.model, opts.finetune, opts.attn)
    params = [p for p in model.parameters() if p.requires_grad]
    # warm the kernels up on a few tokens, so the first timed step is not a cold start
    first = workload.trajectories[0][0].calls[0]
    warm = Workload(0, "warm-up", [(Trajectory(
        id="w", group_id="w", task="w", task_id="0",
        calls=[LLMCall("policy", first.prompt_ids[:24], first.completion_ids[:8],
                       first.completion_logprobs[:8], 0)]), 1.0)])
    train_step(model, warm, mode, opts.max_tokens_per_microbatch, opts.clip_eps)
    model.zero_grad(set_to_none=True)

    base_kib = _proc_status_kib("VmRSS") or 0
    method = "VmHWM" if _reset_peak_rss() else "ru_maxrss"
    figures = []
    for _ in range(opts.repeats):
        for p in params:
            p.grad = None
        figures.append(train_step(model, workload, mode, opts.max_tokens_per_microbatch,
                                  opts.clip_eps))
    if method == "VmHWM":
        peak_kib = _proc_status_kib("VmHWM") or 0
    else:  # ru_maxrss is KiB on Linux: the peak of the whole process, model load included
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    f = figures[0]
    return ModeResult(
        workload=workload.number, mode=mode, tokens_naive=f.tokens_naive,
        tokens_fed=f.tokens_fed, tokens_padded=f.tokens_padded, scored_tokens=f.scored_tokens,
        microbatches=f.microbatches,
        pack_s=statistics.median(x.pack_s for x in figures),
        forward_s=statistics.median(x.forward_s for x in figures),
        backward_s=statistics.median(x.backward_s for x in figures),
        loss=f.loss, peak_rss_mib=peak_kib / 1024, base_rss_mib=base_kib / 1024,
        peak_method=method,
    )


def _worker(workload: Workload, mode: MergeMode, opts: RunOptions, conn: Any) -> None:
    import warnings

    from transformers.utils import logging as hf_logging

    # the parent draws the progress; keep load bars and deprecation notes off the terminal
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        conn.send(("ok", measure(workload, mode, opts)))
    except BaseException as exc:  # reported by the parent with the cell it belongs to
        import traceback

        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise


class BenchError(Exception):
    """A worker failed (out of memory, a bad model source...); the message says which."""


def measure_in_subprocess(workload: Workload, mode: MergeMode, opts: RunOptions) -> ModeResult:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(workload, mode, opts, child), daemon=True)
    proc.start()
    child.close()
    try:
        status, payload = parent.recv()
    except EOFError:
        proc.join()
        raise BenchError(
            f"workload {workload.number} mode {mode}: the worker died with exit code "
            f"{proc.exitcode} (killed for memory? try --max-tokens-per-microbatch lower or "
            "--attn jetctl_tree or sdpa rather than eager)"
        ) from None
    proc.join()
    if status != "ok":
        raise BenchError(f"workload {workload.number} mode {mode} failed: {payload}")
    assert isinstance(payload, ModeResult)
    return payload


def _layout(workload: Workload, mode: MergeMode, budget: int) -> str:
    """A digest of the micro-batches ``mode`` feeds the model: equal digests, equal work."""
    import hashlib

    from jetctl.server import merge

    sequences = [s for t, a in workload.trajectories for s in merge.timeline_sequences(t, a, mode)]
    h = hashlib.sha256()
    for mb in merge.pack(sequences, mode, budget):
        for x in (mb.input_ids, mb.position_ids, mb.attention_mask, mb.pred_index, mb.targets,
                  mb.old_logprobs, mb.advantages):
            h.update(str((x.dtype, tuple(x.shape))).encode())
            h.update(x.numpy().tobytes())
    return h.hexdigest()


def run(
    workloads: list[Workload],
    opts: RunOptions,
    *,
    on_start: Callable[[Workload, str], None] | None = None,
    on_done: Callable[[ModeResult], None] | None = None,
    isolate: bool = True,
) -> list[ModeResult]:
    """Every workload in every mode, each in a fresh process (``isolate``), in table order.

    A mode whose micro-batches are identical to an earlier mode's (``linear`` on a GRPO
    group of single calls is exactly ``off``) reuses that measurement, marked ``same_as``:
    the model would do the same arithmetic again.
    """
    results = []
    for w in workloads:
        seen: dict[str, ModeResult] = {}
        for mode in MODES:
            if on_start:
                on_start(w, mode)
            layout = _layout(w, mode, opts.max_tokens_per_microbatch)
            if layout in seen:
                r = replace(seen[layout], mode=mode, same_as=seen[layout].mode)
            else:
                r = measure_in_subprocess(w, mode, opts) if isolate else measure(w, mode, opts)
                seen[layout] = r
            results.append(r)
            if on_done:
                on_done(r)
    return results


# ----------------------------------------------------------------------------- ratios


@dataclass(frozen=True)
class Ratios:
    """A mode against naive (``off``) on the same workload: > 1 is better for all three."""

    tokens: float  # naive tokens fed / mode tokens fed
    time: float  # naive step seconds / mode step seconds
    memory: float  # naive peak RSS / mode peak RSS


def ratios(results: list[ModeResult]) -> dict[tuple[int, str], Ratios]:
    naive = {r.workload: r for r in results if r.mode == "off"}
    return {
        (r.workload, r.mode): Ratios(
            tokens=naive[r.workload].tokens_fed / r.tokens_fed,
            time=naive[r.workload].step_s / r.step_s,
            memory=naive[r.workload].peak_rss_mib / r.peak_rss_mib,
        )
        for r in results if r.workload in naive
    }


@dataclass(frozen=True)
class Target:
    workload: int
    what: str
    reached: float
    goal: float

    @property
    def met(self) -> bool:
        return self.reached >= self.goal


# (workload, figure, goal): the gains merging is meant to bring; judged on the recipe's
# default mode, tree
TARGETS: tuple[tuple[int, Literal["time", "tokens"], float], ...] = (
    (1, "time", 3.0), (2, "time", 10.0), (3, "time", 4.0), (4, "tokens", 5.0),
)


def targets(results: list[ModeResult], mode: str = "tree") -> list[Target]:
    rs = ratios(results)
    out = []
    for w, figure, goal in TARGETS:
        if (w, mode) in rs:
            r = rs[(w, mode)]
            out.append(Target(w, f"{figure} vs naive ({mode})", getattr(r, figure), goal))
    for (w, m), r in sorted(rs.items()):
        if m != "off":
            out.append(Target(w, f"peak memory vs naive ({m})", r.memory, 1.0))
    return out


def to_json(results: list[ModeResult], opts: RunOptions) -> dict[str, Any]:
    rs = ratios(results)
    return {
        "options": asdict(opts),
        "results": [
            {**asdict(r), "step_s": r.step_s, "step_mib": r.step_mib,
             "ratios": asdict(rs[(r.workload, r.mode)]) if (r.workload, r.mode) in rs else None}
            for r in results
        ],
        "targets": [{**asdict(t), "met": t.met} for t in targets(results)],
    }
