"""`inference: local`: pull full weights and a LoRA adapter by version, verify, apply, generate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from jetctl.client.backend import GenerateParams
from jetctl.client.local_engine import LocalEngine
from jetctl.client.transport import SwarmTransport
from tests.client.client_fakes import TOKEN, FakeSwarm, start_fake_server, weight_chunks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def tiny_llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


async def test_pull_full_then_lora_and_generate(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save

    fake = FakeSwarm(tokenizer, tokenizer_files)
    server, _ = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path)
    engine = LocalEngine(tiny_llama(0), transport, version=0)

    assert not await engine.maybe_update()  # nothing newer on the server
    trained = tiny_llama(1)
    fake.weights = weight_chunks(
        1, "full", save({k: v.contiguous() for k, v in trained.state_dict().items()})
    )
    assert await engine.maybe_update() and engine.version == 1
    for name, value in trained.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value), name

    fake.weights = weight_chunks(2, "full", b"not the announced payload")
    for chunk in fake.weights:
        chunk.sha256 = "0" * 64
    assert not await engine.maybe_update() and engine.version == 1  # refused, kept serving v1

    lora = LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    donor = get_peft_model(tiny_llama(1), lora)
    adapter = {k: v.contiguous() for k, v in get_peft_model_state_dict(donor).items()}
    fake.weights = weight_chunks(
        3, "lora", save(adapter), config=json.dumps(lora.to_dict(), default=list)
    )
    assert await engine.maybe_update() and engine.version == 3
    prompt = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = donor(prompt).logits
        got = engine._peft_model(prompt).logits
    assert torch.allclose(expected, got, atol=1e-5)  # same adapter, same outputs

    result = await engine.generate(
        GenerateParams(
            prompt_ids=[1, 2, 3],
            max_tokens=5,
            temperature=1.0,
            top_p=1.0,
            stop_token_ids=[63],
            request_id="x",
            seed=1,
        )
    )
    assert result.model_version == 3 and 1 <= len(result.completion_ids) <= 5
    assert len(result.completion_logprobs) == len(result.completion_ids)
    assert all(lp <= 0.0 for lp in result.completion_logprobs)
    await transport.close()
    await server.stop(None)
