"""The tpinfer runtime: ``from runtime import LLM, SamplingParams``."""

from runtime.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):  # noqa: ANN202 - keep `import runtime` light (no torch until needed)
    if name in ("LLM", "RequestOutput"):
        from runtime.frontend import llm

        return getattr(llm, name)
    raise AttributeError(name)
