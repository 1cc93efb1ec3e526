"""HF transformers engine: continuous batching on the trainer's weights (its model object,
or a replica: replica.py).

One worker thread owns generation and runs a decode loop over the model's forward:

* **Continuous batching.** Requests join the running batch between decode steps, and a
  reply leaves it the step it ends, so a request never waits for another's long reply and
  the batch stays full while rollouts come and go (`max_batch_size` rows at most).
* **Shared prompts are computed once.** A GRPO group asks for G completions of the same
  prompt at about the same time; identical prompts are prefilled once and their KV rows
  copied. On a CPU the prompt is most of the work: 16 rollouts of an 80-token prompt and
  24 new tokens are 1,280 prompt tokens against 384 new ones, and deduplicated 160
  against 384.
* **Earlier turns are not computed again.** The KV of every prompt prefilled and of every
  finished reply (prompt + generated tokens) is kept in one cache per model version
  (`_KVCache`, at most `KV_CACHE_BYTES`, least recently used out first). A request starts
  from the entry with the longest common token prefix with its prompt and prefills only
  the rest, at the positions that follow: a group member that arrives a step late reuses
  the whole prompt, and a conversation's next turn (the last prompt + the reply + the
  environment's answer) reuses the turns before it. The prefix is matched token by token,
  not as a whole, because the re-tokenized conversation may differ from the sampled
  tokens near the join (a stop token, the chat template's separators); a partial match
  shorter than `MIN_REUSE_TOKENS` is not worth the copy. The cache empties when the
  version changes, so every token of a reply still comes from one version. Prompts
  admitted together that share an uncached prefix (a group's next turns after an
  optimizer step: the same conversation start, then each its own reply and answer) have
  that prefix computed once, as an entry of its own, and prefill only their own rest.
* **Exact versions.** The worker holds the weights lock while any reply is in flight, so
  every token of a reply comes from one model version. When the trainer (or a checkpoint
  or weight snapshot) waits for the lock, the worker admits nobody new, finishes the
  replies in flight and lets go; queued requests start at the next version. On a replica
  that publishes staged versions (`staged`, replica.py) the trainer does not wait: while a
  staged version is pending the worker admits nobody new, and once the batch has drained
  it applies that version under the lock before it serves again.
* **Per-request sampling.** Temperature (0: greedy) and top_p are applied per row, so one
  batch serves every sampling setting. A request with a seed (the OpenAI `seed`) draws its
  tokens from a generator of its own, so its reply does not depend on what else shares
  the batch or on torch's shared stream (the logits can still differ in the last bits
  with the batch's other rows). Logprobs are of the untempered policy (log_softmax
  of the raw logits) at each sampled token: at temperature 1 the behaviour logprobs
  PPO-clip needs.
* **Its own CPU threads** (`generation.threads`): generation and the trainer's
  forward/backward run at the same time in one process, and two torch thread pools that
  each take every core slow both down several times on a small machine. With
  `train.lend_threads` (off by default), the worker also takes the trainer's threads while
  the trainer computes no step (it waits for groups), checked before each forward
  (`lent_threads`; `generate/lent_s` in the step row is the busy time spent with them).

* **Faults fail requests, not the engine.** A forward that raises fails the replies it
  touched, and the next batch starts from an empty batch state (the failed batch's KV
  must not sit beside the next one's). Anything else that raises in the worker fails what
  it holds and queues, and the worker serves on: a dead worker would leave every later
  caller waiting, and a server in that state neither trains nor drains.

`batch_wait_ms` is how long an idle engine waits for company before it starts a batch (the
rest of a group's requests); later arrivals join at the next step anyway.

Figures (`take_figures`, logged with each optimizer step as `generate/...`):
`prompt_tokens` of the requests admitted, `prefill_tokens` actually computed, and
`reused_tokens` taken from the cache instead (per distinct prompt of an admission; the
rest of `prompt_tokens` is identical prompts admitted together, computed once).

Left out: paged KV (the batch's cache is one left-padded tensor per layer, trimmed as rows
leave; cached entries are copies, so a shared prefix is held once per entry), a prefix
tree over the cached entries (lookup compares the prompt with each entry: a few dozen
entries of a few hundred tokens), speculative decoding.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache

from jetctl.server.engines.base import EngineLoad, GenRequest, GenResult

log = logging.getLogger("jetctl.server.engine")

# KV kept of earlier prompts and replies at the serving version. SmolLM2-135M in float32
# holds 45 KiB per token (30 layers x K and V x 3 heads x 64 x 4 B), so 256 MiB is ~5,800
# tokens, half the model's own weights: in the quickstart (prompts of ~100 tokens, replies
# of up to 24) the entries of the last ~25 requests, where a conversation's next turn needs
# its reply's entry only for the moment the environment takes to answer.
KV_CACHE_BYTES = 256 * 2**20
MIN_REUSE_TOKENS = 16  # a shorter partial match is prefilled anew (not worth the copies)


@dataclass
class _Pending:
    req: GenRequest
    future: asyncio.Future[GenResult]
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def cancelled(self) -> bool:
        return self.future.done()

    def finish(self, result: GenResult | BaseException) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's event loop is closed: nobody waits for this
            pass


@dataclass
class _Row:
    """One reply in the batch."""

    pending: _Pending
    stops: frozenset[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None  # a seeded request's own sampling stream


@dataclass
class _Prefilled:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [1, H, T, D]
    logits: torch.Tensor  # [V], the prediction after the T tokens

    @property
    def nbytes(self) -> int:
        return self.logits.nbytes + sum(k.nbytes + v.nbytes for k, v in self.kv)


@dataclass
class _Plan:
    """A distinct prompt of an admission: `reused` tokens of `cached`'s KV, the rest computed."""

    prompt: tuple[int, ...]
    cached: _Prefilled | None
    reused: int

    @property
    def suffix(self) -> tuple[int, ...]:
        return self.prompt[self.reused:]


@dataclass
class EngineFigures:
    """Counters since the last `take_figures` (the trainer logs them with each step)."""

    requests: int = 0
    decode_steps: int = 0
    rows: int = 0  # sum over decode steps of the rows in the batch
    tokens: int = 0
    prompt_tokens: int = 0  # of the requests admitted
    prefill_tokens: int = 0  # actually computed (shared prompts once, cached prefixes never)
    reused_tokens: int = 0  # taken from the KV of earlier prompts and replies (same version)
    busy_s: float = 0.0
    lent_s: float = 0.0  # of busy_s, with threads the trainer lent (train.lend_threads)


class HFEngine:
    """Continuous batching onto one HF model shared with the trainer."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        weights_lock: Any,  # threading.Lock or jetctl.server.locks.WeightsLock
        version: Callable[[], int],
        max_batch_size: int,
        batch_wait_ms: float,
        on_batch: Callable[[int, int, float], None] | None = None,
        threads: int | None = None,
        kv_cache_bytes: int = KV_CACHE_BYTES,
        staged: Any = None,  # a Replica publishing staged versions (pending, apply_staged)
        lent_threads: Callable[[], int] | None = None,
    ) -> None:
        self.model = model
        self._staged = staged
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self._lock = weights_lock
        self._version = version
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._on_batch = on_batch  # (rows in the step, tokens generated, seconds)
        self.threads = threads
        # threads another worker lends right now (train.lend_threads: the trainer's, while
        # it computes no step); checked before each forward
        self.lent_threads = lent_threads
        self._threads_now = 0  # the worker's torch threads, as last set
        self.device = torch.device("cpu")  # the model's, read when the worker starts
        self._cache_kwarg = "cache"
        self._incoming: list[_Pending] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._rows: list[_Row] = []
        self._kv = _KVCache(kv_cache_bytes)  # the worker's; read and written under the lock
        self._figures = EngineFigures()
        self._figures_lock = threading.Lock()
        self.busy_since: float | None = None  # monotonic start of the forward under way

    # --- the asyncio side ------------------------------------------------------------

    def start(self, name: str = "engine") -> None:
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._cond:
            self._stopping = True
            queued, self._incoming = self._incoming, []
            self._cond.notify_all()
        error = RuntimeError("engine stopped")
        for p in queued + [r.pending for r in self._rows]:
            p.finish(error)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    def load(self) -> EngineLoad:
        return EngineLoad(len(self._rows), self.max_batch_size, len(self._incoming))

    async def generate(self, req: GenRequest) -> GenResult:
        if self._thread is None:
            raise RuntimeError("engine not started")
        loop = asyncio.get_running_loop()
        pending = _Pending(req, loop.create_future(), loop)
        with self._cond:
            if self._stopping:
                raise RuntimeError("engine stopped")
            self._incoming.append(pending)
            self._cond.notify_all()
        return await pending.future

    def take_figures(self) -> dict[str, float]:
        """Generation figures since the last call, as step-log scalars (`generate/...`)."""
        with self._figures_lock:
            f, self._figures = self._figures, EngineFigures()
        return {
            "generate/requests": float(f.requests),
            "generate/tokens": float(f.tokens),
            "generate/decode_steps": float(f.decode_steps),
            "generate/batch_size_mean": f.rows / f.decode_steps if f.decode_steps else 0.0,
            "generate/prefill_tokens": float(f.prefill_tokens),
            "generate/prompt_tokens": float(f.prompt_tokens),
            "generate/reused_tokens": float(f.reused_tokens),
            "generate/busy_s": f.busy_s,
            "generate/lent_s": f.lent_s,
        }

    # --- the worker thread -----------------------------------------------------------

    def _work(self) -> None:
        self.device = next(self.model.parameters()).device
        self._cache_kwarg = _cache_kwarg(self.model)
        self._use_threads()
        while True:
            with self._cond:
                while not self._incoming and not self._stopping:
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    break
            if self.batch_wait_s > 0:  # let the rest of a group's requests arrive
                time.sleep(self.batch_wait_s)
            self._lock.acquire()
            try:
                if self._staged is not None:  # nothing in flight: take the newest weights
                    self._staged.apply_staged()
                self._serve_one_version()
            except Exception as exc:  # a dead worker would leave every caller waiting
                log.exception("the engine's worker failed outside a forward; what it held "
                              "fails and it serves on")
                self._fail_held(exc)  # the queue too: a fault before admission would repeat
            finally:
                self._lock.release()
        self._fail_leftovers()

    def _fail_leftovers(self) -> None:
        """After `stop`: fail what the worker still holds. A request taken off the queue is
        in no list `stop` reads until its prefill ends and it joins the batch; one admitted
        while `stop` ran would otherwise wait forever."""
        self._fail_held(RuntimeError("engine stopped"))  # a no-op for what `stop` failed

    def _fail_held(self, error: BaseException) -> None:
        """Fail every queued request and every row of the batch with `error`."""
        with self._cond:
            queued, self._incoming = self._incoming, []
        rows, self._rows = self._rows, []
        for p in queued + [r.pending for r in rows]:
            p.finish(error)

    def _serve_one_version(self) -> None:
        """Serve until the batch empties; admit newcomers unless someone waits for the lock."""
        version = self._version()
        self._kv.serve(version)  # KV of another version is forgotten
        state = _BatchState()
        while not self._stopping:
            if self._may_admit():
                room = self.max_batch_size - len(self._rows)
                with self._cond:
                    admitted, self._incoming = self._incoming[:room], self._incoming[room:]
                admitted = [p for p in admitted if not p.cancelled]
                admit = partial(self._admit, state, admitted)
                if admitted and not self._run_guarded(admit, admitted):
                    state = _BatchState()  # the failed batch's KV must not stay
            self._drop_cancelled(state)
            if not self._rows:
                return
            if not self._run_guarded(partial(self._decode_step, state, version), None):
                state = _BatchState()  # the failed batch's KV must not stay

    def _may_admit(self) -> bool:
        """Newcomers join unless someone waits for the weights. With a plain lock, which
        cannot tell, only an empty batch takes newcomers (no one waits forever)."""
        if self._staged is not None and self._staged.pending():
            return False  # drain, then apply the staged version (_work)
        waiting = getattr(self._lock, "waiting", None)
        return not self._rows if waiting is None else waiting == 0

    def _use_threads(self) -> int:
        """Set this worker's torch threads: its own plus those lent now; returns the lent."""
        lent = self.lent_threads() if self.lent_threads is not None and self.threads else 0
        want = (self.threads or 0) + lent
        if want and want != self._threads_now:
            torch.set_num_threads(want)  # this thread's pool only
            self._threads_now = want
        return lent

    def _run_guarded(self, fn: Callable[[], None], admitted: list[_Pending] | None) -> bool:
        """A failed forward fails the replies it touched, not the engine; False if it did."""
        lent = self._use_threads()  # per forward: the trainer may have started or ended a step
        t0 = time.monotonic()
        self.busy_since = t0
        try:
            with torch.inference_mode():
                fn()
        except Exception as exc:  # noqa: BLE001  # the callers get it; the engine serves on
            victims = [r.pending for r in self._rows] + (admitted or [])
            self._rows = []
            for p in victims:
                p.finish(exc)
            return False
        finally:
            self.busy_since = None
            took = time.monotonic() - t0
            with self._figures_lock:
                self._figures.busy_s += took
                if lent:
                    self._figures.lent_s += took
        return True

    # --- admission: prefill and merge ------------------------------------------------

    def _admit(self, state: _BatchState, admitted: list[_Pending]) -> None:
        keys = [tuple(p.req.prompt_ids) for p in admitted]
        distinct = list(dict.fromkeys(keys))
        plans = [self._kv.plan(key) for key in distinct]
        computed: list[_Plan] = []
        rounds = _shared_prefixes(plans)
        shared_kv: dict[tuple[int, ...], _Prefilled] = {}  # this admission's, cached or not
        for shared in rounds:  # prefixes several prompts share: computed once, then reused
            prefix_plans = [p for p in (self._kv.plan(k, shared_kv) for k in shared) if p.suffix]
            for plan, pre in zip(prefix_plans, self._prefill(prefix_plans)):
                shared_kv[plan.prompt] = self._kv.put(plan.prompt, pre)
            computed += prefix_plans
        if rounds:
            plans = [self._kv.plan(key, shared_kv) for key in distinct]
        todo = [plan for plan in plans if plan.suffix]
        computed += todo
        ready = {plan.prompt: plan.cached for plan in plans if not plan.suffix}
        for plan, pre in zip(todo, self._prefill(todo) if todo else []):
            ready[plan.prompt] = self._kv.put(plan.prompt, pre)
        with self._figures_lock:
            self._figures.requests += len(admitted)
            self._figures.prompt_tokens += sum(len(k) for k in keys)
            self._figures.prefill_tokens += sum(len(plan.suffix) for plan in computed)
            self._figures.reused_tokens += sum(plan.reused for plan in plans)
        state.merge([_must(ready[k]) for k in keys], self.device)
        for p in admitted:
            stops = frozenset(self.eos_token_ids) | frozenset(p.req.stop_token_ids)
            seed = p.req.seed
            generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
            self._rows.append(_Row(p, stops, generator=generator))

    def _prefill(self, plans: list[_Plan]) -> list[_Prefilled]:
        """One forward over the prompts' uncached suffixes, each on top of its cached prefix;
        each prompt's whole KV and logits.

        Row i of the forward: its prefix's KV left-padded to the longest prefix (W), then
        its suffix left-padded to the longest suffix (S), so padding may sit between the
        two; the mask hides it and the positions continue the prefix's (n_i, n_i + 1, ...).
        """
        prefix = max(plan.reused for plan in plans)  # W
        width = max(len(plan.suffix) for plan in plans)  # S
        ids = torch.full((len(plans), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(plans), prefix + width), dtype=torch.long)
        positions = torch.zeros((len(plans), width), dtype=torch.long)
        for i, plan in enumerate(plans):
            n, s = plan.reused, len(plan.suffix)
            ids[i, width - s:] = torch.tensor(plan.suffix)
            mask[i, prefix - n:prefix] = 1
            mask[i, prefix + width - s:] = 1
            positions[i, width - s:] = torch.arange(n, n + s)
        cache = _prefix_cache(plans, prefix)
        out = self.model(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device), use_cache=True, logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        logits = out.logits[:, -1].float()  # [P, V]
        result = []
        for i, plan in enumerate(plans):
            n, s = plan.reused, len(plan.suffix)
            kv = [  # this prompt's prefix and suffix, without the padding
                (torch.cat([k[i : i + 1, :, prefix - n:prefix], k[i : i + 1, :, -s:]], dim=2),
                 torch.cat([v[i : i + 1, :, prefix - n:prefix], v[i : i + 1, :, -s:]], dim=2))
                for k, v, *_ in cache
            ]
            result.append(_Prefilled(kv, logits[i]))
        return result

    # --- one decode step ---------------------------------------------------------------

    def _decode_step(self, state: _BatchState, version: int) -> None:
        t0 = time.monotonic()
        rows = self._rows
        logits = state.logits  # [B, V], the prediction for each row's next token
        assert logits is not None
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = self._sample(logits, [r.pending.req for r in rows],
                              [r.generator for r in rows])  # [B]
        chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        keep: list[int] = []
        done: list[tuple[_Row, GenResult]] = []
        for i, (row, tok, lp) in enumerate(zip(rows, tokens.tolist(), chosen)):
            row.ids.append(tok)
            row.logprobs.append(lp)
            limit = max(row.pending.req.max_tokens, 1)
            if tok in row.stops:
                done.append((row, GenResult(row.ids, row.logprobs, version, "stop")))
            elif len(row.ids) >= limit:
                done.append((row, GenResult(row.ids, row.logprobs, version, "length")))
            else:
                keep.append(i)
                continue
            # the conversation's next turn starts with this: the prompt and the reply (its
            # last token never went through the model; the logits that chose it are kept)
            key = tuple(row.pending.req.prompt_ids) + tuple(row.ids[:-1])
            self._kv.put(key, state.row(i))
        with self._figures_lock:
            self._figures.decode_steps += 1
            self._figures.rows += len(rows)
            self._figures.tokens += len(rows)
        if self._on_batch:  # before the replies go out: a caller sees its own step counted
            self._on_batch(len(rows), len(rows), time.monotonic() - t0)
        for row, result in done:
            row.pending.finish(result)
        if len(keep) < len(rows):
            state.select(keep)
            self._rows = [rows[i] for i in keep]
        if self._rows:
            next_ids = tokens[keep] if len(keep) < len(rows) else tokens
            state.logits = self._forward_one(state, next_ids)

    def _forward_one(self, state: _BatchState, next_ids: torch.Tensor) -> torch.Tensor:
        assert state.mask is not None and state.positions is not None
        state.mask = torch.cat(
            [state.mask, torch.ones((state.mask.shape[0], 1), dtype=state.mask.dtype,
                                    device=state.mask.device)], dim=-1)
        cache = state.cache
        out = self.model(
            input_ids=next_ids.unsqueeze(-1).to(self.device), attention_mask=state.mask,
            position_ids=state.positions.unsqueeze(-1), use_cache=True,
            **{self._cache_kwarg: cache},
        )
        state.positions = state.positions + 1
        logits: torch.Tensor = out.logits[:, -1].float()
        return logits

    def _sample(
        self, logits: torch.Tensor, reqs: list[GenRequest],
        generators: list[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """Per-row temperature and top_p; greedy rows take the argmax. A row with a
        generator (a seeded request) draws from it, the others from torch's shared stream."""
        temps = torch.tensor([r.temperature for r in reqs], device=logits.device)
        greedy = logits.argmax(dim=-1)
        if bool((temps <= 0).all()):
            return greedy
        scaled = logits / temps.clamp(min=1e-6).unsqueeze(-1)
        top_p = torch.tensor([r.top_p for r in reqs], device=logits.device)
        if bool((top_p < 1.0).any()):
            # nucleus: keep the smallest set of most likely tokens whose mass reaches top_p
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
            drop = before >= top_p.unsqueeze(-1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
        probs = scaled.softmax(dim=-1)
        sampled = torch.multinomial(probs, 1).squeeze(-1)
        for i, generator in enumerate(generators or ()):
            if generator is not None:
                sampled[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
        return torch.where(temps > 0, sampled, greedy)

    def _drop_cancelled(self, state: _BatchState) -> None:
        """Rows whose caller went away (a rollout that ended) leave at once."""
        keep = [i for i, r in enumerate(self._rows) if not r.pending.cancelled]
        if len(keep) < len(self._rows):
            state.select(keep)
            self._rows = [self._rows[i] for i in keep]


class _KVCache:
    """KV of token sequences computed at one model version (prompts prefilled, replies
    finished), keyed by their tokens; least recently used out first beyond `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.version: int | None = None
        self.entries: OrderedDict[tuple[int, ...], _Prefilled] = OrderedDict()
        self.nbytes = 0

    def serve(self, version: int) -> None:
        """The worker holds the weights of `version` now: forget the KV of any other."""
        if version != self.version:
            self.entries.clear()
            self.nbytes = 0
            self.version = version

    def plan(
        self, prompt: tuple[int, ...], also: dict[tuple[int, ...], _Prefilled] | None = None,
    ) -> _Plan:
        """Start `prompt` from the entry sharing its longest prefix (of the cache's and of
        `also`, KV of this version the caller holds): all of an equal entry (whose logits
        predict the first new token), else at most all but the prompt's last token (its
        logits must be computed); nothing when that is under MIN_REUSE_TOKENS."""
        best, best_key = _Plan(prompt, None, 0), None
        for key, entry in [*self.entries.items(), *(also or {}).items()]:
            common = _common_prefix(key, prompt)
            reused = common if common == len(key) == len(prompt) else min(common, len(prompt) - 1)
            if reused > best.reused:
                best, best_key = _Plan(prompt, entry, reused), key
        if best.suffix and best.reused < MIN_REUSE_TOKENS:
            return _Plan(prompt, None, 0)
        if best_key is not None and best_key in self.entries:
            self.entries.move_to_end(best_key)
        return best

    def put(self, key: tuple[int, ...], pre: _Prefilled) -> _Prefilled:
        """Keep a copy of `pre` (the KV of `key`), unless it alone exceeds the bound; the
        kept copy, or `pre`."""
        if key in self.entries:  # the same tokens at the same version: the same KV
            self.entries.move_to_end(key)
            return self.entries[key]
        entry = _Prefilled([(k.clone(), v.clone()) for k, v in pre.kv], pre.logits.clone())
        if entry.nbytes > self.max_bytes:
            return pre
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            _, gone = self.entries.popitem(last=False)
            self.nbytes -= gone.nbytes
        return entry


class _BatchState:
    """The batch's left-padded KV cache, attention mask, next positions and next logits."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, T]
        self.positions: torch.Tensor | None = None  # [B], position of each row's next token
        self.logits: torch.Tensor | None = None  # [B, V]

    def merge(self, new: list[_Prefilled], device: torch.device) -> None:
        """Append rows (one per prefilled prompt, repeats allowed) to the batch."""
        width = max(p.kv[0][0].shape[2] for p in new)
        old_width = self.mask.shape[1] if self.mask is not None else 0
        total = max(width, old_width)
        old = [(k, v) for k, v, *_ in self.cache] if self.cache is not None else []
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in range(len(new[0].kv)):
            ks = [_left_pad(p.kv[layer][0], total) for p in new]
            vs = [_left_pad(p.kv[layer][1], total) for p in new]
            if old:
                ks.insert(0, _left_pad(old[layer][0], total))
                vs.insert(0, _left_pad(old[layer][1], total))
            layers.append((torch.cat(ks, dim=0), torch.cat(vs, dim=0)))
        masks = [
            torch.cat([torch.zeros(total - p.kv[0][0].shape[2], dtype=torch.long),
                       torch.ones(p.kv[0][0].shape[2], dtype=torch.long)]).to(device)
            for p in new
        ]
        new_mask = torch.stack(masks)
        lengths = torch.tensor([p.kv[0][0].shape[2] for p in new], device=device)
        new_logits = torch.stack([p.logits for p in new])
        if self.mask is not None and self.positions is not None and self.logits is not None:
            old_mask = torch.cat(
                [torch.zeros((self.mask.shape[0], total - old_width), dtype=self.mask.dtype,
                             device=device), self.mask], dim=-1)
            self.mask = torch.cat([old_mask, new_mask])
            self.positions = torch.cat([self.positions, lengths])
            self.logits = torch.cat([self.logits, new_logits])
        else:
            self.mask, self.positions, self.logits = new_mask, lengths, new_logits
        self.cache = DynamicCache(ddp_cache_data=layers)

    def row(self, i: int) -> _Prefilled:
        """Row i's KV without its left padding (views) and its next-token logits."""
        assert self.cache is not None and self.mask is not None and self.logits is not None
        length = int(self.mask[i].sum())
        kv = [(k[i : i + 1, :, -length:], v[i : i + 1, :, -length:]) for k, v, *_ in self.cache]
        return _Prefilled(kv, self.logits[i])

    def select(self, keep: list[int]) -> None:
        """Keep these rows; trim the left padding no row needs any more."""
        if not keep:
            self.cache = self.mask = self.positions = self.logits = None
            return
        assert self.cache is not None and self.mask is not None
        index = torch.tensor(keep, device=self.mask.device)
        self.mask = self.mask[index]
        assert self.positions is not None and self.logits is not None
        self.positions = self.positions[index]
        self.logits = self.logits[index]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        self.mask = self.mask[:, start:]
        layers = [(k[index, :, start:], v[index, :, start:]) for k, v, *_ in self.cache]
        self.cache = DynamicCache(ddp_cache_data=layers)


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, H, width, D], zeros on the left (masked out)."""
    missing = width - t.shape[2]
    if missing <= 0:
        return t
    pad = torch.zeros((*t.shape[:2], missing, t.shape[3]), dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=2)


def _prefix_cache(plans: list[_Plan], width: int) -> DynamicCache:
    """The plans' reused prefixes as one batch cache, left-padded to `width` (zeros, masked
    out); an empty cache when nothing is reused."""
    if width == 0:
        return DynamicCache()
    like = next(plan.cached for plan in plans if plan.cached is not None)
    layers = []
    for layer, (k0, v0) in enumerate(like.kv):
        ks, vs = [], []
        for plan in plans:
            k, v = plan.cached.kv[layer] if plan.cached is not None else (k0, v0)
            ks.append(_left_pad(k[:, :, :plan.reused], width))
            vs.append(_left_pad(v[:, :, :plan.reused], width))
        layers.append((torch.cat(ks), torch.cat(vs)))
    return DynamicCache(ddp_cache_data=layers)


def _shared_prefixes(plans: list[_Plan]) -> list[list[tuple[int, ...]]]:
    """Prefixes that two or more of an admission's prompts share beyond what the cache gives
    them, in rounds to compute one after the other (no prefix of a round starts another of
    the same round, so each round reuses the rounds before it): a group's next turns after
    an optimizer step emptied the cache share the conversation's start, then each has its
    own reply and answer; two groups share the system prompt and the example before that.

    With the prompts in token order, each branching point of their prefix tree is the
    common prefix of two neighbours. One is kept when it is at least MIN_REUSE_TOKENS
    longer than the cache's reuse for those neighbours and than the kept point above it."""
    order = sorted((plan for plan in plans if plan.suffix), key=lambda plan: plan.prompt)
    points: dict[tuple[int, ...], int] = {}  # branching point -> the reuse below it
    for a, b in itertools.pairwise(order):
        n = _common_prefix(a.prompt, b.prompt)
        floor = max(a.reused, b.reused)
        if n - floor >= MIN_REUSE_TOKENS:
            key = a.prompt[:n]
            points[key] = max(points.get(key, 0), floor)
    kept: list[tuple[int, ...]] = []
    for point in sorted(points, key=len):
        above = max((len(k) for k in kept if point[: len(k)] == k), default=0)
        if len(point) - max(above, points[point]) >= MIN_REUSE_TOKENS:
            kept.append(point)
    rounds: list[list[tuple[int, ...]]] = []
    depth: dict[tuple[int, ...], int] = {}
    for point in kept:  # shortest first: a point's round follows its ancestors'
        d = 1 + max((depth[k] for k in depth if point[: len(k)] == k), default=-1)
        depth[point] = d
        if d == len(rounds):
            rounds.append([])
        rounds[d].append(point)
    return rounds


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _must(pre: _Prefilled | None) -> _Prefilled:
    assert pre is not None  # a prompt without a suffix to compute was found whole
    return pre


def _cache_kwarg(model: Any) -> str:
    """The forward's name for the KV cache: `cache` (transformers 5.2x) or
    `past_key_values` (earlier releases)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"
