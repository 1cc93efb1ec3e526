"""`engine: vllm` (EXPERIMENTAL: written against vLLM's documented APIs, never yet run on a GPU).

vLLM's `AsyncLLM` runs in the server's event loop (its engine core in vLLM's own process, as
vLLM does by default) with continuous batching and paged attention, and holds its own copy
of the weights. What the adapter adds is the engine contract (engines/base.py):

- token ids in and out: `{"prompt_token_ids": ...}` in, `outputs[0].token_ids` out (a stop
  token is the last id, as vLLM leaves it there); `SamplingParams(logprobs=0)` returns the
  sampled token's logprob, and `logprobs_mode="raw_logprobs"` makes it the logprob of the raw
  logits (before temperature, top_p and penalties): the untempered behaviour logprob.
- cancellation: cancelling the caller cancels vLLM's `generate` iterator, which aborts the
  request in the engine core.
- weights after each optimizer step, under `generation.publish_timeout_s`, from the trainer
  thread (`publish`, the same miss / retry / `PublishError` rule as engines/replica.py):
  * LoRA (`finetune: lora`): the adapter is written to a folder (peft's layout) and loaded
    with `add_lora(LoRARequest("v<version>", <id>, path))`; each request carries the
    `LoRARequest` of the version it was admitted at, so replies of two versions may run at
    once and each is exact; an old adapter is removed once no request uses it.
  * full fine-tuning: admission closes, the requests under way finish (the drain counts
    against the deadline), then `start_weight_update` / `update_weights` (CUDA IPC handles
    of the trainer's tensors, vLLM's "ipc" weight-transfer backend) / `finish_weight_update`
    and `reset_prefix_cache` (cached blocks hold the old weights' KV), then admission reopens.
    A full update that fails or times out halfway leaves the engine refusing requests (it
    cannot say which weights it holds) until a publish succeeds.

Placement: vLLM takes `gpu_memory_utilization` of the GPU it runs on (`generation.device`,
else the trainer's device): 0.35 when it shares the trainer's GPU, 0.85 on a GPU of its own.
The IPC backend hands vLLM handles to tensors on its own GPU: on another GPU than the
trainer's, the weights are first copied to a staging copy there (one more copy of the
weights on that GPU).

Left out: tensor parallelism, NCCL weight transfer across machines, vLLM's CUDA graphs
tuning (defaults). Install: `pip install vllm` on a CUDA machine (`jetctl validate` refuses
`engine: vllm` where it is not importable).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from jetctl.server import weights as W
from jetctl.server.engines.base import EngineLoad, GenRequest, GenResult
from jetctl.server.engines.replica import PublishError

if TYPE_CHECKING:
    from jetctl.recipe import ModelConfig

log = logging.getLogger("jetctl.server.engines")
SHARED_GPU_UTILIZATION = 0.35  # of the trainer's GPU, when vLLM shares it
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"
OWN_GPU_UTILIZATION = 0.85
ADMIT_POLL_S = 0.005


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise SystemExit(
            "engine: vllm needs the vllm package: `pip install vllm` on a CUDA machine "
            f"(import failed: {exc}), or use engine: hf or continuous"
        ) from exc
    return vllm


class VLLMEngine:
    """vLLM's AsyncLLM behind the engine contract; weights pushed by `publish`."""

    def __init__(
        self, cfg: ModelConfig, model: Any, *, eos_token_ids: list[int], version: int
    ) -> None:
        self.cfg = cfg
        self.model = model  # the trainer's
        self.eos_token_ids = eos_token_ids
        self.version = version
        self.lora = W.is_lora(model)
        trainer_device = _indexed(torch.device(next(model.parameters()).device))
        self.device = _indexed(torch.device(cfg.generation.device or str(trainer_device)))
        if self.device.type != "cuda":
            raise SystemExit(
                f"engine: vllm runs on CUDA, but the engine's device is {self.device}: set "
                "device (or generation.device) to cuda, or use engine: hf"
            )
        self.shares_gpu = self.device == trainer_device
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lora_req: Any = None  # the current version's LoRARequest
        self._lora_users: dict[int, int] = {}  # adapter id -> requests using it
        self._lora_dirs: dict[int, Path] = {}
        self._adapters = Path(tempfile.mkdtemp(prefix="jetctl-vllm-", dir=_fast_tmp()))
        self._closed = False  # admission closed while a full update drains and copies
        self._broken = False  # a full update failed halfway: version unknown
        self._in_flight: dict[str, float] = {}  # request id -> start (monotonic)
        self._staging: dict[str, torch.Tensor] = {}
        self.misses_in_a_row = 0
        self.timeout_s = cfg.generation.publish_timeout_s

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Create the AsyncLLM in the running loop (vLLM starts its engine core process)."""
        from jetctl.models import resolve_model_dir

        vllm = import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs

        self._loop = asyncio.get_running_loop()
        folder = str(resolve_model_dir(self.cfg.model, progress=False))
        gen = self.cfg.generation
        utilization = SHARED_GPU_UTILIZATION if self.shares_gpu else OWN_GPU_UTILIZATION
        kwargs: dict[str, Any] = {
            "model": folder, "tokenizer": folder, "dtype": self.cfg.dtype,
            "seed": self.cfg.seed, "max_model_len": gen.max_context_tokens,
            "max_num_seqs": gen.max_batch_size, "gpu_memory_utilization": utilization,
            "logprobs_mode": "raw_logprobs", "enable_prefix_caching": True,
        }
        if self.lora:
            kwargs.update(enable_lora=True, max_lora_rank=self.cfg.lora.r, max_loras=4)
        else:
            from vllm.config import WeightTransferConfig

            kwargs["weight_transfer_config"] = WeightTransferConfig(backend="ipc")
        # vLLM's engine core process sees only the engine's GPU, as its device 0; with full
        # updates it unpickles the IPC handles this server sends (they carry a rebuild
        # function), which vLLM refuses unless VLLM_ALLOW_INSECURE_SERIALIZATION: set for
        # the core's start only (it inherits it), never left set in the server's process
        core_env = {"CUDA_VISIBLE_DEVICES": _physical_index(self.device)}
        if not self.lora:
            core_env[INSECURE_SERIALIZATION] = "1"
        with scoped_env(core_env):
            self._llm = vllm.AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**kwargs))
        self._closed = True  # no request before the first weights are in
        self._loop.create_task(self._initial_weights())

    async def _initial_weights(self) -> None:
        """The adapter (LoRA) or resumed weights (full, version > 0) before the first request."""
        try:
            if not self.lora:
                from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

                await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
            if self.lora or self.version > 0:
                await asyncio.wait_for(self._update(self.version), self.timeout_s)
        except Exception:  # logged; requests are refused until a publish works
            self._broken = True
            log.exception("vllm could not take version %d's weights at start", self.version)
        finally:
            self._closed = False

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
        shutil.rmtree(self._adapters, ignore_errors=True)

    @property
    def busy_since(self) -> float | None:
        return min(self._in_flight.values(), default=None)

    # --- generation ------------------------------------------------------------------

    def load(self) -> EngineLoad:
        """Requests in flight; vLLM schedules them itself (max_num_seqs at once)."""
        return EngineLoad(rows=len(self._in_flight))

    async def generate(self, req: GenRequest) -> GenResult:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        assert self._llm is not None, "engine not started"
        while self._closed:
            await asyncio.sleep(ADMIT_POLL_S)
        if self._broken:
            raise RuntimeError("the vllm engine's weights are incomplete after a failed update")
        version, lora = self.version, self._lora_req
        rid = uuid.uuid4().hex
        self._in_flight[rid] = time.monotonic()
        if lora is not None:
            self._lora_users[lora.lora_int_id] = self._lora_users.get(lora.lora_int_id, 0) + 1
        stops = set(self.eos_token_ids) | set(req.stop_token_ids)
        params = SamplingParams(
            n=1, temperature=req.temperature, top_p=req.top_p,
            max_tokens=max(req.max_tokens, 1), stop_token_ids=sorted(stops), logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False, seed=req.seed,
        )
        final = None
        try:
            async for out in self._llm.generate(
                {"prompt_token_ids": list(req.prompt_ids)}, params, request_id=rid,
                lora_request=lora,
            ):
                final = out
        finally:
            self._in_flight.pop(rid, None)
            if lora is not None:
                self._lora_users[lora.lora_int_id] -= 1
                await self._forget_unused_adapters()
        if final is None or not final.outputs:
            raise RuntimeError("vllm returned no output for the request")
        done = final.outputs[0]
        ids = list(done.token_ids)
        if done.logprobs is None or len(done.logprobs) != len(ids):
            raise RuntimeError("vllm returned no logprob for some sampled tokens")
        lps = [float(done.logprobs[i][tok].logprob) for i, tok in enumerate(ids)]
        finish = "stop" if ids and ids[-1] in stops else "length"
        return GenResult(ids, lps, version, finish)

    # --- weights ---------------------------------------------------------------------

    def publish(self, version: int) -> float:
        """From the trainer thread: make `version` the engine's, under the deadline."""
        assert self._loop is not None, "engine not started"
        t0 = time.perf_counter()
        for attempt in (1, 2):
            future = asyncio.run_coroutine_threadsafe(self._update(version), self._loop)
            try:
                future.result(timeout=self.timeout_s)
                self.misses_in_a_row = 0
                return time.perf_counter() - t0
            except TimeoutError:
                future.cancel()
                log.error(
                    "publishing version %d to vllm missed its %.1fs deadline (attempt %d of 2)",
                    version, self.timeout_s, attempt,
                )
        self.misses_in_a_row += 1
        if self.misses_in_a_row >= 3:
            raise PublishError(
                f"vllm took no new weights for 3 steps in a row (deadline {self.timeout_s:g}s); "
                f"it serves version {self.version}"
            )
        return time.perf_counter() - t0

    async def _update(self, version: int) -> None:
        if self.lora:
            await self._load_adapter(version)
        else:
            await self._load_full(version)

    async def _load_adapter(self, version: int) -> None:
        from vllm.lora.request import LoRARequest

        payload = W.snapshot(self.model, version)
        folder = self._adapters / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_model.safetensors").write_bytes(payload.data)
        (folder / "adapter_config.json").write_text(payload.adapter_config_json)
        request = LoRARequest(f"v{version}", version + 1, str(folder))  # ids start at 1
        if not await self._llm.add_lora(request):
            raise RuntimeError(f"vllm refused the adapter of version {version}")
        self._lora_dirs[request.lora_int_id] = folder
        self._lora_req, self.version, self._broken = request, version, False
        await self._forget_unused_adapters()

    async def _forget_unused_adapters(self) -> None:
        current = self._lora_req.lora_int_id if self._lora_req is not None else None
        for lora_id in [i for i in self._lora_dirs if i != current]:
            if self._lora_users.get(lora_id, 0) == 0:
                await self._llm.remove_lora(lora_id)
                shutil.rmtree(self._lora_dirs.pop(lora_id), ignore_errors=True)
                self._lora_users.pop(lora_id, None)

    async def _load_full(self, version: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._closed = True
        try:
            while self._in_flight:  # the caller's deadline bounds this drain
                await asyncio.sleep(ADMIT_POLL_S)
            self._broken = True
            names, dtypes, shapes, handles = self._ipc_handles()
            await self._llm.start_weight_update()
            update = {"names": names, "dtype_names": dtypes, "shapes": shapes,
                      "ipc_handles": handles}
            # the handles are pickled on this side too: allowed for this call only
            with scoped_env({INSECURE_SERIALIZATION: "1"}):
                await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update))
            await self._llm.finish_weight_update()
            await self._llm.reset_prefix_cache()
            self.version, self._broken = version, False
        finally:
            self._closed = False

    @torch.no_grad()
    def _ipc_handles(self) -> tuple[list[str], list[str], list[list[int]], list[dict[str, Any]]]:
        """CUDA IPC handles of the trainer's tensors, on the engine's GPU (staged if elsewhere)."""
        from torch.multiprocessing.reductions import reduce_tensor

        uuid_of_gpu = str(torch.cuda.get_device_properties(self.device).uuid)
        tied = getattr(getattr(self.model, "config", None), "tie_word_embeddings", False)
        names, dtypes, shapes, handles = [], [], [], []
        for name, p in self.model.named_parameters():
            if tied and name == "lm_head.weight":
                continue
            tensor = p.detach()
            if tensor.device != self.device:
                staged = self._staging.get(name)
                if staged is None:
                    staged = self._staging[name] = torch.empty_like(tensor, device=self.device)
                staged.copy_(tensor, non_blocking=True)
                tensor = staged
            names.append(name)
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
            handles.append({uuid_of_gpu: reduce_tensor(tensor.contiguous())})
        torch.cuda.synchronize(self.device)
        return names, dtypes, shapes, handles


def _indexed(device: torch.device) -> torch.device:
    """cuda -> cuda:<current>, so two names of one GPU compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _physical_index(device: torch.device) -> str:
    """The CUDA_VISIBLE_DEVICES entry of `device` as this process numbers it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")[index].strip()
    return str(index)


def _fast_tmp() -> str | None:
    """/dev/shm when there is one: an adapter is written and read once per step."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None



@contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block only, then put back what was there."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
