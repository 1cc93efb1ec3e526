"""Token timelines: chat messages -> exact prompt token ids, and one `LLMCall` per request.

Token-in/token-out (docs/architecture.md section 2). A rollout's `Timeline` keeps every
request it made: the messages, the template text of the prompt, the assistant reply that
was returned and the exact `LLMCall`. For a new request, `ChatRenderer.prompt_ids` looks for
the latest earlier turn whose messages, followed by that turn's assistant reply unchanged,
open the new request. When one exists the prompt is

    earlier prompt_ids + earlier completion_ids + ids(bridge + new text)

where *bridge* is what the chat template puts after the reply that the model did not
generate (ChatML: the `\\n` after `<|im_end|>`, or the whole `<|im_end|>\\n` when the
completion stopped at `max_tokens`), and *new text* is the template text of the new
messages. The past is never re-tokenized, so the ids the trainer sees are the ids the model
produced. Anything else (edited history, other tools, a template that rewrites earlier
turns) renders fresh.

Also here: `parse_tool_calls`, which turns the tool-call formats the served model's chat
template declares (`tool_call_formats`: Hermes/Qwen/SmolLM2 `<tool_call>{json}</tool_call>`,
Llama 3 JSON, Mistral `[TOOL_CALLS] [...]`) into the same OpenAI `tool_calls` for every model,
and `truncate_at_stop` (best-effort `stop` strings).

Pure logic over a Hugging Face tokenizer: no HTTP, no grpc.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from jetctl.types import LLMCall

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]

# a closed block, or an unclosed one that runs to the end of the reply
_TOOL_CALL_RE = re.compile(
    r"<tool_call>\s*(.*?)\s*</tool_call>|<tool_call>\s*(.*?)\s*$", re.DOTALL
)


# ---------------------------------------------------------------------------- messages


def _text(content: Any) -> str:
    """OpenAI content (str, None or a list of parts) as plain text."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ValueError(
        f"message content must be a string, null or a list of parts, not {type(content).__name__}"
    )


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object (OpenAI sends a JSON string)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def normalize_message(message: Any) -> Message:
    """An OpenAI chat message as the plain dict chat templates expect.

    `content` becomes text, tool-call `arguments` become objects; fields templates do not
    read (`refusal`, `audio`, ...) are dropped so that equality means "same conversation".
    """
    if not isinstance(message, dict):
        raise TypeError(f"each message must be an object, not {type(message).__name__}")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise ValueError(
            f"message role {role!r} is not one of system, developer, user, assistant, tool"
        )
    out: Message = {
        "role": "system" if role == "developer" else role,
        "content": _text(message.get("content")),
    }
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": str(c.get("function", {}).get("name", "")),
                    "arguments": _arguments(c.get("function", {}).get("arguments", {})),
                },
            }
            for c in calls
        ]
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
        if message.get("name"):
            out["name"] = str(message["name"])
    return out


# ---------------------------------------------------------------------------- tool calls

ToolCallFormat = Literal["hermes", "llama_json", "mistral"]

# What in a chat template declares each format. A template that declares none (one that
# cannot render tools) gets hermes, the format most open chat models are trained on.
_DECLARED_BY: dict[ToolCallFormat, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),  # Hermes, Qwen2.5/3, SmolLM2/3 (builtin template)
    "llama_json": ("<|python_tag|>", '"parameters": dictionary of argument name'),  # Llama 3.x
    "mistral": ("[TOOL_CALLS]",),  # Mistral v3 ([TOOL_CALLS] [{"name", "arguments"}])
}


def tool_call_formats(chat_template: str | dict[str, str] | None) -> tuple[ToolCallFormat, ...]:
    """The tool-call formats `chat_template` declares, in a fixed order (hermes if none).

    A tokenizer with several named templates (a dict) declares what any of them declares.
    """
    if isinstance(chat_template, dict):
        chat_template = "\n".join(chat_template.values())
    template = chat_template or ""
    declared = tuple(f for f, marks in _DECLARED_BY.items() if any(m in template for m in marks))
    return declared or ("hermes",)


@dataclass(frozen=True)
class ParsedReply:
    """The assistant message returned to the agent."""

    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI shape: id, type, function{name, arguments(str)}

    def as_message(self) -> Message:
        """The reply as it will come back in the next request, normalized."""
        raw: Message = {"role": "assistant", "content": self.content, "tool_calls": self.tool_calls}
        return normalize_message(raw)


def _openai_call(obj: Any) -> dict[str, Any] | None:
    """`{"name": str, "arguments"|"parameters": object or JSON text}` as an OpenAI tool call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": obj["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }


def _calls_in_json(text: str) -> list[dict[str, Any]] | None:
    """One call object or a list of them, as the whole of `text`; None if it is not that."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_openai_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _hermes(text: str) -> tuple[list[dict[str, Any]], str]:
    """`<tool_call>{json}</tool_call>` blocks; the JSON may be one call or a list (SmolLM2's
    own training format), and the last block may lack its closing tag (the model ended its
    turn right after the JSON), as vLLM's hermes parser allows."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL_RE.finditer(text):
        found = _calls_in_json(m.group(1) if m.group(1) is not None else m.group(2))
        if found is None:
            continue  # not a call: the block stays in the content untouched
        calls += found
        kept.append(text[pos : m.start()])
        pos = m.end()
    kept.append(text[pos:])
    return calls, "".join(kept)


def _llama_json(text: str) -> tuple[list[dict[str, Any]], str]:
    """The whole reply is `{"name": ..., "parameters": {...}}` (several joined by `;`),
    optionally after `<|python_tag|>`: Llama 3.1-3.3's JSON tool calling."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return [], text
    whole = _calls_in_json(body)
    if whole is not None:
        return whole, ""
    calls: list[dict[str, Any]] = []
    for part in body.split(";"):
        found = _calls_in_json(part.strip())
        if found is None:
            return [], text  # not calls: keep it all as content
        calls += found
    return calls, ""


def _mistral(text: str) -> tuple[list[dict[str, Any]], str]:
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` at the end of the reply. The
    marker is a special token, so a reply decoded without special tokens may be the list
    alone: a reply that is exactly such a list counts too."""
    at = text.find("[TOOL_CALLS]")
    head, body = (text[:at], text[at + len("[TOOL_CALLS]") :]) if at >= 0 else ("", text)
    if not body.strip().startswith("["):
        return [], text
    found = _calls_in_json(body.strip())
    return (found, head) if found is not None else ([], text)


_PARSERS = {"hermes": _hermes, "llama_json": _llama_json, "mistral": _mistral}


def parse_tool_calls(text: str, formats: tuple[ToolCallFormat, ...] = ("hermes",)) -> ParsedReply:
    """Split the tool calls of `formats` (see `tool_call_formats`) out of a completion.

    The first format that finds a call wins. A call is a JSON object with a non-empty string
    `name` and `arguments` (or Llama's `parameters`) that is an object or JSON text; anything
    else stays in the content untouched. Every format gives the same OpenAI `tool_calls`.
    """
    for fmt in formats:
        calls, rest = _PARSERS[fmt](text)
        if calls:
            content = rest.strip()
            return ParsedReply(content=content or None, tool_calls=calls)
    return ParsedReply(content=text, tool_calls=[])


def truncate_at_stop(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], stops: list[str]
) -> tuple[list[int], bool]:
    """Cut `ids` after the first token whose text completes a stop string (best effort).

    Returns (ids kept, whether a stop string was found). The token holding the stop string
    is kept so the trajectory holds only tokens the model produced, in order.
    """
    stops = [s for s in stops if s]
    if stops and any(s in tokenizer.decode(ids, skip_special_tokens=False) for s in stops):
        for k in range(1, len(ids) + 1):  # the first prefix whose text holds a stop string
            if any(s in tokenizer.decode(ids[:k], skip_special_tokens=False) for s in stops):
                return ids[:k], True
    return ids, False


def text_before_stop(text: str, stops: list[str]) -> str:
    """`text` up to the earliest stop string (OpenAI leaves the stop string out)."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


# ---------------------------------------------------------------------------- timeline


@dataclass
class Turn:
    """One recorded request: what was asked, what the template made of it, what came back."""

    messages: list[Message]
    tools_key: str
    prompt_text: str  # template text of `messages` with the generation prompt
    reply: Message  # normalized assistant reply returned to the agent
    call: LLMCall
    reused: bool  # prompt_ids extended an earlier turn's ids
    role: str = "default"  # the team role the request named (a task without roles: default)


@dataclass
class Timeline:
    """Every LLM call of one rollout, in the order the replies were made."""

    rollout_id: str
    turns: list[Turn] = field(default_factory=list)

    @property
    def calls(self) -> list[LLMCall]:
        return [t.call for t in self.turns]

    def calls_of(self, role: str) -> list[LLMCall]:
        """The calls that played `role`, in order: that role's part of the rollout."""
        return [t.call for t in self.turns if t.role == role]


@dataclass(frozen=True)
class PromptPlan:
    """Prompt ids for a request, and the template text they stand for."""

    ids: list[int]
    prompt_text: str
    reused: bool


class ChatRenderer:
    """Renders chat messages to token ids with the model's chat template, reusing past ids."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: list[int]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; set one on the server")
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids) or (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        )
        self.tool_call_formats = tool_call_formats(getattr(tokenizer, "chat_template", None))
        self._eot_text: str = (
            str(tokenizer.decode(self.eos_token_ids[:1], skip_special_tokens=False))
            if self.eos_token_ids
            else ""
        )

    def render(
        self, messages: list[Message], tools: list[Any] | None, generation_prompt: bool
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text

    def encode(self, text: str) -> list[int]:
        # The template writes every special token (BOS included) as text.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def prompt_ids(
        self,
        timeline: Timeline,
        messages: list[Message],
        tools: list[Any] | None,
        model: str | None = None,
    ) -> PromptPlan:
        """Prompt ids for `messages`: extend the latest matching earlier turn, else render fresh.

        With `model`, only turns of that model count: a team's other models have their own
        tokenizers, so their ids mean nothing here."""
        full = self.render(messages, tools, True)
        key = tools_key(tools)
        for turn in reversed(timeline.turns):
            if model is not None and turn.call.model != model:
                continue
            n = len(turn.messages)
            if turn.tools_key != key or len(messages) <= n:
                continue
            if messages[:n] != turn.messages or messages[n] != turn.reply:
                continue
            ids = self._extend(turn, messages[: n + 1], tools, full)
            if ids is not None:
                return PromptPlan(ids=ids, prompt_text=full, reused=True)
        return PromptPlan(ids=self.encode(full), prompt_text=full, reused=False)

    def _extend(
        self, turn: Turn, upto_reply: list[Message], tools: list[Any] | None, full: str
    ) -> list[int] | None:
        prefix = self.render(upto_reply, tools, False)
        if not prefix.startswith(turn.prompt_text) or not full.startswith(prefix):
            return None  # the template rewrites earlier turns: render fresh
        turn_text = prefix[len(turn.prompt_text) :]  # the template's reply, closing included
        completion = turn.call.completion_ids
        completion_text = self.decode(completion, skip_special_tokens=False)
        if completion_text and turn_text.startswith(completion_text):
            bridge = turn_text[len(completion_text) :]
        else:
            # The template spells the reply differently (e.g. tool-call JSON spacing): keep
            # the generated ids and take only the closing after the reply from the template.
            if not self._eot_text:
                return None
            at = turn_text.rfind(self._eot_text)
            if at < 0:
                return None
            closing = turn_text[at:]
            ended = bool(completion) and completion[-1] in self.eos_token_ids
            bridge = closing[len(self._eot_text) :] if ended else closing
        new_text = bridge + full[len(prefix) :]
        return list(turn.call.prompt_ids) + list(completion) + self.encode(new_text)


def tools_key(tools: list[Any] | None) -> str:
    """A canonical string for the tools of a request (turns reuse ids only under equal tools)."""
    return json.dumps(tools or [], sort_keys=True)
