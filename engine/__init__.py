"""The plant: model, loaders, KV cache, scheduler, backends, API server and CLI."""

from engine.core.sampling_params import SamplingParams
from engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]
