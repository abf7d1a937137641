"""The forward passes of an engine's steps, each run inline or on a thread of its own.

With the overlap (EngineConfig.overlap, the default) a step's forward runs on the
"engine-forward" thread while the engine plans the next step (the forward leaves the GIL
to the host in its kernels, as launches on an accelerator do). The next step is planned
before this one's tokens are known, and its inputs are made then too: its decode rows of
requests that sample in this one hold a PLACEHOLDER token (core/request.py), which the
runner fills in at launch from this step's result (Runner.fill_placeholders). Off, the
forward runs inline, after its plan, as it always did.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from tokenfleet.config import EngineConfig
from tokenfleet.core.runner_output import ModelRunnerOutput
from tokenfleet.core.scheduler_output import SchedulerOutput
from tokenfleet.policy.step_model import StepFeatures
from tokenfleet.runner.grammar import TokenMasks


def overlap_wanted(config: EngineConfig) -> bool:
    """EngineConfig.overlap, or when unset: on for the fixed runner (a forward that leaves
    the host alone), off for the model, whose forward here needs the host the planning
    would take (measured slower, docs/benchmarks.md): on a CPU the forward's own threads and
    Python (the mixed load at one thread: batch 30 against 37 tokens/s, TTFT p50 2.0 against
    0.7 s), on an accelerator the Python that issues its kernels one by one, holding the GIL
    (an H200, 64 sequences: 29 ms a step with it, 23 without)."""
    if config.overlap is not None:
        return config.overlap
    return config.runner != "model"


class Runner(Protocol):
    """ModelRunner and FixedTokenRunner: a step's inputs made on the host (`prepare`),
    then its forward pass and sampling (`run`, which the fixed runner's stand-ins for a
    model do without masks)."""

    def prepare(self, so: SchedulerOutput) -> Any: ...

    def fill_placeholders(self, inputs: Any, sampled: Mapping[str, int]) -> None: ...

    def run(self, inputs: Any, masks: TokenMasks | None = None) -> ModelRunnerOutput: ...


class Launched:
    """A step whose forward was started: its plan, its masks, the step-time model's
    features of it, and the forward's (output, seconds) once it is done."""

    def __init__(
        self,
        so: SchedulerOutput,
        masks: TokenMasks | None,
        features: StepFeatures,
        result: Future[tuple[ModelRunnerOutput, float]],
    ) -> None:
        self.so = so
        self.masks = masks
        self.features = features
        self._result = result

    def wait(self) -> tuple[ModelRunnerOutput, float]:
        return self._result.result()


class Forwards:
    """Starts steps' forward passes on `runner`: on one thread beside the engine's loop
    (`overlap`), or inline."""

    def __init__(self, runner: Runner, *, overlap: bool) -> None:
        self.runner = runner
        self.overlap = overlap
        self._thread = (
            ThreadPoolExecutor(1, thread_name_prefix="engine-forward") if overlap else None
        )
        self._started = threading.Event()

    def prepare(self, so: SchedulerOutput) -> Any:
        """The step's inputs, made on the host: with the overlap, while the step before it
        runs (its decode rows' tokens left as placeholders, filled at launch)."""
        return self.runner.prepare(so)

    def launch(
        self,
        so: SchedulerOutput,
        inputs: Any,
        masks: TokenMasks | None,
        features: StepFeatures,
    ) -> Launched:
        """Run the step's forward on `inputs` (`masks`: its constrained rows', being
        filled or to be): on the thread, which this waits to see start (it would
        otherwise wait for the GIL while the engine's loop plans, up to the
        interpreter's switch interval at a time), or inline."""
        if self._thread is None:
            result: Future[tuple[ModelRunnerOutput, float]] = Future()
            result.set_result(self._run(inputs, masks))
        else:
            self._started.clear()
            result = self._thread.submit(self._run, inputs, masks)
            self._started.wait()
        return Launched(so, masks, features, result)

    def _run(self, inputs: Any, masks: TokenMasks | None) -> tuple[ModelRunnerOutput, float]:
        self._started.set()
        began = time.perf_counter()
        try:
            output = self.runner.run(inputs) if masks is None else self.runner.run(inputs, masks)
        finally:
            if masks is not None:
                masks.wait()  # never leave the fill running past the step
        return output, time.perf_counter() - began

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
