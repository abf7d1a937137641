"""Next-token choice per request: greedy, or temperature with top-k and top-p, seeded.

Each request draws from its own torch.Generator, so a seeded request gives the same
tokens whatever it is batched with. Presence and frequency penalties and logit biases
change the logits first (greedy too). Logprobs are of the model's raw distribution (before
penalties, biases, temperature and truncation), as the OpenAI API reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenfleet.core.engine_api import TokenLogprobs
from tokenfleet.core.sampling_params import SamplingParams


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


CDF_BLOCK = 256  # vocabulary entries per block of the two-level inverse CDF


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Each row's token at its draw (uniform on [0, 1)) in the row's cumulative
    probabilities: the first whose running sum exceeds draw x the row's total.

    One uniform a row instead of a vocabulary of exponentials (the exponential race cost
    ~1 ms a row here), in two levels so that the running sums are float64 where they are
    long: over blocks of CDF_BLOCK entries, then within the one block drawn. A token of
    zero probability adds nothing to a sum, so it is never the first to exceed one; where
    rounding puts a draw at or past a sum's end, the last token with mass is taken.
    """
    rows, vocab = probs.shape
    pad = -vocab % CDF_BLOCK
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(rows, -1, CDF_BLOCK)
    # Each block's sum in float32 (a sum of CDF_BLOCK, converted after: converting the
    # whole vocabulary first costs more than the rest together); the sums over blocks and
    # within the drawn block in float64.
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    total = block_cdf[:, -1]
    points = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, points[:, None], right=True)[:, 0]
    previous = block_cdf.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0]
    before = torch.where(block > 0, previous, torch.zeros_like(previous))
    inner = blocks[torch.arange(rows, device=probs.device), block].cumsum(-1, dtype=torch.float64)
    inner_total = inner[:, -1]
    rest = torch.minimum(points - before, torch.nextafter(inner_total, torch.zeros_like(total)))
    return block * CDF_BLOCK + torch.searchsorted(inner, rest[:, None], right=True)[:, 0]


def adjust_logits(
    logits: torch.Tensor,  # [B, V]
    params: list[SamplingParams],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """The logits with each row's logit biases added and its penalties taken off (a copy
    where any row changes; `logits` itself otherwise). `outputs[i]`: the tokens row i's
    request has generated so far."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p = params[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype)
            logits[i].index_add_(0, ids, bias.to(logits.device))
        if p.penalized and outputs[i]:
            generated = torch.tensor(outputs[i], device=logits.device)
            ids, counts = generated.unique(return_counts=True)
            penalty = counts.to(logits.dtype) * p.frequency_penalty + p.presence_penalty
            logits[i].index_add_(0, ids, -penalty)
    return logits


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    outputs: Sequence[Sequence[int]] = (),
) -> list[int]:
    """The next token of each row. `outputs`: each row's generated tokens so far (needed
    only for rows with penalties)."""
    logits = adjust_logits(logits, params, outputs)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return logits.argmax(dim=-1).tolist()
    # Each part only over the rows that need it: a row of the vocabulary costs ~50 us per
    # operation here, and a copy of the rows as much.
    everyone = len(random_rows) == len(params)
    sub = logits if everyone else logits[random_rows]
    temperatures = [params[i].temperature for i in random_rows]
    if any(t != 1.0 for t in temperatures):
        sub = sub / torch.tensor(temperatures, device=sub.device)[:, None]
    top_k = torch.tensor([params[i].top_k for i in random_rows], device=sub.device)
    top_p = torch.tensor([params[i].top_p for i in random_rows], device=sub.device)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sub = _truncate(sub, top_k, top_p)
    draws = torch.cat(
        [torch.rand(1, generator=generators[i], dtype=torch.float64) for i in random_rows]
    )
    drawn = _inverse_cdf(sub.softmax(dim=-1), draws.to(sub.device)).tolist()
    if everyone:
        return drawn
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    tokens = [0] * len(params)
    for i, token in zip(greedy_rows, logits[greedy_rows].argmax(dim=-1).tolist(), strict=True):
        tokens[i] = token
    for i, token in zip(random_rows, drawn, strict=True):
        tokens[i] = token
    return tokens


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int | None]
) -> list[TokenLogprobs | None]:
    rows = [i for i, n in enumerate(num_top) if n is not None]
    result: list[TokenLogprobs | None] = [None] * len(num_top)
    if not rows:
        return result
    logprobs = logits[rows].log_softmax(dim=-1)
    max_top = max(num_top[i] or 0 for i in rows)
    top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    for j, i in enumerate(rows):
        n = num_top[i] or 0
        top = []
        if n and top_values is not None and top_ids is not None:
            top = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True))
        result[i] = TokenLogprobs(token_ids[i], float(logprobs[j, token_ids[i]]), top)
    return result
