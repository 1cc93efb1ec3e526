"""Recipe schema: one pydantic model tree for the run, its models and its tasks.

Load with `load_recipe(path)`; errors come all at once as a `RecipeError` whose issues
carry the YAML line, the dotted key, the value and the fix (`jetctl validate FILE`).
`${VAR}` and `${VAR:-default}` are interpolated from the environment into scalar values
before validation (`$${` writes a literal `${`).

Cross-field checks (e.g. `concurrency` vs `group_size`) live in `model_validator`s on the
smallest model that holds both fields. They run once that model's own fields are valid,
so a recipe with type errors reports those first and its cross-field problems on the
next run, as pydantic does.

Left out: checking that `env`/`agent` modules import (only their `module:function` syntax
is checked; importing user code belongs to the client) and that model sources exist.

The field reference in docs/recipe.md is generated from this schema:
`python -m jetctl.recipe --write-docs docs/recipe.md`.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
import sys
import types
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticUndefined

from jetctl.deterministic import SEEDED_ENGINES
from jetctl.server.algorithms import AlgorithmName  # the registry (imports no torch)

# --------------------------------------------------------------------------- schema


class _Missing:
    """The value of a Problem about a key that is not there (shown without a value)."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


class Problem(NamedTuple):
    """One cross-field problem found by a validator; `loc` is relative to its model."""

    loc: tuple[str | int, ...]
    value: object
    message: str


class CrossFieldError(ValueError):
    """Raised by model validators with every problem they found, so each keeps its key.

    pydantic wraps it as a `value_error` whose `ctx["error"]` is this object; the loader
    prefixes each problem's `loc` with the error's and so reports the exact YAML line.
    """

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__(
            "; ".join(f"{_dotted(p.loc)} = {_show(p.value)}: {p.message}" for p in problems)
        )


def _raise_problems(problems: list[Problem]) -> None:
    if problems:
        raise CrossFieldError(problems)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_M = TypeVar("_M", bound=BaseModel)


def checkpoint_url_problem(url: str, packages: bool = True) -> str:
    """Why `checkpoint.dir` cannot be written ('' when it can): an fsspec URL whose scheme is
    unknown or whose filesystem package is missing (`packages`: on this host), or one that
    would not outlive the server."""
    if "://" not in url:
        return ""  # a local folder
    scheme = url.split("://", 1)[0]
    if scheme == "memory":
        return (
            "memory:// lives only inside the server process, so a restarted server would find "
            "no checkpoint: use a folder or a durable URL (file://, s3://, ...)"
        )
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        return f"unknown filesystem {scheme!r}: use a folder or an fsspec URL (file://, s3://, ...)"
    except ImportError as err:
        if not packages:
            return ""
        return f"the {scheme}:// filesystem needs a package that is not installed ({err}); or use a folder"
    return ""


def server_host_problems(cfg: ModelConfig) -> list[Problem]:
    """What the host that runs this model's server must have installed: checked by
    `jetctl validate` and `up` for a server they start here (runtime: process), and by the
    server itself when it starts elsewhere (runtime: ray or external), on its own host."""
    problems: list[Problem] = []
    if cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append(
            Problem(
                ("engine",),
                cfg.engine,
                "needs the vllm package, which is not importable on the server's host: run "
                "`pip install vllm` on a CUDA machine, or use engine: hf",
            )
        )
    if cfg.checkpoint.dir is not None:
        problem = checkpoint_url_problem(cfg.checkpoint.dir)
        if problem:
            problems.append(Problem(("checkpoint", "dir"), cfg.checkpoint.dir, problem))
    return problems


class LoraConfig(_Strict):
    r: int = Field(default=16, ge=1, description="LoRA rank")
    alpha: int = Field(
        default=32, ge=1, description="LoRA scale; the update is scaled by alpha / r"
    )
    dropout: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the LoRA input, in the trainer's forward only (generation "
        "never sees it)",
    )
    target_modules: list[str] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj"],
        description="names of the modules to adapt",
    )


class OptimizerConfig(_Strict):
    lr: float = Field(default=1e-5, gt=0, description="learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="decoupled weight decay")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="Adam (beta1, beta2)")
    max_grad_norm: float = Field(
        default=1.0, gt=0, description="clip gradients to this global L2 norm"
    )


class TrainConfig(_Strict):
    algorithm: AlgorithmName = Field(
        default="grpo",
        description="policy-gradient algorithm, one file each in jetctl/server/algorithms/: "
        "grpo (group-normalised advantages, PPO-clip, token mean), dr_grpo (no std "
        "normalisation, constant normaliser), dapo (clip-higher: clip_eps_high), gspo "
        "(sequence-level ratio and clip), rloo (leave-one-out baseline)",
    )
    groups_per_step: int = Field(default=2, ge=1, description="groups in one optimizer step")
    max_staleness: int = Field(
        default=4,
        ge=0,
        description="refuse groups whose lag (server version - oldest call version) "
        "exceeds this many steps",
    )
    order: Literal["oldest", "newest"] = Field(
        default="oldest",
        description="which buffered groups a step takes first: oldest (arrival order) or "
        "newest (made at the highest model version first: the freshest data when generation "
        "outruns training; older groups wait, and are refused once past max_staleness)",
    )
    clip_eps: float = Field(
        default=0.2, gt=0, description="epsilon of PPO-clip: ratio clipped to [1 - eps, 1 + eps]"
    )
    clip_eps_high: float | None = Field(
        default=None, gt=0,
        description="algorithm dapo: the upper clip range eps_high, ratio clipped to "
        "[1 - clip_eps, 1 + clip_eps_high] (null: DAPO's 0.28)",
    )
    tis_cap: float | None = Field(
        default=None, ge=1,
        description="truncated importance sampling, with any algorithm: weight each token by "
        "min(exp(logp_trainer - logp_engine), tis_cap), correcting the gap between the "
        "engine's and the trainer's logprobs (null: off; e.g. 2.0)",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="beta: weight of the KL penalty against the reference policy, the base "
        "model (finetune: lora only; 0: none)",
    )
    merge: Literal["off", "linear", "tree"] = Field(
        default="tree",
        description="off: one sequence per call; linear: merge calls whose context extends "
        "an earlier call; tree: also pack shared prefixes as a prefix tree",
    )
    max_tokens_per_microbatch: int = Field(
        default=8192, ge=64, description="token budget of one forward/backward micro-batch"
    )
    threads: int | None = Field(
        default=None, ge=1,
        description="CPU threads of the trainer's torch work (null: the cores generation.threads "
        "leaves, at least one)",
    )
    max_steps: int | None = Field(
        default=None, ge=1,
        description="stop training after this many steps (null: no limit); the server "
        "checkpoints and exits, the client nodes of the tasks that train this model drain, "
        "and the run ends when every model is done",
    )
    mix: dict[str, float] = Field(
        default={},
        description="task -> share of each batch's groups, e.g. {web: 0.5, code: 0.3, api: 0.2}"
        " (shares sum to 1; every task training this model named). {}: batches take groups "
        "in the order they arrive, whatever their task",
    )
    mix_wait_s: float = Field(
        default=10.0,
        gt=0,
        description="with mix: how long a batch waits for a task short of its share before "
        "other tasks' groups fill its slots (counted; the task shown starving)",
    )

    @field_validator("mix")
    @classmethod
    def _shares(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {t: v for t, v in value.items() if not v > 0}
        if bad:
            raise ValueError(f"every share must be > 0, got {bad}: remove the task or give it "
                             "a share")
        total = sum(value.values())
        if value and abs(total - 1.0) > 1e-6:
            raise ValueError(f"shares sum to {total:g}, not 1: scale them, e.g. "
                             + ", ".join(f"{t}: {v / total:.3g}" for t, v in value.items()))
        return value


class CheckpointConfig(_Strict):
    every_steps: int = Field(default=10, ge=1, description="checkpoint every this many steps")
    keep: int = Field(default=3, ge=1, description="how many recent checkpoints to keep")
    dir: str | None = Field(
        default=None,
        description="folder or fsspec URL, e.g. s3://bucket/run (needs s3fs) or file:///path "
        "(null: <run dir>/checkpoints/<model>)",
    )
    keep_trained_groups: Literal["all"] | int | None = Field(
        default=None,
        description="trained groups whose tokens the store keeps, so that `jetctl replay` and "
        "`jetctl up --replay-from` can take their steps again: all (every step of the run "
        "replays; the store grows with every group), or N in 1..keep: those of the steps "
        "after the Nth newest checkpoint (1: only since the newest, which a restarted server "
        "trains again anyway) (null: keep, so every step after the oldest checkpoint kept "
        "replays, and the store holds about keep x every_steps steps of groups)",
    )

    @field_validator("dir")
    @classmethod
    def _known_filesystem(cls, value: str | None) -> str | None:
        if value is not None:
            problem = checkpoint_url_problem(value, packages=False)  # server_host_problems
            if problem:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _groups_kept_within_checkpoints(self) -> CheckpointConfig:
        n = self.keep_trained_groups
        if isinstance(n, int) and n < 1:
            _raise_problems([Problem(
                ("keep_trained_groups",), n,
                "must be at least 1 (the groups trained since the newest checkpoint are what a "
                "restarted server trains again): use 1 for the least disk, or all",
            )])
        if isinstance(n, int) and n > self.keep:
            _raise_problems([Problem(
                ("keep_trained_groups",), n,
                f"is more than keep ({self.keep}): the groups of steps before the oldest "
                "checkpoint kept have no checkpoint to replay from, so they would fill the "
                f"disk for nothing: set keep to {n}, lower this to {self.keep}, or use all",
            )])
        return self

    @property
    def trained_groups_checkpoints(self) -> int | None:
        """The checkpoints whose later steps' groups keep their tokens (None: all groups)."""
        n = self.keep_trained_groups
        if isinstance(n, int):
            return n
        return self.keep if n is None else None  # None: all


class GenerationConfig(_Strict):
    max_batch_size: int = Field(
        default=16, ge=1, description="most replies generated together (rows of a decode step)"
    )
    batch_wait_ms: float = Field(
        default=20.0, ge=0,
        description="how long an idle engine waits for company before it starts (later "
        "requests join the running batch at its next step)"
    )
    max_new_tokens: int = Field(default=256, ge=1, description="cap on any request's max_tokens")
    threads: int | None = Field(
        default=None, ge=1,
        description="CPU threads of the engine's torch work (null: half of this host's cores "
        "on a CPU server, the rest go to train.threads; generation and training run at once)",
    )
    max_context_tokens: int = Field(
        default=2048, ge=16, description="cap on prompt + completion tokens of one request"
    )
    device: str | None = Field(
        default=None,
        description="device of the engine's own copy of the weights, e.g. cuda:1, refreshed "
        "after each optimizer step (null: engine hf generates on the trainer's device, on the "
        "trainer's model object with finetune: full, on its own copy of the adapter over the "
        "shared base with lora; "
        "engine continuous keeps its copy on the trainer's device)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        default=None,
        description="dtype of the weights the engine generates with (null: the model's dtype). "
        "Another dtype than the model's gives the engine its own copy in that dtype, refreshed "
        "after each optimizer step (LoRA: the adapter only); replies carry that copy's "
        "logprobs and the trainer's importance ratio corrects for the difference. bfloat16 "
        "halves the weight bytes a decode step reads, but is faster only where the hardware "
        "computes in it (SmolLM2-135M, a decode step at 14 rows: 74 ms against 104 ms in "
        "float32 on a CPU with avx512_bf16; 527 ms against 192 ms on an AVX2-only CPU). auto: "
        "bfloat16 where this host measures it faster (the server times its largest matrix in "
        "both at start and logs the figures; a CUDA device with bfloat16), else the model's "
        "dtype; never for engine vllm or a model that is not float32",
    )
    publish_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="deadline of one weight publish to an engine with its own copy (waiting "
        "for the requests under way included); a miss is logged and retried, and 3 steps in "
        "a row without a publish stop the server",
    )

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str | None) -> str | None:
        if value is not None and not _DEVICE.match(value):
            raise ValueError("must be cpu, cuda, cuda:N or mps (or null)")
        return value


class LimitsConfig(_Strict):
    max_message_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        description="largest gRPC message accepted; larger ones get RESOURCE_EXHAUSTED",
    )
    max_buffer_groups: int = Field(
        default=1024,
        ge=1,
        description="accepted groups a server holds untrained; past it Submit acks BUSY and "
        "the client keeps the group spooled and sends it again later",
    )
    max_buffer_bytes: int = Field(
        default=1 << 30,
        ge=1024,
        description="payload bytes of the accepted groups a server holds untrained (a bound "
        "on its memory whatever the groups' size); past it Submit acks BUSY as for "
        "max_buffer_groups. At least max_message_bytes, so that any one group fits",
    )
    max_queued_generates: int = Field(
        default=1024,
        ge=1,
        description="Generate calls waiting for a row of the engine (beyond "
        "generation.max_batch_size; every call held, for an engine that does not say how "
        "many rows it has); past it Generate answers RESOURCE_EXHAUSTED with a retry-after "
        "and the node calls again after that wait, its rollout going on",
    )
    max_concurrent_rpcs: int = Field(
        default=4096,
        ge=2,
        description="RPCs the server runs at once, of every kind (gRPC's "
        "maximum_concurrent_rpcs); past it a call gets RESOURCE_EXHAUSTED at once. A "
        "backstop above max_queued_generates, so that Generate's bound (with its "
        "retry-after) answers first",
    )

    @model_validator(mode="after")
    def _one_group_fits(self) -> LimitsConfig:
        if self.max_buffer_bytes < self.max_message_bytes:
            raise ValueError(
                f"max_buffer_bytes ({self.max_buffer_bytes}) is below max_message_bytes "
                f"({self.max_message_bytes}): a group that large could never be buffered; set "
                f"max_buffer_bytes to at least {self.max_message_bytes}"
            )
        return self

    @model_validator(mode="after")
    def _queue_bound_answers_first(self) -> LimitsConfig:
        if self.max_concurrent_rpcs <= self.max_queued_generates:
            raise ValueError(
                f"max_concurrent_rpcs ({self.max_concurrent_rpcs}) is not above "
                f"max_queued_generates ({self.max_queued_generates}): Generate calls would be "
                "refused without a retry-after before the engine's queue is full; set "
                f"max_concurrent_rpcs above it, e.g. to {2 * self.max_queued_generates}"
            )
        return self


_ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_BYTE_SIZE = re.compile(r"^[0-9]+(\.[0-9]+)?[bkmg]?$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """`512m`, `2g`, `1024` (bytes) as bytes (a value `_BYTE_SIZE` accepted)."""
    unit = text[-1].lower()
    scale = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(unit)
    return int(float(text[:-1]) * scale) if scale else int(float(text))


class ServerResources(_Strict):
    """What a server asks of its Ray node (runtime: ray); the process runtime reserves none."""

    cpus: float | None = Field(default=None, gt=0, description="CPUs reserved (null: 1)")
    gpus: float | None = Field(default=None, ge=0, description="GPUs reserved (null: none)")
    memory: str | None = Field(
        default=None, description="memory reserved, a number with b, k, m or g (e.g. 8g)"
    )
    custom: dict[str, float] = Field(
        default={},
        description="Ray custom resources the placement needs, e.g. {gpu_host: 1} (runtime: ray)",
    )

    @field_validator("memory")
    @classmethod
    def _byte_size(cls, value: str | None) -> str | None:
        if value is not None and not _BYTE_SIZE.match(value):
            raise ValueError("must be a number with an optional unit b, k, m or g, e.g. 512m or 2g")
        return value


class ModelConfig(_Strict):
    model: str = Field(
        description="builtin:tiny | builtin:smollm2-135m-instruct | HF repo id | local folder"
    )
    device: str = Field(default="cpu", description="torch device of the server: cpu, cuda, cuda:1")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="weight dtype"
    )
    engine: Literal["hf", "continuous", "vllm"] = Field(
        default="hf",
        description="inference engine: hf (continuous batching on the trainer's weights: "
        "newcomers join between decode steps), continuous (transformers' continuous batching "
        "with a paged KV cache; for CUDA) or vllm "
        "(experimental; needs vllm installed, CUDA)",
    )
    finetune: Literal["lora", "full"] = Field(
        default="lora", description="train a LoRA adapter (peft) or every weight"
    )
    lora: LoraConfig = Field(default=LoraConfig(), description="used when finetune is lora")
    optimizer: OptimizerConfig = Field(default=OptimizerConfig(), description="optimizer")
    train: TrainConfig = Field(default=TrainConfig(), description="training loop")
    checkpoint: CheckpointConfig = Field(default=CheckpointConfig(), description="checkpoints")
    generation: GenerationConfig = Field(default=GenerationConfig(), description="serving")
    limits: LimitsConfig = Field(default=LimitsConfig(), description="wire limits")
    host: str = Field(default="127.0.0.1", description="address the server binds")
    advertise: str | None = Field(
        default=None,
        description="address clients dial (null: host; for a wildcard host such as 0.0.0.0, "
        "the server's address on its route to the controller)",
    )
    runtime: Literal["process", "ray", "external"] = Field(
        default="process",
        description="process: a subprocess of the controller; ray: an actor on run.ray's "
        "cluster; external: you start it on any host with `jetctl server --join`",
    )
    resources: ServerResources = Field(
        default=ServerResources(), description="what the server reserves (runtime: ray)"
    )
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port (0: pick a free port)")
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Prometheus /metrics port (0: pick a free port)"
    )
    seed: int = Field(default=0, description="seed of the server's RNG")

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        problems: list[Problem] = []
        if self.runtime == "process":  # else the server checks on its own host as it starts
            problems += server_host_problems(self)
        if self.engine == "vllm" and self.generation.dtype not in (None, "auto", self.dtype):
            problems.append(
                Problem(
                    ("generation", "dtype"),
                    self.generation.dtype,
                    f"engine vllm loads the model in the model's dtype ({self.dtype}) and takes "
                    "the trainer's tensors as they are: remove generation.dtype, or set dtype "
                    "(the model's) instead",
                )
            )
        if self.engine == "vllm" and self.generation.threads is not None:
            problems.append(
                Problem(
                    ("generation", "threads"),
                    self.generation.threads,
                    "sets the CPU threads of the hf and continuous engines; engine vllm "
                    "generates on its GPU and does not read it: remove it",
                )
            )
        if self.finetune == "full" and self.train.kl_coef > 0:
            problems.append(
                Problem(
                    ("train", "kl_coef"),
                    self.train.kl_coef,
                    "needs finetune: lora, where the reference policy is the base model with "
                    "the adapter switched off; full fine-tuning would need a second copy of "
                    "the model, which jetctl does not keep: set kl_coef to 0 or use lora",
                )
            )
        if self.finetune == "full" and "lora" in self.model_fields_set:
            problems.append(
                Problem(
                    ("lora",),
                    self.lora.model_dump(),
                    "only applies to finetune: lora (this model trains every weight): remove "
                    "lora: or set finetune: lora",
                )
            )
        if self.runtime != "ray" and "resources" in self.model_fields_set:
            problems.append(
                Problem(
                    ("resources",),
                    self.resources.model_dump(exclude_defaults=True),
                    f"only applies to runtime: ray (this server runs as {self.runtime}, which "
                    "reserves nothing): remove it or set runtime: ray",
                )
            )
        problems += _algorithm_problems(self.train)
        if "mix_wait_s" in self.train.model_fields_set and not self.train.mix:
            problems.append(
                Problem(
                    ("train", "mix_wait_s"),
                    self.train.mix_wait_s,
                    "only applies with train.mix (no mix: batches never wait for a task): "
                    "remove it or give mix:",
                )
            )
        if self.port and self.port == self.metrics_port:
            problems.append(
                Problem(
                    ("metrics_port",),
                    self.metrics_port,
                    f"is the same as port ({self.port}): use another port, or 0 to pick one",
                )
            )
        _raise_problems(problems)
        return self


class SamplingConfig(_Strict):
    """Defaults for the knobs an agent's request leaves out; a value the request sets wins."""

    temperature: float = Field(
        default=1.0, ge=0, description="temperature of a request that does not set one"
    )
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="nucleus mass of a request that does not set one"
    )
    max_tokens: int = Field(
        default=128, ge=1, description="max_tokens of a request that does not set one"
    )


_DEVICE = re.compile(r"^(cpu|mps|cuda(:[0-9]+)?)$")
_ROLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_ROLE = "default"  # the role of every call of a task without roles:


class ResourcesConfig(_Strict):
    """Limits of one client node's container (runtime: docker) or what it reserves on its Ray
    node (runtime: ray: cpus, gpus, memory, custom); the process runtime has none."""

    cpus: float | None = Field(
        default=None, gt=0, description="CPUs the container may use (1.5: one and a half)"
    )
    memory: str | None = Field(
        default=None, description="memory cap, a number with b, k, m or g (e.g. 2g); null: none"
    )
    pids: int | None = Field(
        default=None, ge=16, description="most processes and threads in the container; null: none"
    )
    shm: str | None = Field(
        default=None, description="size of /dev/shm (Chromium wants 256m or more); null: docker's 64m"
    )
    gpus: float | None = Field(
        default=None, ge=0, description="GPUs a node reserves (runtime: ray; null: none)"
    )
    custom: dict[str, float] = Field(
        default={},
        description="Ray custom resources each node needs, e.g. {cpu_host: 1} to place the "
        "nodes on workers started with `ray start --resources '{\"cpu_host\": 8}'` (runtime: ray)",
    )

    @field_validator("memory", "shm")
    @classmethod
    def _byte_size(cls, value: str | None) -> str | None:
        if value is not None and not _BYTE_SIZE.match(value):
            raise ValueError("must be a number with an optional unit b, k, m or g, e.g. 512m or 2g")
        return value


# what `jetctl images build` makes (jetctl/images.py): client images without torch
SHIPPED_IMAGES = frozenset({"jetctl-base", "jetctl-web", "jetctl-code", "jetctl-api"})
DATASET_ENV = "jetctl.envs.dataset:make_env"


class EvalConfig(_Strict):
    """An eval during the run (jetctl/server/evals.py): after a checkpoint at a multiple of
    `every_steps`, the task's server runs `jetctl eval` on the held-out rows in a process of
    its own and logs the figures with the next step."""

    every_steps: int = Field(
        ge=1,
        description="eval the checkpoint of every this many steps: a multiple of the model's "
        "checkpoint.every_steps (the eval loads a checkpoint)",
    )
    split: Literal["test", "train"] = Field(
        default="test",
        description="the rows scored: test (the held-out rows: env_args.test_fraction or "
        "test_path) or train",
    )
    samples: int = Field(default=1, ge=1, description="K: samples per row (pass@K)")
    max_rows: int | None = Field(
        default=None,
        ge=1,
        description="score only the split's first this many rows (the same ones every time; "
        "null: all): the cost of each eval",
    )
    timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="an eval running longer is killed and logged as failed; the next due "
        "checkpoint is evaluated",
    )



class TaskConfig(_Strict):
    env: str = Field(description="module:factory of the environment, e.g. envs.arithmetic:make_env")
    agent: str = Field(description="module:function of the agent, e.g. agents.arithmetic:agent")
    model: str | None = Field(
        default=None,
        description="the key under models: that trains on this task (a team task names its "
        "models under roles: instead)",
    )
    roles: dict[str, str] = Field(
        default={},
        description="a team: agent role -> key under models:. The agent picks a role with the "
        "`model` field of its OpenAI call; each role's calls train that role's model, with the "
        "role's reward ({}: no team, one model)",
    )
    env_args: dict[str, object] = Field(
        default={}, description="keyword arguments of the env factory"
    )
    clients: int = Field(default=1, ge=0, description="client nodes running this task")
    group_size: int = Field(
        default=8, ge=2, description="G in GRPO: rollouts of one task per group"
    )
    concurrency: Literal["auto"] | int = Field(
        default="auto",
        description="rollouts a node runs at once. auto: sized by the server's load (starts at "
        "8, at least group_size; a group more while the trainer waits for groups and every "
        "slot is busy, a group less while the engine queues requests or the trainer has a "
        "backlog of 4 steps; between group_size and 8 x group_size; `jetctl status` shows the "
        "figure and why). A number: that many, fixed",
    )
    rollout_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="a rollout running longer is killed and recorded as timeout",
    )
    runtime: Literal["process", "docker", "ray"] = Field(
        default="process",
        description="process: subprocesses here; docker: a container per node; ray: an actor "
        "per node on run.ray's cluster, placed in one placement group per revision",
    )
    image: str | None = Field(
        default=None,
        description="docker image of the nodes (runtime: docker; null: jetctl-base, made by "
        "`jetctl images build`); `jetctl swap-clients --image` replaces it for a new revision",
    )
    resources: ResourcesConfig = Field(
        default=ResourcesConfig(),
        description="container limits (runtime: docker) or reservations (runtime: ray)",
    )
    docker_socket: bool = Field(
        default=False,
        description="mount the host's docker socket into the nodes' containers (runtime: "
        "docker), so the env can start sibling containers, e.g. the code env's "
        "`backend: docker` sandbox; it gives the node control of the host's docker engine",
    )
    network: Literal["isolated", "host"] = Field(
        default="isolated",
        description="the nodes' network (runtime: docker). isolated: a docker network of the "
        "run's own, no route out, from which only the controller and this host's servers "
        "are reached (they also listen on its gateway address); host: the host's network, "
        "every address this host reaches (logged as a warning)",
    )
    inference: Literal["server", "local"] = Field(
        default="server",
        description="server: generate on the model's server; local: on the client with "
        "weights pulled from the server",
    )
    sampling: SamplingConfig = Field(
        default=SamplingConfig(),
        description="sampling defaults of the agent's requests (the agent's own values win)",
    )
    spool_max_bytes: int = Field(
        default=512 * 1024 * 1024,
        ge=1024,
        description="back-pressure watermark: a node stops taking tasks above this spool size",
    )
    seed: int = Field(default=0, description="seed of task sampling")
    eval: EvalConfig | None = Field(
        default=None,
        description="an eval every N steps during the run (a dataset task): e.g. "
        "{every_steps: 10, max_rows: 40} (null: none; `jetctl eval` after the run)",
    )

    @property
    def role_models(self) -> dict[str, str]:
        """Role -> model key. A task without `roles:` has one role, `default`, on `model`."""
        if self.roles:
            return dict(self.roles)
        assert self.model is not None  # the validator requires model or roles
        return {DEFAULT_ROLE: self.model}

    @property
    def models(self) -> list[str]:
        """The distinct model keys this task trains, in recipe order."""
        return list(dict.fromkeys(self.role_models.values()))

    @field_validator("roles")
    @classmethod
    def _role_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [role for role in value if not _ROLE_NAME.match(role)]
        if bad:
            raise ValueError(
                f"role name {bad[0]!r} must be 1-64 letters, digits, '_', '.' or '-', starting "
                "with a letter or digit (the agent sends it as the model name)"
            )
        return value

    @field_validator("env", "agent")
    @classmethod
    def _entry_point(cls, value: str) -> str:
        if not _ENTRY_POINT.match(value):
            raise ValueError(
                "must be 'module:function' (a dotted module, a colon, a name), "
                "e.g. envs.arithmetic:make_env"
            )
        return value

    @field_validator("concurrency", mode="before")
    @classmethod
    def _auto_or_count(cls, value: object) -> object:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise ValueError(
            "must be auto (sized by the server's load) or a whole number of rollouts, e.g. 16")

    @model_validator(mode="after")
    def _group_fits(self) -> TaskConfig:
        problems = []
        if self.model is None and not self.roles:
            problems.append(
                Problem(
                    ("model",),
                    MISSING,
                    "required key is missing: name the key under models: that trains on this task, or give "
                    "roles: (role: model key) for a team of models",
                )
            )
        if self.model is not None and self.roles:
            problems.append(
                Problem(
                    ("model",),
                    self.model,
                    "a team task names its models under roles: (here "
                    f"{', '.join(f'{r}: {m}' for r, m in self.roles.items())}): remove model:",
                )
            )
        if self.roles and self.inference == "local":
            problems.append(
                Problem(
                    ("inference",),
                    self.inference,
                    "local inference serves one model on the node; a team (roles:) generates "
                    "on its models' servers: use inference: server or remove roles:",
                )
            )
        if self.concurrency != "auto" and self.concurrency < self.group_size:
            problems.append(
                Problem(
                    ("concurrency",),
                    self.concurrency,
                    f"is less than group_size ({self.group_size}); a node runs a "
                    "group's rollouts at once so the server can batch them: set "
                    f"concurrency to at least {self.group_size}",
                )
            )
        ray_only = {"gpus", "custom"} & self.resources.model_fields_set
        docker_only = {"pids", "shm"} & self.resources.model_fields_set
        wrong = ray_only if self.runtime != "ray" else docker_only
        for key in sorted(wrong):
            problems.append(
                Problem(
                    ("resources", key),
                    getattr(self.resources, key),
                    f"only applies to runtime: {'ray' if key in ray_only else 'docker'} "
                    f"(this task runs as {self.runtime}): remove it or change runtime",
                )
            )
        if self.runtime == "process":  # the process runtime starts plain subprocesses
            for key in sorted({"cpus", "memory"} & self.resources.model_fields_set):
                problems.append(
                    Problem(
                        ("resources", key),
                        getattr(self.resources, key),
                        "is not applied by runtime: process (plain subprocesses, no limits): "
                        "use runtime: docker for container limits or runtime: ray for "
                        "reservations, or remove it",
                    )
                )
        shipped = self.image is None or self.image.split(":")[0] in SHIPPED_IMAGES
        if self.inference == "local" and self.runtime == "docker" and shipped:
            problems.append(
                Problem(
                    ("inference",), self.inference,
                    f"needs torch in the nodes' image, and {self.image or 'jetctl-base'} (like "
                    "every image `jetctl images build` makes) has none: use inference: server, "
                    "or an image of your own built FROM jetctl-base with torch installed",
                )
            )
        if self.image is not None and self.runtime != "docker":
            problems.append(
                Problem(
                    ("image",), self.image,
                    f"only applies to runtime: docker (this task runs as {self.runtime}): "
                    "remove it or set runtime: docker",
                )
            )
        if self.network != "isolated" and self.runtime != "docker":
            problems.append(
                Problem(
                    ("network",), self.network,
                    f"only applies to runtime: docker (this task runs as {self.runtime}): "
                    "remove it or set runtime: docker",
                )
            )
        if self.docker_socket and self.runtime != "docker":
            problems.append(
                Problem(
                    ("docker_socket",),
                    self.docker_socket,
                    f"only applies to runtime: docker (this task runs as {self.runtime}, "
                    "where the env reaches the engine directly): remove it or set "
                    "runtime: docker",
                )
            )
        if problems:
            _raise_problems(problems)
        return self


class TlsConfig(_Strict):
    mode: Literal["off", "tls", "mtls"] = Field(
        default="off",
        description="off: plaintext gRPC; tls: servers and the controller show a certificate "
        "of the run CA; mtls: callers must show one too",
    )
    cert_dir: str | None = Field(
        default=None,
        description="folder with ca.pem, server.pem, server.key, client.pem, client.key "
        "(null: jetctl up generates them in <run dir>/tls, keys 0600)",
    )
    hosts: list[str] = Field(
        default=[],
        description="extra DNS names or IPs clients dial, added to the generated server "
        "certificate (127.0.0.1, localhost, this host, models.<m>.host and .advertise, "
        "run.control.host and .advertise are always in)",
    )


class ControlConfig(_Strict):
    host: str = Field(
        default="127.0.0.1",
        description="address the controller's Control service binds (0.0.0.0: every "
        "interface, for nodes on other hosts)",
    )
    port: int = Field(
        default=0, ge=0, le=65535,
        description="its port (0: a free one, kept across `jetctl up --resume`)",
    )
    advertise: str | None = Field(
        default=None,
        description="address nodes on other hosts dial (null: host; for a wildcard host, the "
        "Ray node address of the controller with runtime: ray, else 127.0.0.1)",
    )


class RayConfig(_Strict):
    address: str | None = Field(
        default=None,
        description="the Ray cluster of runtime: ray nodes, as `ray.init(address=...)` takes "
        "it: host:port of its head, or auto (a cluster started on this host)",
    )
    namespace: str | None = Field(
        default=None,
        description="Ray namespace of the run's actors (null: jetctl-<run.name>); `up --resume` "
        "and `down` find the actors there",
    )
    runtime_env: dict[str, object] = Field(
        default={},
        description="Ray runtime environment of every actor (pip, working_dir, env_vars, ...); "
        "jetctl must be importable in it",
    )
    work_dir: str = Field(
        default="/tmp/jetctl",
        description="folder on each Ray host where its nodes keep their spools and logs",
    )


TrackerName = Literal["tensorboard", "wandb", "mlflow", "trackio"]
# tracker -> (the module it needs, the pip line that installs it); jetctl.trackers uses them
TRACKER_MODULES: dict[str, str] = {
    "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio",
}


class TrackerConfig(_Strict):
    """One experiment tracker of `run.trackers`: a name, or a mapping with its options."""

    name: TrackerName
    project: str | None = Field(
        default=None,
        description="W&B project, MLflow experiment or trackio project (null: run.name)",
    )
    mode: Literal["online", "offline"] | None = Field(
        default=None, description="wandb only: offline writes run files and needs no network",
    )
    dir: str | None = Field(
        default=None,
        description="where it writes (null: <run dir>/trackers/<name>; trackio: its own store "
        "unless set)",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _usable(self) -> TrackerConfig:
        problems = []
        if self.mode is not None and self.name != "wandb":
            problems.append(Problem(("mode",), self.mode, "is a wandb option: remove it"))
        # find_spec, not import: the trackers are heavy, and the recipe imports light
        if importlib.util.find_spec(TRACKER_MODULES[self.name]) is None:
            problems.append(
                Problem(
                    ("name",), self.name,
                    f"is not installed: pip install 'jetctl[trackers]' "
                    f"(or pip install {TRACKER_MODULES[self.name]})",
                )
            )
        _raise_problems(problems)
        return self


class TracingConfig(_Strict):
    """`run.tracing`: OpenTelemetry traces of every rollout, sent to an OTLP gRPC collector."""

    otlp_endpoint: str = Field(
        description="host:port of the collector's OTLP gRPC receiver (Jaeger, Grafana Tempo, "
        "an OpenTelemetry Collector), e.g. localhost:4317; https://host:port for TLS (no "
        "run.tracing: no traces)",
    )

    @model_validator(mode="after")
    def _usable(self) -> TracingConfig:
        problems = []
        address = self.otlp_endpoint.removeprefix("http://").removeprefix("https://")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            problems.append(Problem(
                ("otlp_endpoint",), self.otlp_endpoint,
                "is not host:port: give the collector's OTLP gRPC address, e.g. localhost:4317",
            ))
        # find_spec, not import: the recipe imports light (jetctl.tracing imports it when on)
        if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
            problems.append(Problem(
                ("otlp_endpoint",), self.otlp_endpoint,
                "needs the OpenTelemetry SDK and its OTLP exporter: "
                "pip install 'jetctl[tracing]'",
            ))
        _raise_problems(problems)
        return self


class RunConfig(_Strict):
    name: str = Field(default="run", description="run name; names the run directory")
    dir: str | None = Field(default=None, description="run directory (null: runs/<name>)")
    token: str | None = Field(
        default=None,
        description="bearer token of every RPC (null: generated by jetctl up, stored 0600); "
        "read a secret with ${VAR}",
    )
    tls: TlsConfig = Field(default=TlsConfig(), description="transport security")
    control: ControlConfig = Field(
        default=ControlConfig(), description="the controller's address, which every node dials"
    )
    ray: RayConfig = Field(default=RayConfig(), description="the Ray cluster (runtime: ray)")
    duration_s: float | None = Field(
        default=None, gt=0, description="stop the run after this long (null: run until jetctl down)"
    )
    restart_backoff_s: float = Field(
        default=1.0, gt=0, description="first delay before a dead process is restarted; doubles"
    )
    restart_backoff_max_s: float = Field(default=30.0, gt=0, description="cap on that delay")
    tracing: TracingConfig | None = Field(
        default=None,
        description="OpenTelemetry traces, one per rollout: the node's rollout, each model "
        "call and Generate, the env, Submit and the admission verdict, linked from the "
        "optimizer step that trained it; {otlp_endpoint: host:4317} (null: off; "
        "jetctl.tracing; pip install 'jetctl[tracing]')",
    )
    deterministic: bool = Field(
        default=False,
        description="a seed for every Generate request (from the run, node, group, "
        "trajectory and call) and each node's tasks, dataset rows included, in its seeded "
        "order (jetctl.deterministic); needs engine: hf or continuous",
    )
    trackers: list[TrackerConfig] = Field(
        default=[],
        description="experiment trackers each server sends its step rows, the recipe and a "
        "sample of each step's rollouts to: names (tensorboard, wandb, mlflow, trackio) or "
        "mappings {name, project, mode, dir} (jetctl.trackers; pip install 'jetctl[trackers]')",
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> RunConfig:
        if self.restart_backoff_s > self.restart_backoff_max_s:
            _raise_problems(
                [
                    Problem(
                        ("restart_backoff_s",),
                        self.restart_backoff_s,
                        f"is more than restart_backoff_max_s ({self.restart_backoff_max_s}): "
                        "lower it or raise the cap",
                    )
                ]
            )
        return self


class Recipe(_Strict):
    run: RunConfig = Field(default=RunConfig(), description="the run as a whole")
    models: dict[str, ModelConfig] = Field(description="trainable models, one server each")
    tasks: dict[str, TaskConfig] = Field(description="tasks, one client pool each")

    @model_validator(mode="after")
    def _tasks_name_known_models(self) -> Recipe:
        task_models = {
            name: _model_refs(task.model, task.roles) for name, task in self.tasks.items()
        }
        problems = _recipe_problems(task_models, self.models, self.models, self.tasks)
        on_ray = [("models", m) for m, c in self.models.items() if c.runtime == "ray"]
        on_ray += [("tasks", t) for t, c in self.tasks.items() if c.runtime == "ray"]
        if on_ray and not self.run.ray.address:
            where = ", ".join(f"{a}.{b}" for a, b in on_ray)
            problems.append(
                Problem(
                    ("run", "ray", "address"),
                    None,
                    f"is needed by runtime: ray ({where}): give the cluster's head, e.g. "
                    "10.0.0.5:6379, or auto for a cluster started on this host",
                )
            )
        engines = {name: model.engine for name, model in self.models.items()}
        problems += _deterministic_problems(self.run.deterministic, engines)
        _raise_problems(problems)
        return self

    @property
    def uses_ray(self) -> bool:
        return any(c.runtime == "ray" for c in self.models.values()) or any(
            c.runtime == "ray" for c in self.tasks.values()
        )

    @property
    def run_dir(self) -> str:
        return self.run.dir or f"runs/{self.run.name}"


def _deterministic_problems(deterministic: object, engines: Mapping[str, object]) -> list[Problem]:
    """run.deterministic: every model's engine (`engines`: model -> engine) must honour a
    request's seed."""
    if deterministic is not True:
        return []
    return [
        Problem(
            ("models", name, "engine"),
            engine,
            f"is not an engine whose seeded replies repeat, which run.deterministic: true "
            f"needs (vllm takes the seed, but its replies change with the batch they ran "
            f"in): use engine: {' or '.join(SEEDED_ENGINES)}, or set run.deterministic: false",
        )
        for name, engine in engines.items()
        if engine not in SEEDED_ENGINES
    ]


def _model_refs(model: object, roles: object) -> list[tuple[tuple[str, ...], str]]:
    """Where a task names models: [(key path inside the task, model key)]."""
    refs: list[tuple[tuple[str, ...], str]] = []
    if isinstance(model, str):
        refs.append((("model",), model))
    if isinstance(roles, dict):
        refs += [(("roles", str(r)), m) for r, m in roles.items() if isinstance(m, str)]
    return refs


def _recipe_problems(
    task_models: Mapping[str, list[tuple[tuple[str, ...], str]]],
    model_names: Collection[str],
    models: Mapping[str, ModelConfig],
    tasks: Mapping[str, TaskConfig],
) -> list[Problem]:
    """Checks across models and tasks. `task_models` maps each task to where it names models
    (its `model:` or each of its `roles:`, see `_model_refs`) and `model_names` holds every
    key of models; `models` and `tasks` hold the valid ones (all of them, unless the loader
    is checking a recipe with field errors)."""
    problems: list[Problem] = []
    if not model_names:
        problems.append(
            Problem(("models",), {}, "names no model: add one, e.g. policy: {model: ...}")
        )
    known = ", ".join(sorted(model_names)) or "(none)"
    for name, refs in task_models.items():
        for at, model_key in refs:
            for p in _task_model_problems(name, at, model_key, model_names, known, models, tasks):
                if p not in problems:  # two roles on models with the same caps: once
                    problems.append(p)
    problems += _mix_problems(models, tasks)
    problems += _eval_step_problems(models, tasks)
    folders: dict[str, str] = {}  # checkpoint.dir -> the first model that names it
    for name, model in models.items():
        folder = model.checkpoint.dir
        if folder is None:
            continue  # <run dir>/checkpoints/<model>: a folder of its own
        first = folders.setdefault(folder.rstrip("/"), name)
        if first != name:
            problems.append(
                Problem(
                    ("models", name, "checkpoint", "dir"),
                    folder,
                    f"is also models.{first}.checkpoint.dir: two models' steps would mix in "
                    "one folder; give each model its own folder, or leave it unset "
                    "(<run dir>/checkpoints/<model>)",
                )
            )
    taken: dict[tuple[str, int], str] = {}
    for name, model in models.items():
        for key in ("port", "metrics_port"):
            port: int = getattr(model, key)
            where = f"models.{name}.{key}"
            other = taken.setdefault((model.host, port), where) if port else where
            if other != where:
                problems.append(
                    Problem(
                        ("models", name, key),
                        port,
                        f"is already used by {other}: use another port, or 0 to pick one",
                    )
                )
    return problems


def _algorithm_problems(train: TrainConfig) -> list[Problem]:
    """Clip settings the chosen algorithm would not read are refused, not ignored."""
    problems: list[Problem] = []
    if train.clip_eps_high is not None and train.algorithm != "dapo":
        problems.append(Problem(
            ("train", "clip_eps_high"), train.clip_eps_high,
            f"only applies with algorithm: dapo (its decoupled upper clip range; "
            f"{train.algorithm} clips to [1 - clip_eps, 1 + clip_eps]): remove it or set "
            "algorithm: dapo",
        ))
    if train.algorithm == "gspo" and "clip_eps" in train.model_fields_set:
        problems.append(Problem(
            ("train", "clip_eps"), train.clip_eps,
            "gspo clips its sequence-level ratio to its own range [1 - 3e-4, 1 + 4e-4] "
            "(Zheng et al. 2025); clip_eps is the token ratio's range of grpo, dr_grpo, dapo "
            "and rloo: remove it",
        ))
    return problems


def _mix_problems(
    models: Mapping[str, ModelConfig], tasks: Mapping[str, TaskConfig]
) -> list[Problem]:
    """Each model's `train.mix` names exactly the tasks that train it."""
    problems: list[Problem] = []
    for name, model in models.items():
        mix = model.train.mix
        if not mix:
            continue
        training = [t for t, c in tasks.items() if name in c.models]
        for task in mix:
            if task not in training:
                close = difflib.get_close_matches(task, training, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                problems.append(Problem(
                    ("models", name, "train", "mix", task), mix[task],
                    f"{task!r} is not a task that trains {name} (those: "
                    f"{', '.join(training) or 'none'}){hint}",
                ))
        missing = [t for t in training if t not in mix]
        if missing:
            problems.append(Problem(
                ("models", name, "train", "mix"), mix,
                f"gives no share to {', '.join(missing)}, which train(s) {name}: give every "
                "task of this model a share",
            ))
    return problems


def _task_eval_problems(task: TaskConfig, block: EvalConfig) -> list[Problem]:
    """An eval scores fixed rows of one model: a dataset task, with held-out rows."""
    if not task.env.startswith(DATASET_ENV.split(":")[0] + ":"):
        return [Problem(
            ("eval",), block.model_dump(exclude_defaults=True),
            f"needs a dataset task (env: {DATASET_ENV}), whose rows can be held out; "
            f"{task.env} has none: remove eval:, and score this task your own way",
        )]
    problems: list[Problem] = []
    if task.roles:
        problems.append(Problem(
            ("eval",), block.model_dump(exclude_defaults=True),
            "scores one model, and this team task trains several (roles:): remove eval:, "
            "or give the task one model:",
        ))
    held_out = task.env_args.get("test_fraction") or task.env_args.get("test_path")
    if block.split == "test" and not held_out:
        problems.append(Problem(
            ("eval", "split"), block.split,
            "needs held-out rows, and env_args has neither test_fraction nor test_path: "
            "add env_args.test_fraction (e.g. 0.2) or env_args.test_path, or set split: "
            "train",
        ))
    return problems


def _eval_step_problems(
    models: Mapping[str, ModelConfig], tasks: Mapping[str, TaskConfig]
) -> list[Problem]:
    """A task's `eval.every_steps` falls on its model's checkpoints (the eval loads one),
    and its model's server runs where the run dir's recipe and data are (runtime: process)."""
    problems: list[Problem] = []
    for name, task in tasks.items():
        if task.eval is None:
            continue
        problems += [Problem(("tasks", name, *p.loc), p.value, p.message)
                     for p in _task_eval_problems(task, task.eval)]
        if task.model is None or task.model not in models:  # a team: refused above
            continue
        model = models[task.model]
        every, ckpt = task.eval.every_steps, model.checkpoint.every_steps
        if every % ckpt:
            up = -(-every // ckpt) * ckpt
            problems.append(Problem(
                ("tasks", name, "eval", "every_steps"), every,
                f"is not a multiple of models.{task.model}.checkpoint.every_steps ({ckpt}), "
                f"so no checkpoint would be there to evaluate: use {up} (or another multiple "
                f"of {ckpt}), or change checkpoint.every_steps",
            ))
        if model.runtime != "process":
            problems.append(Problem(
                ("tasks", name, "eval"), task.eval.model_dump(exclude_defaults=True),
                f"runs beside models.{task.model}'s server, reading the run dir's recipe and "
                f"the dataset, which a server with runtime: {model.runtime} does not have: "
                "remove eval: and run `jetctl eval RUN_DIR` on this host",
            ))
    return problems


def _task_model_problems(
    name: str,
    at: tuple[str, ...],
    model_key: str,
    model_names: Collection[str],
    known: str,
    models: Mapping[str, ModelConfig],
    tasks: Mapping[str, TaskConfig],
) -> list[Problem]:
    """A task's reference to one model: the key exists, and the task's sampling fits it."""
    if model_key not in model_names:
        close = difflib.get_close_matches(model_key, list(model_names), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return [
            Problem(
                ("tasks", name, *at),
                model_key,
                f"is not a key of models: use one of {known}{hint}",
            )
        ]
    if name not in tasks or model_key not in models:
        return []
    cap = models[model_key].generation.max_new_tokens
    context = models[model_key].generation.max_context_tokens
    wanted = tasks[name].sampling.max_tokens
    if wanted >= context:
        return [
            Problem(
                ("tasks", name, "sampling", "max_tokens"),
                wanted,
                f"leaves no room for the prompt in models.{model_key}.generation."
                f"max_context_tokens ({context}), so the server would refuse every "
                f"request: lower max_tokens well below {context}",
            )
        ]
    if wanted > cap:
        return [
            Problem(
                ("tasks", name, "sampling", "max_tokens"),
                wanted,
                f"exceeds models.{model_key}.generation.max_new_tokens ({cap}), the "
                f"server's cap on any request: lower max_tokens to {cap} or raise "
                "max_new_tokens",
            )
        ]
    return []


def _partial_problems(data: object) -> list[Problem]:
    """`_recipe_problems` over the parts of a recipe that are valid on their own, so that
    a recipe with field errors also gets its cross-references checked in the same run."""
    if not isinstance(data, dict):
        return []
    models_raw, tasks_raw = data.get("models"), data.get("tasks")
    if not isinstance(models_raw, dict) or not isinstance(tasks_raw, dict):
        return []
    task_models = {
        str(name): _model_refs(task.get("model"), task.get("roles"))
        for name, task in tasks_raw.items()
        if isinstance(task, dict)
    }
    models = {str(k): m for k, v in models_raw.items() if (m := _valid(ModelConfig, v))}
    tasks = {str(k): t for k, v in tasks_raw.items() if (t := _valid(TaskConfig, v))}
    names = [str(name) for name in models_raw]
    run_raw = data.get("run")
    engine_default = ModelConfig.model_fields["engine"].default
    engines = {
        str(k): v.get("engine", engine_default) for k, v in models_raw.items() if isinstance(v, dict)
    }
    deterministic = run_raw.get("deterministic") if isinstance(run_raw, dict) else None
    return _recipe_problems(task_models, names, models, tasks) + _deterministic_problems(
        deterministic, engines
    )


def _valid(cls: type[_M], raw: object) -> _M | None:
    """`raw` validated as `cls`, or None when it has errors (they are reported already)."""
    try:
        return cls.model_validate(raw)
    except ValidationError:
        return None


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class RecipeIssue:
    """One problem in a recipe file: where it is, what the value is, and the fix."""

    file: str
    line: int | None  # 1-based YAML line; None when the file could not be read
    path: str  # dotted key path, e.g. tasks.math.group_size ("" for the file as a whole)
    message: str  # the constraint broken and how to fix it
    value: object = None
    has_value: bool = False  # False for a missing key or a file-level problem

    def render(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        what = self.path
        if self.has_value:
            what = f"{what} = {_show(self.value, self.path)}"
        return f"{where}: {what}: {self.message}" if what else f"{where}: {self.message}"


class RecipeError(Exception):
    """Every problem found in one recipe file, sorted by line."""

    def __init__(self, issues: list[RecipeIssue]) -> None:
        self.issues = sorted(issues, key=lambda i: (i.line is None, i.line or 0))
        super().__init__(self.render())

    def render(self) -> str:
        """One line per issue: `FILE:LINE: key.path = value: constraint and fix`."""
        return "\n".join(issue.render() for issue in self.issues)


# --------------------------------------------------------------------------- loading

_Loc = tuple[str | int, ...]
_Key = tuple[str, ...]  # a loc with every part as str, to match YAML keys and indexes


def load_recipe(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Recipe:
    """Read, interpolate and validate a recipe file; raise `RecipeError` with every issue.

    `env` defaults to `os.environ`.
    """
    file = os.fspath(path)
    try:
        text = Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([RecipeIssue(file, None, "", "file not found")]) from None
    except IsADirectoryError:
        raise RecipeError([RecipeIssue(file, None, "", "is a directory, not a file")]) from None
    except UnicodeDecodeError:
        raise RecipeError([RecipeIssue(file, None, "", "is not UTF-8 text")]) from None
    except OSError as err:
        raise RecipeError([RecipeIssue(file, None, "", err.strerror or str(err))]) from None
    return parse_recipe(text, file=file, env=env)


def parse_recipe(text: str, file: str = "<recipe>", env: Mapping[str, str] | None = None) -> Recipe:
    """`load_recipe` for YAML text already in memory; `file` is the name used in issues."""
    environ: Mapping[str, str] = os.environ if env is None else env
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise RecipeError(
                [RecipeIssue(file, 1, "", "the file is empty: a recipe needs models: and tasks:")]
            )
        prep = _Interpolator(loader, environ, file)
        prep.walk(root, ())
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as err:
        raise RecipeError([_syntax_issue(file, err)]) from None
    finally:
        loader.dispose()
    lines: dict[_Key, int] = {}
    _line_map(root, (), root.start_mark.line + 1, lines, set())
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        # a key with an interpolation problem is reported once, for that problem
        reported = {issue.path for issue in prep.issues}
        found = _issues(err, file, lines, prep.interpolated)
        if not any(error["loc"] == () for error in err.errors()):  # Recipe's check did not run
            found += _problem_issues(_partial_problems(data), (), file, lines, prep.interpolated)
        raise RecipeError(prep.issues + [i for i in found if i.path not in reported]) from None
    if prep.issues:
        raise RecipeError(prep.issues)
    return recipe


def _syntax_issue(file: str, err: yaml.MarkedYAMLError) -> RecipeIssue:
    mark = err.problem_mark or err.context_mark
    problem = err.problem or "invalid YAML"
    if err.context:
        problem = f"{err.context}, {problem}"
    if "\\t" in problem or "\t" in problem:
        problem += " (indent with spaces, not tabs)"
    elif "block" in problem:
        problem += " (check the indentation)"
    line = mark.line + 1 if mark is not None else None
    return RecipeIssue(file, line, "", f"YAML syntax error: {problem}")


_MERGE_TAG = "tag:yaml.org,2002:merge"
_REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_NAME_DEFAULT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?$", re.DOTALL)


@dataclass
class _Interpolator:
    """Interpolates `${VAR}` in scalar values and flags duplicate keys, in place."""

    loader: yaml.SafeLoader
    environ: Mapping[str, str]
    file: str
    issues: list[RecipeIssue] = field(default_factory=list)
    interpolated: dict[_Key, str] = field(default_factory=dict)  # key path -> text as written
    visited: set[int] = field(default_factory=set)  # node ids (an alias shares its node)

    def walk(self, node: yaml.Node, path: _Key) -> None:
        if id(node) in self.visited:
            return
        self.visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = str(key_node.value)
                line = key_node.start_mark.line + 1
                if key in seen:
                    self.issues.append(
                        RecipeIssue(
                            self.file,
                            line,
                            _dotted((*path, key)),
                            f"duplicate key (first on line {seen[key]}); YAML would keep only "
                            "the last: remove one",
                        )
                    )
                seen.setdefault(key, line)
                self.walk(value_node, (*path, key))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self.walk(item, (*path, str(index)))
        elif isinstance(node, yaml.ScalarNode) and "${" in node.value:
            self._interpolate(node, path)

    def _interpolate(self, node: yaml.ScalarNode, path: _Key) -> None:
        raw: str = node.value
        line = node.start_mark.line + 1

        def substitute(match: re.Match[str]) -> str:
            if match.group(0) == "$${":
                return "${"
            ref = _NAME_DEFAULT.match(match.group(1))
            if ref is None:
                self.issues.append(
                    RecipeIssue(
                        self.file,
                        line,
                        _dotted(path),
                        f"malformed reference {match.group(0)}: write ${{NAME}} or "
                        "${NAME:-default}, or $${ for a literal ${",
                        raw,
                        True,
                    )
                )
                return match.group(0)
            name, default = ref.group(1), ref.group(2)
            value = self.environ.get(name)
            if default is not None and not value:  # like the shell: unset or empty
                return default
            if value is None:
                self.issues.append(
                    RecipeIssue(
                        self.file,
                        line,
                        _dotted(path),
                        f"environment variable {name} is not set: export {name}=... "
                        f"or write ${{{name}:-default}}",
                    )
                )
                return match.group(0)
            return value

        node.value = _REFERENCE.sub(substitute, raw)
        self.interpolated[path] = raw
        if node.style is None:  # a plain scalar: type it as if the value had been written
            node.tag = self.loader.resolve(yaml.ScalarNode, node.value, (True, False))


def _line_map(
    node: yaml.Node, path: _Key, line: int, lines: dict[_Key, int], ancestors: set[int]
) -> None:
    """Record the 1-based line of every key path (a key's line, or a list item's)."""
    lines[path] = line
    if id(node) in ancestors:  # a recursive alias
        return
    ancestors = ancestors | {id(node)}
    if isinstance(node, yaml.MappingNode):
        # the last of duplicate keys is the one YAML keeps
        last = {str(k.value): (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)}
        for key, (key_node, value_node) in last.items():
            key_line = key_node.start_mark.line + 1
            _line_map(value_node, (*path, key), key_line, lines, ancestors)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            item_line = item.start_mark.line + 1
            _line_map(item, (*path, str(index)), item_line, lines, ancestors)


def _line_for(loc: _Loc, lines: dict[_Key, int]) -> int | None:
    key: _Key = tuple(str(part) for part in loc)
    while key not in lines and key:
        key = key[:-1]
    return lines.get(key)


# --------------------------------------------------------------------------- messages

_WHY: dict[tuple[str, str], str] = {
    ("TaskConfig", "group_size"): "GRPO needs at least two rollouts per group",
    ("TaskConfig", "clients"): "0 starts no client node for this task",
    ("LoraConfig", "dropout"): "a probability",
    ("SamplingConfig", "top_p"): "a probability mass",
    ("ModelConfig", "port"): "0 picks a free port",
    ("ModelConfig", "metrics_port"): "0 picks a free port",
    ("TrainConfig", "max_staleness"): "0 accepts only groups made by the current weights",
}
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}
_TYPES = {
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "dict_type": "must be a mapping of key: value lines",
    "model_type": "must be a mapping of key: value lines",
    "model_attributes_type": "must be a mapping of key: value lines",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
}


def _issues(
    err: ValidationError, file: str, lines: dict[_Key, int], interpolated: dict[_Key, str]
) -> list[RecipeIssue]:
    issues: list[RecipeIssue] = []
    for error in err.errors():
        loc: _Loc = tuple(part for part in error["loc"] if part != "[key]")
        ctx: dict[str, Any] = error.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, CrossFieldError):
            issues += _problem_issues(cause.problems, loc, file, lines, interpolated)
            continue
        message = _describe(error["type"], loc, ctx, error["input"], error["msg"])
        missing = error["type"] == "missing"
        issues.append(
            RecipeIssue(
                file,
                _line_for(loc, lines),
                _dotted(loc),
                _with_source(message, loc, interpolated),
                None if missing else error["input"],
                not missing and bool(loc),
            )
        )
    return issues


def _problem_issues(
    problems: list[Problem],
    at: _Loc,
    file: str,
    lines: dict[_Key, int],
    interpolated: dict[_Key, str],
) -> list[RecipeIssue]:
    issues = []
    for problem in problems:
        loc = (*at, *problem.loc)
        message = _with_source(problem.message, loc, interpolated)
        issues.append(
            RecipeIssue(
                file, _line_for(loc, lines), _dotted(loc), message,
                None if problem.value is MISSING else problem.value, problem.value is not MISSING,
            )
        )
    return issues


def _describe(kind: str, loc: _Loc, ctx: dict[str, Any], value: object, msg: str) -> str:
    owner = _model_at(loc[:-1]) if loc else None
    key = str(loc[-1]) if loc else ""
    why = _WHY.get((owner.__name__, key)) if owner is not None else None
    if kind == "extra_forbidden" and owner is not None:
        return _unknown_key(key, owner, loc[:-1])
    if kind == "missing":
        if isinstance(loc[-1], int):
            return f"item {loc[-1]} is missing"
        info = owner.model_fields.get(key) if owner is not None else None
        desc = f": {info.description}" if info is not None and info.description else ""
        return f"required key is missing; add it{desc}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        text = f"must be {_BOUNDS[kind]} {bound}"
        return f"{text} ({why})" if why else text
    if kind == "literal_error":
        info = owner.model_fields.get(key) if owner is not None else None
        choices = _literal_choices(info.annotation) if info is not None else []
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"must be one of {ctx['expected']}{hint}"
    if kind == "value_error":
        return str(ctx.get("error", msg))
    if kind == "string_type":
        if not loc:
            return "a recipe must be a mapping with run:, models: and tasks:"
        if isinstance(value, (int, float, bool)):
            return f"must be a string: YAML read a {type(value).__name__}, so quote it"
        return "must be a string"
    if kind in _TYPES:
        if not loc:
            return "a recipe must be a mapping with run:, models: and tasks:"
        return _TYPES[kind]
    return msg[:1].lower() + msg[1:]


def _literal_choices(annotation: Any) -> list[str]:
    """The values of a Literal field (of the Literal inside `Literal[...] | None` too)."""
    if get_origin(annotation) is Literal:
        return [str(c) for c in get_args(annotation)]
    return [c for arg in get_args(annotation) for c in _literal_choices(arg)]


def _unknown_key(key: str, owner: type[BaseModel], parent: _Loc) -> str:
    """A suggestion for a key `owner` does not have: the same key where it does belong,
    else the closest key of `owner`, else the list of `owner`'s keys."""
    homes = [
        doc.path.rsplit(".", 1)[0] for doc in reference_fields() if doc.path.endswith(f".{key}")
    ]
    if homes:
        return f"unknown key here; {key} belongs under {' or '.join(homes)}"
    known = list(owner.model_fields)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    where = _dotted(parent) or "the top level"
    return f"unknown key; keys of {where} are: {', '.join(known)}"


def _with_source(message: str, loc: _Loc, interpolated: dict[_Key, str]) -> str:
    raw = interpolated.get(tuple(str(part) for part in loc))
    return f"{message} (value from {raw})" if raw is not None else message


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_SECRET_KEYS = ("token", "secret", "password", "api_key", "apikey")


def _show(value: object, path: str = "") -> str:
    """A value as the user would recognise it in YAML, short; secrets masked."""
    if any(path.lower().endswith(key) for key in _SECRET_KEYS) and value:
        return "'***'"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        text = repr(value)
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------- schema walk


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [arg for arg in get_args(tp) if arg is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _model_at(loc: _Loc) -> type[BaseModel] | None:
    """The schema model whose fields sit at `loc` (dict keys and list indexes skipped)."""
    tp: Any = Recipe
    for part in loc:
        tp = _unwrap(tp)
        if _is_model(tp):
            info = tp.model_fields.get(str(part))
            if info is None:
                return None
            tp = info.annotation
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        elif get_origin(tp) in (list, tuple):
            tp = get_args(tp)[0]
        else:
            return None
    tp = _unwrap(tp)
    return tp if _is_model(tp) else None


class FieldDoc(NamedTuple):
    path: str  # dotted; dict keys appear as <name>
    type: str
    default: str  # "required" or the YAML of the default
    description: str


def reference_fields(model: type[BaseModel] = Recipe, prefix: str = "") -> Iterator[FieldDoc]:
    """Every leaf field of the schema, in declaration order."""
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        tp = _unwrap(info.annotation)
        if _is_model(tp):
            yield from reference_fields(tp, path)
        elif get_origin(tp) is dict and _is_model(get_args(tp)[1]):
            yield from reference_fields(get_args(tp)[1], f"{path}.<name>")
        else:
            yield FieldDoc(
                path,
                _type_name(info.annotation, info.metadata),
                _default(info.default),
                info.description or "",
            )


def _type_name(tp: Any, metadata: list[Any]) -> str:
    if get_origin(tp) is Literal:
        text = " \\| ".join(str(arg) for arg in get_args(tp))
    elif get_origin(tp) in (Union, types.UnionType):
        text = " \\| ".join(_type_name(arg, []) for arg in get_args(tp))
    elif get_origin(tp) is not None:
        args = ", ".join(_type_name(arg, []) for arg in get_args(tp))
        text = f"{get_origin(tp).__name__}[{args}]"
    elif tp is type(None):
        text = "null"
    else:
        text = getattr(tp, "__name__", str(tp))
    bounds = []
    for item in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                bounds.append(f"{sign} {getattr(item, attr)}")
    return f"{text}, {', '.join(bounds)}" if bounds else text


def _default(value: object) -> str:
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
    return f"`{text.strip()}`"


def reference_markdown() -> str:
    """The field table of docs/recipe.md, generated from the schema."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for doc in reference_fields():
        meaning = doc.description.replace("|", "\\|").replace("<", "\\<")
        rows.append(f"| `{doc.path}` | {doc.type} | {doc.default} | {meaning} |")
    return "\n".join(rows) + "\n"


BEGIN_MARK = "<!-- BEGIN GENERATED: python -m jetctl.recipe --write-docs docs/recipe.md -->"
END_MARK = "<!-- END GENERATED -->"


def write_reference(doc: Path) -> None:
    """Replace the generated table of `doc` (between the markers) with a fresh one."""
    text = doc.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN_MARK, 1)
    _, tail = rest.split(END_MARK, 1)
    doc.write_text(f"{head}{BEGIN_MARK}\n{reference_markdown()}{END_MARK}{tail}", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write-docs":
        write_reference(Path(sys.argv[2]))
    else:
        sys.stdout.write(reference_markdown())
