"""Timeline merging and prefix packing: turn trajectories into few, short model inputs.

What it does (docs/architecture.md section 5, "Timeline merging"):

1. ``timeline_sequences(traj, advantage, mode)`` turns one trajectory's LLM calls into
   training sequences. ``off``: one sequence per call (prompt unmasked, completion
   masked). ``linear`` / ``tree``: a call whose recorded ``prompt_ids`` start with the
   full tokens (prompt + completion) of an earlier sequence extends that sequence; its
   extra prompt tokens are unmasked context and its completion is masked. A history that
   is not append-only (edited, truncated, re-rendered) starts a new sequence, so merging
   may save less but never changes what is trained.
2. ``pack(sequences, mode, max_tokens_per_microbatch)`` lays sequences out as model
   inputs. ``off`` / ``linear``: one right-padded row per sequence and a 2-D 0/1 padding
   mask, rows grouped so that ``B * T <= budget``. ``tree``: the sequences of a micro-batch
   become a token trie (shared prefixes once, nested sharing included) laid out in one
   row in depth-first order, with a 4-D *additive float* mask (0 where a token may attend
   to an ancestor or itself, ``finfo(dtype).min`` elsewhere) and ``position_ids`` = depth
   in the trie, so every branch continues from the end of its prefix. A boolean 4-D mask
   would be silently wrong under eager attention (it is added to the scores), hence float.
   Each target token is scored from the logits at its parent's position in the row, so
   several branches may be scored from one position (``pred_index`` rows repeat).
   The row also carries its ``TreeLayout`` (runs of trie nodes without a branch and their
   parents), with which the ``jetctl_tree`` attention kernel (kernels/tree_attention.py) computes
   only the scores the mask leaves visible.
   A tree row that holds a single sequence (one agent's timeline) gets the ``linear``
   layout: nothing branches, and kernels can then take their causal path.
3. ``merge_stats(naive, microbatches)`` gives the ``merge/*`` step scalars.

This module is data layout only: the forward that scores a micro-batch is
``jetctl.server.step.token_logprobs``.

Merged and naive training give the same per-token log-probs, loss and gradients up to
fp32 reduction order (tests/server/test_merge.py checks 1e-5 relative).

Run the checks: ``.venv/bin/pytest tests/server/test_merge.py``.

Left out: attention kernels that ignore custom 4-D masks (``flash_attention_2``; use
``jetctl_tree``, ``sdpa`` or ``eager`` with ``tree``); an O(T^2) mask per row, built even
when ``jetctl_tree`` does not read it, so keep the tree budget to a few thousand tokens
(fp32 mask at T=8192 is 256 MiB); bin-packing beyond greedy first-fit over sorted
sequences; per-call loss normalisation (a merged sequence no longer knows which call each
token came from; use token-level or per-trajectory normalisation, which merging
preserves); calls with an empty completion are skipped (nothing to score).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from jetctl.kernels.tree_attention import TreeLayout
from jetctl.types import Trajectory

MergeMode = Literal["off", "linear", "tree"]


@dataclass
class TrainSequence:
    """One training sequence: a timeline's calls, merged where possible."""

    tokens: list[int]
    loss_mask: list[bool]  # True at i where tokens[i] was generated (scored from logits at i-1)
    old_logprobs: list[float]  # behaviour logprob of tokens[i] where loss_mask[i], else 0.0
    advantage: float
    trajectory_id: str
    group_id: str

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.loss_mask) == len(self.old_logprobs)):
            raise ValueError(
                f"TrainSequence of trajectory {self.trajectory_id}: tokens ({len(self.tokens)}), "
                f"loss_mask ({len(self.loss_mask)}) and old_logprobs ({len(self.old_logprobs)}) "
                "must have the same length"
            )
        if self.loss_mask and self.loss_mask[0]:
            raise ValueError(
                f"TrainSequence of trajectory {self.trajectory_id}: the first token cannot be "
                "scored (no logits precede it); a call needs at least one prompt token"
            )

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask)


@dataclass
class MicroBatch:
    """One forward pass: model inputs plus the N scored target tokens."""

    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T] 0/1 padding mask, or [B, 1, T, T] additive float
    pred_index: torch.Tensor  # [N, 2] (row, position) whose logits score a target token
    targets: torch.Tensor  # [N] token ids
    old_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    seq_index: torch.Tensor  # [N] index into the `sequences` list passed to pack()
    token_index: torch.Tensor  # [N] index of the target in sequences[seq_index].tokens
    num_tokens: int  # real (non-pad) tokens fed to the model
    tree_layout: TreeLayout | None = None  # a trie row's segments (tree_attention.py)

    @property
    def num_targets(self) -> int:
        return int(self.targets.shape[0])

    @property
    def padded_tokens(self) -> int:
        """B * T: what the model actually computes over, padding included."""
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            pred_index=self.pred_index.to(device),
            targets=self.targets.to(device),
            old_logprobs=self.old_logprobs.to(device),
            advantages=self.advantages.to(device),
            seq_index=self.seq_index.to(device),
            token_index=self.token_index.to(device),
            num_tokens=self.num_tokens,
            tree_layout=self.tree_layout,
        )


@dataclass(frozen=True)
class MergeStats:
    """Tokens the model would see call by call vs. after merging and packing."""

    tokens_naive: int  # sum of len(prompt + completion) over calls
    tokens_packed: int  # real tokens fed to the model after merging/packing
    tokens_padded: int  # B * T summed over micro-batches (what is computed, padding included)

    @property
    def ratio(self) -> float:
        """tokens_naive / tokens_packed: > 1 means merging saved work."""
        return self.tokens_naive / self.tokens_packed if self.tokens_packed else 1.0

    def scalars(self) -> dict[str, float]:
        return {
            "merge/tokens_naive": float(self.tokens_naive),
            "merge/tokens_packed": float(self.tokens_packed),
            "merge/tokens_padded": float(self.tokens_padded),
            "merge/ratio": self.ratio,
        }


def merge_stats(sequences_naive: list[TrainSequence], microbatches: list[MicroBatch]) -> MergeStats:
    """Figures for the step scalars; ``sequences_naive`` are the ``mode="off"`` sequences."""
    return MergeStats(
        tokens_naive=sum(len(s.tokens) for s in sequences_naive),
        tokens_packed=sum(mb.num_tokens for mb in microbatches),
        tokens_padded=sum(mb.padded_tokens for mb in microbatches),
    )


# ----------------------------------------------------------------------------- timelines


def timeline_sequences(traj: Trajectory, advantage: float, mode: MergeMode) -> list[TrainSequence]:
    """The training sequences of one trajectory (see the module docstring for the modes)."""
    sequences: list[TrainSequence] = []
    for call_index, call in enumerate(traj.calls):
        if len(call.completion_logprobs) != len(call.completion_ids):
            raise ValueError(
                f"trajectory {traj.id} call {call_index}: {len(call.completion_ids)} completion "
                f"ids but {len(call.completion_logprobs)} logprobs; they must match one to one"
            )
        if not call.completion_ids:
            continue  # nothing generated, nothing to score
        if not call.prompt_ids:
            raise ValueError(
                f"trajectory {traj.id} call {call_index}: empty prompt_ids; the first completion "
                "token needs at least one prompt token to be scored from"
            )
        base = _longest_extendable(sequences, call.prompt_ids) if mode != "off" else None
        if base is None:
            base = TrainSequence(
                tokens=[],
                loss_mask=[],
                old_logprobs=[],
                advantage=advantage,
                trajectory_id=traj.id,
                group_id=traj.group_id,
            )
            sequences.append(base)
        context = call.prompt_ids[len(base.tokens) :]  # new, unscored context
        base.tokens.extend(context)
        base.loss_mask.extend([False] * len(context))
        base.old_logprobs.extend([0.0] * len(context))
        base.tokens.extend(call.completion_ids)
        base.loss_mask.extend([True] * len(call.completion_ids))
        base.old_logprobs.extend(float(lp) for lp in call.completion_logprobs)
    return sequences


def _longest_extendable(sequences: list[TrainSequence], prompt: list[int]) -> TrainSequence | None:
    """The longest sequence whose full tokens are a prefix of ``prompt`` (token ids compared)."""
    best: TrainSequence | None = None
    for seq in sequences:
        n = len(seq.tokens)
        if n <= len(prompt) and prompt[:n] == seq.tokens and (best is None or n > len(best.tokens)):
            best = seq
    return best


# ----------------------------------------------------------------------------- packing


def pack(
    sequences: list[TrainSequence],
    mode: MergeMode,
    max_tokens_per_microbatch: int,
    dtype: torch.dtype = torch.float32,
) -> list[MicroBatch]:
    """Lay ``sequences`` out as micro-batches of at most ``max_tokens_per_microbatch`` tokens.

    ``dtype`` is the model's compute dtype: the tree mask's "blocked" value is
    ``torch.finfo(dtype).min`` (token_logprobs re-makes it if the model's dtype differs).
    A single sequence longer than the budget gets a micro-batch of its own.
    """
    if max_tokens_per_microbatch < 1:
        raise ValueError(
            f"max_tokens_per_microbatch ({max_tokens_per_microbatch}) must be at least 1"
        )
    if mode == "tree":
        # A row of one sequence has no branches: lay it out as ``linear`` does (2-D mask),
        # which lets attention kernels take their causal path (half the score blocks) and
        # skips building a T x T mask; the arithmetic is the same.
        return [
            _padded_microbatch(sequences, row) if len(row) == 1
            else _tree_microbatch(sequences, row, dtype)
            for row in _tree_rows(sequences, max_tokens_per_microbatch)
        ]
    return [
        _padded_microbatch(sequences, rows)
        for rows in _padded_groups(sequences, max_tokens_per_microbatch)
    ]


def _padded_groups(sequences: list[TrainSequence], budget: int) -> list[list[int]]:
    """Group sequence indices, longest first, so that rows * longest <= budget."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].tokens))
    groups: list[list[int]] = []
    for i in order:
        # sorted longest first, so a group's padded width is the length of its first member
        if groups and (len(groups[-1]) + 1) * len(sequences[groups[-1][0]].tokens) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _padded_microbatch(sequences: list[TrainSequence], rows: list[int]) -> MicroBatch:
    width = max(len(sequences[i].tokens) for i in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]; pad id is masked out
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]
    targets = _Targets()
    for row, i in enumerate(rows):
        seq = sequences[i]
        n = len(seq.tokens)
        input_ids[row, :n] = torch.tensor(seq.tokens, dtype=torch.long)
        attention_mask[row, :n] = 1
        position_ids[row, :n] = torch.arange(n)
        for t in range(1, n):
            if seq.loss_mask[t]:
                targets.add(row=row, pos=t - 1, seq=seq, seq_index=i, token_index=t)
    return targets.build(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        num_tokens=sum(len(sequences[i].tokens) for i in rows),
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _tree_rows(sequences: list[TrainSequence], budget: int) -> list[list[int]]:
    """Group sequence indices into trie rows of at most ``budget`` distinct tokens.

    Sequences are sorted lexicographically by tokens, so each one shares the most with its
    predecessor: a new member adds ``len - common_prefix(previous, new)`` trie nodes.
    """
    order = sorted(range(len(sequences)), key=lambda i: sequences[i].tokens)
    rows: list[list[int]] = []
    row_tokens = 0
    for i in order:
        tokens = sequences[i].tokens
        if rows:
            added = len(tokens) - _common_prefix(sequences[rows[-1][-1]].tokens, tokens)
            if row_tokens + added <= budget:
                rows[-1].append(i)
                row_tokens += added
                continue
        rows.append([i])
        row_tokens = len(tokens)
    return rows


def _tree_microbatch(
    sequences: list[TrainSequence], row: list[int], dtype: torch.dtype
) -> MicroBatch:
    """One row holding the token trie of ``row`` (indices sorted lexicographically by tokens).

    Nodes are created while inserting sequences in lexicographic order, so creation order is
    a depth-first preorder: every subtree occupies a contiguous span [j, end[j]) of the row.
    Hence token k may attend to token j iff j <= k < end[j] (j is k's ancestor or k itself).
    """
    node_token: list[int] = []
    node_parent: list[int] = []
    node_depth: list[int] = []
    children: list[dict[int, int]] = []
    root_children: dict[int, int] = {}
    paths: list[list[int]] = []  # per row member: trie node of each of its tokens
    for i in row:
        path: list[int] = []
        level, parent = root_children, -1
        for depth, tok in enumerate(sequences[i].tokens):
            node = level.get(tok)
            if node is None:
                node = len(node_token)
                node_token.append(tok)
                node_parent.append(parent)
                node_depth.append(depth)
                children.append({})
                level[tok] = node
            path.append(node)
            level, parent = children[node], node
        paths.append(path)

    n = len(node_token)
    end = list(range(1, n + 1))  # end[j]: one past the last node of j's subtree
    for j in range(n - 1, -1, -1):  # children have larger ids than parents
        p = node_parent[j]
        if p >= 0:
            end[p] = max(end[p], end[j])
    idx = torch.arange(n)
    end_t = torch.tensor(end, dtype=torch.long)
    visible = (idx[None, :] <= idx[:, None]) & (idx[:, None] < end_t[None, :])  # [T, T] (q, k)
    mask = torch.zeros(n, n, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)

    targets = _Targets()
    for i, path in zip(row, paths):
        seq = sequences[i]
        for t in range(1, len(seq.tokens)):
            if seq.loss_mask[t]:
                targets.add(row=0, pos=path[t - 1], seq=seq, seq_index=i, token_index=t)
    return targets.build(
        input_ids=torch.tensor([node_token], dtype=torch.long),  # [1, T]
        position_ids=torch.tensor([node_depth], dtype=torch.long),  # [1, T]
        attention_mask=mask[None, None],  # [1, 1, T, T]
        num_tokens=n,
        tree_layout=_segments(node_parent, children),
    )


def _segments(node_parent: list[int], children: list[dict[int, int]]) -> TreeLayout:
    """Cut the preorder trie row into runs of nodes without a branch (tree_attention.py).

    A node starts a segment unless it is the only child of its parent; an only child comes
    right after its parent in preorder, so every segment is a contiguous span of the row.
    """
    bounds: list[int] = []
    parents: list[int] = []
    segment_of: list[int] = []  # per node
    for j, p in enumerate(node_parent):
        if p < 0 or len(children[p]) > 1:
            bounds.append(j)
            parents.append(segment_of[p] if p >= 0 else -1)
        segment_of.append(len(parents) - 1)
    return TreeLayout(bounds=(*bounds, len(node_parent)), parents=tuple(parents))


class _Targets:
    """Accumulates scored targets of one micro-batch, then builds the MicroBatch."""

    def __init__(self) -> None:
        self.pred: list[tuple[int, int]] = []
        self.targets: list[int] = []
        self.old_logprobs: list[float] = []
        self.advantages: list[float] = []
        self.seq_index: list[int] = []
        self.token_index: list[int] = []

    def add(self, row: int, pos: int, seq: TrainSequence, seq_index: int, token_index: int) -> None:
        self.pred.append((row, pos))
        self.targets.append(seq.tokens[token_index])
        self.old_logprobs.append(seq.old_logprobs[token_index])
        self.advantages.append(seq.advantage)
        self.seq_index.append(seq_index)
        self.token_index.append(token_index)

    def build(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        num_tokens: int,
        tree_layout: TreeLayout | None = None,
    ) -> MicroBatch:
        return MicroBatch(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            pred_index=torch.tensor(self.pred, dtype=torch.long).reshape(-1, 2),  # [N, 2]
            targets=torch.tensor(self.targets, dtype=torch.long),  # [N]
            old_logprobs=torch.tensor(self.old_logprobs, dtype=torch.float32),  # [N]
            advantages=torch.tensor(self.advantages, dtype=torch.float32),  # [N]
            seq_index=torch.tensor(self.seq_index, dtype=torch.long),  # [N]
            token_index=torch.tensor(self.token_index, dtype=torch.long),  # [N]
            num_tokens=num_tokens,
            tree_layout=tree_layout,
        )
