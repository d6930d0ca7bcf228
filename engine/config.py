"""What an engine and a server are made of, in one place: frozen dataclasses, validated once.

Each field is documented once, in its `help`: the CLI builds its flags from these fields (engine/cli.py),
`LLM(...)` builds the config from keyword arguments, and a replica in another process gets the same engine
from `to_json()` / `from_json()`. An unknown or misspelled field is an error that names it, never dropped.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from telemetry.units import parse_bytes

POLICIES = ("adaptive", "fixed", "seed-static", "vllm")
ROUTERS = ("headroom", "default")
BACKENDS = ("torch", "twin")
DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1")  # engine/model/quant.py says what each means
ATTENTIONS = ("auto", "cpu", "sdpa", "flash")
TWIN_SENSORS = ("ideal", "realistic")
FIXED_STEPS = ("seed", "mixed")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # engine/serving/tool_parsers.py


class ConfigError(ValueError):
    """A configuration that can never build: the message names the field."""


def _opt(
    default: Any, help: str, choices: tuple[str, ...] | None = None, group: str = "engine", flag: str | None = None
) -> Any:
    """A field with its one documentation; `flag` names its CLI flag where that is not --field-name."""
    return field(default=default, metadata={"help": help, "choices": choices, "group": group, "flag": flag})


class _Config:
    """Construction from a mapping that names every field it sets, and the JSON round trip."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> Self:
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = [k for k in values if k not in names]
        if unknown:
            hints = [f"{k!r}" + _did_you_mean(k, names) for k in unknown]
            raise ConfigError(f"{source}: unknown {cls.__name__} field {', '.join(hints)}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls.from_dict(json.loads(text), source="JSON")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def _check_choices(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ConfigError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")

    def _check_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive; got {value}")


def _did_you_mean(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class EngineConfig(_Config):
    model: str = _opt("default", "'default' (SmolLM2-135M-Instruct), a GGUF file or an HF directory")
    backend: str = _opt("torch", "torch (the real model) or twin (a simulated RTX 4090 + Llama-3.1-8B)", BACKENDS)
    profile: str = _opt("rtx4090-llama3.1-8b", "twin profile")
    device: str = _opt("auto", "torch device: auto, cpu, cuda, cuda:N")
    dtype: str = _opt(
        "auto", "weights and KV dtype; auto: bf16 on CUDA and on CPUs with AMX-BF16/AVX512-BF16, else float32", DTYPES
    )
    kv_cache_dtype: str = _opt(
        "auto", "KV cache dtype; auto: the model's, except float16 where the CPU kernel runs an auto-chosen float32 "
        "model (half the KV bytes read a step and half its RSS); another dtype than the model's: float16 on the "
        "CPU kernel only", DTYPES,
    )  # fmt: skip
    quantization: str = _opt(
        "auto",
        "linear weights; auto: a GGUF's Q8_0/Q4_0/Q4_1 weights served as they ship where the CPU kernels "
        "run (dequantized on CUDA); none: dequantized; q8_0/q4_0/q4_1: every linear quantized to it (CPU)",
        QUANTIZATIONS,
    )
    attention: str = _opt(
        "auto",
        "attention kernel; auto: on CPU, cpu (the C++ paged kernel, built with g++ on first use; sdpa without "
        "a compiler); on CUDA, flash (flash-attn paged KV) with flash_attn and a 16-bit dtype, else sdpa",
        ATTENTIONS,
    )
    num_blocks: int | None = _opt(None, "KV blocks (default: the backend's choice)")
    block_size: int | None = _opt(
        None, "tokens per KV block (default: 256 for flash, which pages only multiples of 256; 16 for sdpa; twin 256)"
    )
    device_memory: str | None = _opt(None, "emulated device capacity on CPU, e.g. 2GiB")
    max_model_len: int | None = _opt(None, "cap the context length")
    enable_prefix_caching: bool = _opt(
        True, "reuse the KV of full blocks an earlier request computed for the same prefix (as vLLM v1)"
    )
    model_cache: bool = _opt(
        True, "keep the converted weights and tokenizer in $HEADROOM_CACHE_DIR (default ~/.cache/headroom), "
        "so that the next start skips converting the model",
    )  # fmt: skip
    inject_oom_rate: float = _opt(0.0, "test hook: fail this fraction of steps with an OOM")
    inject_oom_rank: int | None = _opt(
        None, "test hook, tensor parallel: --inject-oom-rate's OOMs strike inside this rank's forward only"
    )
    tensor_parallel_size: int = _opt(
        1, "shard the model over this many ranks: torch, one process each (gloo on the CPU, NCCL on CUDA, one "
        "GPU a rank), a size that divides the attention heads; twin, 2 (two RTX 4090s on PCIe, no NVLink)",
    )  # fmt: skip
    enforce_eager: bool = _opt(False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs (vLLM's flag)")
    realtime: bool = _opt(False, "twin: sleep each modelled step so virtual time tracks wall time")
    twin_sensors: str = _opt(
        "realistic", "twin: realistic (NVML device-wide and read every 0.1 s, CUDA graph pools and cuBLAS "
        "workspaces; engine/backends/twin/sensors.py) or ideal (exact bytes every step, as the calibration "
        "facts were taken; for comparison)", TWIN_SENSORS,
    )  # fmt: skip
    policy: str = _opt("adaptive", "who sets the batch limits", POLICIES, "policy")
    controller_config: str | None = _opt(None, "adaptive: controller config TOML", group="policy", flag="--config")
    # The `fixed` policy's caps (controller/limits.py says where each is enforced); None: uncapped.
    max_num_seqs: int | None = _opt(None, "fixed: running sequences", group="policy")
    max_prefill_seqs: int | None = _opt(None, "fixed: prompts (or chunks) per step", group="policy")
    max_decode_seqs: int | None = _opt(None, "fixed: decodes per step", group="policy")
    max_prefill_tokens: int | None = _opt(None, "fixed: prompt tokens per step", group="policy")
    max_num_batched_tokens: int | None = _opt(None, "fixed: tokens per step, decodes included", group="policy")
    kv_reserve_ratio: float | None = _opt(None, "fixed: share of max_tokens held in KV on admission", group="policy")
    fixed_steps: str | None = _opt(
        None, "fixed: how a step is packed: seed (prefill-only while prompts wait, as the seed engine) or mixed "
        "(decodes first, prompt chunks fill the rest, as vLLM v1)", FIXED_STEPS, "policy",
    )  # fmt: skip

    FIXED_CAPS = ("max_num_seqs", "max_prefill_seqs", "max_decode_seqs", "max_prefill_tokens",
                  "max_num_batched_tokens", "kv_reserve_ratio", "fixed_steps")  # fmt: skip

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_positive("num_blocks", "block_size", "max_model_len", "tensor_parallel_size", *self.FIXED_CAPS[:5])
        self._check_tensor_parallel()
        if not 0.0 <= self.inject_oom_rate < 1.0:
            raise ConfigError(f"inject_oom_rate must be in [0, 1); got {self.inject_oom_rate}")
        if self.kv_reserve_ratio is not None and not 0.0 <= self.kv_reserve_ratio <= 1.0:
            raise ConfigError(f"kv_reserve_ratio must be in [0, 1]; got {self.kv_reserve_ratio}")
        if self.device_memory is not None:
            try:
                parse_bytes(self.device_memory)
            except ValueError as e:
                raise ConfigError(f"device_memory: {e}") from e
        caps = [name for name in self.FIXED_CAPS if getattr(self, name) is not None]
        if caps and self.policy != "fixed":
            raise ConfigError(f"{', '.join(caps)}: caps of the fixed policy, not of policy {self.policy!r}")

    def _check_tensor_parallel(self) -> None:
        rank = self.inject_oom_rank
        if rank is not None and not 0 <= rank < self.tensor_parallel_size:
            raise ConfigError(f"inject_oom_rank must be a rank below tensor_parallel_size; got {rank}")
        if self.backend == "twin" and self.tensor_parallel_size not in (1, 2):
            raise ConfigError("tensor_parallel_size: the twin models one RTX 4090, or two (size 2)")
        if self.backend == "twin" and rank is not None:
            raise ConfigError("inject_oom_rank: the twin injects OOMs into whole steps (inject_oom_rate)")

    def fixed_caps(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.FIXED_CAPS if getattr(self, name) is not None}


@dataclass(frozen=True)
class ServerConfig(_Config):
    host: str = _opt("127.0.0.1", "bind address; beyond loopback, set --api-key and --admin-key", group="server")
    port: int = _opt(8000, "0 picks a free port (the ready line shows it)", group="server")
    served_model_name: tuple[str, ...] = _opt(
        (), "names requests may use; responses carry the first (default: the model's own name and --model)",
        group="server",
    )  # fmt: skip
    api_key: str | None = _opt(None, "Bearer token required on /v1/* (default: $HEADROOM_API_KEY)", group="server")
    admin_key: str | None = _opt(
        None, "Bearer token required on PATCH /controller/config (default: $HEADROOM_ADMIN_KEY, else --api-key; "
        "with neither, that endpoint is open on loopback and refused beyond it)", group="server",
    )  # fmt: skip
    max_waiting: int = _opt(256, "requests queued for admission before new ones get 429", group="server")
    shutdown_grace: float = _opt(
        30.0, "on SIGTERM/SIGINT: stop admitting (503), let open requests finish this long, then abort them",
        group="server",
    )  # fmt: skip
    trace_file: str | None = _opt(None, "write every step record as a JSON line here", group="server")
    log_level: str = _opt("info", "server log level", ("debug", "info", "warning", "error"), "server")
    tool_call_parser: str | None = _opt(
        None, "how tool_choice auto finds tool calls in the model's text: hermes (<tool_call>{...}</tool_call>) or "
        "llama3_json; without it, auto with tools is a 400 (as vLLM's --enable-auto-tool-choice)",
        TOOL_CALL_PARSERS, "server",
    )  # fmt: skip
    trust_request_chat_template: bool = _opt(
        False, "render a request's own chat_template (in the sandboxed Jinja environment the model's runs in); "
        "without it such a request is a 400, as vLLM's --trust-request-chat-template",
        group="server",
    )  # fmt: skip
    replicas: int = _opt(
        1, "engine replicas behind one port on Ray Serve (1 with no --ray-address: one process, no Ray)",
        group="fleet",
    )  # fmt: skip
    ray_address: str | None = _opt(
        None, "join this Ray cluster (e.g. 10.0.0.1:6379 or auto) instead of starting a local one", group="fleet"
    )
    router: str = _opt(
        "headroom", "fleet: headroom (by each replica's measured prompt headroom) or default (Ray's pow-2 by queue)",
        ROUTERS, "fleet",
    )  # fmt: skip
    max_resends: int = _opt(
        2, "fleet: how often a request whose replica died is sent to another (a begun stream resumes there); "
        "past it, a 503", group="fleet",
    )  # fmt: skip

    def __post_init__(self) -> None:
        object.__setattr__(self, "served_model_name", tuple(self.served_model_name))  # JSON gives a list
        self._check_choices()
        self._check_positive("max_waiting", "replicas")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535]; got {self.port}")
        if self.max_resends < 0:
            raise ConfigError(f"max_resends must be 0 or more; got {self.max_resends}")
        if self.shutdown_grace < 0:
            raise ConfigError(f"shutdown_grace must not be negative; got {self.shutdown_grace}")

    @property
    def on_ray(self) -> bool:
        """Served by a Ray Serve fleet rather than by one process."""
        return self.replicas > 1 or self.ray_address is not None
