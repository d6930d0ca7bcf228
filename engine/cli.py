"""The command line's engine side: flags built from the config dataclasses (engine/config.py: each field is one
flag, documented once there) and the `generate` command. The `headroom` script itself is headroom/cli.py."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from functools import partial
from typing import Any, TypeVar

from engine.config import ConfigError, EngineConfig

C = TypeVar("C")


def add_config_flags(p: argparse.ArgumentParser, cls: type, **defaults: Any) -> None:
    """One flag per field of a config dataclass, with the field's help and choices; `defaults` are this
    command's own defaults where they differ from the dataclass's."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta, hint = f.metadata, hints[f.name]
        if meta["group"] not in groups:
            groups[meta["group"]] = p.add_argument_group(meta["group"])
        kw: dict[str, Any] = {"dest": f.name, "default": defaults.get(f.name, f.default), "help": meta["help"]}
        kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
        if typing.get_origin(hint) is tuple:
            kw.update(nargs="+", metavar="NAME")
        elif kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=kind, choices=meta["choices"])
        groups[meta["group"]].add_argument(meta["flag"] or "--" + f.name.replace("_", "-"), **kw)


def config_from_args(p: argparse.ArgumentParser, cls: type[C], args: argparse.Namespace) -> C:
    """The config the parsed flags describe; an invalid one is a usage error that names the field (exit 2)."""
    try:
        return cls.from_dict({f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}, "command line")
    except ConfigError as e:
        p.error(str(e))


def engine_config(argv: list[str] | None = None, **defaults: Any) -> EngineConfig:
    """An EngineConfig from engine flags alone, as the CLI would parse them (bench scripts, tests)."""
    p = argparse.ArgumentParser(prog="headroom")
    add_config_flags(p, EngineConfig, **defaults)
    return config_from_args(p, EngineConfig, p.parse_args(argv or []))


def _generate(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from engine.core.sampling_params import SamplingParams
    from engine.factory import build_engine
    from engine.llm import LLM

    llm = LLM(engine=build_engine(config_from_args(p, EngineConfig, args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate([args.prompt], params)[0]
    print(out.text)
    return 0


def register(subparsers: Any) -> None:
    g = subparsers.add_parser("generate", help="generate one completion offline")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="render the prompt through the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    add_config_flags(g, EngineConfig, policy="fixed")
    g.set_defaults(func=partial(_generate, g))
