"""Build an engine (backend + policy) from an EngineConfig; shared by generate, serve, bench and `LLM`."""

from __future__ import annotations

import dataclasses

from controller.policy import Policy
from engine.baselines.seed import FixedPolicy, SeedStaticPolicy
from engine.baselines.vllm import VllmPolicy
from engine.config import EngineConfig
from engine.core.backend import Backend
from engine.core.faults import OOMInjector
from engine.core.llm_engine import LLMEngine
from telemetry.probes.cgroup import cgroup_limit


def build_policy(cfg: EngineConfig) -> Policy:
    """The policy by name; a baseline's (engine/baselines/) brings its engine's scheduler and OOM rules."""
    if cfg.policy == "seed-static":
        return SeedStaticPolicy()
    if cfg.policy == "vllm":
        return VllmPolicy()
    if cfg.policy == "adaptive":
        from controller.adaptive import AdaptivePolicy
        from controller.config import load_config

        return AdaptivePolicy(load_config(cfg.controller_config, plant_defaults=controller_defaults(cfg)))
    return FixedPolicy.from_config(cfg.fixed_caps())


# The controller's defaults on every CPU plant. The CPU probe counts tensor bytes exactly (telemetry/probes/
# cpu.py): none of the CUDA caching allocator's 2 MiB and 20 MiB segment rounding, which the 16 MiB default
# margin floor covers. On a small CPU plant that floor, held under each step's bound and under what a step
# retains, takes nearly all the room a sized pool leaves for steps, so a burst of long prompts goes through in
# chunks of a few dozen tokens and takes several times as long as with 1 MiB (bench/results/cgroup_plant.md).
CPU_CONTROLLER_DEFAULTS: dict[str, float] = {"margin_floor_mib": 1.0}

# And on a CPU whose memory is not a bound (`memory_bounded`). Its memory law lets a burst of prompts into
# one prefill step of up to max_prefill_tokens (16,384) where memory allows, and there it always does; but a
# CPU step's time grows with its tokens and every running decode waits for it. The linears run about as fast
# at 512 rows as at 2,048, so smaller prefill steps start a burst's prompts sooner at the same output rate
# (the sweep is in bench/results/cpu_vs_vllm.md). Prompts under 512 tokens are not affected. A config file or
# HEADROOM_CONTROLLER_MAX_PREFILL_TOKENS overrides it.
CPU_UNBOUNDED_DEFAULTS: dict[str, float] = {"max_prefill_tokens": 512}


def memory_bounded(cfg: EngineConfig) -> bool:
    """Whether the device's capacity is a real bound: the twin, a CUDA device, a CPU with --device-memory, or
    a CPU under a memory cgroup limit. On a plain CPU the capacity is all of the host's RAM."""
    return (
        cfg.backend == "twin"
        or cfg.device_memory is not None
        or cfg.device.startswith("cuda")
        or cgroup_limit() is not None
    )


def controller_defaults(cfg: EngineConfig) -> dict[str, float]:
    """The adaptive controller's defaults for this engine's plant: CPU_CONTROLLER_DEFAULTS on a CPU, with
    CPU_UNBOUNDED_DEFAULTS where its memory is not a bound (there latency binds first); none elsewhere."""
    if cfg.backend == "twin":
        return {}
    from engine.backends.torch_backend import resolve_device

    if resolve_device(cfg.device).type != "cpu":
        return {}
    return CPU_CONTROLLER_DEFAULTS if memory_bounded(cfg) else CPU_CONTROLLER_DEFAULTS | CPU_UNBOUNDED_DEFAULTS


def build_backend(cfg: EngineConfig) -> Backend:
    backend = _plain_backend(cfg)
    whole_step = cfg.inject_oom_rate and cfg.inject_oom_rank is None  # else the rank's forward fails (tp_executor)
    return OOMInjector(backend, cfg.inject_oom_rate) if whole_step else backend


def _plain_backend(cfg: EngineConfig) -> Backend:
    if cfg.backend == "twin" and cfg.tensor_parallel_size > 1:
        from engine.backends.twin.tensor_parallel import TwinGroup

        return TwinGroup(
            cfg.tensor_parallel_size, cfg.profile, cfg.num_blocks, cfg.block_size, cfg.max_model_len, cfg.twin_sensors
        )
    if cfg.backend == "twin":
        from engine.backends.twin.backend import TwinBackend

        return TwinBackend(
            profile=cfg.profile,
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            realtime=cfg.realtime,
            max_model_len=cfg.max_model_len,
            sensors=cfg.twin_sensors,
        )
    kwargs = {
        "model": cfg.model,
        "dtype": cfg.dtype,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "device": cfg.device,
        "quantization": cfg.quantization,
        "num_blocks": cfg.num_blocks,
        "block_size": cfg.block_size,
        "attention": cfg.attention,
        "device_memory": cfg.device_memory,
        "max_model_len": cfg.max_model_len,
        "model_cache": cfg.model_cache,
        "enforce_eager": cfg.enforce_eager,
    }
    if cfg.tensor_parallel_size > 1:
        from engine.backends.tp_executor import TensorParallelBackend

        return TensorParallelBackend(cfg.tensor_parallel_size, kwargs, cfg.inject_oom_rank, cfg.inject_oom_rate)
    from engine.backends.torch_backend import TorchBackend

    return TorchBackend(**kwargs)


def sizes_kv_pool(cfg: EngineConfig) -> bool:
    """Without --num-blocks the adaptive controller sizes the pool (engine/core/kv/sizing.py) where the capacity is
    a real bound (`memory_bounded`). On a plain CPU the capacity is all of the host's RAM, which is not the
    engine's to fill, so the default pool stays, as it does for every other policy."""
    return cfg.num_blocks is None and cfg.policy == "adaptive" and memory_bounded(cfg)


def build_engine(cfg: EngineConfig) -> LLMEngine:
    policy = build_policy(cfg)
    wanted = policy.kv_pool_profile() if sizes_kv_pool(cfg) else None
    if wanted is None:
        return LLMEngine(build_backend(cfg), policy, cfg.enable_prefix_caching)
    from engine.core.kv.sizing import profile_blocks, size_kv_pool

    block_size = cfg.block_size or _default_block_size(cfg)
    start = profile_blocks(wanted.prefill_tokens, block_size)
    backend = build_backend(dataclasses.replace(cfg, num_blocks=start, block_size=block_size))
    engine = LLMEngine(backend, policy, cfg.enable_prefix_caching)
    size_kv_pool(engine)
    if cfg.backend == "torch":  # a copied pool's resize dropped the graphs (the twin's pool is resized in place)
        backend.capture_graphs()
    return engine


def _default_block_size(cfg: EngineConfig) -> int:
    if cfg.backend == "twin":
        from engine.backends.twin.profile import load_profile

        return int(load_profile(cfg.profile).section("engine")["default_block_size"])
    from engine.backends.torch_backend import kernel_for

    return kernel_for(cfg.attention, cfg.block_size, cfg.device, cfg.dtype).block_size
