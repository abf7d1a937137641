"""Runs one scheduled step on the device: inputs, forward pass, sampling.

Owns the weights, the paged KV tensors (sized from a memory budget) and the random
generators of unseeded requests (a seeded request's draws are keyed by seed and output
position: sampler.seeded_uniform); knows nothing of queues or policy. Constrained rows come
with their token masks (runner/grammar.py), filled beside the forward pass and applied to
the logits before sampling.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from tokenfleet.config import CacheConfig
from tokenfleet.core.engine_api import TokenLogprobs
from tokenfleet.core.request import PLACEHOLDER
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.sampling_params import SamplingParams
from tokenfleet.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenfleet.kernels import paged_attention_lib
from tokenfleet.models.attention import AttentionMetadata, long_tensor
from tokenfleet.models.config import ModelConfig
from tokenfleet.models.loader import DTYPES, load_model
from tokenfleet.models.rope import rope_cos_sin
from tokenfleet.runner.block_tables import BlockTables
from tokenfleet.runner.grammar import TokenMasks
from tokenfleet.runner.sampler import compute_logprobs, logprobs_rows, sample_rows

logger = logging.getLogger(__name__)


class StepInputs(NamedTuple):
    """A step's inputs as ModelRunner.prepare made them (tensors None for an empty step)."""

    so: SchedulerOutput
    batch: list[ScheduledRequest]  # decodes first
    input_ids: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    meta: AttentionMetadata | None
    logits_rows: torch.Tensor | None
    scored: list[tuple[ScheduledRequest, int, list[int]]]
    num_sampling: int
    host: HostInputs | None


class HostInputs(NamedTuple):
    """A step's inputs as the host lays them out (host_inputs)."""

    batch: list[ScheduledRequest]  # decodes first
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # the sampling rows, then the scored prompt rows
    scored: list[tuple[ScheduledRequest, int, list[int]]]
    num_sampling: int
    # Decode rows planned ahead of the step still running: the input_ids rows that hold a
    # PLACEHOLDER and their requests; rows whose output lists end with one (penalties, a
    # seeded draw). Filled by fill_input_placeholders once that step's tokens are known.
    placeholder_rows: torch.Tensor | None  # None: no placeholder
    placeholder_req_ids: list[str]
    placeholder_outputs: list[ScheduledRequest]


def host_inputs(
    so: SchedulerOutput,
    tables: BlockTables,
    block_size: int,
    device: torch.device,
    sliding_window: int | None,
) -> HostInputs:
    """The token ids, positions, attention metadata and logits rows of a step, decodes
    first (attention treats them as one slice of the batch), its changes to the block
    tables applied (every step's, in order: they carry only what changed). A busy step is
    mostly decodes: theirs are gathered by list comprehensions and their block tables
    from the tables' rows in one gather, the rest row by row."""
    rows = tables.update(so)
    decode_rows = [row for row, s in zip(rows, so.scheduled, strict=True) if len(s.token_ids) == 1]
    decodes = [s for s in so.scheduled if len(s.token_ids) == 1]
    rest = (
        [s for s in so.scheduled if len(s.token_ids) > 1]
        if len(decodes) < len(so.scheduled)
        else []
    )
    batch = decodes + rest
    input_ids = [s.token_ids[0] for s in decodes]
    positions = [s.start_pos for s in decodes]
    logits_rows = [i for i, s in enumerate(decodes) if s.sample]
    # Rows whose logits score the prompt's next token (prompt_logprobs): after the
    # sampling rows in the logits, as (request, first row, targets).
    scored = [(s, i, list(s.prompt_targets)) for i, s in enumerate(decodes) if s.prompt_targets]
    for s in rest:
        if s.prompt_targets:
            scored.append((s, len(input_ids), list(s.prompt_targets)))
        input_ids.extend(s.token_ids)
        positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        if s.sample:
            logits_rows.append(len(input_ids) - 1)
    num_sampling = len(logits_rows)
    for _, row, targets in scored:
        logits_rows.extend(range(row, row + len(targets)))
    width = max(positions[: len(decodes)], default=-1) // block_size + 1
    meta = AttentionMetadata.build(
        [(s.start_pos, 1, ()) for s in decodes]
        + [(s.start_pos, len(s.token_ids), tables.row(s.req_id)) for s in rest],
        block_size,
        device,
        sliding_window,
        decode_table=tables.ids[:, :width][decode_rows],
    )
    # A placeholder is only ever a decode's one token (its request sampled last step).
    waiting = [i for i, token in enumerate(input_ids[: len(decodes)]) if token == PLACEHOLDER]
    return HostInputs(
        batch,
        long_tensor(input_ids, device),
        long_tensor(positions, device),
        meta,
        long_tensor(logits_rows, device),
        scored,
        num_sampling,
        long_tensor(waiting, device) if waiting else None,
        [decodes[i].req_id for i in waiting],
        [decodes[i] for i in waiting if decodes[i].output_token_ids],
    )


def fill_input_placeholders(host: HostInputs, sampled: Mapping[str, int]) -> None:
    """The placeholders of inputs made ahead: each request's token from the step that
    sampled it (0 for one that got none: it failed there and ends, its row dropped)."""
    if host.placeholder_rows is not None:
        device = host.input_ids.device
        get = sampled.get
        tokens = long_tensor([get(req_id, 0) for req_id in host.placeholder_req_ids], device)
        with torch.inference_mode():  # as the inputs were made (ModelRunner.prepare)
            host.input_ids.index_put_((host.placeholder_rows,), tokens)
    for row in host.placeholder_outputs:
        row.output_token_ids[-1] = sampled.get(row.req_id, 0)  # type: ignore[index]


def free_device_memory(device: torch.device) -> int:
    """Bytes still available on the device (host RAM for the CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class ModelRunner:
    def __init__(
        self,
        model_folder: Path,
        *,
        device: str,
        dtype: str,
        cache_config: CacheConfig,
        max_model_len: int,
        seed: int = 0,
        attention_backend: str = "auto",
        linear_backend: str = "auto",
    ) -> None:
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.use_kernel = (
            attention_backend == "auto"
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and paged_attention_lib() is not None
        )
        self.model = load_model(
            model_folder,
            self.device,
            self.dtype,
            use_kernel=self.use_kernel,
            linear_backend=linear_backend,
        )
        self.config: ModelConfig = self.model.config
        self.block_size = cache_config.block_size
        kv_dtype = cache_config.kv_cache_dtype
        self.kv_dtype = self.dtype if kv_dtype == "auto" else DTYPES[kv_dtype]
        bytes_per_block = self.config.kv_bytes_per_token(self.kv_dtype.itemsize) * self.block_size
        budget = cache_config.kv_cache_memory
        if budget is None:
            budget = int(free_device_memory(self.device) * cache_config.kv_cache_memory_fraction)
        self.num_blocks = budget // bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"a KV budget of {budget} bytes holds no block ({bytes_per_block} bytes each)"
            )
        shape = (
            2,
            self.num_blocks,
            self.block_size,
            self.config.num_kv_heads,
            self.config.head_dim,
        )
        # Zeroed, not empty: padded decode rows read unwritten blocks under a mask, and
        # garbage NaNs there would leak through the softmax.
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(self.config.num_layers)
        ]
        self.cos, self.sin = rope_cos_sin(self.config, max_model_len, self.device, self.dtype)
        self.block_tables = BlockTables(-(-max_model_len // self.block_size) + 1)
        self._seed_rng = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}
        # The requests of the latest step that failed on their own (their sampling, their
        # logprobs: never the forward pass, which is the whole step's), with what failed:
        # they have no token in its output, and the engine ends them with an error.
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * bytes_per_block / 2**20,
            str(self.kv_dtype).removeprefix("torch."),
        )

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def _generator(self, req_id: str) -> torch.Generator:
        """An unseeded request's own generator. On the host, whatever the device: it makes
        one number a row, which the sampler takes as a Python float."""
        gen = self._generators.get(req_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(self._seed_rng.getrandbits(63))
            self._generators[req_id] = gen
        return gen

    def execute(self, so: SchedulerOutput, masks: TokenMasks | None = None) -> ModelRunnerOutput:
        """Runs the step. `masks`: the token masks of its constrained rows that sample,
        being filled while the forward pass runs; applied once it is done."""
        return self.run(self.prepare(so), masks)

    @torch.inference_mode()
    def prepare(self, so: SchedulerOutput) -> StepInputs:
        """The step's inputs on the device: the host's part of a launch, done by the
        engine's loop before it hands the step to the forward thread (the overlap)."""
        if so.is_empty:
            self.block_tables.update(so)  # the requests it says ended
            return StepInputs(so, [], None, None, None, None, None, [], 0, None)
        host = host_inputs(
            so, self.block_tables, self.block_size, self.device, self.config.sliding_window
        )
        return StepInputs(
            so,
            host.batch,
            host.input_ids,
            self.cos[host.positions],
            self.sin[host.positions],
            host.meta,
            host.logits_rows,
            host.scored,
            host.num_sampling,
            host,
        )

    @staticmethod
    def fill_placeholders(inputs: StepInputs, sampled: Mapping[str, int]) -> None:
        """Inputs made ahead of the step that sampled `sampled`: its tokens in place."""
        if inputs.host is not None:
            fill_input_placeholders(inputs.host, sampled)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, masks: TokenMasks | None = None) -> ModelRunnerOutput:
        """The forward pass of prepared inputs, then the sampling."""
        for req_id in inputs.so.finished_req_ids:
            self._generators.pop(req_id, None)
        if inputs.input_ids is None:
            return ModelRunnerOutput({})
        batch, scored, num_sampling = inputs.batch, inputs.scored, inputs.num_sampling
        logits = self.model(
            inputs.input_ids,
            inputs.cos,
            inputs.sin,
            self.kv_caches,
            inputs.meta,
            inputs.logits_rows,
        )
        failed: dict[str, str] = {}
        prompt_logprobs = self._prompt_logprobs(logits[num_sampling:], scored, failed)
        logits = logits[:num_sampling]
        sampling = [s for s in batch if s.sample]
        params = [s.sampling_params for s in sampling]
        # Constrained rows: disallowed tokens to -inf before anything else touches the
        # logits (penalties, temperature, top-k/top-p, the greedy argmax). Logprobs stay
        # those of the raw logits, the model's own distribution (as OpenAI's API reports
        # them): masked is then a copy.
        masked = logits
        if masks is not None:
            masked, failed_masks = masks.apply(
                logits, [s.req_id for s in sampling], [p.logprobs is not None for p in params]
            )
            failed.update(failed_masks)
        # Seeded rows draw by (seed, output position): no generator of their own.
        generators = [
            None if p.greedy or p.seed is not None else self._generator(s.req_id)
            for s, p in zip(sampling, params, strict=True)
        ]
        # Rows of requests that failed already are sampled greedily and dropped below.
        params = [
            SamplingParams(temperature=0) if s.req_id in failed else p
            for s, p in zip(sampling, params, strict=True)
        ]
        outputs = [s.output_token_ids for s in sampling]
        drawn, failed_rows = sample_rows(masked, params, generators, outputs)
        token_ids = [0 if t is None else t for t in drawn]
        num_top = [None if i in failed_rows else p.logprobs for i, p in enumerate(params)]
        logprobs, failed_scoring = logprobs_rows(logits, token_ids, num_top)
        for i, message in (failed_rows | failed_scoring).items():
            failed.setdefault(sampling[i].req_id, message)
        if failed:
            logger.warning("requests failed on their own in this step: %s", failed)
        return ModelRunnerOutput(
            sampled_token_ids={
                s.req_id: t
                for s, t in zip(sampling, token_ids, strict=True)
                if s.req_id not in failed
            },
            logprobs={
                s.req_id: lp
                for s, lp in zip(sampling, logprobs, strict=True)
                if lp and s.req_id not in failed
            },
            prompt_logprobs={k: v for k, v in prompt_logprobs.items() if k not in failed},
            failed=failed,
        )

    @staticmethod
    def _prompt_logprobs(
        logits: torch.Tensor,
        scored: list[tuple[ScheduledRequest, int, list[int]]],
        failed: dict[str, str],
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Each scored chunk's logprobs of the prompt tokens its rows predict, from its rows'
        logits (in `scored` order), keyed by request: (first position scored, entries). A
        request whose scoring raises goes to `failed` instead."""
        result = {}
        row = 0
        for s, _, targets in scored:
            k = s.sampling_params.prompt_logprobs
            try:
                entries = compute_logprobs(
                    logits[row : row + len(targets)], targets, [k] * len(targets)
                )
            except Exception as exc:
                failed[s.req_id] = (
                    f"computing its prompt logprobs failed: {type(exc).__name__}: {exc}"
                )
            else:
                result[s.req_id] = (s.start_pos + 1, [e for e in entries if e is not None])
            row += len(targets)
        return result
