"""The offline API: `LLM(...).generate(prompts, params)`, vLLM-style."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, TokenLogprob
from engine.core.structured import check as check_structured
from engine.factory import build_engine
from engine.frontend.bad_words import with_bad_words_tokenized
from engine.frontend.output_processor import OutputProcessor


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    num_preemptions: int
    prompt_logprobs: list[TokenLogprob | None] | None = None  # where SamplingParams.prompt_logprobs asked (first: None)


class LLM:
    def __init__(self, model: str = "default", engine: LLMEngine | None = None, **engine_options: object) -> None:
        """Options are EngineConfig's fields (policy, num_blocks, block_size, ...); a misspelled one is a
        ConfigError that names it. Offline runs default to the `fixed` policy (no caps: the whole batch at once)."""
        if engine is None:
            cfg = EngineConfig.from_dict({"model": model, "policy": "fixed", **engine_options}, "LLM()")
            engine = build_engine(cfg)
        self.engine = engine
        self.tokenizer = self.engine.backend.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self._next_id = 0

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Submit every prompt at once (continuous batching) and run the engine until all finish. A text prompt
        gets the tokenizer's special tokens (BOS where the model's config says so), as vLLM's does."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        for p in params_list:  # every grammar compiles before any request is taken (a bad one raises GrammarError)
            check_structured(p.structured, self.tokenizer, self.engine.backend.vocab_size)
        seqs: list[Sequence] = []
        for prompt, p in zip(prompts, params_list, strict=True):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
            p = with_bad_words_tokenized(p, self.tokenizer)
            seqs.append(self.engine.add_request(str(self._next_id), ids, p))
            self.processor.add_request(str(self._next_id), p, ids)
            self._next_id += 1
        texts = {seq.request_id: "" for seq in seqs}
        reasons: dict[str, str | None] = {}  # the processor's: a stop string the last token completed is "stop"
        while self.engine.has_unfinished():
            processed = self.processor.process(self.engine.step())
            for request_id in processed.to_abort:  # a stop string ended it: free its KV before the next step
                self.engine.abort(request_id, "stop")
            for out in processed.outputs:
                texts[out.request_id] += out.text
                reasons[out.request_id] = out.finish_reason
        return [
            CompletionOutput(
                texts[s.request_id],
                s.output_ids,
                list(s.prompt_ids),
                reasons[s.request_id],
                s.num_preemptions,
                s.prompt_logprobs if s.params.prompt_logprobs is not None else None,
            )
            for s in seqs
        ]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> CompletionOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the template writes BOS itself
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], params)[0]
