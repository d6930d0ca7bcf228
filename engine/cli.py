"""The `headroom` console script: generate, serve, bench."""

from __future__ import annotations

import argparse
import importlib
import sys

from engine.factory import add_engine_args

# Subcommands living beside what they drive; each module has `register(subparsers)`.
COMMAND_MODULES = ("engine.server.cli", "engine.bench.cli")


def _generate(args: argparse.Namespace) -> int:
    from engine.factory import build_engine
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(engine=build_engine(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate([args.prompt], params)[0]
    print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headroom", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate one completion offline")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="render the prompt through the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(g)
    g.set_defaults(func=_generate)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
