"""LLM: offline generation over an in-process EngineCore."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, fields
from typing import Any

from tqdm import tqdm

from tokenfleet.checkpoint.tokenizer import Tokenizer
from tokenfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenfleet.core.engine_api import EngineCoreRequest, TokenLogprobs
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.engine.core import EngineCore

# LLM(**kwargs) fills CacheConfig and SchedulerConfig from their own field names, except
# those EngineConfig has too (max_model_len: the engine's, which it passes down).
_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}
_CACHE_FIELDS = {f.name for f in fields(CacheConfig)} - _ENGINE_FIELDS
_SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)} - _ENGINE_FIELDS


@dataclass
class RequestOutput:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1, 2, ... (asked for)


class LLM:
    """Generate from many prompts at once with continuous batching.

    Keyword arguments are EngineConfig fields (device, dtype, num_threads, max_model_len,
    seed), CacheConfig fields (block_size, kv_cache_memory, ...) or SchedulerConfig fields
    (max_num_batched_tokens, max_num_seqs).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        cache = CacheConfig(**{k: kwargs.pop(k) for k in _CACHE_FIELDS & kwargs.keys()})
        sched = SchedulerConfig(**{k: kwargs.pop(k) for k in _SCHEDULER_FIELDS & kwargs.keys()})
        self.config = EngineConfig(model=model, cache=cache, scheduler=sched, **kwargs)
        self.engine = EngineCore(self.config)
        self._tokenizer: Tokenizer | None = None
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        # Loaded on first use: a folder without tokenizer files still serves token ids.
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.engine.model_folder)
        return self._tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in prompt order; prompts are text or token id lists."""
        if isinstance(prompts, str):
            prompts = [prompts]
        token_lists = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError(f"{len(params)} sampling params for {len(token_lists)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        try:
            for ids, p in zip(token_lists, params, strict=True):
                req_id = str(next(self._ids))
                self.engine.add_request(EngineCoreRequest(req_id, ids, p, time.monotonic()))
                results[req_id] = RequestOutput(req_id, ids)
                order.append(req_id)
        except Exception:
            self.engine.abort(order)
            self.engine.step()
            raise
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step().outputs:
                result = results[out.req_id]
                result.token_ids.extend(out.new_token_ids)
                result.num_cached_tokens = out.num_cached_tokens
                if out.logprobs:
                    result.logprobs = (result.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.stop_token_id = out.stop_token_id
                    bar.update(1)
        bar.close()
        if (self.engine.model_folder / "tokenizer.json").is_file():
            for result in results.values():
                ids = result.token_ids
                if result.stop_token_id is not None:
                    ids = ids[:-1]
                result.text = self.tokenizer.decode(ids)
        return [results[r] for r in order]

    def chat(
        self,
        conversations: list[list[dict[str, Any]]],
        params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        prompts = [
            self.tokenizer.encode(self.tokenizer.apply_chat_template(c)) for c in conversations
        ]
        return self.generate(prompts, params, use_tqdm=use_tqdm)
