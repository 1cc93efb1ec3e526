"""A team task's proxy: the agent names a role as `model`; each role's calls are recorded as
that role's, for that role's model, and never reuse another model's token ids."""

from __future__ import annotations

from typing import Any

import pytest

from jetctl.client.backend import GenerateParams, GenerateResult
from jetctl.client.proxy import Proxy, ProxyError, ServedModel
from jetctl.client.timeline import ChatRenderer

pytestmark = pytest.mark.unit


class CountingBackend:
    """Answers every prompt with `reply` (then end of turn) and counts its calls."""

    def __init__(self, tokenizer: Any, reply: str) -> None:
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.ids = list(tokenizer.encode(reply, add_special_tokens=False)) + [self.eos]
        self.prompts: list[list[int]] = []

    async def generate(self, params: GenerateParams) -> GenerateResult:
        self.prompts.append(params.prompt_ids)
        return GenerateResult(list(self.ids), [-0.5] * len(self.ids), 3, "stop")


@pytest.fixture
def team(tokenizer: Any) -> tuple[Proxy, CountingBackend, CountingBackend]:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tokenizer, [eos])
    big, small = CountingBackend(tokenizer, "plan"), CountingBackend(tokenizer, "code")
    proxy = Proxy(
        {
            "planner": ServedModel("planner", renderer, big, 512, model="big", role="planner"),
            "coder": ServedModel("coder", renderer, small, 512, model="small", role="coder"),
        },
        default_model=None,
    )
    return proxy, big, small


def ask(model: str | None, *messages: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": list(messages) or [{"role": "user", "content": "go"}]}
    if model is not None:
        body["model"] = model
    return body


async def test_roles_reach_their_models_and_are_recorded_as_theirs(team: Any) -> None:
    proxy, big, small = team
    proxy.open("r1")
    first = await proxy.complete("r1", ask("planner"))
    assert first["model"] == "planner" and first["choices"][0]["message"]["content"] == "plan"
    reply = first["choices"][0]["message"]
    # the coder continues the planner's conversation: a prefix of it, but another model's
    # ids are not its own, so its prompt is rendered fresh
    await proxy.complete("r1", ask("coder", {"role": "user", "content": "go"}, reply,
                                   {"role": "user", "content": "now code"}))
    await proxy.complete("r1", ask("planner", {"role": "user", "content": "go"}, reply,
                                   {"role": "user", "content": "again"}))
    timeline = proxy.close("r1")
    assert [(t.role, t.call.model) for t in timeline.turns] == [
        ("planner", "big"), ("coder", "small"), ("planner", "big")]
    assert [t.reused for t in timeline.turns] == [False, False, True]  # same model: reused
    assert len(big.prompts) == 2 and len(small.prompts) == 1
    assert [c.model for c in timeline.calls_of("coder")] == ["small"]
    assert proxy.tokens_generated == {"big": 2 * len(big.ids), "small": len(small.ids)}


async def test_an_unknown_or_missing_role_is_a_400_naming_the_roles(team: Any) -> None:
    proxy, big, small = team
    proxy.open("r1")
    with pytest.raises(ProxyError) as unknown:
        await proxy.complete("r1", ask("big"))  # a model key is not a role
    assert unknown.value.status == 400
    assert "'big' is not served on this node; known roles of this team: coder, planner" in str(
        unknown.value)
    with pytest.raises(ProxyError) as missing:
        await proxy.complete("r1", ask(None))
    assert missing.value.status == 400 and "name a role as model (one of coder, planner)" in str(
        missing.value)
    assert not big.prompts and not small.prompts
