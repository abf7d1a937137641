"""Next-token choice per request: greedy, or temperature with top-k and top-p, seeded.

A random row takes one uniform draw. A seeded request's draw for its output token k
(counted from 0 over all its outputs, an earlier attempt's included) is a pure function
of (seed, k), seeded_uniform: the same whatever it is batched with, after a preemption's
recompute, and on another replica that resumes the stream. An unseeded request draws from
its own torch.Generator. Presence and frequency penalties and logit biases change the
logits first (greedy too); a constrained row's logits come masked already (-inf where its
grammar disallows a token: runner/grammar.py). Logprobs are of the model's raw distribution
(before masks, penalties, biases, temperature and truncation), as the OpenAI API reports
them.
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


_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 / the golden ratio


def _mix64(z: int) -> int:
    """SplitMix64's finaliser (Stafford's variant 13 of MurmurHash3's fmix64): a bijection
    of 64-bit integers in which each input bit flips each output bit with probability
    ~1/2."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform draw on [0, 1) of a seeded request's output token `position`.

    SplitMix64 read as a counter: output `position` of the SplitMix64 stream whose state
    starts at mix64(seed mod 2**64), i.e. mix64(mix64(seed) + (position + 1) * gamma),
    its top 53 bits as a double. Pure Python integers, so exact and the same on every
    device and torch version (~1 us). The seed is mixed before it is stepped, so that
    nearby seeds (the gateway gives choice i of n seed + i) start unrelated streams.
    """
    state = (_mix64(seed & _MASK64) + (position + 1) * _GOLDEN_GAMMA) & _MASK64
    return (_mix64(state) >> 11) * 2.0**-53


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
    return _inverse_cdf_checked(probs, draws)[0]


def _inverse_cdf_checked(
    probs: torch.Tensor, draws: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """_inverse_cdf, and whether each row's probabilities could be drawn from (a finite,
    positive total). A row that could not (NaN or infinite probabilities: a temperature
    that underflows, say) gets an arbitrary token and False: its indices are clamped, so
    that it never indexes out of bounds (on CUDA a device-side assert, fatal to the whole
    process, not only to that row)."""
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
    ok = torch.isfinite(total) & (total > 0)
    points = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, points[:, None], right=True)[:, 0]
    block = block.clamp(max=blocks.shape[1] - 1)
    previous = block_cdf.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0]
    before = torch.where(block > 0, previous, torch.zeros_like(previous))
    inner = blocks[torch.arange(rows, device=probs.device), block].cumsum(-1, dtype=torch.float64)
    inner_total = inner[:, -1]
    rest = torch.minimum(points - before, torch.nextafter(inner_total, torch.zeros_like(total)))
    within = torch.searchsorted(inner, rest[:, None], right=True)[:, 0].clamp(max=CDF_BLOCK - 1)
    return block * CDF_BLOCK + within, ok


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


class RowFailure(Exception):
    """Sampling or scoring failed for one row, for a reason of that row alone."""


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    outputs: Sequence[Sequence[int]] = (),
) -> list[int]:
    """The next token of each row (sample_rows' arguments). Raises RowFailure if a row
    cannot be sampled."""
    tokens, failed = sample_rows(logits, params, generators, outputs)
    if failed:
        i, message = next(iter(failed.items()))
        raise RowFailure(f"row {i}: {message}")
    return [t for t in tokens if t is not None]


def sample_rows(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    outputs: Sequence[Sequence[int]] = (),
) -> tuple[list[int | None], dict[int, str]]:
    """The next token of each row, with a row's failure kept to that row: (tokens, None
    where the row failed; {row: what failed}).

    `outputs[i]`: the tokens row i's request has generated so far, an earlier attempt's
    included (needed for rows with penalties, and for seeded random rows: their draw is
    seeded_uniform(seed, len(outputs[i]))). `generators[i]`: an unseeded random row's
    generator (unused for greedy and seeded rows).

    The rows are sampled together; should that raise, each row is sampled again alone,
    with the random number it drew already (a seeded row's tokens stay what they would
    have been), and only the rows that raise alone fail. A row whose draw raises, or
    whose probabilities cannot be drawn from (not finite), fails too."""
    failed: dict[int, str] = {}
    if not outputs:
        outputs = [()] * len(params)
    draws: list[float | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        try:
            if p.seed is not None:
                draws[i] = seeded_uniform(p.seed, len(outputs[i]))
            else:
                draws[i] = torch.rand(1, generator=generators[i], dtype=torch.float64).item()
        except Exception as exc:
            failed[i] = f"drawing its random number failed: {_describe(exc)}"
    rows = [i for i in range(len(params)) if i not in failed]
    tokens: list[int | None] = [None] * len(params)
    try:
        part = logits if len(rows) == len(params) else logits[rows]
        drawn, ok = _sample_batch(
            part, [params[i] for i in rows], [draws[i] for i in rows], [outputs[i] for i in rows]
        )
        results = list(zip(rows, drawn, ok, strict=True))
    except Exception:
        results = []
        for i in rows:
            try:
                (token,), (good,) = _sample_batch(
                    logits[i : i + 1], [params[i]], [draws[i]], [outputs[i]]
                )
            except Exception as exc:
                failed[i] = f"sampling failed: {_describe(exc)}"
                continue
            results.append((i, token, good))
    for i, token, good in results:
        if good:
            tokens[i] = token
        else:
            failed[i] = (
                "sampling failed: its probabilities are not finite (temperature "
                f"{params[i].temperature!r})"
            )
    return tokens, failed


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    draws: list[float | None],
    outputs: Sequence[Sequence[int]],
) -> tuple[list[int], list[bool]]:
    """Each row's token, and whether its probabilities could be drawn from (greedy rows
    always can). `draws`: each random row's uniform draw (None for greedy rows)."""
    logits = adjust_logits(logits, params, outputs)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return logits.argmax(dim=-1).tolist(), [True] * len(params)
    # Each part only over the rows that need it: a row of the vocabulary costs ~50 us per
    # operation here, and a copy of the rows as much.
    everyone = len(random_rows) == len(params)
    sub = logits if everyone else logits[random_rows]
    vocab = sub.shape[-1]
    temperatures = [params[i].temperature for i in random_rows]
    if any(t != 1.0 for t in temperatures):
        sub = sub / torch.tensor(temperatures, device=sub.device)[:, None]
    # A top_k past the vocabulary keeps all of it (and may be past what a tensor holds).
    top_k = torch.tensor([min(params[i].top_k, vocab) for i in random_rows], device=sub.device)
    top_p = torch.tensor([params[i].top_p for i in random_rows], device=sub.device)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sub = _truncate(sub, top_k, top_p)
    row_draws = torch.tensor([draws[i] for i in random_rows], dtype=torch.float64)
    drawn_t, ok_t = _inverse_cdf_checked(sub.softmax(dim=-1), row_draws.to(sub.device))
    drawn, ok = drawn_t.tolist(), ok_t.tolist()
    if everyone:
        return drawn, ok
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    tokens = [0] * len(params)
    good = [True] * len(params)
    for i, token in zip(greedy_rows, logits[greedy_rows].argmax(dim=-1).tolist(), strict=True):
        tokens[i] = token
    for i, token, row_ok in zip(random_rows, drawn, ok, strict=True):
        tokens[i] = token
        good[i] = row_ok
    return tokens, good


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


def logprobs_rows(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int | None]
) -> tuple[list[TokenLogprobs | None], dict[int, str]]:
    """compute_logprobs with a row's failure kept to that row: should the rows together
    raise, each is scored again alone, and only the rows that raise alone fail."""
    try:
        return compute_logprobs(logits, token_ids, num_top), {}
    except Exception:
        pass
    result: list[TokenLogprobs | None] = [None] * len(num_top)
    failed: dict[int, str] = {}
    for i, n in enumerate(num_top):
        if n is None:
            continue
        try:
            (result[i],) = compute_logprobs(logits[i : i + 1], [token_ids[i]], [n])
        except Exception as exc:
            failed[i] = f"computing its logprobs failed: {_describe(exc)}"
    return result, failed
