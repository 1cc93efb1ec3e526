"""Tree attention: attention over a packed prefix trie that computes only the visible scores.

``merge.pack(..., "tree")`` lays the sequences of a micro-batch out as a token trie in one
row (depth-first) with a dense [1, 1, T, T] additive mask. Plain ``sdpa`` / ``eager`` then
compute all T x T scores and mask most of them away: in a GRPO group of G completions of
one prompt, branches never see each other and ~60% of the scores are thrown away.

This module cuts the row into *segments*, maximal runs of trie nodes without a branch
(a GRPO group: the prompt, then one segment per completion), recorded by ``pack`` as a
``TreeLayout`` on the micro-batch. The queries of segment s see exactly the keys of the
segments on its root path (fully) and of s itself (causally), so attention runs once per
segment::

    keys(s)    = cat(K[a] for a in ancestors(s)) ++ K[s]        # [B, kv_heads, Lk, D]
    mask(s)    = [0 ... 0 | causal over the last Lq columns]     # [Lq, Lk], additive
    out[s]     = sdpa(Q[s], keys(s), values(s), mask(s))         # a root: is_causal, no mask
    out        = cat(out[s] for s in row order)                   # segments tile the row

The scores computed are the visible ones plus the masked upper triangle inside each
segment; the arithmetic per visible score is the one of dense ``sdpa`` (masked keys add
exp(finfo.min) = 0 there), so results agree to fp32 reduction order
(tests/server/test_merge.py checks 1e-5 relative against call-by-call).

Use: ``register()``, then load the model with ``attn_implementation="jetctl_tree"``
(``jetctl.models.load_model`` does both); ``step.token_logprobs`` passes the layout as
the ``tree_layout`` keyword, which transformers forwards to attention functions. A keyword
of the call, not a global: the trainer's forward and the engine's generation may run on
the same model object in two threads at once. Every forward without a layout (padded
``off`` / ``linear`` micro-batches, generation, a KV cache) runs transformers' ``sdpa``
unchanged, with the same mask (``sdpa_mask`` is registered for this name too).

Memory: a segment's keys and values are a gathered copy of its root path, kept for the
backward pass, so a prompt shared by G branches is held G more times per layer (the bench's
GRPO group, G = 8 of a 1k prompt on SmolLM2: ~0.4 GiB more saved tensors than dense sdpa's
~2.7 GiB). The masks of a layer are views of one [Lmax, Pmax + Lmax] template.

Left out: a row of more than ``MAX_SEGMENTS`` segments falls back to dense ``sdpa`` with
the 4-D mask (every segment is a few small kernel calls per layer; 64 is a round number,
not a tuned one); batch rows > 1 with a layout (pack makes tree rows of B = 1); custom
kernels: each segment is one call of torch's ``scaled_dot_product_attention``, which on CPU
skips only whole masked blocks of a root segment (``is_causal``) and computes every block
of a masked one; GQA uses ``enable_gqa`` on CPU (native there) and ``repeat_kv`` elsewhere,
since CUDA's fused kernels take a mask only without GQA. Measured on CPU only; the CUDA
path runs the same code but has not been timed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTN_IMPLEMENTATION = "jetctl_tree"
MAX_SEGMENTS = 64  # more segments: dense sdpa with the 4-D mask (see the module docstring)


@dataclass(frozen=True)
class TreeLayout:
    """A trie row cut into segments: runs of trie nodes without a branch, in row order.

    Segment i covers row positions [bounds[i], bounds[i + 1]); its queries see the keys of
    its root path (the segments ``chains[i]`` lists, root first) and its own, causally.
    """

    bounds: tuple[int, ...]  # [S + 1]: 0 = bounds[0] < bounds[1] < ... < bounds[S] = T
    parents: tuple[int, ...]  # [S]: parent segment of i (earlier in the row), -1 for a root

    def __post_init__(self) -> None:
        s = len(self.parents)
        if len(self.bounds) != s + 1 or self.bounds[0] != 0:
            raise ValueError(
                f"TreeLayout: {len(self.bounds)} bounds for {s} segments; give S + 1 bounds "
                "starting at 0"
            )
        if any(b <= a for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"TreeLayout: bounds {self.bounds} must strictly increase")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(
                f"TreeLayout: parents {self.parents} must point to an earlier segment or be -1"
            )

    @property
    def num_segments(self) -> int:
        return len(self.parents)

    @property
    def length(self) -> int:
        """T, the row's token count."""
        return self.bounds[-1]

    @property
    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    @cached_property
    def chains(self) -> tuple[tuple[int, ...], ...]:
        """Per segment: the segments whose keys it sees, root first, itself last."""
        out: list[tuple[int, ...]] = []
        for i, p in enumerate(self.parents):
            out.append((*out[p], i) if p >= 0 else (i,))
        return tuple(out)


def tree_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, kv_heads, T, D]
    value: torch.Tensor,  # [B, kv_heads, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tree_layout: TreeLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: per segment with a layout, else transformers' sdpa.

    Returns ``([B, T, H, D], None)`` like every transformers attention function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        tree_layout is None
        or tree_layout.num_segments > MAX_SEGMENTS
        or not getattr(module, "is_causal", True)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    t = tree_layout.length
    if query.shape[0] != 1 or query.shape[2] != t or key.shape[2] != t:
        raise ValueError(
            f"tree attention: a layout of {t} tokens needs a single row "
            f"without a KV cache, got query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    n_rep = query.shape[1] // key.shape[1]  # query heads per kv head (GQA)
    gqa = n_rep > 1 and query.device.type == "cpu"
    if n_rep > 1 and not gqa:
        from transformers.integrations.sdpa_attention import repeat_kv

        key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    # split once: each piece's gradient is accumulated where it is used, then concatenated
    # once (slicing per segment would make a zero-filled T-sized gradient per use)
    sizes = tree_layout.sizes
    q_parts = query.split(sizes, dim=2)
    k_parts = key.split(sizes, dim=2)
    v_parts = value.split(sizes, dim=2)
    masks = _PrefixCausalMasks(tree_layout, query.dtype, query.device)
    outs = []
    for i, chain in enumerate(tree_layout.chains):
        q = q_parts[i]  # [B, H, Lq, D]
        if len(chain) == 1:  # a root: plain causal attention over itself
            outs.append(F.scaled_dot_product_attention(
                q, k_parts[i], v_parts[i], dropout_p=dropout, scale=scaling, is_causal=True,
                enable_gqa=gqa,
            ))
            continue
        k = torch.cat([k_parts[j] for j in chain], dim=2)  # [B, kv_heads, Lk, D]
        v = torch.cat([v_parts[j] for j in chain], dim=2)
        outs.append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=masks.get(q.shape[2], k.shape[2] - q.shape[2]),
            dropout_p=dropout, scale=scaling, enable_gqa=gqa,
        ))
    out = torch.cat(outs, dim=2)  # [B, H, T, D]: segments tile the row in order
    return out.transpose(1, 2).contiguous(), None


class _PrefixCausalMasks:
    """The masks of one layer's segments, as views of one template (one small allocation).

    Segment (Lq queries, P prefix keys) needs the additive [Lq, P + Lq] mask "column c is
    visible from row r iff c <= P + r". The template [Lmax, Pmax + Lmax] holds "c' <= Pmax
    + r"; its columns from Pmax - P on are exactly that mask, for every (Lq, P) at once.
    """

    def __init__(self, layout: TreeLayout, dtype: torch.dtype, device: torch.device) -> None:
        sizes = layout.sizes
        shapes = [  # (Lq, P) of every segment with a prefix
            (sizes[i], sum(sizes[j] for j in chain[:-1]))
            for i, chain in enumerate(layout.chains) if len(chain) > 1
        ]
        self.l_max = max((lq for lq, _ in shapes), default=0)
        self.p_max = max((p for _, p in shapes), default=0)
        rows = torch.arange(self.l_max, device=device)[:, None]
        cols = torch.arange(self.p_max + self.l_max, device=device)[None, :]
        self.template = torch.zeros(  # [Lmax, Pmax + Lmax]
            self.l_max, self.p_max + self.l_max, dtype=dtype, device=device
        ).masked_fill_(cols > self.p_max + rows, torch.finfo(dtype).min)

    def get(self, q_len: int, prefix: int) -> torch.Tensor:
        """[Lq, P + Lq]: every prefix key visible, the last Lq keys causal (lower right)."""
        start = self.p_max - prefix
        return self.template[:q_len, start:start + prefix + q_len]


def register() -> None:
    """Make ``attn_implementation="jetctl_tree"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)
    # without a mask function transformers would build no mask at all for this name
    # (padding and causality lost); the fallback path needs exactly sdpa's
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def uses_tree_attention(model: nn.Module) -> bool:
    """Whether ``model`` (a transformers model, PEFT-wrapped or not) runs this kernel."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
