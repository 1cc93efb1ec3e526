"""Timeline merging and prefix packing give the same training signal as call-by-call.

The reference is a plain loop (CleanRL style): every LLM call is run through the model on
its own, with no mask and default positions, and each completion token is scored from the
logits just before it. The merged path (timeline_sequences -> pack -> token_logprobs) must
agree per token, in the loss and in every gradient.

Every exactness test runs under three attention kernels: ``eager`` (adds the mask to the
scores), ``sdpa`` (hands it to torch) and ``jetctl_tree`` (jetctl/kernels/tree_attention.py:
per trie segment, only the visible keys; sdpa for padded rows).

Tolerance: 1e-5 relative, fp32. The two paths do the same arithmetic on the same values,
except that matmuls and softmax sums over different sequence lengths/layouts reduce in a
different order, and masked keys contribute exp(finfo.min) = 0 exactly. fp32 rounding is
~6e-8 per op; measured here: log-probs within 5e-7, gradients within 5e-7 relative (every
check prints its figures: ``pytest -s``). Real mistakes are far above 1e-5 on this model:
position ids 0..T-1 instead of the trie depth move log-probs by 2e-3, a plain causal mask
(siblings visible) by 4e-2, a boolean 4-D mask under eager attention by 0.18, a tree layout
in which one branch sees its sibling by ~1e-2 (test_a_wrong_tree_layout_is_caught).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jetctl.kernels import tree_attention
from jetctl.server.merge import (
    MergeMode,
    MicroBatch,
    TrainSequence,
    merge_stats,
    pack,
    timeline_sequences,
)
from jetctl.server.step import token_logprobs
from jetctl.types import LLMCall, Trajectory

pytestmark = pytest.mark.unit

VOCAB = 300
RTOL = 1e-5  # see the module docstring
ATTENTIONS = ["eager", "sdpa", tree_attention.ATTN_IMPLEMENTATION]


def tiny_llama(attn: str = "eager", seed: int = 0) -> LlamaForCausalLM:
    tree_attention.register()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config._attn_implementation = attn  # one of ATTENTIONS
    model = LlamaForCausalLM(config).float()
    assert model.config._attn_implementation == attn
    return model


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def call(prompt: list[int], completion: list[int], rng: random.Random) -> LLMCall:
    logprobs = [-rng.random() * 3 for _ in completion]
    return LLMCall("policy", list(prompt), list(completion), logprobs, model_version=0)


def traj(tid: str, calls: list[LLMCall], group: str = "g0") -> Trajectory:
    return Trajectory(id=tid, group_id=group, task="t", task_id="0", calls=calls)


def linear_timeline(rng: random.Random, tid: str, prefix: list[int], turns: int) -> Trajectory:
    """A chat: each call's prompt is the previous prompt + completion + a new user turn."""
    history = list(prefix)
    calls = []
    for _ in range(turns):
        history += toks(rng, rng.randrange(3, 8))  # user / tool turn
        completion = toks(rng, rng.randrange(2, 6))
        calls.append(call(history, completion, rng))
        history = history + completion
    return traj(tid, calls)


# ----------------------------------------------------------------------------- reference


Key = tuple[str, tuple[int, ...]]  # (trajectory id, context + target): names one scored token


def naive(
    model: torch.nn.Module, trajs: list[tuple[Trajectory, float]]
) -> tuple[dict[Key, torch.Tensor], torch.Tensor]:
    """Call by call: per-token logprobs keyed by their context, and sum(adv * logp) / N."""
    logps: dict[Key, torch.Tensor] = {}
    terms = []
    for t, adv in trajs:
        for c in t.calls:
            ids = torch.tensor([c.prompt_ids + c.completion_ids])  # [1, L]
            logits = model(input_ids=ids).logits[0].float()  # [L, V]
            p = len(c.prompt_ids)
            for k, tok in enumerate(c.completion_ids):
                lp = torch.log_softmax(logits[p + k - 1], -1)[tok]
                logps[(t.id, tuple(ids[0, : p + k + 1].tolist()))] = lp
                terms.append(adv * lp)
    return logps, torch.stack(terms).sum() / len(terms)


def merged_logps(
    model: torch.nn.Module, seqs: list[TrainSequence], mbs: list[MicroBatch]
) -> Iterator[tuple[MicroBatch, torch.Tensor, list[Key]]]:
    for mb in mbs:
        lp = token_logprobs(model, mb)
        keys = [
            (seqs[s].trajectory_id, tuple(seqs[s].tokens[: t + 1]))
            for s, t in zip(mb.seq_index.tolist(), mb.token_index.tolist())
        ]
        yield mb, lp, keys


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [p.grad.flatten() for p in model.parameters() if p.requires_grad and p.grad is not None]
    )


def check_exact(
    model: torch.nn.Module,
    trajs: list[tuple[Trajectory, float]],
    mode: MergeMode,
    budget: int = 10_000,
    alter: Callable[[MicroBatch], MicroBatch] | None = None,
) -> list[MicroBatch]:
    """Assert merged == naive for logprobs, loss and gradient; return the micro-batches.

    ``alter`` rewrites each packed micro-batch before it runs (tests that must fail).
    """
    model.zero_grad()
    ref_logps, ref_loss = naive(model, trajs)
    ref_loss.backward()
    ref_grad = grads(model).clone()
    model.zero_grad()

    seqs = [s for t, adv in trajs for s in timeline_sequences(t, adv, mode)]
    mbs = pack(seqs, mode, budget)
    if alter is not None:
        mbs = [alter(mb) for mb in mbs]
    n_total = sum(mb.num_targets for mb in mbs)
    assert n_total == len(ref_logps)
    loss = torch.zeros(())
    got: dict[Key, torch.Tensor] = {}
    for mb, lp, keys in merged_logps(model, seqs, mbs):
        mb_loss = (mb.advantages * lp).sum() / n_total
        mb_loss.backward()  # gradient accumulation over micro-batches
        loss = loss + mb_loss.detach()
        got.update(zip(keys, lp.detach()))

    assert got.keys() == ref_logps.keys()
    ref = torch.stack([ref_logps[k].detach() for k in got])
    lp_err = (torch.stack(list(got.values())) - ref).abs().max().item()
    loss_err = ((loss - ref_loss.detach()).abs() / ref_loss.abs()).item()
    g = grads(model)
    rel = ((g - ref_grad).norm() / ref_grad.norm()).item()
    attn = getattr(getattr(model, "config", None), "_attn_implementation", "?")
    print(f"{attn} {mode}: logprob max abs error {lp_err:.1e}, loss {loss_err:.1e} relative, "
          f"gradient {rel:.1e} relative")
    torch.testing.assert_close(torch.stack(list(got.values())), ref, rtol=RTOL, atol=RTOL)
    torch.testing.assert_close(
        loss, ref_loss.detach(), rtol=RTOL, atol=RTOL * ref_loss.abs().item()
    )
    assert rel <= RTOL, f"gradient differs by {rel:.2e} relative"
    model.zero_grad()
    return mbs


# ----------------------------------------------------------------------------- sequences


def test_off_mode_one_sequence_per_call() -> None:
    rng = random.Random(0)
    t = linear_timeline(rng, "a", toks(rng, 5), turns=3)
    seqs = timeline_sequences(t, 0.5, "off")
    assert len(seqs) == 3
    for s, c in zip(seqs, t.calls):
        assert s.tokens == c.prompt_ids + c.completion_ids
        assert s.loss_mask == [False] * len(c.prompt_ids) + [True] * len(c.completion_ids)
        assert s.old_logprobs[len(c.prompt_ids) :] == c.completion_logprobs
        assert s.advantage == 0.5 and s.trajectory_id == "a" and s.group_id == "g0"


def test_linear_mode_merges_append_only_history() -> None:
    rng = random.Random(1)
    t = linear_timeline(rng, "a", toks(rng, 5), turns=4)
    (seq,) = timeline_sequences(t, 1.0, "linear")
    last = t.calls[-1]
    assert seq.tokens == last.prompt_ids + last.completion_ids
    assert seq.num_targets == sum(len(c.completion_ids) for c in t.calls)
    # every generated token is masked with its own behaviour logprob, context is not
    for c in t.calls:
        start = len(c.prompt_ids)
        for k, lp in enumerate(c.completion_logprobs):
            assert seq.loss_mask[start + k] and seq.old_logprobs[start + k] == lp
    assert sum(seq.loss_mask) == seq.num_targets


def test_edited_history_starts_a_new_sequence() -> None:
    rng = random.Random(2)
    sys = toks(rng, 6)
    c1 = call(sys + toks(rng, 4), toks(rng, 3), rng)
    # the agent summarised the history: the second prompt drops the first completion
    c2 = call(c1.prompt_ids + toks(rng, 3), toks(rng, 4), rng)
    c3 = call(c2.prompt_ids + c2.completion_ids + toks(rng, 2), toks(rng, 3), rng)
    seqs = timeline_sequences(traj("a", [c1, c2, c3]), 1.0, "linear")
    assert [len(s.tokens) for s in seqs] == [
        len(c1.prompt_ids) + 3,
        len(c3.prompt_ids) + 3,
    ]


def test_invalid_calls_are_refused_with_the_reason() -> None:
    bad = LLMCall("policy", [1, 2], [3, 4], [-0.1], model_version=0)
    with pytest.raises(ValueError, match="2 completion ids but 1 logprobs"):
        timeline_sequences(traj("a", [bad]), 1.0, "linear")
    empty_prompt = LLMCall("policy", [], [3], [-0.1], model_version=0)
    with pytest.raises(ValueError, match="empty prompt_ids"):
        timeline_sequences(traj("a", [empty_prompt]), 1.0, "off")


# ----------------------------------------------------------------------------- packing


def test_tree_mask_sees_ancestors_only_and_positions_continue() -> None:
    # prompt [1,2,3]; branches [4,5] and [6]; and a nested branch [4,7] under [4]
    seqs = [
        TrainSequence(
            [1, 2, 3, 4, 5], [False, False, False, True, True], [0, 0, 0, -1, -1], 1.0, "a", "g"
        ),
        TrainSequence([1, 2, 3, 6], [False, False, False, True], [0, 0, 0, -1], 1.0, "b", "g"),
        TrainSequence(
            [1, 2, 3, 4, 7], [False, False, False, True, True], [0, 0, 0, -1, -1], 1.0, "c", "g"
        ),
    ]
    (mb,) = pack(seqs, "tree", 100)
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 6]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 3]]
    assert mb.num_tokens == 7 and mb.attention_mask.shape == (1, 1, 7, 7)
    visible = (mb.attention_mask[0, 0] == 0).int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 1, 0],  # 7 sees its path 1,2,3,4 and itself, not its sibling 5
        [1, 1, 1, 0, 0, 0, 1],
    ]
    assert mb.attention_mask.min().item() == torch.finfo(torch.float32).min
    # segments for the tree kernel: [1 2 3] [4] [5] [7] [6]; 5 and 7 hang off 4, 6 off the root
    assert mb.tree_layout == tree_attention.TreeLayout(
        bounds=(0, 3, 4, 5, 6, 7), parents=(-1, 0, 1, 1, 0)
    )
    assert mb.tree_layout.chains == ((0,), (0, 1), (0, 1, 2), (0, 1, 3), (0, 4))
    # token 4 is generated in both a and c: scored twice from position 2 (token 3)
    assert sorted(zip(mb.pred_index[:, 1].tolist(), mb.targets.tolist())) == [
        (2, 4),
        (2, 4),
        (2, 6),
        (3, 5),
        (3, 7),
    ]


def test_budget_splits_microbatches_and_oversized_sequences_stand_alone() -> None:
    rng = random.Random(3)
    seqs = [
        TrainSequence(toks(rng, n), [False] + [True] * (n - 1), [0.0] * n, 1.0, str(n), "g")
        for n in (30, 8, 8, 7, 5, 4)
    ]
    modes: list[MergeMode] = ["linear", "tree"]
    for mode in modes:
        mbs = pack(seqs, mode, 16)
        assert sorted(i for mb in mbs for i in set(mb.seq_index.tolist())) == list(range(6))
        for mb in mbs:
            if 0 in mb.seq_index.tolist():
                assert mb.input_ids.shape == (1, 30)  # longer than the budget: on its own
            else:
                assert mb.padded_tokens <= 16
    # longest first: [30] [8, 8] [7, 5] [4]; 2 * 8 = 16 and 2 * 7 = 14 fit, 3 * 7 does not
    assert [mb.input_ids.shape[0] for mb in pack(seqs, "linear", 16)] == [1, 2, 2, 1]


def test_merge_stats_count_naive_and_packed_tokens() -> None:
    rng = random.Random(4)
    t = linear_timeline(rng, "a", toks(rng, 10), turns=4)
    naive_seqs = timeline_sequences(t, 1.0, "off")
    mbs = pack(timeline_sequences(t, 1.0, "linear"), "linear", 1000)
    stats = merge_stats(naive_seqs, mbs)
    assert stats.tokens_naive == sum(len(c.prompt_ids) + len(c.completion_ids) for c in t.calls)
    assert stats.tokens_packed == len(t.calls[-1].prompt_ids) + len(t.calls[-1].completion_ids)
    assert stats.ratio == stats.tokens_naive / stats.tokens_packed > 2
    assert set(stats.scalars()) >= {"merge/tokens_naive", "merge/tokens_packed", "merge/ratio"}


# ----------------------------------------------------------------------------- exactness


@pytest.fixture(scope="module", params=ATTENTIONS)
def model(request: pytest.FixtureRequest) -> LlamaForCausalLM:
    return tiny_llama(request.param)


@pytest.mark.parametrize("mode", ["off", "linear", "tree"])
def test_linear_timeline_is_exact(model: LlamaForCausalLM, mode: MergeMode) -> None:
    rng = random.Random(10)
    trajs = [(linear_timeline(rng, "a", toks(rng, 12), turns=4), 0.7)]
    mbs = check_exact(model, trajs, mode)
    if mode != "off":
        assert len(mbs) == 1 and mbs[0].input_ids.shape[0] == 1  # four calls, one row


# (trajectories with advantages, prompt, completions)
Group = tuple[list[tuple[Trajectory, float]], list[int], list[list[int]]]


def grpo_group(rng: random.Random) -> Group:
    """G = 4 completions of one prompt, two of them sharing their first two tokens."""
    prompt = toks(rng, 20)
    head = toks(rng, 2)  # two completions start alike: a nested branch point in the trie
    completions = [head + toks(rng, 4), head + toks(rng, 3), toks(rng, 5), toks(rng, 6)]
    advs = [1.2, -0.3, 0.5, -1.4]
    trajs = [
        (traj(f"r{i}", [call(prompt, c, rng)]), a)
        for i, (c, a) in enumerate(zip(completions, advs))
    ]
    return trajs, prompt, completions


def test_grpo_group_shared_prompt_is_one_row(model: LlamaForCausalLM) -> None:
    trajs, prompt, completions = grpo_group(random.Random(11))
    (mb,) = check_exact(model, trajs, "tree")
    assert mb.num_tokens == len(prompt) + 2 + sum(len(c) - 2 for c in completions[:2]) + 11
    assert mb.tree_layout is not None and mb.tree_layout.num_segments == 6


def test_two_agents_sharing_a_document_are_exact(model: LlamaForCausalLM) -> None:
    rng = random.Random(12)
    system, document = toks(rng, 6), toks(rng, 25)
    planner = linear_timeline(rng, "planner", system + document + toks(rng, 4), turns=2)
    critic = linear_timeline(rng, "critic", system + document + toks(rng, 5), turns=3)
    other = linear_timeline(rng, "other", system + toks(rng, 8), turns=2)  # shares the system only
    trajs = [(planner, 1.0), (critic, -0.5), (other, 0.25)]
    (mb,) = check_exact(model, trajs, "tree")
    naive_tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for t, _ in trajs for c in t.calls)
    assert mb.num_tokens < naive_tokens / 2


@pytest.mark.parametrize("mode", ["linear", "tree"])
def test_edited_history_falls_back_and_stays_exact(
    model: LlamaForCausalLM, mode: MergeMode
) -> None:
    rng = random.Random(13)
    sys = toks(rng, 8)
    c1 = call(sys + toks(rng, 4), toks(rng, 3), rng)
    c2 = call(c1.prompt_ids + toks(rng, 3), toks(rng, 4), rng)  # drops c1's completion
    edited = c2.prompt_ids + c2.completion_ids
    edited[len(sys) + 1] = (edited[len(sys) + 1] % (VOCAB - 1)) + 1  # rewrites an old token
    c3 = call(edited + toks(rng, 2), toks(rng, 3), rng)
    t = traj("a", [c1, c2, c3])
    assert len(timeline_sequences(t, 1.0, mode)) == 3
    check_exact(model, [(t, 0.9)], mode)


@pytest.mark.parametrize("mode", ["linear", "tree"])
def test_microbatches_accumulate_to_the_same_gradient(
    model: LlamaForCausalLM, mode: MergeMode
) -> None:
    rng = random.Random(14)
    prompt = toks(rng, 10)
    trajs = [(linear_timeline(rng, f"r{i}", prompt, turns=2), 0.3 * i - 0.5) for i in range(4)]
    mbs = check_exact(model, trajs, mode, budget=40)
    assert len(mbs) > 1
    assert all(mb.padded_tokens <= 40 for mb in mbs)


@pytest.mark.parametrize("attn", ATTENTIONS)
def test_lora_model_is_exact(attn: str) -> None:
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(attn, seed=1)
    # init_lora_weights=False: random A and B, so the adapter changes the output and both
    # A and B get gradients (the default B = 0 would leave A's gradient at exactly zero)
    lora = get_peft_model(
        base,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    rng = random.Random(15)
    prompt = toks(rng, 16)
    trajs = [
        (linear_timeline(rng, f"r{i}", prompt, turns=2), a) for i, a in enumerate([1.0, -1.0, 0.5])
    ]
    # the PEFT wrapper passes the tree layout on to the kernel
    assert tree_attention.uses_tree_attention(lora) == (attn == tree_attention.ATTN_IMPLEMENTATION)
    check_exact(lora, trajs, "tree")
    check_exact(lora, trajs, "linear")
    assert all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)


def sibling_visible(mb: MicroBatch) -> MicroBatch:
    """The same micro-batch with a wrong layout: the last branch also sees its elder sibling."""
    layout = mb.tree_layout
    assert layout is not None
    parents = list(layout.parents)
    i = max(i for i, p in enumerate(parents) if p >= 0 and parents.index(p) < i)
    parents[i] = parents.index(parents[i])  # its parent's first child, a sibling of i
    wrong = tree_attention.TreeLayout(bounds=layout.bounds, parents=tuple(parents))
    return dataclasses.replace(mb, tree_layout=wrong)


def test_a_wrong_tree_layout_is_caught() -> None:
    """The exactness check fails when the tree kernel lets one branch see its sibling.

    Proves both that the kernel follows the layout (not the dense mask, which stays right)
    and that check_exact is sharp enough to notice a leak between branches.
    """
    model = tiny_llama(tree_attention.ATTN_IMPLEMENTATION)
    trajs, _, _ = grpo_group(random.Random(11))
    check_exact(model, trajs, "tree")
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        check_exact(model, trajs, "tree", alter=sibling_visible)


def test_tree_kernel_equals_dense_sdpa_on_random_tries() -> None:
    """The kernel alone, on nested tries with several roots: outputs and input gradients."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rng = random.Random(19)
    module = torch.nn.Module()
    module.is_causal = True  # type: ignore[assignment]
    module.num_key_value_groups = 2  # type: ignore[assignment]
    for trial in range(5):
        stems = [toks(rng, rng.randrange(1, 12)) for _ in range(rng.randrange(1, 3))]
        seqs = []
        for n in range(rng.randrange(2, 9)):
            tokens = list(rng.choice(stems))
            for _ in range(rng.randrange(1, 4)):  # nested branch points
                tokens += rng.choice([toks(rng, rng.randrange(1, 9)), [7, 8, 9]])
            seqs.append(TrainSequence(tokens, [False] * len(tokens), [0.0] * len(tokens),
                                      1.0, str(n), "g"))
        (mb,) = pack(seqs, "tree", 10_000)
        assert mb.tree_layout is not None
        t = mb.num_tokens
        torch.manual_seed(trial)
        q = torch.randn(1, 4, t, 8, requires_grad=True)  # [B, H, T, D]
        k = torch.randn(1, 2, t, 8, requires_grad=True)  # [B, kv_heads, T, D]
        v = torch.randn(1, 2, t, 8, requires_grad=True)
        dense, _ = sdpa_attention_forward(module, q, k, v, mb.attention_mask, scaling=0.3)
        tree, _ = tree_attention.tree_attention_forward(
            module, q, k, v, mb.attention_mask, scaling=0.3, tree_layout=mb.tree_layout
        )  # [B, T, H, D]
        weights = torch.linspace(-1, 1, dense.numel()).view_as(dense)
        want = torch.autograd.grad((dense * weights).sum(), (q, k, v))
        got = torch.autograd.grad((tree * weights).sum(), (q, k, v))
        torch.testing.assert_close(tree, dense, rtol=RTOL, atol=RTOL)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=RTOL, atol=RTOL)


def test_many_segments_fall_back_to_the_dense_mask() -> None:
    """Past MAX_SEGMENTS the kernel runs dense sdpa with the 4-D mask: exact, layout unused."""
    rng = random.Random(17)
    prompt = toks(rng, 8)
    g = tree_attention.MAX_SEGMENTS + 6
    trajs = [(traj(f"r{i}", [call(prompt, toks(rng, 3), rng)]), (i % 3) - 1.0) for i in range(g)]
    model = tiny_llama(tree_attention.ATTN_IMPLEMENTATION)
    (mb,) = check_exact(model, trajs, "tree")
    assert mb.tree_layout is not None
    assert mb.tree_layout.num_segments > tree_attention.MAX_SEGMENTS
    check_exact(model, trajs, "tree", alter=sibling_visible)  # the layout is not consulted


def test_tree_kernel_without_a_layout_is_sdpa() -> None:
    """Padded 2-D-mask forwards and generation with jetctl_tree are sdpa's, bit for bit."""
    sdpa = tiny_llama("sdpa")
    tree = tiny_llama(tree_attention.ATTN_IMPLEMENTATION)
    rng = random.Random(18)
    rows = [toks(rng, n) for n in (9, 4, 6)]
    ids = torch.zeros(3, 9, dtype=torch.long)  # [B, T], left padded as the engine does
    mask = torch.zeros(3, 9, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, 9 - len(row):] = torch.tensor(row)
        mask[r, 9 - len(row):] = 1
    with torch.no_grad():
        want = sdpa(input_ids=ids, attention_mask=mask).logits
        got = tree(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(got, want)
        kwargs: dict[str, Any] = {
            "input_ids": ids, "attention_mask": mask, "max_new_tokens": 6, "do_sample": False,
            "pad_token_id": 0, "output_logits": True, "return_dict_in_generate": True,
        }
        want_gen = sdpa.generate(**kwargs)
        got_gen = tree.generate(**kwargs)
    assert torch.equal(got_gen.sequences, want_gen.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got_gen.logits, want_gen.logits))


def test_mask_is_remade_for_a_lower_precision_model() -> None:
    rng = random.Random(16)
    prompt = toks(rng, 10)
    seqs = [
        s
        for i in range(3)
        for s in timeline_sequences(traj(f"r{i}", [call(prompt, toks(rng, 4), rng)]), 1.0, "tree")
    ]
    (mb,) = pack(seqs, "tree", 1000)  # fp32 mask
    model32 = tiny_llama("eager")
    model16 = tiny_llama("eager").bfloat16()
    lp32 = token_logprobs(model32, mb)
    lp16 = token_logprobs(model16, mb)
    assert torch.isfinite(lp16).all()
    # bf16 keeps 8 mantissa bits: logprobs of ~-5.7 agree to a few 1e-2, not better
    torch.testing.assert_close(lp16, lp32, rtol=0, atol=5e-2)
