"""Every field of the recipe schema does what it says, or is refused: one row per field.

`ROWS` maps each leaf field of `jetctl/recipe/schema.py` (as `reference_fields()` names it) to how
its effect is shown:

* `Effect(check)`: `check` sets the field to a value other than its default, runs the code
  that reads it, and asserts what a user would see change (a cheap check, here);
* `CoveredBy(tests)`: tests elsewhere set the field through a recipe and assert its effect
  (they need real processes, a docker engine, Ray or network namespaces); the row checks that
  each named test exists and that its file names the field, and that one of those files (or
  a recipe file they run, `recipes`) sets its whole key path (`limits:` and
  `max_buffer_groups:`, not only the last key);
* `CoveredBy(tests, weak=why)`: the named tests show the effect but hand the value to its
  consumer directly (`TaskConfig(...)`, `LimitsConfig(...)`), or set it through a recipe
  without an assert that its being ignored would fail; `why` says which. A gap, kept in view:
  such a row wants a check that sets the field in a recipe.

A refused value (e.g. `engine: vllm` where vllm is not importable) is part of a field's row.
`test_every_field_has_a_row` fails on a schema field without a row, so a new field cannot
be silently ignored: give it an effect, or refuse it in the schema until it has one.
"""

from __future__ import annotations

import ast
import math
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml

from jetctl.recipe import (
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    RecipeError,
    TrainConfig,
    parse_recipe,
    reference_fields,
)
from tests.factories import GOOD_RECIPE, parsed_recipe, recipe_text

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Effect:
    check: Callable[[Path], None]
    integration: bool = False  # starts processes


@dataclass(frozen=True)
class CoveredBy:
    tests: tuple[str, ...]  # "tests/file.py::test_name"
    recipes: tuple[str, ...] = ()  # recipe files those tests run, where the field is set
    weak: str = ""  # why none of them sets the field through a recipe and shows its effect


def policy(**fields: Any) -> ModelConfig:
    """models.policy of GOOD_RECIPE with `fields` set, parsed as the server gets it."""
    return parsed_recipe(models={"policy": fields}).models["policy"]


def refused(message: str, **parts: Any) -> None:
    with pytest.raises(RecipeError) as caught:
        parsed_recipe(**parts)
    assert message in caught.value.render(), caught.value.render()


def tiny(**fields: Any) -> ModelConfig:
    return ModelConfig(model="builtin:tiny", **fields)


def load(cfg: ModelConfig) -> Any:
    from jetctl.server.step import load_trainable

    model, _ = load_trainable(cfg, attn_implementation="sdpa")
    return model


# --------------------------------------------------------------------------- run


def run_name(_: Path) -> None:
    assert parsed_recipe(run={"name": "exp7"}).run_dir == "runs/exp7"


def run_dir(_: Path) -> None:
    assert parsed_recipe(run={"name": "exp7", "dir": "/data/runs/x"}).run_dir == "/data/runs/x"


@pytest.fixture
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JETCTL_TOKEN", raising=False)


def controller_sees(tmp_path: Path, run: dict[str, Any], model: dict[str, Any]) -> None:
    """A controller with fake nodes: the recipe's token, ports and metrics port reach the
    run directory and the server's command line."""
    import psutil

    from jetctl.controller.controller import Controller
    from tests.controller.controller_fakes import (
        FAST,
        Running,
        fake_commands,
        read_run_json,
        recipe_dict,
        wait_for,
        write_recipe,
    )

    data = recipe_dict(clients=0, **run)
    data["models"]["policy"].update(model)
    rec, path = write_recipe(tmp_path, data)
    rd = tmp_path / "runs" / "t"
    ctl = Controller(rec, path, run_dir=rd, commands=fake_commands(path, rd), options=FAST)
    running = Running(ctl).start()
    try:
        info = wait_for(lambda: (read_run_json(rd).get("servers") or {}).get("policy", {}).get("pid")
                        and read_run_json(rd), what="the server in run.json")
        assert (rd / "token").read_text().strip() == run["token"]
        server = info["servers"]["policy"]
        assert server["endpoint"].endswith(f":{model['port']}")
        argv = psutil.Process(int(server["pid"])).cmdline()
        assert argv[argv.index("--port") + 1] == str(model["port"])
        assert argv[argv.index("--metrics-port") + 1] == str(model["metrics_port"])
    finally:
        running.stop(grace_s=2.0)


def restart_backoff(tmp_path: Path) -> None:
    """Kill a client three times: the controller plans its restarts after restart_backoff_s,
    doubling up to restart_backoff_max_s (read from the plan it logs, not from timing)."""
    import logging
    import os
    import re
    import signal

    from jetctl.controller.controller import Controller
    from tests.controller.controller_fakes import (
        FAST,
        Running,
        fake_commands,
        node_states,
        recipe_dict,
        wait_for,
        write_recipe,
    )

    data = recipe_dict(clients=1, restart_backoff_s=0.3, restart_backoff_max_s=0.5)
    rec, path = write_recipe(tmp_path, data)
    rd = tmp_path / "runs" / "t"
    planned: list[float] = []

    class Plans(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found = re.search(r"arith-0 exited .* restarting in ([0-9.]+)s", record.getMessage())
            if found:
                planned.append(float(found.group(1)))

    handler = Plans()
    logger = logging.getLogger("jetctl.controller")
    logger.addHandler(handler)
    ctl = Controller(rec, path, run_dir=rd, commands=fake_commands(path, rd), options=FAST)
    running = Running(ctl).start()
    try:
        for n in range(1, 4):
            wait_for(lambda: node_states(ctl).get("arith-0") == "running", what="arith-0 up")
            pid = next(x.pid for x in ctl.status().nodes if x.name == "arith-0")
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda n=n: len(planned) == n, what=f"restart {n} planned")
    finally:
        running.stop(grace_s=2.0)
        logger.removeHandler(handler)
    assert planned == [0.3, 0.5, 0.5], planned  # uncapped: 0.3, 0.6, 1.2


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def run_token_and_ports(tmp_path: Path) -> None:
    port, metrics = free_ports(2)
    controller_sees(tmp_path, {"token": "recipe-token-123"},
                    {"port": port, "metrics_port": metrics})


# --------------------------------------------------------------------------- models


def model_source(_: Path) -> None:
    assert load(tiny(finetune="full")).config.hidden_size == 64  # builtin:tiny's width


def model_device(_: Path) -> None:
    # no accelerator here: the meta device shows the weights go where `device` says
    model = load(tiny(finetune="full", device="meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}


def model_dtype(_: Path) -> None:
    assert {p.dtype for p in load(tiny(finetune="full", dtype="bfloat16")).parameters()} == {
        torch.bfloat16
    }


def model_finetune(_: Path) -> None:
    lora = load(tiny(finetune="lora"))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    full = load(tiny(finetune="full"))
    assert all(p.requires_grad for p in full.parameters())


def lora_modules(model: Any) -> dict[str, Any]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and m.lora_A}


def lora_r(_: Path) -> None:
    layers = lora_modules(load(tiny(lora=LoraConfig(r=4))))
    assert {m.lora_A["default"].weight.shape[0] for m in layers.values()} == {4}


def lora_alpha(_: Path) -> None:
    layers = lora_modules(load(tiny(lora=LoraConfig(r=4, alpha=12))))
    assert {m.scaling["default"] for m in layers.values()} == {3.0}


def lora_target_modules(_: Path) -> None:
    layers = lora_modules(load(tiny(lora=LoraConfig(target_modules=["q_proj", "down_proj"]))))
    assert {name.rsplit(".", 1)[-1] for name in layers} == {"q_proj", "down_proj"}


def make_trainer(tmp_path: Path, cfg: ModelConfig) -> Any:
    from tests.server.trainer_support import make_trainer as make

    return make(tmp_path, cfg)


def optimizer_hyperparameters(tmp_path: Path) -> None:
    cfg = tiny(finetune="full", optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.1,
                                                          betas=(0.8, 0.95)))
    group = make_trainer(tmp_path, cfg).optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (3e-3, 0.1, (0.8, 0.95))


def optimizer_max_grad_norm(tmp_path: Path) -> None:
    """Adam divides by the gradient's size, so a clip far below its epsilon stalls the step."""
    from tests.server.trainer_support import same_weights, step, submit, weights

    moved = {}
    for norm in (1.0, 1e-14):
        cfg = tiny(finetune="full", optimizer=OptimizerConfig(lr=1e-2, max_grad_norm=norm),
                   train=TrainConfig(groups_per_step=1))
        trainer = make_trainer(tmp_path / str(norm), cfg)
        before = weights(trainer.model)
        submit(trainer)
        assert step(trainer) is not None
        after = weights(trainer.model)
        assert not same_weights(before, after)
        moved[norm] = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved[1.0] > 1e-3 and moved[1e-14] < 1e-4


def train_algorithm(tmp_path: Path) -> None:
    """Each algorithm's formula: tests/server/test_algorithms.py; learning: ..._learn.py."""
    from tests.server.trainer_support import step, submit

    assert parsed_recipe().models["policy"].train.algorithm == "grpo"
    refused("did you mean 'rloo'?", models={"policy": {"train": {"algorithm": "rlo"}}})
    losses = {}
    for name in ("grpo", "rloo"):  # rewards 0, 1, 0.5: A = -1.22, 1.22, 0 vs -0.75, 0.75, 0
        trainer = make_trainer(tmp_path / name, tiny(finetune="full", train=TrainConfig(
            groups_per_step=1, algorithm=name)))
        assert trainer.algorithm.name == name
        submit(trainer, rewards=(0.0, 1.0, 0.5))
        scalars = step(trainer)
        assert scalars is not None
        losses[name] = scalars["loss"]
    assert losses["grpo"] != losses["rloo"]


def train_mix(_: Path) -> None:
    """Validation here; what a mix does to the batches: tests/server/test_mixing.py."""
    assert parsed_recipe().models["policy"].train.mix == {}
    assert parsed_recipe(models={"policy": {"train": {"mix": {"digits": 1.0}}}}).models[
        "policy"].train.mix == {"digits": 1.0}
    refused("shares sum to 0.8, not 1", models={"policy": {"train": {"mix": {"digits": 0.8}}}})
    refused("'digit' is not a task that trains policy (those: digits); did you mean 'digits'?",
            models={"policy": {"train": {"mix": {"digits": 0.5, "digit": 0.5}}}})
    refused("gives no share to digits", tasks={"web": {
        "env": "envs.digits:make_env", "agent": "agents.digits:agent", "model": "policy"}},
        models={"policy": {"train": {"mix": {"web": 1.0}}}})


def train_mix_wait_s(_: Path) -> None:
    assert parsed_recipe().models["policy"].train.mix_wait_s == 10.0
    refused("only applies with train.mix", models={"policy": {"train": {"mix_wait_s": 5}}})


def train_groups_per_step(tmp_path: Path) -> None:
    from tests.server.trainer_support import step, submit

    trainer = make_trainer(tmp_path, tiny(finetune="full", train=TrainConfig(groups_per_step=2)))
    submit(trainer)
    assert step(trainer) is None and trainer.groups_waiting == 1, "waits for a second group"
    submit(trainer)
    scalars = step(trainer)
    assert scalars is not None and scalars["groups"] == 2


def shifted_step(train: TrainConfig, shift: float) -> dict[str, float]:
    """The scalars of one step on builtin:tiny whose behaviour logprobs are the model's own
    plus `shift` (shift > 0: the engine liked these tokens more, ratio exp(-shift))."""
    from jetctl.server import algorithms, merge
    from jetctl.server.step import token_logprobs, train_step
    from tests.factories import make_group

    model = load(tiny(finetune="full"))
    g = make_group(prompt=(11, 12, 13), completion=(14, 15, 16, 17))
    mbs = merge.pack(merge.timeline_sequences(g.trajectories[1], 1.0, "off"), "off", 8192)
    with torch.no_grad():
        now = token_logprobs(model, mbs[0])
    for t in g.trajectories:
        t.calls[0].completion_logprobs = (now + shift).tolist()
    result = train_step(model, [g.trajectories], train, algorithms.make(train), max_grad_norm=1.0)
    return result.scalars


def clip_fraction(clip_eps: float) -> float:
    # the behaviour policy liked these tokens more: ratio 0.74
    return shifted_step(TrainConfig(clip_eps=clip_eps), 0.3)["clip_fraction"]


def train_clip_eps(_: Path) -> None:
    assert clip_fraction(0.2) == 1.0 and clip_fraction(0.5) == 0.0
    refused("gspo clips its sequence-level ratio to its own range",
            models={"policy": {"train": {"algorithm": "gspo", "clip_eps": 0.3}}})


def train_clip_eps_high(_: Path) -> None:
    # ratio e^0.3 = 1.35 with dapo: clipped under DAPO's 0.28, not under 0.4
    def clipped(high: float | None) -> float:
        return shifted_step(TrainConfig(algorithm="dapo", clip_eps_high=high), -0.3)[
            "clip_fraction"]

    assert clipped(None) == 1.0 and clipped(0.4) == 0.0
    refused("only applies with algorithm: dapo",
            models={"policy": {"train": {"clip_eps_high": 0.3}}})


def train_tis_cap(_: Path) -> None:
    # engine logprobs 0.3 above the trainer's: every w_t = exp(-0.3); 0.3 below: capped at 1.2
    assert "tis/weight_mean" not in shifted_step(TrainConfig(), 0.3)
    below = shifted_step(TrainConfig(tis_cap=2.0), 0.3)
    assert below["tis/weight_mean"] == pytest.approx(math.exp(-0.3), rel=1e-5)
    assert below["tis/truncated"] == 0.0
    above = shifted_step(TrainConfig(tis_cap=1.2), -0.3)
    assert above["tis/weight_mean"] == pytest.approx(1.2) and above["tis/truncated"] == 1.0
    assert above["importance_ratio/mean"] == pytest.approx(1.0), "the ratio is the trainer's"
    refused("must be >= 1", models={"policy": {"train": {"tis_cap": 0.5}}})


def train_merge(tmp_path: Path) -> None:
    from tests.server.trainer_support import step, submit

    packed = {}
    for mode in ("off", "tree"):
        trainer = make_trainer(tmp_path / mode, tiny(finetune="full", train=TrainConfig(
            groups_per_step=1, merge=mode)))
        submit(trainer, rewards=(0.0, 1.0, 0.5, 0.0))
        scalars = step(trainer)
        assert scalars is not None
        packed[mode] = scalars["merge/tokens_packed"]
    assert packed["tree"] < packed["off"], "tree packs the group's prompt once"


def train_max_tokens_per_microbatch(tmp_path: Path) -> None:
    from tests.server.trainer_support import step, submit

    counts = {}
    for budget in (8192, 64):
        trainer = make_trainer(tmp_path / str(budget), tiny(finetune="full", train=TrainConfig(
            groups_per_step=1, merge="off", max_tokens_per_microbatch=budget)))
        submit(trainer, rewards=(0.0, 1.0) * 4)
        scalars = step(trainer)
        assert scalars is not None
        counts[budget] = scalars["microbatches"]
    assert counts == {8192: 1.0, 64: 2.0}  # 8 sequences of 9 tokens; 64 holds 7 of them


def train_max_steps(tmp_path: Path) -> None:
    from tests.server.trainer_support import step, submit

    trainer = make_trainer(tmp_path, tiny(finetune="full", train=TrainConfig(
        groups_per_step=1, max_steps=2)))
    for _ in range(2):
        assert not trainer.done
        submit(trainer)
        step(trainer)
    assert trainer.version == 2 and trainer.done


def generation_batch_wait_ms(tmp_path: Path) -> None:
    from tests.server.test_engine_batching import batch_sizes_of_staggered_requests

    assert batch_sizes_of_staggered_requests(batch_wait_ms=0.0)[0] == 1
    assert batch_sizes_of_staggered_requests(batch_wait_ms=2000.0) == [4, 4]


def torch_threads_seen(model: Any) -> tuple[set[int], Callable[[], None]]:
    """The torch thread counts of the threads that run `model`'s forward, and an undo."""
    seen: set[int] = set()
    handle = model.register_forward_hook(lambda *_: seen.add(torch.get_num_threads()))
    return seen, handle.remove


def generation_threads(_: Path) -> None:
    import asyncio

    from jetctl.server.engines import GenRequest, make_engine
    from jetctl.server.locks import WeightsLock

    cfg = tiny(generation={"threads": 1})
    model = load(cfg)
    assert torch.get_num_threads() != 1  # the process default, which the engine overrides
    seen, undo = torch_threads_seen(model)

    async def one() -> None:
        engine = make_engine(cfg, model, eos_token_ids=[2], pad_token_id=2,
                             weights_lock=WeightsLock(), version=lambda: 0).engine
        engine.start()
        try:
            await engine.generate(GenRequest([5, 6, 7], 3, 1.0, 1.0))
        finally:
            await engine.stop()

    asyncio.run(one())
    undo()
    assert seen == {1}


def generation_workers(_: Path) -> None:
    """With workers: 2, two engine threads each decode their own batch on their share of
    generation.threads; a group's requests stay on one; a publish reaches both. Another
    engine, and lend_threads beside it, are refused."""
    import asyncio
    import threading

    from jetctl.server.engines import GenRequest, make_engine
    from jetctl.server.locks import WeightsLock

    cfg = tiny(finetune="lora", generation={"threads": 2, "workers": 2})
    model = load(cfg)
    ran: dict[str, set[int]] = {}
    handle = model.register_forward_hook(  # deep-copied with the model into each replica
        lambda *_: ran.setdefault(threading.current_thread().name, set()).add(
            torch.get_num_threads()))

    async def two_groups() -> tuple[list[int], Any]:
        serving = make_engine(cfg, model, eos_token_ids=[2], pad_token_id=2,
                              weights_lock=WeightsLock(), version=lambda: 0)
        serving.engine.start()
        try:
            group = [GenRequest([5, 6, 7], 6, 1.0, 1.0) for _ in range(4)]
            other = [GenRequest([9, 8, 7, 6], 6, 1.0, 1.0) for _ in range(4)]
            first = [asyncio.ensure_future(serving.engine.generate(r)) for r in group]
            await asyncio.sleep(0)
            second = [asyncio.ensure_future(serving.engine.generate(r)) for r in other]
            await asyncio.gather(*first, *second)
            assert serving.publish is not None
            serving.publish(1)
            after = await serving.engine.generate(GenRequest([5, 6, 7], 2, 1.0, 1.0))
            routed = [serving.engine.route([5, 6, 7]), serving.engine.route([9, 8, 7, 6])]
            return routed, after
        finally:
            await serving.engine.stop()

    routed, after = asyncio.run(two_groups())
    handle.remove()
    assert ran == {"engine-0": {1}, "engine-1": {1}}, ran  # both decoded, one thread each
    assert sorted(routed) == [0, 1]  # each group on its own worker, and it stays there
    assert after.model_version == 1
    refused("runs several engine hf workers side by side",
            models={"policy": {"engine": "continuous", "generation": {"workers": 2}}})
    refused("the workers already use the cores",
            models={"policy": {"generation": {"workers": 2}, "train": {"lend_threads": True}}})


def train_lend_threads(_: Path) -> None:
    """With lend_threads, the engine's forwards run on generation.threads + train.threads
    while the trainer computes no step, on its own threads while it does; without, always
    on its own. An engine other than hf is refused."""
    import asyncio
    from types import SimpleNamespace

    from jetctl.server.app import lending
    from jetctl.server.engines import GenRequest, make_engine
    from jetctl.server.locks import WeightsLock

    def forward_threads(lend: bool, computing: bool) -> tuple[set[int], dict[str, float]]:
        cfg = policy(model="builtin:tiny", generation={"threads": 1},
                     train={"threads": 1, "lend_threads": lend})
        model = load(cfg)
        seen, undo = torch_threads_seen(model)
        trainer = SimpleNamespace(computing=computing)

        async def one() -> dict[str, float]:
            engine = make_engine(cfg, model, eos_token_ids=[2], pad_token_id=2,
                                 weights_lock=WeightsLock(), version=lambda: 0,
                                 lent_threads=lending(cfg, trainer, 1)).engine  # type: ignore[arg-type]
            engine.start()
            try:
                await engine.generate(GenRequest([5, 6, 7], 3, 1.0, 1.0))
                return engine.take_figures()
            finally:
                await engine.stop()

        figures = asyncio.run(one())
        undo()
        return seen, figures

    seen, figures = forward_threads(lend=True, computing=False)
    assert seen == {2} and figures["generate/lent_s"] > 0
    seen, figures = forward_threads(lend=True, computing=True)
    assert seen == {1} and figures["generate/lent_s"] == 0
    seen, figures = forward_threads(lend=False, computing=False)
    assert seen == {1} and figures["generate/lent_s"] == 0
    refused("engine hf generating on a CPU",
            models={"policy": {"engine": "continuous", "train": {"lend_threads": True}}})


def train_threads(tmp_path: Path) -> None:
    from tests.server.trainer_support import submit

    trainer = make_trainer(tmp_path, tiny(finetune="full", train=TrainConfig(
        groups_per_step=1, threads=1, max_steps=1)))
    assert torch.get_num_threads() != 1
    seen, undo = torch_threads_seen(trainer.model)
    submit(trainer)
    trainer.start()
    deadline = time.monotonic() + 60
    while not trainer.done and time.monotonic() < deadline:
        time.sleep(0.05)
    trainer.stop()
    undo()
    assert trainer.version == 1 and seen == {1}


def model_seed(_: Path) -> None:
    def lora_a(seed: int) -> torch.Tensor:
        model = load(tiny(seed=seed))
        return next(p for n, p in model.named_parameters() if "lora_A" in n).detach()

    assert torch.equal(lora_a(3), lora_a(3)) and not torch.equal(lora_a(3), lora_a(4))


# ------------------------------------- the parsed recipe's model, in the server's own parts


def lora_dropout(_: Path) -> None:
    """The trainer's view of the adapter (adapter_mode train) drops inputs only with dropout."""
    from jetctl.server.adapter import adapter_mode
    from tests.server.test_adapter import logprobs, microbatch

    def two_trainer_views(**lora: Any) -> list[torch.Tensor]:
        model = load(policy(lora=lora))
        with torch.no_grad():  # a trained adapter: lora_B starts at zero, hiding the rest
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5)
        mb = microbatch()
        with adapter_mode("train"):
            return [logprobs(model, mb) for _ in range(2)]

    assert torch.equal(*two_trainer_views())  # the default, 0.0
    assert not torch.equal(*two_trainer_views(dropout=0.5))


def trainer_of(tmp_path: Path, **fields: Any) -> Any:
    """A Trainer (tests/server/trainer_support.py) on models.policy of GOOD_RECIPE with `fields`,
    one group per step."""
    train = {"groups_per_step": 1, **fields.pop("train", {})}
    return make_trainer(tmp_path, policy(train=train, **fields))


def train_order(tmp_path: Path) -> None:
    """Groups made at versions 3, 5 and 4 wait while the trainer is at 5: oldest trains them
    in arrival order, newest the highest version first."""
    from tests.server.trainer_support import step, submit

    def made_at(name: str, **train: Any) -> list[int]:
        trainer = trainer_of(tmp_path / name, finetune="full", train=train)
        trainer.version = 5  # as if five steps ran
        for version in (3, 5, 4):
            submit(trainer, version=version)
        made = []
        for _ in range(3):
            before = trainer.version
            assert step(trainer) is not None
            made.append(before - trainer.figures.recent_lags["digits"][-1])
        return made

    assert made_at("default") == [3, 5, 4]
    assert made_at("newest", order="newest") == [5, 4, 3]


def train_kl_coef(tmp_path: Path) -> None:
    """LoRA: the reference is the base model; once the adapter moved (step 2), a step with
    kl_coef > 0 measures its distance from it, and its loss holds the penalty."""
    from tests.server.trainer_support import step, submit

    def second_step(name: str, **train: Any) -> dict[str, float]:
        trainer = trainer_of(tmp_path / name, optimizer={"lr": 1e-2}, train=train)
        scalars = None
        for _ in range(2):
            submit(trainer)
            scalars = step(trainer)
            assert scalars is not None
        return scalars

    free, held = second_step("free"), second_step("held", kl_coef=5.0)
    assert free["kl_ref"] == 0.0 and held["kl_ref"] > 0.0
    assert held["loss"] != free["loss"]


def checkpoint_dir(tmp_path: Path) -> None:
    """`jetctl server` from a recipe whose checkpoint.dir is a folder outside the run dir
    takes one step (max_steps: 1) and checkpoints it: the checkpoint is in that folder, and
    the run dir's own checkpoints folder holds none, also after the server's drain."""
    from jetctl.auth import bearer, write_token
    from jetctl.proto._gen import swarm_pb2 as pb
    from jetctl.proto.convert import group_to_pb
    from tests.server.test_server_process import TOKEN, rollout_group, stub

    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    write_token(run_dir / "token", TOKEN)
    data = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    data["models"]["policy"]["checkpoint"] = {"dir": str(elsewhere), "every_steps": 1}
    data["models"]["policy"]["train"].update(groups_per_step=1, max_steps=1)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(data))
    (port,) = free_ports(1)
    log = run_dir / "server.log"
    proc = start_server(run_dir, port)
    try:
        s = stub(f"127.0.0.1:{port}")
        group = rollout_group(s, [0.0, 1.0])  # a signal: the one step it takes
        reply = s.Submit(pb.SubmitRequest(groups=[group_to_pb(group)]), metadata=bearer(TOKEN),
                         timeout=30)
        assert [a.code for a in reply.acks] == [pb.Ack.ACCEPTED]
        deadline = time.monotonic() + 120  # the step, then its checkpoint (every_steps: 1)
        while not (elsewhere.is_dir() and any(elsewhere.rglob("step-*"))):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert [p.name for p in elsewhere.rglob("step-*") if p.is_dir()] == ["step-00000001"]
    assert not list((run_dir / "checkpoints").rglob("step-*"))


def checkpoint_every_steps_and_keep(tmp_path: Path) -> None:
    from tests.server.trainer_support import step, submit

    trainer = trainer_of(tmp_path, finetune="full", checkpoint={"every_steps": 2, "keep": 2})
    for _ in range(5):
        submit(trainer)
        assert step(trainer) is not None
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-00000002", "step-00000004"]  # every 2 steps (default 10)
    trainer.stop()  # stopping checkpoints what is new since the last checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-00000004", "step-00000005"]  # keep: 2 (default 3)


def serving(cfg: ModelConfig, eos: int = 2, **kwargs: Any) -> tuple[Any, Any]:
    """(the trainer's model, the ServingEngine `make_engine` builds for it), as the server
    does from `cfg`; `eos`: the token that ends a reply."""
    from jetctl.server.engines import make_engine
    from jetctl.server.locks import WeightsLock

    model = load(cfg)
    return model, make_engine(cfg, model, eos_token_ids=[eos], pad_token_id=2,
                              weights_lock=WeightsLock(), version=lambda: 0, **kwargs)


def model_engine(_: Path) -> None:
    from jetctl.server.engines.continuous import ContinuousEngine
    from jetctl.server.engines.hf import HFEngine

    assert isinstance(serving(policy())[1].engine, HFEngine)
    assert isinstance(serving(policy(engine="continuous"))[1].engine, ContinuousEngine)


def replica_of(served: Any) -> Any:
    assert served.publish is not None, "a replica publishes the trainer's weights to itself"
    return served.publish.__self__


def generation_device(_: Path) -> None:
    """Full fine-tuning on hf generates on the trainer's own model, unless generation.device
    names a device: then on a copy there (only cpu exists here; tests/gpu for CUDA)."""
    model, served = serving(policy(finetune="full"))
    assert served.publish is None
    model, served = serving(policy(finetune="full", generation={"device": "cpu"}))
    replica = replica_of(served)
    assert replica.model is not model
    assert {p.device.type for p in replica.model.parameters()} == {"cpu"}


def generation_dtype(_: Path) -> None:
    model, served = serving(policy(finetune="full", generation={"dtype": "bfloat16"}))
    assert {p.dtype for p in replica_of(served).model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the trainer's


def generation_publish_timeout_s(_: Path) -> None:
    """A publish to an engine with its own copy of the weights that is not staged
    (continuous) waits for the requests under way at most publish_timeout_s per attempt
    (default 30 s), twice, then leaves the engine on its version until the next step: a
    long reply is under way here."""
    import asyncio

    from jetctl.server.engines import GenRequest

    cfg = policy(finetune="full", engine="continuous", generation={"publish_timeout_s": 0.05})
    engine = serving(cfg, eos=10**6)[1]  # no reply ends before its max_tokens
    replica = replica_of(engine)
    assert not replica.staged

    async def publish_during_a_long_reply() -> tuple[float, int]:
        engine.engine.start()
        try:
            long = GenRequest([5, 6, 7], max_tokens=60, temperature=1.0, top_p=1.0)
            running = asyncio.create_task(engine.engine.generate(long))
            deadline = time.monotonic() + 10
            while engine.engine.load().rows == 0:  # the reply under way
                assert time.monotonic() < deadline, "the long reply never started"
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            await asyncio.to_thread(replica.publish, 1)
            waited = time.monotonic() - t0
            return waited, (await running).model_version
        finally:
            await engine.engine.stop()

    waited, served_at = asyncio.run(publish_during_a_long_reply())
    assert replica.figures.missed_attempts == 2 and replica.version == 0
    assert served_at == 0 and waited < 5.0


def generation_max_batch_size(_: Path) -> None:
    """Eight requests at once: more than 3 share a decode step by default (16), at most 3
    with max_batch_size: 3."""
    import asyncio

    from tests.server.test_engine_batching import no_eos, request

    def rows_per_step(**generation: Any) -> list[int]:
        sizes: list[int] = []
        cfg = policy(finetune="full", generation={"batch_wait_ms": 50, **generation})
        engine = no_eos(serving(cfg, on_batch=lambda n, _t, _s: sizes.append(n))[1].engine)

        async def eight() -> None:
            engine.start()
            try:
                await asyncio.gather(*(engine.generate(request(i)) for i in range(8)))
            finally:
                await engine.stop()

        asyncio.run(eight())
        return sizes

    assert max(rows_per_step()) > 3
    assert max(rows_per_step(max_batch_size=3)) == 3


def run_tls_hosts(tmp_path: Path) -> None:
    """The run's server certificate (what `jetctl up` makes) names the hosts listed."""
    from cryptography import x509

    from jetctl.tls import prepare_run_tls

    def names(name: str, **tls: Any) -> set[str]:
        files = prepare_run_tls(parsed_recipe(run={"tls": {"mode": "mtls", **tls}}), tmp_path / name)
        assert files is not None
        cert = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} | set(
            san.get_values_for_type(x509.DNSName))

    listed = {"10.1.2.3", "trainer.internal"}
    assert listed <= names("listed", hosts=sorted(listed))
    assert not listed & names("default")


# ---------------------------------------------- the parsed recipe's task, as the run runs it


class FakeDocker:
    """The docker SDK's client, where DockerRuntime.start asks `containers` for a container
    by name (none) and runs one: records each `containers.run(image, **kwargs)`."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, dict[str, Any]]] = []
        self.containers = self

    def get(self, name: str) -> Any:
        import docker

        raise docker.errors.NotFound(name)

    def run(self, image: str, **kwargs: Any) -> Any:
        from types import SimpleNamespace

        self.runs.append((image, kwargs))
        return SimpleNamespace(id=f"container-{len(self.runs)}")


def node_started(tmp_path: Path, **task: Any) -> tuple[Any, FakeDocker]:
    """digits-0 of GOOD_RECIPE with `task`'s fields, as the controller builds its spec from the
    parsed recipe and hands it to its runtime: a docker runtime on a fake engine."""
    from jetctl.controller.controller import Controller
    from jetctl.controller.runtimes.docker import DockerRuntime

    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "r.yaml"
    path.write_text(recipe_text(tasks={"digits": task}))
    rec = parse_recipe(path.read_text(), file=str(path), env={})
    fake = FakeDocker()
    ctl = Controller(rec, path, run_dir=tmp_path / "run",
                     runtimes={"docker": DockerRuntime(tmp_path / "run", client=fake)})
    ctl.token = ctl.reconciler.token = "run-token"
    ctl.reconciler.control = "127.0.0.1:7000"
    ctl.reconciler.build_nodes({})
    spec = ctl.reconciler.spec(ctl.state.nodes["digits-0"])
    if spec.container is not None:
        ctl.reconciler.runtimes["docker"].start(spec)
    return spec, fake


def docker_run(tmp_path: Path, **task: Any) -> tuple[str, dict[str, Any]]:
    """The image and arguments of the `containers.run` that starts digits-0 with `task`'s
    fields, `runtime: docker` and `network: host` (no run network to make)."""
    _, fake = node_started(tmp_path, runtime="docker", network="host", **task)
    (run,) = fake.runs
    return run


def task_runtime(tmp_path: Path) -> None:
    spec, fake = node_started(tmp_path / "process")
    assert spec.container is None and not fake.runs  # the default: a plain subprocess
    spec, fake = node_started(tmp_path / "docker", runtime="docker", network="host")
    ((image, kwargs),) = fake.runs
    assert spec.container is not None and image == "jetctl-base"
    assert kwargs["command"][-len(spec.argv):] == spec.argv  # the node, in a container


def task_image(tmp_path: Path) -> None:
    assert docker_run(tmp_path, image="jetctl-code:7")[0] == "jetctl-code:7"


def task_resources(tmp_path: Path) -> None:
    _, default = docker_run(tmp_path / "default")
    assert "nano_cpus" not in default and "shm_size" not in default
    assert (default["mem_limit"], default["pids_limit"]) == ("4g", 512)
    _, limited = docker_run(tmp_path / "limited", resources={
        "cpus": 0.5, "memory": "256m", "pids": 64, "shm": "128m"})
    assert limited["nano_cpus"] == 500_000_000 and limited["shm_size"] == "128m"
    assert limited["mem_limit"] == limited["memswap_limit"] == "256m"
    assert limited["pids_limit"] == 64


def task_docker_socket(tmp_path: Path) -> None:
    import os
    from unittest import mock

    sock = tmp_path / "docker.sock"  # what DOCKER_HOST names; a file is enough here
    sock.touch()
    with mock.patch.dict(os.environ, {"DOCKER_HOST": f"unix://{sock}"}):
        _, without = docker_run(tmp_path / "without")
        _, given = docker_run(tmp_path / "given", docker_socket=True)
    assert str(sock) not in without["volumes"]
    assert given["volumes"][str(sock)] == {"bind": "/var/run/docker.sock", "mode": "rw"}
    assert given["group_add"] == [str(sock.stat().st_gid)]


def client_node(tmp_path: Path) -> None:
    """A client node run from the parsed recipe's task, as `jetctl client` hands it to
    ClientNode, against tests/client's fake server. The bare agent leaves every sampling
    knob out of its call (the digits agent would ask for 1.0 and `length` tokens)."""
    import asyncio
    import collections
    import random

    from envs.digits.env import make_env
    from jetctl.client.node import ClientNode, NodeConfig
    from jetctl.models import tokenizer_from_files
    from tests.client.client_fakes import (
        TOKEN,
        FakeSwarm,
        start_fake_server,
        tiny_tokenizer_files,
    )
    from tests.client.test_client_node import digit_reply

    task = parsed_recipe(models={"writer": {"model": "builtin:tiny"}}, tasks={"digits": {
        "model": "writer", "agent": "tests.client.client_fakes:bare_agent",
        "env_args": {"digit": 3, "length": 5}, "group_size": 3, "concurrency": 3, "seed": 5,
        "sampling": {"temperature": 0.5, "top_p": 0.8, "max_tokens": 3},
    }}).tasks["digits"]
    files = tiny_tokenizer_files()
    tokenizer = tokenizer_from_files(files)
    fake = FakeSwarm(tokenizer, files, model="writer", reply_text=digit_reply(tokenizer))

    async def run() -> None:
        server, _ = await start_fake_server(fake, tmp_path)
        try:
            node = ClientNode(NodeConfig(
                name="digits-0", task_name="digits", task=task, run_dir=tmp_path, token=TOKEN,
                index=0, max_groups=3, install_signal_handlers=False, drain_grace_s=10,
            ))
            assert await node.run() == 0
        finally:
            await server.stop(None)

    asyncio.run(run())
    assert [r.model for r in fake.registers] == ["writer"]  # tasks.digits.model
    assert len(fake.stored) == 3 and len(fake.generate_calls) == 9
    for group in fake.stored.values():
        assert group.model == "writer" and len(group.trajectories) == 3  # group_size
    for req in fake.generate_calls:  # sampling, filled in for the agent named
        assert (req.temperature, req.top_p, req.max_tokens) == (
            pytest.approx(0.5), pytest.approx(0.8), 3)
    # env and env_args: the digits env for digit 3; seed: the tasks random.Random(5) draws
    # (node index 0), which are not those of the default seed 0
    def drawn(seed: int) -> collections.Counter[str]:
        rng, tasks = random.Random(seed), make_env(digit=3, length=5).all_tasks()
        return collections.Counter(rng.choice(tasks).id for _ in range(3))

    assert drawn(5) != drawn(0)
    assert collections.Counter(g.task_id for g in fake.stored.values()) == drawn(5)


def in_run_eval(tmp_path: Path, seconds: float, **block: Any) -> tuple[Any, Path]:
    """The server's in-run evals (`InRunEval.for_server`: the recipe its run dir's run.json
    names) of a dataset task with eval block `block`, the child being tests/server/
    test_evals.py's stand-in, which notes in `asked` the options it got and takes `seconds`."""
    import json

    from jetctl.rundir import RunPaths
    from jetctl.server.evals import InRunEval
    from tests.server.test_evals import stand_in

    path = tmp_path / "r.yaml"
    path.write_text(recipe_text(
        models={"policy": {"checkpoint": {"every_steps": 2}}},
        tasks={"digits": {"env": "jetctl.envs.dataset:make_env",
                          "agent": "jetctl.envs.dataset:chat_agent",
                          "env_args": {"path": "data.jsonl"}, "eval": block}},
    ))
    paths = RunPaths(tmp_path / "run")
    paths.make()
    paths.run_json.write_text(json.dumps({"recipe": str(path)}))
    evals = InRunEval.for_server(paths.root, "policy", 0)
    assert evals is not None
    asked = tmp_path / "asked"
    evals.command = stand_in(asked, seconds)
    return evals, asked


def eval_options(tmp_path: Path) -> None:
    """Checkpoints 2 and 4 with every_steps 4: one eval, of step 4, with the block's options
    (the defaults: --split test --samples 1, no --max-rows)."""
    from tests.server.test_evals import wait_for as eval_rows

    evals, asked = in_run_eval(tmp_path, 0.1, every_steps=4, split="train", samples=3,
                               max_rows=7)
    evals.start()
    try:
        for step in (2, 4):
            evals.checkpointed(step)
        rows = eval_rows(evals, "eval/digits/step")
    finally:
        evals.stop()
    assert asked.read_text().splitlines() == [
        "--task digits --checkpoint step-4 --split train --samples 3 --json --max-rows 7"]
    assert [r["eval/digits/step"] for r in rows] == [4.0]


def eval_timeout_s(tmp_path: Path) -> None:
    """timeout_s 0.5 from the recipe kills a 60 s eval (the default, 900 s, would not)."""
    from tests.server.test_evals import assert_killed_at_timeout

    evals, _ = in_run_eval(tmp_path, 60, every_steps=2, split="train", timeout_s=0.5)
    assert_killed_at_timeout(evals)


# ------------------------------------------------------------------ a real server process


@dataclass
class Server:
    endpoint: str
    metrics_port: int
    run_dir: Path


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`jetctl server` on builtin:tiny with non-default serving and wire settings."""
    from jetctl.auth import write_token

    rd = tmp_path_factory.mktemp("run")
    write_token(rd / "token", "tok")
    data = yaml.safe_load(yaml.safe_dump(GOOD_RECIPE))
    data["models"]["policy"].update({
        "finetune": "full", "host": "localhost",
        "generation": {"max_new_tokens": 3, "max_context_tokens": 40, "max_batch_size": 1},
        "limits": {"max_message_bytes": 3 * 1024 * 1024, "max_queued_generates": 1},
        "train": {"max_staleness": 1},
    })
    data["tasks"]["digits"]["sampling"] = {"max_tokens": 3}
    (rd / "recipe.yaml").write_text(yaml.safe_dump(data))
    port, metrics_port = free_ports(2)
    proc = start_server(rd, port, "--metrics-port", str(metrics_port))
    yield Server(f"localhost:{port}", metrics_port, rd)
    proc.terminate()
    proc.wait(60)


def start_server(run_dir: Path, port: int, *more: str) -> subprocess.Popen[bytes]:
    """`jetctl server` of policy from run_dir/recipe.yaml, once it serves (its endpoint file
    written); its output in run_dir/server.log."""
    log = run_dir / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetctl.cli.main", "server", "--recipe", str(run_dir / "recipe.yaml"),
         "--model", "policy", "--run-dir", str(run_dir), "--port", str(port), *more],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "servers" / "policy.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(30)
            raise AssertionError(f"the server did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


def stub(server: Server) -> Any:
    from jetctl.proto._gen import swarm_pb2_grpc

    return swarm_pb2_grpc.SwarmStub(grpc.insecure_channel(
        server.endpoint, options=[("grpc.max_send_message_length", 64 << 20)]))


def register(server: Server) -> Any:
    from jetctl.auth import bearer
    from jetctl.proto._gen import swarm_pb2 as pb

    return stub(server).Register(pb.RegisterRequest(client_id="c", task="digits", model="policy"),
                                 metadata=bearer("tok"), timeout=10)


def generate(server: Server, prompt: list[int], max_tokens: int) -> Any:
    from jetctl.auth import bearer
    from jetctl.proto._gen import swarm_pb2 as pb

    return stub(server).Generate(
        pb.GenerateRequest(model="policy", prompt_ids=prompt, max_tokens=max_tokens,
                           temperature=1.0),
        metadata=bearer("tok"), timeout=30)


def served_host(server: Server) -> None:
    import json

    info = json.loads((server.run_dir / "servers" / "policy.json").read_text())
    assert info["endpoint"] == server.endpoint  # bound on models.policy.host: localhost


def served_metrics_port(server: Server) -> None:
    import urllib.request

    with urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10) as r:
        assert b"jetctl_server" in r.read()


def served_max_new_tokens(server: Server) -> None:
    # a random tiny model almost never ends a reply within 3 tokens; it is cut at 3
    assert all(len(generate(server, [5, 6, 7], 50).completion_ids) <= 3 for _ in range(3))


def served_max_context_tokens(server: Server) -> None:
    assert register(server).max_context_tokens == 40
    with pytest.raises(grpc.RpcError) as e:
        generate(server, list(range(5, 50)), 2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def served_max_message_bytes(server: Server) -> None:
    from jetctl.auth import bearer
    from jetctl.proto._gen import swarm_pb2 as pb

    assert register(server).max_message_bytes == 3 * 1024 * 1024
    big = pb.SubmitRequest()
    big.groups.add().id = "x" * (4 * 1024 * 1024)
    with pytest.raises(grpc.RpcError) as e:
        stub(server).Submit(big, metadata=bearer("tok"), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def served_max_queued_generates(server: Server) -> None:
    """One row (max_batch_size 1) and one call allowed to wait for it: of 32 calls sent at
    once, some are refused with RESOURCE_EXHAUSTED and a retry-after, some answered (the
    default bound, 1024, would answer all); the server serves on."""
    from jetctl.auth import bearer
    from jetctl.proto._gen import swarm_pb2 as pb
    from jetctl.server.service import RETRY_AFTER_KEY

    s = stub(server)
    calls = [s.Generate.future(
        pb.GenerateRequest(model="policy", prompt_ids=[5, 6, 7], max_tokens=3, temperature=1.0),
        metadata=bearer("tok"), timeout=60) for _ in range(32)]
    answered, refused = 0, 0
    for call in calls:
        try:
            call.result()
            answered += 1
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert RETRY_AFTER_KEY in dict(e.trailing_metadata() or ())
            refused += 1
    assert answered >= 1 and refused >= 1, (answered, refused)
    assert generate(server, [5, 6, 7], 3).completion_ids  # serving on


def served_max_staleness(server: Server) -> None:
    assert register(server).max_staleness == 1


@dataclass(frozen=True)
class Served:
    check: Callable[[Server], None]


# --------------------------------------------------------------------------- the table

Row = Effect | CoveredBy | Served

CONTROLLER = "tests/controller/test_controller.py"
DOCKER = "tests/controller/test_docker_runtime.py"
NODE = "tests/client/test_client_node.py"
CONCURRENCY = "tests/client/test_concurrency.py"
TRAINER = "tests/server/test_trainer.py"
EVALS = "tests/server/test_evals.py"

ROWS: dict[str, Row] = {
    "run.name": Effect(run_name),
    "run.dir": Effect(run_dir),
    "run.token": Effect(run_token_and_ports, integration=True),
    "run.tls.mode": CoveredBy(("tests/security/test_up_mtls.py::test_up_status_down_over_mtls",
                               "tests/security/test_tls.py::test_control_service_over_tls")),
    "run.tls.cert_dir": CoveredBy(
        ("tests/security/test_tls.py::test_up_makes_certificates_once_and_checks_user_files",)),
    "run.tls.hosts": Effect(run_tls_hosts),
    "run.control.host": CoveredBy(("tests/multihost/test_hosts.py::test_a_run_across_hosts_survives_a_partition_and_balances",)),
    "run.control.port": CoveredBy(("tests/multihost/test_hosts.py::test_a_run_across_hosts_survives_a_partition_and_balances",)),
    "run.control.advertise": CoveredBy(("tests/multihost/test_hosts.py::test_a_run_across_hosts_survives_a_partition_and_balances",)),
    "run.ray.address": CoveredBy(("tests/multihost/test_ray.py::test_client_actors_run_on_the_worker_and_the_run_cleans_up",)),
    "run.ray.namespace": CoveredBy(("tests/multihost/test_ray.py::test_client_actors_run_on_the_worker_and_the_run_cleans_up",)),
    "run.ray.runtime_env": CoveredBy(("tests/multihost/test_ray.py::test_client_actors_run_on_the_worker_and_the_run_cleans_up",)),
    "run.ray.work_dir": CoveredBy(("tests/multihost/test_ray.py::test_client_actors_run_on_the_worker_and_the_run_cleans_up",)),
    "run.trackers": CoveredBy(("tests/test_observability.py::test_tensorboard_holds_the_runs_reward_series",
                               "tests/test_trackers.py::test_recipe_refuses_mode_outside_wandb_and_a_missing_tracker")),
    "run.duration_s": CoveredBy(
        (f"{CONTROLLER}::test_duration_stops_the_run_and_sigkills_a_node_that_ignores_sigterm",)),
    "run.tracing.otlp_endpoint": CoveredBy(
        ("tests/test_tracing.py::test_one_rollout_is_one_trace_across_processes_linked_from_its_step",
         "tests/test_tracing.py::test_a_wrong_tracing_field_is_refused_naming_it")),
    "run.restart_backoff_s": Effect(restart_backoff, integration=True),
    "run.restart_backoff_max_s": Effect(restart_backoff, integration=True),
    "run.deterministic": CoveredBy(
        ("tests/test_deterministic.py::test_two_deterministic_runs_generate_the_same_tokens",
         "tests/test_deterministic.py::test_an_engine_whose_seeded_replies_do_not_repeat_is_refused")),
    "models.<name>.model": Effect(model_source),
    "models.<name>.device": Effect(model_device),
    "models.<name>.dtype": Effect(model_dtype),
    "models.<name>.engine": Effect(model_engine),
    "models.<name>.finetune": Effect(model_finetune),
    "models.<name>.lora.r": Effect(lora_r),
    "models.<name>.lora.alpha": Effect(lora_alpha),
    "models.<name>.lora.dropout": Effect(lora_dropout),
    "models.<name>.lora.target_modules": Effect(lora_target_modules),
    "models.<name>.optimizer.lr": Effect(optimizer_hyperparameters),
    "models.<name>.optimizer.weight_decay": Effect(optimizer_hyperparameters),
    "models.<name>.optimizer.betas": Effect(optimizer_hyperparameters),
    "models.<name>.optimizer.max_grad_norm": Effect(optimizer_max_grad_norm),
    "models.<name>.train.algorithm": Effect(train_algorithm),
    "models.<name>.train.groups_per_step": Effect(train_groups_per_step),
    "models.<name>.train.max_staleness": CoveredBy((
        f"{TRAINER}::test_a_group_that_went_stale_in_the_buffer_is_refused_at_batch_time",
        "tests/server/test_server_process.py::test_stale_group_is_refused",
    ), recipes=("recipes/tiny.yaml",)),
    "models.<name>.train.order": Effect(train_order),
    "models.<name>.train.clip_eps": Effect(train_clip_eps),
    "models.<name>.train.clip_eps_high": Effect(train_clip_eps_high),
    "models.<name>.train.tis_cap": Effect(train_tis_cap),
    "models.<name>.train.kl_coef": Effect(train_kl_coef),
    "models.<name>.train.merge": Effect(train_merge),
    "models.<name>.train.max_tokens_per_microbatch": Effect(train_max_tokens_per_microbatch),
    "models.<name>.train.max_steps": Effect(train_max_steps),
    "models.<name>.train.mix": Effect(train_mix),
    "models.<name>.train.mix_wait_s": Effect(train_mix_wait_s),
    "models.<name>.checkpoint.every_steps": Effect(checkpoint_every_steps_and_keep),
    "models.<name>.checkpoint.keep": Effect(checkpoint_every_steps_and_keep),
    "models.<name>.checkpoint.dir": Effect(checkpoint_dir, integration=True),
    "models.<name>.checkpoint.keep_trained_groups": CoveredBy((
        "tests/run/test_replay.py::test_a_finished_run_replays_steps_chosen_at_random_and_a_changed_token_is_reported",
        "tests/run/test_replay.py::test_by_default_the_steps_after_the_oldest_checkpoint_kept_replay",
        "tests/run/test_replay.py::test_keeping_groups_beyond_the_checkpoints_kept_is_refused",
        "tests/run/test_rerun.py::test_a_run_whose_groups_were_dropped_is_refused_with_the_setting",
    )),
    "models.<name>.generation.max_batch_size": Effect(generation_max_batch_size),
    "models.<name>.generation.batch_wait_ms": Effect(generation_batch_wait_ms),
    "models.<name>.generation.threads": Effect(generation_threads),
    "models.<name>.train.threads": Effect(train_threads),
    "models.<name>.train.lend_threads": Effect(train_lend_threads),
    "models.<name>.generation.workers": Effect(generation_workers),
    "models.<name>.generation.max_new_tokens": Served(served_max_new_tokens),
    "models.<name>.generation.max_context_tokens": Served(served_max_context_tokens),
    "models.<name>.generation.device": Effect(generation_device),
    "models.<name>.generation.dtype": Effect(generation_dtype),
    "models.<name>.generation.publish_timeout_s": Effect(generation_publish_timeout_s),
    "models.<name>.limits.max_message_bytes": Served(served_max_message_bytes),
    "models.<name>.limits.max_buffer_groups": CoveredBy((
        "tests/server/test_server_buffer.py::test_past_the_bound_groups_are_busy_and_not_stored",
        "tests/server/test_store.py::test_a_full_buffer_refuses_new_groups_as_busy_and_stores_nothing",
    )),
    "models.<name>.limits.max_buffer_bytes": CoveredBy((
        "tests/server/test_buffer_bytes.py::test_past_the_byte_bound_a_group_is_busy_and_not_stored",
        "tests/server/test_buffer_bytes.py::test_a_byte_bound_below_one_message_is_refused_with_the_fix",
    )),
    "models.<name>.limits.max_queued_generates": Served(served_max_queued_generates),
    "models.<name>.limits.max_concurrent_rpcs": CoveredBy((
        "tests/server/test_engine_backpressure.py::test_past_max_concurrent_rpcs_any_call_is_refused_until_one_finishes",
        "tests/server/test_engine_backpressure.py::test_a_concurrency_cap_not_above_the_generate_queue_is_refused_with_the_fix",
    )),  # parsed from a recipe (parsed_limits) into grpc_server, the server's own builder
    "models.<name>.host": Served(served_host),
    "models.<name>.advertise": CoveredBy(("tests/multihost/test_hosts.py::test_a_run_across_hosts_survives_a_partition_and_balances",)),
    "models.<name>.runtime": CoveredBy(("tests/multihost/test_hosts.py::test_a_run_across_hosts_survives_a_partition_and_balances", "tests/multihost/test_ray.py::test_client_actors_run_on_the_worker_and_the_run_cleans_up")),
    "models.<name>.resources.cpus": CoveredBy(("tests/controller/test_placement.py::test_a_server_gets_a_group_of_its_own_with_its_gpus", "tests/multihost/test_ray.py::test_client_actors_run_on_the_worker_and_the_run_cleans_up")),
    "models.<name>.resources.gpus": CoveredBy(("tests/controller/test_placement.py::test_a_server_gets_a_group_of_its_own_with_its_gpus",)),
    "models.<name>.resources.memory": CoveredBy(("tests/controller/test_placement.py::test_a_server_gets_a_group_of_its_own_with_its_gpus",)),
    "models.<name>.resources.custom": CoveredBy(("tests/controller/test_placement.py::test_a_server_gets_a_group_of_its_own_with_its_gpus",)),
    "models.<name>.port": Effect(run_token_and_ports, integration=True),
    "models.<name>.metrics_port": Effect(run_token_and_ports, integration=True),
    "models.<name>.seed": Effect(model_seed),
    "tasks.<name>.env": Effect(client_node, integration=True),
    "tasks.<name>.agent": Effect(client_node, integration=True),
    "tasks.<name>.model": Effect(client_node, integration=True),
    "tasks.<name>.roles": CoveredBy((
        "tests/client/test_team_node.py::test_each_role_reaches_its_model_and_trains_it_with_its_reward",
        "tests/test_recipe.py::test_a_team_names_its_models_under_roles",
    )),  # the team node's TEAM_TASK is parsed from TEAM_RECIPE, which sets roles
    "tasks.<name>.env_args": Effect(client_node, integration=True),
    "tasks.<name>.clients": CoveredBy(
        (f"{CONTROLLER}::test_start_status_and_down_drains_clients_before_servers",)),
    "tasks.<name>.group_size": Effect(client_node, integration=True),
    "tasks.<name>.concurrency": CoveredBy((
        f"{NODE}::test_backpressure_stops_new_rollouts_and_keeps_unacked_groups",
        f"{CONCURRENCY}::test_a_node_with_a_slow_env_runs_more_rollouts_while_the_server_says_it_waits",
        f"{CONCURRENCY}::test_a_node_backs_off_to_one_group_while_the_engine_is_full",
    )),  # the backpressure test's task comes from a parsed recipe (parsed_task)
    "tasks.<name>.rollout_timeout_s": CoveredBy(  # run_node parses its task from a recipe
        (f"{NODE}::test_hanging_rollout_is_killed_with_its_children",)),
    "tasks.<name>.runtime": Effect(task_runtime),
    "tasks.<name>.image": Effect(task_image),
    "tasks.<name>.resources.cpus": Effect(task_resources),
    "tasks.<name>.resources.memory": Effect(task_resources),
    "tasks.<name>.resources.pids": Effect(task_resources),
    "tasks.<name>.resources.shm": Effect(task_resources),
    "tasks.<name>.resources.gpus": CoveredBy(("tests/controller/test_placement.py::test_each_client_node_gets_its_bundle_of_the_task_revisions_group",)),
    "tasks.<name>.resources.custom": CoveredBy(("tests/controller/test_placement.py::test_each_client_node_gets_its_bundle_of_the_task_revisions_group", "tests/multihost/test_ray.py::test_client_actors_run_on_the_worker_and_the_run_cleans_up")),
    "tasks.<name>.docker_socket": Effect(task_docker_socket),
    "tasks.<name>.network": CoveredBy((
        "tests/security/test_container_network.py::test_an_isolated_task_dials_the_gateway_with_its_own_credential",
        "tests/security/test_container_network.py::test_network_host_is_the_hosts_network",
        "tests/security/test_container_network.py::test_network_needs_the_docker_runtime",
        "tests/security/test_hostile_client.py::test_a_hostile_agent_is_contained_and_the_run_keeps_training",
    )),
    "tasks.<name>.inference": CoveredBy(
        # its recipe sets inference: local; the server's /metrics shows it generated no token
        ("tests/client/test_local_inference.py::test_local_inference_node_trains_the_server",)),
    "tasks.<name>.sampling.temperature": Effect(client_node, integration=True),
    "tasks.<name>.sampling.top_p": Effect(client_node, integration=True),
    "tasks.<name>.sampling.max_tokens": Effect(client_node, integration=True),
    "tasks.<name>.spool_max_bytes": CoveredBy(
        (f"{NODE}::test_backpressure_stops_new_rollouts_and_keeps_unacked_groups",)),
    "tasks.<name>.seed": Effect(client_node, integration=True),
    "tasks.<name>.eval.every_steps": CoveredBy((
        f"{EVALS}::test_a_run_evaluates_its_due_checkpoints_and_shows_the_figures",
        f"{EVALS}::test_checkpoints_that_come_faster_than_evals_skip_to_the_newest",
        f"{EVALS}::test_every_steps_must_fall_on_a_checkpoint",
    )),
    "tasks.<name>.eval.split": Effect(eval_options),
    "tasks.<name>.eval.samples": Effect(eval_options),
    "tasks.<name>.eval.max_rows": CoveredBy((
        f"{EVALS}::test_a_run_evaluates_its_due_checkpoints_and_shows_the_figures",
        "tests/run/test_eval.py::test_max_rows_and_two_tasks_evaluated_apart_share_the_step_file",
    )),
    "tasks.<name>.eval.timeout_s": Effect(eval_timeout_s),
}


@pytest.mark.unit
def test_every_field_has_a_row() -> None:
    fields = [f.path for f in reference_fields()]
    missing = [f for f in fields if f not in ROWS]
    stale = [r for r in ROWS if r not in fields]
    assert not missing, (
        f"schema fields without a row in {__name__}.ROWS: {missing}; show each one's effect "
        "or refuse it in jetctl/recipe/ until it has one"
    )
    assert not stale, f"rows for fields the schema no longer has: {stale}"


def _functions(file: Path) -> set[str]:
    tree = ast.parse(file.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.unit
@pytest.mark.parametrize(
    "path", [p for p, r in ROWS.items() if isinstance(r, CoveredBy)]
)
def test_the_tests_a_row_names_exist_and_set_the_field(path: str) -> None:
    row = ROWS[path]
    assert isinstance(row, CoveredBy)
    key = path.rsplit(".", 1)[-1]
    texts = {}
    for ref in row.tests:
        file, name = ref.split("::")
        source = ROOT / file
        assert source.is_file(), f"{path}: {file} does not exist"
        assert name in _functions(source), f"{path}: {ref} does not exist"
        texts[file] = source.read_text(encoding="utf-8")
        assert key in texts[file], f"{path}: {file} never sets {key}"
    for file in row.recipes:
        texts[file] = (ROOT / file).read_text(encoding="utf-8")
    if row.weak:
        return
    keys = [k for k in path.split(".")[1:] if k != "<name>"]  # limits, max_buffer_groups
    assert any(all(_sets(text, k) for k in keys) for text in texts.values()), (
        f"{path}: none of {sorted(texts)} sets {': '.join(keys)}: name a test that sets it "
        "in a recipe (or the recipe file it runs, in recipes=), or say why not in weak="
    )


def _sets(text: str, key: str) -> bool:
    """Whether `text` sets `key`: as a YAML or dict key or a keyword argument (`key:`,
    `"key":`, `key=`), not only names it in prose or a comparison."""
    return re.search(rf"""(?<![\w.])["']?{re.escape(key)}["']?\s*(:|=(?!=))""", text) is not None


def _effect_params() -> list[Any]:
    params = []
    for path, row in ROWS.items():
        if isinstance(row, Effect):
            mark = pytest.mark.integration if row.integration else pytest.mark.unit
            params.append(pytest.param(path, marks=[mark], id=path))
    return params


@pytest.mark.parametrize("path", _effect_params())
def test_a_field_has_its_effect(path: str, tmp_path: Path, no_token_env: None) -> None:
    row = ROWS[path]
    assert isinstance(row, Effect)
    row.check(tmp_path)


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", [p for p, r in ROWS.items() if isinstance(r, Served)])
def test_a_served_field_has_its_effect(path: str, real_server: Server) -> None:
    row = ROWS[path]
    assert isinstance(row, Served)
    row.check(real_server)
