"""tokenfleet: serve one LLM to interactive and batch callers from one shared fleet."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenfleet.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenfleet.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; keep `import tokenfleet` light for the torch-free parts.
    if name in ("LLM", "RequestOutput"):
        from tokenfleet import llm

        return getattr(llm, name)
    raise AttributeError(name)
