"""Build an engine (backend + policy) from an EngineConfig; shared by generate, serve, bench and `LLM`."""

from __future__ import annotations

from controller.baselines import FixedPolicy, SeedStaticPolicy, VllmPolicy
from controller.policy import Policy
from engine.config import EngineConfig
from engine.faults import OOMInjector
from engine.llm_engine import Backend, LLMEngine

# EngineConfig's fixed caps whose Limits field has another name.
LIMIT_NAMES = {"max_num_batched_tokens": "max_batched_tokens", "mixed": "allow_mixed"}


def build_policy(cfg: EngineConfig) -> Policy:
    if cfg.policy == "seed-static":
        return SeedStaticPolicy()
    if cfg.policy == "vllm":
        return VllmPolicy()
    if cfg.policy == "adaptive":
        from controller.adaptive import AdaptivePolicy
        from controller.config import load_config

        return AdaptivePolicy(load_config(cfg.controller_config))
    return FixedPolicy(**{LIMIT_NAMES.get(k, k): v for k, v in cfg.fixed_caps().items()})


def build_backend(cfg: EngineConfig) -> Backend:
    backend = _plain_backend(cfg)
    return OOMInjector(backend, cfg.inject_oom_rate) if cfg.inject_oom_rate else backend


def _plain_backend(cfg: EngineConfig) -> Backend:
    if cfg.backend == "twin":
        from engine.twin.backend import TwinBackend

        return TwinBackend(
            profile=cfg.profile,
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            realtime=cfg.realtime,
            max_model_len=cfg.max_model_len,
        )
    from engine.torch_backend import TorchBackend

    return TorchBackend(
        cfg.model,
        dtype=cfg.dtype,
        device=cfg.device,
        num_blocks=cfg.num_blocks,
        block_size=cfg.block_size or 16,
        attention=cfg.attention,
        device_memory=cfg.device_memory,
        max_model_len=cfg.max_model_len,
    )


def build_engine(cfg: EngineConfig) -> LLMEngine:
    return LLMEngine(build_backend(cfg), build_policy(cfg))
