"""The offline API: `LLM(...).generate(prompts, params)`, vLLM-style."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.factory import build_engine


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    num_preemptions: int


class LLM:
    def __init__(self, model: str = "default", engine: LLMEngine | None = None, **engine_options: object) -> None:
        """Options are EngineConfig's fields (policy, num_blocks, block_size, ...); a misspelled one is a
        ConfigError that names it. Offline runs default to the `fixed` policy (no caps: the whole batch at once)."""
        if engine is None:
            cfg = EngineConfig.from_dict({"model": model, "policy": "fixed", **engine_options}, "LLM()")
            engine = build_engine(cfg)
        self.engine = engine
        self.tokenizer = self.engine.backend.tokenizer
        self._next_id = 0

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Submit every prompt at once (continuous batching) and run the engine until all finish. A text prompt
        gets the tokenizer's special tokens (BOS where the model's config says so), as vLLM's does."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        seqs: list[Sequence] = []
        for prompt, p in zip(prompts, params_list, strict=True):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
            seqs.append(self.engine.add_request(str(self._next_id), ids, p))
            self._next_id += 1
        while self.engine.has_unfinished():
            self.engine.step()
        return [self._output(s) for s in seqs]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> CompletionOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the template writes BOS itself
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], params)[0]

    def _output(self, seq: Sequence) -> CompletionOutput:
        text = self.tokenizer.decode(seq.output_ids) if self.tokenizer else ""
        if seq.stop_text_len is not None:
            text = text[: seq.stop_text_len]
        return CompletionOutput(text, seq.output_ids, seq.prompt_ids, seq.finish_reason, seq.num_preemptions)
