"""An engine's own copy of the trainer's model, refreshed after each optimizer step under a deadline.

Engines that do not generate on the trainer's model object (a second GPU, weights in
another dtype, a continuous batching loop that must not see weights change under a
running request, or the hf engine on a LoRA model, whose replica shares the frozen base
with the trainer and owns only a copy of the adapter: `share_frozen`) serve a `Replica`:
a deep copy of the trainer's model on `device` (its parameters in `dtype` when one is
given, `generation.dtype`; each publish casts what it copies), with its own version. After each optimizer step the trainer thread calls
`publish(version)`:

    acquire the engine's gate, at most `timeout_s`    (the engine finishes what it is running)
    copy the trainable tensors trainer -> replica       (LoRA: the adapter only; full: all)
    replica.version = version; release the gate

The gate is whatever the engine holds while it generates (a lock around each `generate`
batch, or a drain of the continuous-batching loop), so every reply is computed entirely at
the version it names. A publish that misses its deadline is logged as an error and retried
once; if both attempts miss, the engine keeps serving the older version (its replies still
name it exactly, and the staleness gate bounds how old it may get) and the next step tries
again. `max_misses` steps in a row without a publish raise `PublishError`: the trainer stops
and the server exits, as for a crash, rather than train on while generation never catches up.

**Staged publishing** (`staged=True`; the hf engine on a replica whose trainable tensors
fit in `STAGE_MAX_BYTES`, e.g. a LoRA adapter): the trainer does not wait for the engine to
finish what it runs. `publish` takes the gate only when it is free at once (an idle
engine); otherwise it copies the trainable tensors into staging buffers (a few MB for an
adapter, milliseconds) and returns, and the engine, which admits nobody new while a staged
version waits (`pending`), drains its batch and applies the newest staged version under its
own gate before it serves again (`apply_staged`). Every reply is still computed entirely at
the version it names; the trainer meanwhile gathers and trains its next step. Measured
reason (py-spy on the quickstart's server, 30 s at 50 Hz): the trainer thread spent 26% of
its samples blocked in the gate's `acquire` while the engine drained, and the interpreter
lock was held in only 19% of samples, so the server was not bound by it. A staged version
the engine has not taken within `timeout_s` when the next is staged counts as a missed
publish, as a missed deadline does.

Left out: copying over a separate CUDA stream while the engine keeps generating; a copy
that hangs inside the device itself is caught by the server's stall watchdog, not here.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

log = logging.getLogger("jetctl.server.engines")

STAGE_MAX_BYTES = 256 * 2**20  # staging buffers beyond this (full fine-tuning): publish waits


class PublishError(RuntimeError):
    """Weights could not reach the engine within the deadline, `max_misses` steps in a row."""


class Gate(Protocol):
    """What the engine holds while it generates; `threading.Lock` is one."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...


@dataclass
class PublishFigures:
    published: int = 0
    missed_attempts: int = 0
    misses_in_a_row: int = 0
    last_s: float = 0.0  # seconds of the last successful publish (gate wait + copy)
    last_copy_s: float = 0.0  # of which the copy
    history_s: list[float] = field(default_factory=list)  # recent publish times (bench)


class Replica:
    """A copy of `source` on `device` that an engine generates from; `publish` refreshes it."""

    def __init__(
        self,
        source: Any,
        *,
        device: str,
        version: int,
        timeout_s: float,
        max_misses: int = 3,
        gate: Gate | None = None,
        dtype: str | None = None,
        staged: bool = False,
        share_frozen: bool = False,
    ) -> None:
        self.source = source
        self.device = torch.device(device)
        # share_frozen (same device, same dtype): the frozen tensors (a LoRA's base) are the
        # trainer's own objects, never copied; only what training changes is the replica's
        memo: dict[int, Any] = {}
        if share_frozen and dtype is None:
            memo = {id(p): p for p in source.parameters() if not p.requires_grad}
        self.model = copy.deepcopy(source, memo).to(self.device)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
            if dtype is not None and p.is_floating_point():
                # parameters only: buffers such as RoPE's inverse frequencies keep their dtype
                p.data = p.data.to(getattr(torch, dtype))
        self.version = version
        self.timeout_s = timeout_s
        self.max_misses = max_misses
        self.gate: Gate = gate if gate is not None else threading.Lock()
        self.figures = PublishFigures()
        self._pairs = self._trainable_pairs()
        # staged publishing: buffers in the replica's dtype, the version they hold, since when
        self._staging_lock = threading.Lock()
        self._staged_version: int | None = None
        self._staged_at = 0.0
        self._staging: list[torch.Tensor] = []
        nbytes = sum(dst.numel() * dst.element_size() for _, dst in self._pairs)
        if staged and nbytes <= STAGE_MAX_BYTES:
            self._staging = [torch.empty_like(dst) for _, dst in self._pairs]
        self.staged = bool(self._staging)

    def _trainable_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(trainer tensor, replica tensor) for every tensor training changes."""
        mine = dict(self.model.named_parameters())
        pairs = [(p, mine[n]) for n, p in self.source.named_parameters() if p.requires_grad]
        if not pairs:
            raise ValueError("the trainer's model has no trainable parameters to publish")
        return pairs

    def serving_version(self) -> int:
        """The version the replica holds; raises while a failed copy left it incomplete."""
        if self.version < 0:
            raise RuntimeError(
                "the engine's weights are incomplete (a publish failed halfway); "
                "the server stops at the trainer's next step"
            )
        return self.version

    def set_gate(self, gate: Gate) -> None:
        """The engine built on this replica says what it holds while generating."""
        self.gate = gate

    @torch.no_grad()
    def copy_weights(self) -> float:
        """Copy the trainable tensors now (the caller holds the gate); returns seconds."""
        t0 = time.perf_counter()
        for src, dst in self._pairs:
            dst.copy_(src, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def pending(self) -> bool:
        """A staged version waits for the engine (it admits nobody new until it applies it)."""
        return self._staged_version is not None

    @torch.no_grad()
    def apply_staged(self) -> None:
        """The engine, holding its gate with nothing in flight: take the staged version."""
        with self._staging_lock:
            version, self._staged_version = self._staged_version, None
            if version is None:
                return
            t0 = time.perf_counter()
            self.version = -1  # a copy that fails halfway leaves no version to claim
            for buf, (_, dst) in zip(self._staging, self._pairs):
                dst.copy_(buf)
            self.version = version
            self.figures.last_copy_s = time.perf_counter() - t0

    @torch.no_grad()
    def _stage(self, version: int, t0: float) -> float:
        """Snapshot the trainer's tensors for the engine to apply; returns seconds."""
        with self._staging_lock:
            f = self.figures
            late = self._staged_version is not None and \
                time.monotonic() - self._staged_at > self.timeout_s
            for buf, (src, _) in zip(self._staging, self._pairs):
                buf.copy_(src)
            caught_up = self._staged_version is None  # the engine took the last one
            if caught_up:
                self._staged_at = time.monotonic()  # since when the engine is behind
            self._staged_version = version  # a newer staged version replaces an older one
        if late:
            f.missed_attempts += 1
            f.misses_in_a_row += 1
            log.error("the engine on %s has not taken a staged version for over %.1fs; it "
                      "still serves version %d", self.device, self.timeout_s, self.version)
            if f.misses_in_a_row >= self.max_misses:
                raise PublishError(
                    f"the engine on {self.device} took no new weights for {self.max_misses} "
                    f"steps in a row (deadline {self.timeout_s:g}s); it still serves version "
                    f"{self.version}. Raise generation.publish_timeout_s or lower "
                    "max_new_tokens")
        elif caught_up:
            f.misses_in_a_row = 0
        return self._published(t0)

    def _published(self, t0: float) -> float:
        f = self.figures
        f.published += 1
        f.last_s = time.perf_counter() - t0
        f.history_s = (f.history_s + [f.last_s])[-64:]
        return f.last_s

    @torch.no_grad()
    def _copy_holding_gate(self, version: int, t0: float) -> float:
        """Copy now (the caller acquired the gate; released here); returns seconds."""
        try:
            with self._staging_lock:
                self._staged_version = None  # older than what is copied now
            self.version = -1  # a copy that fails halfway leaves no version to claim
            self.figures.last_copy_s = self.copy_weights()
            self.version = version
        finally:
            self.gate.release()
        self.figures.misses_in_a_row = 0
        return self._published(t0)

    def publish(self, version: int) -> float:
        """Make `version` (the trainer's weights right now) the replica's; returns seconds.

        Staged (see the module): copied now if the engine is idle, else staged for it.
        Otherwise two attempts of `timeout_s` each; raises `PublishError` after
        `max_misses` steps in a row without a publish.
        """
        t0 = time.perf_counter()
        if self.staged:
            if self.gate.acquire(blocking=False):
                return self._copy_holding_gate(version, t0)
            return self._stage(version, t0)
        for attempt in (1, 2):
            if self.gate.acquire(timeout=self.timeout_s):
                return self._copy_holding_gate(version, t0)
            self.figures.missed_attempts += 1
            log.error(
                "publishing version %d to the engine on %s missed its %.1fs deadline "
                "(attempt %d of 2): the engine did not let go of the weights",
                version, self.device, self.timeout_s, attempt,
            )
        self.figures.misses_in_a_row += 1
        if self.figures.misses_in_a_row >= self.max_misses:
            raise PublishError(
                f"the engine on {self.device} took no new weights for {self.max_misses} steps in "
                f"a row (deadline {self.timeout_s:g}s per attempt); it still serves version "
                f"{self.version}. Raise generation.publish_timeout_s or lower max_new_tokens"
            )
        log.error(
            "the engine keeps serving version %d; the next step publishes again", self.version
        )
        return time.perf_counter() - t0
