"""Build an engine (backend + policy) from CLI arguments; shared by generate, serve and bench."""

from __future__ import annotations

import argparse

from controller.baselines import FixedPolicy, SeedStaticPolicy, VllmPolicy
from controller.limits import Limits
from controller.policy import Policy
from engine.faults import OOMInjector
from engine.llm_engine import Backend, LLMEngine

POLICIES = ("adaptive", "fixed", "seed-static", "vllm")
# CLI flag -> Limits field, for the `fixed` policy's caps.
FIXED_CAPS = {
    "max_num_seqs": int,
    "max_prefill_seqs": int,
    "max_decode_seqs": int,
    "max_prefill_tokens": int,
    "max_num_batched_tokens": int,
    "kv_reserve_ratio": float,
}


def add_engine_args(p: argparse.ArgumentParser, default_backend: str = "torch", default_policy: str = "fixed") -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a GGUF file or an HF dir")
    g.add_argument("--backend", choices=("torch", "twin"), default=default_backend)
    g.add_argument("--profile", default="rtx4090-llama3.1-8b", help="twin profile")
    g.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    g.add_argument("--attention", default="auto", choices=("auto", "sdpa", "flash"))
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: backend's choice)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (torch 16, twin: profile's)")
    g.add_argument("--device-memory", default=None, help="emulated device capacity on CPU, e.g. 2GiB")
    g.add_argument("--max-model-len", type=int, default=None, help="cap the context length")
    g.add_argument("--inject-oom-rate", type=float, default=0.0, help="test hook: fail this fraction of steps")
    g = p.add_argument_group("policy")
    g.add_argument("--policy", choices=POLICIES, default=default_policy)
    g.add_argument("--config", default=None, help="controller config TOML")
    for name, kind in FIXED_CAPS.items():
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help="fixed policy cap")
    g.add_argument(
        "--mixed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fixed: prefill and decode may share a step",
    )
    g.add_argument(
        "--prefill-first",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fixed: a step with waiting prompts is prefill-only",
    )


def build_policy(args: argparse.Namespace) -> Policy:
    if args.policy == "seed-static":
        return SeedStaticPolicy()
    if args.policy == "vllm":
        return VllmPolicy()
    if args.policy == "adaptive":
        from controller.adaptive import AdaptivePolicy
        from controller.config import load_config

        return AdaptivePolicy(load_config(args.config))
    caps: dict = {k: getattr(args, k) for k in FIXED_CAPS if getattr(args, k) is not None}
    if "max_num_batched_tokens" in caps:
        caps["max_batched_tokens"] = caps.pop("max_num_batched_tokens")
    if args.mixed is not None:
        caps["allow_mixed"] = args.mixed
    if args.prefill_first is not None:
        caps["prefill_first"] = args.prefill_first
    assert set(caps) <= set(Limits.__dataclass_fields__)
    return FixedPolicy(**caps)


def build_backend(args: argparse.Namespace) -> Backend:
    backend = _plain_backend(args)
    return OOMInjector(backend, args.inject_oom_rate) if args.inject_oom_rate else backend


def _plain_backend(args: argparse.Namespace) -> Backend:
    if args.backend == "twin":
        from engine.twin.backend import TwinBackend

        return TwinBackend(
            profile=args.profile,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            realtime=getattr(args, "realtime", False),
        )
    from engine.torch_backend import TorchBackend

    return TorchBackend(
        args.model,
        dtype=args.dtype,
        device=args.device,
        num_blocks=args.num_blocks,
        block_size=args.block_size or 16,
        attention=args.attention,
        device_memory=args.device_memory,
        max_model_len=args.max_model_len,
    )


def build_engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(build_backend(args), build_policy(args))


def engine_args(argv: list[str] | None = None, **defaults: object) -> argparse.Namespace:
    """Engine arguments as the CLI would parse them; for the offline API and tests."""
    p = argparse.ArgumentParser()
    add_engine_args(p)
    p.set_defaults(**defaults)
    return p.parse_args(argv or [])
