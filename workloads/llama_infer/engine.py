"""Continuous batching: requests join and leave the running batch between decode steps.

One :meth:`ServingEngine.step` is one iteration of the engine:

1. **admit** waiting requests into free cache slots (at most ``max_batch`` run at once) and prefill
   them together in one batched forward; each gets its first token (greedy) at once;
2. **decode** one token for every running request (the newcomers included) in one forward;
3. requests that produced EOS or their ``max_new_tokens`` **leave**; their slots are refilled by
   the next admissions.

Sampling is greedy (argmax), as in MLPerf's llama3.1-8b reference. Callbacks report the first token
and the finished request from the thread that calls :meth:`step`; :meth:`submit` may be called
from any thread (LoadGen's issue thread, in a benchmark).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from workloads.llama_infer.decoder import CachedDecoder, KVCache


@dataclass
class Request:
    """One generation request: ``prompt`` token ids and a budget of new tokens."""

    request_id: int
    prompt: Sequence[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # generated so far
    finish_reason: str | None = None  # "eos" or "length" once done
    record_logits: bool = False  # keep each step's logits (equivalence tests)
    # seconds from the engine taking the request up until its prompt tokens were on the device (the
    # prefill batch assembled and copied): what serving waits on its data, set at admission
    data_wait_s: float | None = None
    logits: list[torch.Tensor] = field(default_factory=list)  # float32 (vocab,) per generated token


RequestCallback = Callable[[Request], None]


class ServingEngine:
    """Greedy generation for up to ``max_batch`` concurrent requests over one :class:`KVCache`.

    ``max_len`` bounds prompt + new tokens of a request (the cache's length); requests that do not
    fit are refused by :meth:`submit` with a ``ValueError``.
    """

    def __init__(self, decoder: CachedDecoder, max_batch: int, max_len: int, eos_token_id: int | None = None,
                 on_first_token: RequestCallback | None = None, on_finish: RequestCallback | None = None):
        if max_len > decoder.args.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {decoder.args.max_seq_len}")
        self.decoder, self.max_batch, self.max_len = decoder, max_batch, max_len
        self.eos_token_id = eos_token_id
        self.on_first_token, self.on_finish = on_first_token, on_finish
        self.cache: KVCache = decoder.new_cache(max_batch, max_len)
        self.device = decoder.model.tok_embeddings.weight.device
        self.running: list[Request] = []  # running[b] owns cache slot b
        self.cached: list[int] = []  # tokens in the cache per slot
        self.waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self.work = threading.Condition(self._lock)  # notified on submit

    def submit(self, request: Request) -> None:
        if request.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if not request.prompt:
            raise ValueError(f"request {request.request_id}: empty prompt")
        if len(request.prompt) + request.max_new_tokens - 1 > self.max_len:
            raise ValueError(f"request {request.request_id}: prompt ({len(request.prompt)} tokens) + max_new_tokens "
                             f"({request.max_new_tokens}) exceeds the context ({self.max_len} tokens)")
        with self.work:
            self.waiting.append(request)
            self.work.notify()

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def step(self) -> int:
        """One engine iteration (admit + prefill, decode, retire); returns the tokens it generated."""
        generated = self._admit()
        if self.running:
            generated += self._decode()
        return generated

    def _admit(self) -> int:
        with self._lock:
            n = min(len(self.waiting), self.max_batch - len(self.running))
            newcomers = [self.waiting.popleft() for _ in range(n)]
        if not newcomers:
            return 0
        start = time.perf_counter()
        lengths = [len(r.prompt) for r in newcomers]
        tokens_bs = torch.zeros(len(newcomers), max(lengths), dtype=torch.long)
        for row, request in enumerate(newcomers):
            tokens_bs[row, : lengths[row]] = torch.as_tensor(request.prompt, dtype=torch.long)
        tokens_bs, lengths_b = tokens_bs.to(self.device), torch.tensor(lengths, device=self.device)
        # a blocking copy returns once the tokens are on the device; the device is idle here (the last step's
        # tokens were read back), so the wait is the copy's own
        waited = time.perf_counter() - start
        for request in newcomers:  # each waited for the whole batch it was prefilled with
            request.data_wait_s = waited
        first_slot = len(self.running)
        logits_bv = self.decoder.prefill(tokens_bs, lengths_b, first_slot, self.cache)
        self.running.extend(newcomers)
        self.cached.extend(lengths)
        self._emit(logits_bv, first_slot, first=True)
        return len(newcomers)

    def _decode(self) -> int:
        n = len(self.running)
        tokens_b = torch.tensor([r.tokens[-1] for r in self.running], device=self.device)
        positions_b = torch.tensor(self.cached, device=self.device)
        logits_bv = self.decoder.decode(tokens_b, positions_b, self.cache)
        self.cached = [c + 1 for c in self.cached]
        self._emit(logits_bv, 0, first=False)
        return n

    def _emit(self, logits_bv: torch.Tensor, first_slot: int, first: bool) -> None:
        """Append each slot's greedy token, report first tokens, then retire the finished requests."""
        done = []
        for offset, token in enumerate(logits_bv.argmax(-1).tolist()):
            slot = first_slot + offset
            request = self.running[slot]
            request.tokens.append(token)
            if request.record_logits:
                request.logits.append(logits_bv[offset].clone())
            if first and self.on_first_token is not None:
                self.on_first_token(request)
            if self.eos_token_id is not None and token == self.eos_token_id:
                request.finish_reason = "eos"
            elif len(request.tokens) >= request.max_new_tokens:
                request.finish_reason = "length"
            if request.finish_reason is not None:
                done.append(slot)
        for slot in reversed(done):  # highest slot first, so the slots still to retire keep their place
            self._retire(slot)

    def _retire(self, slot: int) -> None:
        request = self.running[slot]
        last = len(self.running) - 1
        if slot != last:  # the last running request takes the freed slot: running rows stay 0 .. n-1
            self.cache.move(last, slot, self.cached[last])
            self.running[slot], self.cached[slot] = self.running[last], self.cached[last]
        self.running.pop()
        self.cached.pop()
        if self.on_finish is not None:
            self.on_finish(request)


def generate(engine: ServingEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (run to completion on ``engine``, which must be idle)."""
    requests = [Request(i, prompt, max_new_tokens) for i, prompt in enumerate(prompts)]
    for request in requests:
        engine.submit(request)
    while not engine.idle:
        engine.step()
    return [r.tokens for r in requests]


__all__ = ["Request", "ServingEngine", "generate"]
