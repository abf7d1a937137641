"""The step-time model: how long one engine step takes, from what the step schedules.

    t = a + b*prefill_tokens + c*decode_seqs + d*kv_tokens_read + e*prefill_attention

Every feature is a sum over the step's requests (`StepFeatures.of_chunk` is the one
definition; features add), so a scheduler growing a step can price each request it adds.
The coefficients are fitted by non-negative least squares on relative error, first from a
short start-up profile (step_profile.py), then refitted online from measured steps: a
bounded window of recent steps plus the profile's steps, kept as a prior so that a quiet
period with no prefill never forgets the prefill slope.

Torch-free: the engine feeds it measured seconds, the simulator uses it as its cost model.
(Over 400 lines: the features, the one pricing function and the online fit belong together.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from tokenfleet.core.scheduler_output import SchedulerOutput

Array = npt.NDArray[np.float64]

# The model's terms, in coefficient order. "intercept" is the step's fixed cost.
TERMS = ("intercept", "prefill_tokens", "decode_seqs", "kv_tokens_read", "prefill_attention")


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What a step costs in, summed over its requests.

    A request scheduling one token runs as a decode (the runner puts every one-token query
    in its decode slice, whatever its position), so it counts in `decode_seqs`; any longer
    chunk counts its tokens in `prefill_tokens`. `kv_tokens_read` is the context every
    request attends to, its new tokens included; `prefill_attention` is a prefill chunk's
    query tokens times that context, the quadratic part of a long prompt's attention.
    """

    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_tokens_read: int = 0
    prefill_attention: int = 0

    @classmethod
    def of_chunk(cls, num_tokens: int, start_pos: int) -> StepFeatures:
        """One request scheduling `num_tokens` tokens from position `start_pos`."""
        return cls.of_chunks(((num_tokens, start_pos),))

    @classmethod
    def of_chunks(cls, chunks: Iterable[tuple[int, int]]) -> StepFeatures:
        """The sum of `of_chunk` over (num_tokens, start_pos) pairs, in one object (the
        gateway prices a burst's prompts per request it admits)."""
        prefill = seqs = kv = attention = 0
        for num_tokens, start_pos in chunks:
            context = start_pos + num_tokens
            kv += context
            if num_tokens == 1:
                seqs += 1
            else:
                prefill += num_tokens
                attention += num_tokens * context
        return cls(prefill, seqs, kv, attention)

    def __add__(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(
            self.prefill_tokens + other.prefill_tokens,
            self.decode_seqs + other.decode_seqs,
            self.kv_tokens_read + other.kv_tokens_read,
            self.prefill_attention + other.prefill_attention,
        )

    def __sub__(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(
            self.prefill_tokens - other.prefill_tokens,
            self.decode_seqs - other.decode_seqs,
            self.kv_tokens_read - other.kv_tokens_read,
            self.prefill_attention - other.prefill_attention,
        )

    def values(self) -> tuple[int, ...]:
        """The values of TERMS, in order (1 for the intercept)."""
        return (
            1,
            self.prefill_tokens,
            self.decode_seqs,
            self.kv_tokens_read,
            self.prefill_attention,
        )

    def vector(self) -> Array:
        """`values()` as an array."""
        return np.array(self.values(), dtype=np.float64)


def step_seconds(coefficients: Sequence[float], features: StepFeatures) -> float:
    """Seconds for a step: `coefficients` (TERMS order) times its features. The one place a
    step is priced (LinearStepCost, StepTimeModel: harvest, admission, the simulator)."""
    a, b, c, d, e = coefficients
    return (
        a
        + b * features.prefill_tokens
        + c * features.decode_seqs
        + d * features.kv_tokens_read
        + e * features.prefill_attention
    )


class StepCost(Protocol):
    """A step-time model: seconds for a step with these features (StepTimeModel, ...).
    Assumed non-decreasing in every feature, as a fit with non-negative coefficients is."""

    def predict(self, features: StepFeatures) -> float: ...


@dataclass(frozen=True)
class LinearStepCost:
    """t = sum of coefficient x term over TERMS (the intercept per step): a step-time model
    frozen at given coefficients (the profile's fit; the simulator's cost model; admission's)."""

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(TERMS):
            raise ValueError(f"{len(TERMS)} coefficients expected ({TERMS})")
        if any(c < 0 for c in self.coefficients):
            raise ValueError(f"coefficients must be >= 0, got {self.coefficients}")

    @classmethod
    def from_dict(cls, coefficients: dict[str, float]) -> LinearStepCost:
        unknown = set(coefficients) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown terms {sorted(unknown)}; terms are {TERMS}")
        return cls(tuple(float(coefficients.get(t, 0.0)) for t in TERMS))

    def predict(self, features: StepFeatures) -> float:
        return step_seconds(self.coefficients, features)


def step_features(scheduler_output: SchedulerOutput) -> StepFeatures:
    """The features of a scheduled step: the sum of its requests' chunks."""
    return StepFeatures.of_chunks(
        (len(s.token_ids), s.start_pos) for s in scheduler_output.scheduled
    )


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: its features and how long the runner took, in seconds."""

    features: StepFeatures
    seconds: float


@dataclass(frozen=True)
class StepModelConfig:
    """How the engine profiles and refits its step-time model.

    `terms` are the model's terms (a subset of TERMS, the intercept always in); the others
    stay at zero. `profile` off starts with no coefficients (predict gives 0) until the
    first online fit. `profile_max_s` caps the start-up profile's duration. The online fit
    keeps the last `window` steps, refits every `refit_interval` steps, and counts each
    profile step `prior_weight` times as much as a recent one: little, so that recent
    steps win wherever they say something, but enough to pin the terms they never vary
    (the prefill slope through a quiet period with decodes only).

    `bias_weight` follows the machine's spells of fast and slow steps, which last seconds
    (over a run's steps the measured/predicted ratio correlates 0.7 from one step to the
    next): every prediction is scaled by an exponential moving average of the recent
    steps' measured / fitted ratios (each clipped to [1/2, 2], so that one stall does not
    swing it), with this weight on the newest; 0 leaves the fit's predictions as they are.
    """

    terms: tuple[str, ...] = TERMS
    profile: bool = True
    profile_max_s: float = 2.0
    window: int = 512
    refit_interval: int = 1
    prior_weight: float = 0.1
    bias_weight: float = 0.2

    def __post_init__(self) -> None:
        unknown = set(self.terms) - set(TERMS)
        if unknown or "intercept" not in self.terms:
            raise ValueError(f"terms must include 'intercept' and come from {TERMS}")
        if self.profile_max_s <= 0:
            raise ValueError(f"profile_max_s must be positive, got {self.profile_max_s}")
        for name in ("window", "refit_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {self.prior_weight}")
        if not 0 <= self.bias_weight <= 1:
            raise ValueError(f"bias_weight must be in [0, 1], got {self.bias_weight}")


def nnls_gram(gram: Array, h: Array) -> Array:
    """argmin x'Gx - 2h'x subject to x >= 0: non-negative least squares from the normal
    equations (G = A'A, h = A'b), by Lawson and Hanson's active-set method. With 5 terms
    the normal equations are 5x5 whatever the window, so a refit takes ~0.1 ms."""
    n = len(h)
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-10 * max(
        float(np.abs(h).max(initial=0.0)), float(np.abs(gram).max(initial=0.0)), 1e-300
    )
    for _ in range(3 * n + 10):
        gradient = h - gram @ x
        candidates = ~passive & (gradient > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        for _ in range(n + 1):
            s = np.zeros(n)
            p = np.flatnonzero(passive)
            s[p] = _solve(gram[np.ix_(p, p)], h[p])
            if (s[p] > 0).all():
                break
            # Step from x toward s until the first passive coefficient reaches zero.
            blocked = passive & (s <= 0)
            gap = x[blocked] - s[blocked]
            alpha = np.min(np.divide(x[blocked], gap, out=np.zeros_like(gap), where=gap > 0))
            x = x + alpha * (s - x)
            passive &= x > 0
            x[~passive] = 0.0
        x = s
    return np.maximum(x, 0.0)  # an iteration cap hit on rounding noise leaves no negatives


def _solve(gram: Array, h: Array) -> Array:
    try:
        return np.asarray(np.linalg.solve(gram, h), dtype=np.float64)
    except np.linalg.LinAlgError:  # collinear columns: any least-squares solution will do
        return np.asarray(np.linalg.lstsq(gram, h, rcond=None)[0], dtype=np.float64)


def nnls(a: Array, b: Array) -> Array:
    """argmin ||a x - b|| subject to x >= 0."""
    return nnls_gram(a.T @ a, a.T @ b)


def relative_rows(samples: Iterable[StepSample]) -> Array:
    """Each sample's TERMS vector divided by its measured time: rows of a least-squares
    problem whose residual against 1 is the relative error."""
    rows = [(*s.features.values(), s.seconds) for s in samples]
    if not rows:
        return np.zeros((0, len(TERMS)))
    x = np.array(rows, dtype=float)
    relative: Array = x[:, :-1] / x[:, -1:]
    return relative


def solve_relative(gram: Array, h: Array, terms: Sequence[str]) -> Array:
    """Coefficients for TERMS (zero outside `terms`) from the weighted normal equations of
    relative rows: G = sum of w r r', h = sum of w r."""
    cols = [TERMS.index(t) for t in terms]
    g = gram[np.ix_(cols, cols)]
    # Columns span 1 to ~1e7 (prefill_attention): normalise them so the solver is stable.
    norms = np.sqrt(np.diag(g))
    norms[norms == 0] = 1.0
    coef = np.zeros(len(TERMS))
    coef[cols] = nnls_gram(g / np.outer(norms, norms), h[cols] / norms) / norms
    return coef


def fit_coefficients(
    samples: Sequence[StepSample],
    terms: Sequence[str] = TERMS,
    weights: Sequence[float] | None = None,
) -> Array:
    """Non-negative coefficients for TERMS (zero outside `terms`) minimising the weighted
    sum of squared relative errors (|predicted - measured| / measured)^2 over `samples`."""
    if any(s.seconds <= 0 for s in samples):
        raise ValueError("a step's measured time must be positive")
    w = np.ones(len(samples)) if weights is None else np.asarray(weights, dtype=float)
    if len(w) != len(samples):
        raise ValueError(f"{len(w)} weights for {len(samples)} samples")
    rows = relative_rows(samples)
    return solve_relative(rows.T @ (rows * w[:, None]), rows.T @ w, terms)


class StepTimeModel:
    """Predicts a step's runner time in seconds; refits itself from measured steps.

    Each observed step is first predicted with the current coefficients, and its relative
    error |predicted - measured| / measured is recorded (out of sample, as the scheduler
    sees it) before the step joins the window.
    """

    def __init__(self, config: StepModelConfig | None = None) -> None:
        self.config = config or StepModelConfig()
        self._priced = LinearStepCost((0.0,) * len(TERMS))  # the fit's coefficients
        self.prior: list[StepSample] = []
        self._prior_gram = np.zeros((len(TERMS), len(TERMS)))
        self._prior_h = np.zeros(len(TERMS))
        # The start-up profile's own fit, never refitted: what this hardware does on the
        # steps it timed, for questions a window of alike recent steps cannot answer
        # (harvest.target_reachable). None without a profile.
        self.profiled: LinearStepCost | None = None
        self._window: deque[StepSample] = deque(maxlen=self.config.window)
        # The window's relative rows, a ring buffer in step with _window.
        self._rows = np.zeros((self.config.window, len(TERMS)))
        # Relative errors of the last `window` predictions, a ring buffer.
        self._errors = np.zeros(self.config.window)
        self._num_errors = 0
        self._since_refit = 0
        self.fitted = False
        self.num_observed = 0
        # Recent steps' measured / fitted time (StepModelConfig.bias_weight): predictions,
        # and the coefficients others price steps with, are the fit's scaled by it.
        self.bias = 1.0

    @property
    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each of TERMS (the intercept in seconds per step), as
        `predict` prices steps: the fit's, scaled by the recent bias."""
        coefficients = self._priced.coefficients
        return {t: c * self.bias for t, c in zip(TERMS, coefficients, strict=True)}

    @property
    def profile_coefficients(self) -> dict[str, float]:
        """`profiled` as term -> value ({} without a profile)."""
        if self.profiled is None:
            return {}
        return {t: c for t, c in zip(TERMS, self.profiled.coefficients, strict=True)}

    @property
    def samples(self) -> list[StepSample]:
        """The recent measured steps the online fit uses, oldest first."""
        return list(self._window)

    def predict(self, features: StepFeatures) -> float:
        return self._priced.predict(features) * self.bias

    def fit(self, samples: Sequence[StepSample]) -> None:
        """Fit on `samples` alone, replacing the coefficients (prior and window unused)."""
        self._set_coefficients(fit_coefficients(samples, self.config.terms))
        self.fitted = len(samples) >= len(self.config.terms)

    def _set_coefficients(self, coef: Array) -> None:
        self._priced = LinearStepCost(tuple(float(c) for c in coef))

    def set_prior(self, samples: Sequence[StepSample]) -> None:
        """Keep `samples` (the start-up profile) in every later fit, and refit now."""
        self.prior = list(samples)
        rows = relative_rows(self.prior) * np.sqrt(self.config.prior_weight)
        self._prior_gram = rows.T @ rows
        self._prior_h = rows.sum(axis=0) * np.sqrt(self.config.prior_weight)
        if self.prior:
            coef = fit_coefficients(self.prior, self.config.terms)
            self.profiled = LinearStepCost(tuple(float(c) for c in coef))
        self.refit()

    def refit(self) -> None:
        rows = self._rows[: len(self._window)]
        gram = self._prior_gram + rows.T @ rows
        coef = solve_relative(gram, self._prior_h + rows.sum(axis=0), self.config.terms)
        self._set_coefficients(coef)
        self.fitted = len(self.prior) + len(self._window) >= len(self.config.terms)
        self._since_refit = 0

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Record a measured step; refit every `refit_interval` steps (and every step until
        there are enough samples for a first fit)."""
        if seconds <= 0:
            return
        vector = features.vector()
        if self.fitted:
            fitted = self._priced.predict(features)
            error = abs(fitted * self.bias - seconds) / seconds
            self._errors[self._num_errors % self.config.window] = error
            self._num_errors += 1
            if fitted > 0:
                ratio = min(max(seconds / fitted, 0.5), 2.0)
                self.bias += self.config.bias_weight * (ratio - self.bias)
        self._rows[self.num_observed % self.config.window] = vector / seconds
        self._window.append(StepSample(features, seconds))
        self.num_observed += 1
        self._since_refit += 1
        if not self.fitted or self._since_refit >= self.config.refit_interval:
            self.refit()

    def prediction_error_quantiles(
        self, quantiles: Sequence[float] = (0.5, 0.99)
    ) -> list[float] | None:
        """Quantiles of the last `window` steps' relative prediction errors, interpolated
        linearly between order statistics (numpy's default method); None before any step
        was predicted."""
        if not self._num_errors:
            return None
        errors = np.sort(self._errors[: min(self._num_errors, self.config.window)])
        # np.quantile costs ~60 us a call; this runs every step, so by hand.
        position = np.asarray(quantiles) * (len(errors) - 1)
        below = np.floor(position).astype(int)
        above = np.minimum(below + 1, len(errors) - 1)
        value = errors[below] + (position - below) * (errors[above] - errors[below])
        return [float(v) for v in value]
