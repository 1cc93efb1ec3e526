"""`inference: local`: generate on the client node with weights pulled from the server.

The node loads the base model (`jetctl.models.load_model(model_source)`), then between
rollouts asks the server for newer weights (`PullWeights(have_version)`, in the background
with `refresh()`, each pull bounded by `pull_timeout_s`, failures backed off: an unreachable
server never stalls rollouts, they go on with the weights at hand); the transport checks
size and sha256. A `full` payload is a safetensors state dict loaded into the model;
a `lora` payload is a peft adapter (safetensors + `adapter_config_json`) set on a peft
wrapper of the base model. Generation is Hugging Face `generate` (sampling with the
request's temperature/top_p) on one worker thread; the returned logprobs are the model's
log-softmax at temperature 1 of each sampled token (what the trainer recomputes), and the
version is the one whose weights produced the tokens.

Left out: batching concurrent requests (they run one at a time), GPU placement beyond the
`device` argument, and quantized weights.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc

from jetctl.client.backend import BackendError, GenerateParams, GenerateResult
from jetctl.client.transport import SwarmTransport, Weights, WeightsError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


def safetensors_views(buffer: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors payload as views into `buffer`, not copies (the payload
    of a full model is hundreds of MB; `safetensors.torch.load` takes only `bytes` and copies
    every tensor out of it). Layout (https://github.com/huggingface/safetensors): an 8-byte
    little-endian header length, a JSON header {name: {dtype, shape, data_offsets: [begin,
    end]}} and the data, offsets relative to its start. Raises WeightsError on a payload
    that does not follow it."""
    import torch

    if len(buffer) < 8:
        raise WeightsError(f"a safetensors payload of {len(buffer)} bytes has no header")
    size = int.from_bytes(buffer[:8], "little")
    if size > len(buffer) - 8:
        raise WeightsError(f"safetensors header of {size} bytes in a {len(buffer)}-byte payload")
    try:
        header = json.loads(bytes(buffer[8 : 8 + size]))
    except ValueError as e:
        raise WeightsError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WeightsError("safetensors header is not a JSON object")
    start, end = 8 + size, len(buffer)
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = getattr(torch, SAFETENSORS_DTYPES[info["dtype"]])
            shape = [int(n) for n in info["shape"]]
            begin, stop = (start + int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WeightsError(
                f"safetensors entry {name!r} is not one of {sorted(SAFETENSORS_DTYPES)} with "
                f"a shape and data_offsets: {info!r}"
            ) from None
        count = math.prod(shape)
        if not start <= begin <= stop <= end or stop - begin != count * dtype.itemsize:
            raise WeightsError(
                f"safetensors entry {name!r} ({info['dtype']} {shape}) has data_offsets "
                f"{info['data_offsets']} outside its {end - start} bytes of data or of "
                "another size"
            )
        if count == 0:  # frombuffer refuses an empty view
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(
                buffer, dtype=dtype, count=count, offset=begin
            ).reshape(shape)
    return out


class LocalEngine:
    """A `Backend` that runs the model in this process."""

    def __init__(
        self, model: Any, transport: SwarmTransport | None, version: int, device: str = "cpu"
    ) -> None:
        self.model = model
        self.transport = transport
        self.version = version
        self.device = device
        self._peft_model: Any = None
        self._lock = threading.Lock()  # generation vs. weight updates
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-engine")
        self.pull_timeout_s = 60.0
        self._pull_backoff_s = 0.0  # 0 while pulls succeed; doubles on failure up to 60 s
        self._next_pull_at = 0.0  # monotonic
        self._refresh_task: asyncio.Task[bool] | None = None

    @classmethod
    async def start(
        cls, model_source: str, transport: SwarmTransport, server_version: int, device: str = "cpu"
    ) -> LocalEngine:
        """Load the base model (version 0 weights), then pull the server's current version."""
        from jetctl.models import load_model

        loop = asyncio.get_running_loop()
        model, _tokenizer = await loop.run_in_executor(
            None, lambda: load_model(model_source, device=device, progress=False)
        )
        engine = cls(model, transport, version=0, device=device)
        if server_version != 0:
            await engine.maybe_update()
        return engine

    # ------------------------------------------------------------------ weights

    def refresh(self) -> None:
        """Pull newer weights in the background, unless a pull runs or recently failed."""
        if self._refresh_task is not None and not self._refresh_task.done():
            return
        if time.monotonic() < self._next_pull_at:
            return
        self._refresh_task = asyncio.get_running_loop().create_task(self.maybe_update())

    def _pull_failed(self, why: str) -> None:
        self._pull_backoff_s = min(max(2 * self._pull_backoff_s, 2.0), 60.0)
        self._next_pull_at = time.monotonic() + self._pull_backoff_s
        log.error(
            "PullWeights %s; generating with version %d, next try in %.0fs",
            why, self.version, self._pull_backoff_s,
        )

    async def maybe_update(self) -> bool:
        """Pull and apply newer weights if the server has them; True when applied."""
        if self.transport is None:
            return False
        try:
            weights = await asyncio.wait_for(
                self.transport.pull_weights(self.version), self.pull_timeout_s
            )
        except WeightsError as e:
            log.warning("ignoring a bad weights payload: %s", e)
            return False
        except asyncio.TimeoutError:
            self._pull_failed(f"took more than {self.pull_timeout_s:g}s")
            return False
        except grpc.aio.AioRpcError as e:  # keep generating with the weights we have
            self._pull_failed(f"failed ({e.code().name})")
            return False
        self._pull_backoff_s = 0.0
        if weights is None or weights.version == self.version:
            return False
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.apply, weights)
        return True

    def apply(self, weights: Weights) -> None:
        """Load a verified payload into the model (under the generation lock)."""
        if weights.format not in ("", "safetensors"):
            raise WeightsError(f"weights format {weights.format!r} is not safetensors")
        state = safetensors_views(weights.data)
        with self._lock:
            if weights.kind == "lora":
                self._apply_lora(state, weights.adapter_config_json)
            elif weights.kind in ("", "full"):
                base = self._base()
                result = base.load_state_dict(state, strict=False)
                if result.unexpected_keys:
                    raise WeightsError(
                        f"full weights have unknown keys: {result.unexpected_keys[:5]}"
                    )
            else:
                raise WeightsError(f"weights kind {weights.kind!r} is not full or lora")
            self.version = weights.version
        log.info("local engine now at version %d (%s)", weights.version, weights.kind)

    def _base(self) -> Any:
        return self._peft_model.get_base_model() if self._peft_model is not None else self.model

    def _apply_lora(self, state: dict[str, torch.Tensor], config_json: str) -> None:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        if self._peft_model is None:
            raw = json.loads(config_json) if config_json else {}
            fields = set(LoraConfig.__dataclass_fields__)
            config = LoraConfig(
                **{k: v for k, v in raw.items() if k in fields and k != "peft_type"}
            )
            self._peft_model = get_peft_model(self.model, config)
            self._peft_model.eval()
        result = set_peft_model_state_dict(self._peft_model, state)
        unexpected = list(getattr(result, "unexpected_keys", []))
        if unexpected:
            raise WeightsError(f"adapter has unknown keys: {unexpected[:5]}")

    # ------------------------------------------------------------------ generation

    async def generate(self, params: GenerateParams) -> GenerateResult:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self._generate, params)
        except RuntimeError as e:
            raise BackendError(f"local generation failed: {e}", status=500) from e

    def _generate(self, params: GenerateParams) -> GenerateResult:
        import torch

        with self._lock:
            model = self._peft_model if self._peft_model is not None else self.model
            version = self.version
            input_ids = torch.tensor(
                [params.prompt_ids], dtype=torch.long, device=self.device
            )  # [1, T]
            greedy = params.temperature <= 0
            generator_kwargs: dict[str, Any] = {"do_sample": not greedy}
            if not greedy:
                generator_kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=0)
            if params.seed is not None:
                torch.manual_seed(params.seed)
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=params.max_tokens,
                    eos_token_id=params.stop_token_ids or None,
                    pad_token_id=(params.stop_token_ids or [0])[0],
                    return_dict_in_generate=True,
                    output_logits=True,
                    **generator_kwargs,
                )
            ids = out.sequences[0, input_ids.shape[1] :].tolist()  # [N]
            logits = torch.stack(out.logits, dim=1)[0].float()  # [N, V]
            logprobs = torch.log_softmax(logits, dim=-1)
            chosen = logprobs[torch.arange(len(ids)), torch.tensor(ids)].tolist()
        finish = "stop" if ids and ids[-1] in params.stop_token_ids else "length"
        return GenerateResult(
            completion_ids=ids,
            completion_logprobs=chosen,
            model_version=version,
            finish_reason=finish,
        )
