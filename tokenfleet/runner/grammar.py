"""Constrained decoding: constraints compiled against the model's tokenizer, each constrained
request's matcher, and each step's token masks. The library is llguidance.

    EngineCore.add_request ──▶ GrammarCompiler.compile(constraint)   worker threads; an LRU
         (the request waits         │ Future[template matcher]        cache of futures by
          out of the scheduler)     ▼                                 spec: each compiles once
    EngineCore.step: admitted once compiled ─▶ Matchers.add (a copy of the template, past a
                                               resumed request's earlier outputs)
        Matchers.start_fill(step) ──▶ mask thread: the bitmasks of the constrained rows that
        runner: forward pass           sample (llguidance fills them in Rust without the GIL,
        TokenMasks.apply(logits) ◀──   beside the forward pass), as biases: 0 or -inf
          biases added: disallowed -> -inf, before penalties, temperature, top-k/top-p, argmax
        Matchers.advance(sampled) ──▶ each matcher consumes its row's token; a matcher that
                                      can take nothing more (the grammar is complete) ends
                                      its request with "stop" in that same step

Why llguidance: it builds its tokenizer from the model folder's tokenizer.json (once, at
start-up) and needs no other package; it compiles a schema in about a millisecond and
fills a row's mask in Rust without the GIL (docs/structured.md has today's figures, from
bench/structured.py). xgrammar needs transformers and triton; outlines-core
fills one row at a time. llguidance.torch's mask helper is a torch.compile function
(seconds on its first call): it is not used; the bitmasks become biases through a byte
table here (numpy, in the mask thread).

A grammar's end: EOS (and a row's stop token ids) is allowed only where the grammar may
end; once the matcher can take nothing more after a token, the request ends with "stop" in
that step, with no EOS sampled after it (stop_token_id None). EOS sampled where the
grammar could go on or end ends it as EOS does on any row.

With the engine's overlap, the step planned ahead is launched before the matchers have
consumed the tokens of the step it follows: its masks go with it unfilled
(Matchers.fill_later), and their fill starts once `advance` has run, beside its forward,
without the rows of the requests that step ended (PendingFill.start).

Rows of unconstrained requests are never touched: no mask, no copy, no Python per row
beyond a set lookup, so their greedy output is the same as without constrained neighbours.
(Over 400 lines: one concept, a constraint's way from its text to each step's masks.)
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import torch

from tokenfleet.core.request import Request
from tokenfleet.core.sampling_params import JSON_OPTIONS, Constraint, SamplingParams
from tokenfleet.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first)
COMPILE_THREADS = 2

# llguidance's default limits (they bound one compile's and one mask's work), with short
# error messages: verbose ones carry the parser's state and the whole grammar.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# A schema can ask for other JSON options than JSON_OPTIONS under "x-guidance".
_JSON_OPTIONS: dict[str, Any] = dict(JSON_OPTIONS)
_ANY_OBJECT = '{"type": "object"}'
_WHAT = {
    "json_schema": "the JSON schema",
    "json_object": "the JSON object constraint",
    "regex": "the regex",
    "grammar": "the grammar",
}


class ConstraintError(Exception):
    """A constraint that cannot be compiled, or that a request's tokens break; the message
    is llguidance's reason (an unsupported schema keyword is named)."""


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked: LLMatcher does that)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    return llguidance.LLMatcher.grammar_from_lark(spec)


class GrammarCompiler:
    """Compiles constraints against one tokenizer in worker threads, each spec once.

    The cache holds futures, so that requests arriving together with one spec share one
    compile; a failed compile is cached too (the same spec fails at once). A compile
    cannot be interrupted: a request whose compile outlives its time limit fails
    (EngineCore), and the compile ends in its thread, its result cached.
    """

    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        num_threads: int = COMPILE_THREADS,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        # ~0.3 s holding the GIL (llguidance builds its token trie): at start-up, never on
        # a step's path.
        self.tokenizer = llguidance.LLTokenizer(
            str(tokenizer_json), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self.cache_size = cache_size
        self._cache: OrderedDict[Constraint, Future[llguidance.LLMatcher]] = OrderedDict()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compile")

    def compile(self, constraint: Constraint) -> Future[llguidance.LLMatcher]:
        """The constraint's matcher in its initial state (a template: copy it, never advance
        it), or its ConstraintError."""
        future = self._cache.get(constraint)
        if future is not None:
            self._cache.move_to_end(constraint)
            return future
        future = self._pool.submit(self._compile, constraint)
        self._cache[constraint] = future
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        what = _WHAT[constraint.kind]
        try:
            grammar = grammar_text(constraint)
        except ValueError as exc:
            raise ConstraintError(f"{what} cannot be compiled: {exc}") from exc
        # Releases the GIL while it builds the parser.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            reason = matcher.get_error().strip()
            raise ConstraintError(f"{what} is not supported or not valid: {reason}")
        for warning in matcher.get_grammar_warnings():
            logger.warning("%s: %s", what, warning)
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class Compiling:
    """A constrained request waiting for its constraint's compile, and until when."""

    request: Request
    future: Future[llguidance.LLMatcher]
    deadline: float

    def ended(self, now: float) -> bool:
        return self.future.done() or now >= self.deadline


class CompileWaits:
    """The constrained requests waiting out of the scheduler for their compile, by id: the
    engine takes each in once its compile ends, or ends it once its time limit passes."""

    def __init__(self) -> None:
        self._waiting: dict[str, Compiling] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._waiting

    def requests(self) -> list[Request]:
        return [w.request for w in self._waiting.values()]

    def add(self, waiting: Compiling) -> None:
        self._waiting[waiting.request.req_id] = waiting

    def pop(self, req_id: str) -> Compiling | None:
        return self._waiting.pop(req_id, None)

    def any_ended(self, now: float) -> bool:
        """Whether a compile ended or ran out of time: a request to take in or end."""
        return any(w.ended(now) for w in self._waiting.values())

    def take_ended(self, now: float) -> tuple[list[Compiling], list[str]]:
        """Those whose compile ended, and the ids of those past their time limit, no longer
        waiting."""
        done = [w for w in self._waiting.values() if w.future.done()]
        late = [i for i, w in self._waiting.items() if not w.future.done() and now >= w.deadline]
        for req_id in [w.request.req_id for w in done] + late:
            del self._waiting[req_id]
        return done, late

    def wait_first(self) -> None:
        """Blocks until the first compile ends or the first time limit passes."""
        first = min(w.deadline for w in self._waiting.values())
        futures = {w.future for w in self._waiting.values()}
        wait(futures, timeout=max(0.0, first - time.monotonic()), return_when=FIRST_COMPLETED)


# Byte b of an inverted bitmask (bit k set: token 8i + k disallowed) -> its 8 tokens' biases,
# 0 or -inf: np.take through it turns a row's bitmask into its bias (~9 us a row here; a
# bool mask and masked_fill cost ~150 us a row).
_BIAS_OF_BYTE = np.where(
    (np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(-np.inf), np.float32(0)
).astype(np.float32)


Fill = tuple[list[str], np.ndarray, dict[str, str]]  # (rows' requests, biases, failed)


class TokenMasks:
    """One step's masks of the constrained rows that sample, being filled in a thread as
    additive biases: 0 for a token the row's grammar allows, -inf for one it does not.
    Which rows they are is known once the fill is (`req_ids` waits for it): a step
    launched before the one it follows has advanced the matchers (Matchers.fill_later)
    leaves out the rows of requests that step ended."""

    def __init__(self, fill: Future[Fill]) -> None:
        self._fill = fill

    @property
    def req_ids(self) -> list[str]:
        return self._fill.result()[0]

    def wait(self) -> None:
        self._fill.result()

    def apply(
        self, logits: torch.Tensor, req_ids: Sequence[str], wants_logprobs: Sequence[bool]
    ) -> tuple[torch.Tensor, dict[str, str]]:
        """Waits for the fill, then sets the logits of the tokens each constrained row's
        grammar disallows to -inf. `req_ids[i]` and `wants_logprobs[i]` are logits row i's.

        Returns (the masked logits, {req_id: why} for rows whose matcher failed: left
        unmasked, their requests end with that error). The masked logits are `logits`
        itself, changed in place, unless a constrained row asks for logprobs: they are of
        the model's raw distribution, so then the masks go on a copy."""
        masked, biases, failed = self._fill.result()
        row_of = {req_id: i for i, req_id in enumerate(req_ids)}
        rows = [row_of[r] for r in masked if r not in failed]
        if not rows:
            return logits, failed
        if failed:
            biases = biases[[j for j, r in enumerate(masked) if r not in failed]]
        if any(wants_logprobs[i] for i in rows):
            logits = logits.clone()
        index = torch.tensor(rows, device=logits.device)
        logits.index_add_(0, index, torch.from_numpy(biases).to(logits.device, logits.dtype))
        return logits, failed


class Matchers:
    """Each admitted constrained request's matcher, advanced by its sampled tokens."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._eos = tuple(eos_token_ids)
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # Stop token ids of constrained requests that have some: allowed wherever the
        # grammar allows EOS (a request may end at them where it may end), never consumed.
        self._stops: dict[str, frozenset[int]] = {}
        # One thread: a step's fill never overlaps the previous one's. llguidance's own
        # pool (made on the first fill) fills the rows in parallel.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._executor: llguidance.LLExecutor | None = None

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._matchers

    def add(
        self,
        req_id: str,
        template: llguidance.LLMatcher,
        params: SamplingParams,
        earlier: Sequence[int] = (),
    ) -> None:
        """A matcher for this request, copied from its compiled template and advanced past
        `earlier` (a resumed request's earlier outputs): the state the matcher of the
        stream that never moved had there. Raises ConstraintError where they do not fit."""
        matcher = template.deep_copy()
        stops = frozenset(params.stop_token_ids)
        for k, token in enumerate(earlier):
            if token in stops:
                continue
            if not matcher.consume_token(token):
                raise ConstraintError(
                    f"its earlier output token {k} (id {token}) does not fit its "
                    f"constraint: {matcher.get_error().strip()}"
                )
        if matcher.is_stopped():
            raise ConstraintError(
                "its earlier output tokens complete its constraint already: nothing is left "
                "to generate"
            )
        self._matchers[req_id] = matcher
        if stops:
            self._stops[req_id] = stops

    def remove(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            if self._matchers.pop(req_id, None) is not None:
                self._stops.pop(req_id, None)

    def start_fill(self, so: SchedulerOutput, skip: Collection[str] = ()) -> TokenMasks | None:
        """Starts filling the masks of this step's constrained rows that sample (None when
        there are none), but those of `skip`; TokenMasks.apply waits."""
        req_ids = self._rows(so, skip)
        return TokenMasks(self.submit(req_ids)) if req_ids else None

    def fill_later(self, so: SchedulerOutput, skip: Collection[str] = ()) -> PendingFill | None:
        """The masks of a step planned ahead of the one still ending, to launch it with
        before the matchers have consumed that one's tokens (advance): PendingFill.start
        then starts the fill, without the rows of the requests that step ended. None when
        the step has no constrained row that samples."""
        req_ids = self._rows(so, skip)
        return PendingFill(self, req_ids) if req_ids else None

    def _rows(self, so: SchedulerOutput, skip: Collection[str]) -> list[str]:
        matchers = self._matchers
        return [
            s.req_id
            for s in so.scheduled
            if s.sample and s.req_id in matchers and s.req_id not in skip
        ]

    def submit(self, req_ids: list[str]) -> Future[Fill]:
        """Starts filling the masks of these requests' rows (in this order)."""
        matchers = self._matchers
        req_ids = [r for r in req_ids if r in matchers]  # none: aborted meanwhile
        rows = [matchers[r] for r in req_ids]
        stops = [(i, self._stops[r]) for i, r in enumerate(req_ids) if r in self._stops]
        return self._pool.submit(self._fill, req_ids, rows, stops)

    def _fill(
        self,
        req_ids: list[str],
        matchers: list[llguidance.LLMatcher],
        stops: list[tuple[int, frozenset[int]]],
    ) -> Fill:
        """(the rows' requests, biases [rows, vocab] float32, {req_id: why} for matchers
        that failed)."""
        n, words = len(matchers), self._words
        bitmask = np.empty((n, words), dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, words * 4, n
        )
        failed = {
            req_ids[i]: f"its constraint failed: {m.get_error().strip()}"
            for i, m in enumerate(matchers)
            if m.is_error()
        }
        bits = bitmask.view(np.uint32)
        for i, stop_ids in stops:
            if any(bits[i, t >> 5] >> np.uint32(t & 31) & 1 for t in self._eos):
                for t in stop_ids:
                    if 0 <= t < self.vocab_size:
                        bits[i, t >> 5] |= np.uint32(1 << (t & 31))
        # Bit t of a row's words is token t, lowest bit first; inverted: "disallowed".
        disallowed = (~bitmask).view(np.uint8)
        biases = np.take(_BIAS_OF_BYTE, disallowed, axis=0).reshape(n, -1)
        if biases.shape[1] != self.vocab_size:
            biases = np.ascontiguousarray(biases[:, : self.vocab_size])
        return req_ids, biases, failed

    def advance(
        self, sampled: Mapping[str, int], req_ids: Sequence[str]
    ) -> tuple[set[str], dict[str, str]]:
        """Each of these requests' matchers consumes the token its request sampled.

        Returns (the requests whose grammar is complete with it: their matcher can take
        nothing more, so they end now with "stop"; {req_id: why} for tokens the matcher
        refused, which masks make impossible but for a row that failed its mask). A stop
        token id ends its request anyway: it is not consumed."""
        completed: set[str] = set()
        rejected: dict[str, str] = {}
        for req_id in req_ids:
            token = sampled.get(req_id)
            matcher = self._matchers.get(req_id)  # none: aborted while its step ran
            if token is None or matcher is None or token in self._stops.get(req_id, ()):
                continue
            if not matcher.consume_token(token):
                rejected[req_id] = (
                    f"the sampled token {token} does not fit its constraint: "
                    f"{matcher.get_error().strip()}"
                )
            elif matcher.is_stopped():
                completed.add(req_id)
        return completed, rejected

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PendingFill:
    """Masks whose fill starts later (Matchers.fill_later): `masks` goes with the launch;
    `start(ended)` fills them for the rows but those of `ended`, or `fail(exc)` makes them
    raise. One of the two must come: the step's forward waits for its masks."""

    def __init__(self, matchers: Matchers, req_ids: list[str]) -> None:
        self._matchers = matchers
        self._req_ids = req_ids
        self._result: Future[Fill] = Future()
        self.masks = TokenMasks(self._result)

    def start(self, ended: Collection[str]) -> None:
        req_ids = [r for r in self._req_ids if r not in ended]
        if not req_ids:
            self._result.set_result(([], np.empty((0, self._matchers.vocab_size), np.float32), {}))
            return
        self._matchers.submit(req_ids).add_done_callback(self._done)

    def fail(self, exc: BaseException) -> None:
        if not self._result.done():
            self._result.set_exception(exc)

    def _done(self, fill: Future[Fill]) -> None:
        error = fill.exception()
        if error is not None:
            self._result.set_exception(error)
        else:
            self._result.set_result(fill.result())
