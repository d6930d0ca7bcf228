"""Every request field of OpenAI's and vLLM's completions and chat APIs is declared in engine/serving/protocol.py
and implemented, or is listed here: `UNSUPPORTED_OPTIONS` (protocol.py's `UNSUPPORTED`), a 400 naming the field
unless its value is one that changes nothing, each with why; `IGNORED`, fields that never change the answer here.
tests/test_api_fields.py enumerates the openai client's request types and `VLLM_EXTRA_FIELDS` and holds each
field to one of these.
"""

from __future__ import annotations

from typing import Any

# field -> the values that change nothing (None never does); any other value is a 400 naming the field
UNSUPPORTED_OPTIONS: dict[str, tuple[Any, ...]] = {
    # vLLM answers any suffix with a 400 ("suffix is not currently supported"): a suffix needs a model trained
    # for fill-in-the-middle and its FIM token format, and no model served here has one
    "suffix": (),
    "best_of": (1,),  # vLLM v1 removed best_of: more samples than returned is not served
    # per-request Python logits processors: vLLM v1 refuses them (they would run a client's named code here)
    "logits_processors": ([],),
    "audio": (),  # no model served here speaks: audio output cannot be made
    "modalities": (["text"],),  # the same: text is the only output modality
    "web_search_options": (),  # this server cannot search the web
    "moderation": (),  # no moderation model runs here to score or block the input and output
    "verbosity": ("medium",),  # no model served here has a verbosity control; OpenAI's default changes nothing
    "logprob_token_ids": (),  # vLLM's scoring of chosen token ids: not implemented
    "watermarking": (False,),  # vLLM's output watermark: not implemented
    "repetition_detection": (),  # vLLM's n-gram repetition stop: not implemented
    "thinking_token_budget": (-1,),  # no reasoning parser runs here to count thinking tokens (-1: unlimited)
    "early_stopping": (False,),  # vLLM's beam search stops when its beams are done; no early stop
    "priority": (0,),  # vLLM: a priority needs priority scheduling, which this scheduler does not have
    "stream_interval": (1,),  # every streamed chunk carries what one step produced
    "return_prompt_text": (False,),  # vLLM's rendered prompt in the answer: not implemented
    "cache_salt": (),  # salting the prefix cache per tenant is not implemented: not isolated, so not accepted
    "kv_transfer_params": (),  # disaggregated prefill/decode: not served
    "ec_transfer_params": (),  # disaggregated encoders: not served
    "vllm_xargs": ({},),  # arguments for vLLM plugins: none run here
    "prompt_embeds": (),  # prompts are text or token ids; embeddings are not taken
    "media_io_kwargs": ({},),  # only text content is taken: there is no media to load
    "mm_processor_kwargs": ({},),  # the same: no multimodal processor runs
}

# Fields of OpenAI's and vLLM's APIs that never change the answer here: accepted and not used. Bookkeeping,
# storage and routing hints (user, metadata, store, safety_identifier, service_tier, session_id), prompt
# caching hints (prefix caching is automatic), predicted outputs (OpenAI's only change the latency), and
# options of what this server does not have: render endpoints (return_token_offsets, return_mm_kwargs),
# MoE routing data (routed_experts_prompt_start), and a reasoning parser (include_reasoning: there is no
# reasoning text to include or leave out).
IGNORED = frozenset(
    {
        "user", "metadata", "store", "safety_identifier", "service_tier", "session_id", "prompt_cache_key",
        "prompt_cache_retention", "prompt_cache_options", "prediction", "return_token_offsets",
        "return_mm_kwargs", "routed_experts_prompt_start", "include_reasoning",
    }
)  # fmt: skip

# vLLM's request fields beyond OpenAI's (vllm/entrypoints/openai/completion/protocol.py and
# chat_completion/protocol.py: their sampling params, their extra params, and the older ones still sent),
# by endpoint: each is declared in protocol.py, refused (protocol.py's UNSUPPORTED) or IGNORED.
_VLLM_BOTH = frozenset(
    {
        "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty",
        "early_stopping", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
        "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side",
        "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words", "add_special_tokens",
        "response_format", "structured_outputs", "priority", "request_id", "session_id",
        "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
        "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
        "repetition_detection", "thinking_token_budget", "stream_interval", "logits_processors", "guided_json",
        "guided_regex", "guided_choice", "guided_grammar",
    }
)  # fmt: skip
VLLM_EXTRA_FIELDS = {
    "completions": _VLLM_BOTH | {"prompt_embeds"},
    "chat": _VLLM_BOTH | {
        "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
        "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "return_prompt_text", "include_reasoning",
    },
}  # fmt: skip
