"""The plant: model, loaders, KV cache, scheduler, backends, API server and CLI."""

from engine.llm import LLM
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
