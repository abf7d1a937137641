"""FakeModelRunner: a torch-free stand-in for the model runner, for scheduler tests.

It keeps a fake paged KV cache (block id -> the token id stored at each slot) and treats it
the way the real runner treats its K/V tensors: every step first writes each scheduled
token into the slot that its request's block table gives its position (the table kept
from the steps' new block ids, as the real runner keeps it), then, for each
request with `sample=True`, reads the request's whole context back *from the blocks* and
samples a token from it.

The default sampler is a deterministic function of that context, so a wrong block table, a
bad prefix-cache hit or a block reused while still holding live K/V changes the sampled
tokens, and `reference_generate` (which never touches the cache) gives the tokens a
correct engine must produce. Tests that need chosen tokens (EOS, stop ids) pass `token_fn`.

Every step's SchedulerOutput and scheduled token counts are recorded for assertions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.runner.block_tables import BlockTables

# token_fn(req_id, context) -> the next token; context is every token before it.
TokenFn = Callable[[str, Sequence[int]], int]

FAKE_VOCAB_SIZE = 997
# Default tokens come from [FAKE_TOKEN_BASE, FAKE_TOKEN_BASE + FAKE_VOCAB_SIZE): tests keep
# their prompt ids, EOS and stop ids below it so that nothing stops by accident.
FAKE_TOKEN_BASE = 1000


def fake_next_token(req_id: str, context: Sequence[int]) -> int:
    """A deterministic 'model': a polynomial hash of the whole context (req_id unused)."""
    h = 7
    for token in context:
        h = (h * 31 + token) % 1_000_003
    return FAKE_TOKEN_BASE + (h + len(context)) % FAKE_VOCAB_SIZE


def reference_generate(
    prompt: Sequence[int], num_tokens: int, token_fn: TokenFn = fake_next_token, req_id: str = ""
) -> list[int]:
    """The tokens a correct engine samples for `prompt`, computed without any cache."""
    context = list(prompt)
    out = []
    for _ in range(num_tokens):
        token = token_fn(req_id, context)
        out.append(token)
        context.append(token)
    return out


class FakeModelRunner:
    """Answers SchedulerOutputs like the model runner, from a fake paged KV cache."""

    def __init__(self, block_size: int, token_fn: TokenFn = fake_next_token) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        # block id -> token id stored at each slot (None: never written).
        self.kv: dict[int, list[int | None]] = {}
        self.scheduler_outputs: list[SchedulerOutput] = []
        # One dict per step: req_id -> number of tokens scheduled.
        self.num_scheduled_tokens: list[dict[str, int]] = []
        self.sampled: list[dict[str, int]] = []
        self.block_tables = BlockTables(max_blocks_per_seq=8)

    @property
    def num_steps(self) -> int:
        return len(self.scheduler_outputs)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.scheduler_outputs.append(scheduler_output)
        self.num_scheduled_tokens.append(scheduler_output.num_scheduled_tokens)
        req_ids = [s.req_id for s in scheduler_output.scheduled]
        assert len(set(req_ids)) == len(req_ids), f"a request scheduled twice: {req_ids}"
        assert not set(req_ids) & scheduler_output.finished_req_ids, (
            "a finished request was scheduled"
        )
        self.block_tables.update(scheduler_output)
        tables = {
            s.req_id: self.block_tables.block_ids(s.req_id) for s in scheduler_output.scheduled
        }
        # Like the real runner: all K/V of the step are written before any is read.
        for s in scheduler_output.scheduled:
            assert s.num_tokens > 0, f"{s.req_id} scheduled with no tokens"
            end = s.start_pos + s.num_tokens
            block_ids = tables[s.req_id]
            assert len(block_ids) * self.block_size >= end, (
                f"{s.req_id}: {len(block_ids)} blocks cannot hold positions up to {end}"
            )
            assert len(set(block_ids)) == len(block_ids), f"{s.req_id}: repeated block"
            for offset, token in enumerate(s.token_ids):
                block_id, slot = self._slot(block_ids, s.start_pos + offset)
                self.kv.setdefault(block_id, [None] * self.block_size)[slot] = token
        sampled = {}
        for s in scheduler_output.scheduled:
            if not s.sample:
                continue
            context = self.read_context(tables[s.req_id], s.start_pos + s.num_tokens)
            sampled[s.req_id] = self.token_fn(s.req_id, context)
        self.sampled.append(sampled)
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def read_context(self, block_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The tokens at positions [0, num_tokens) as stored in the given blocks."""
        context = []
        for pos in range(num_tokens):
            block_id, slot = self._slot(block_ids, pos)
            token = self.kv.get(block_id, [None] * self.block_size)[slot]
            assert token is not None, f"position {pos} (block {block_id}) was never written"
            context.append(token)
        return context

    def _slot(self, block_ids: Sequence[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size
