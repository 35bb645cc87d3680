"""The `tokenyard` command: `tokenyard up`, `tokenyard generate`, `tokenyard bench ...`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenyard")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline with the engine")
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--model", default=None)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    return 2


def _generate(args: argparse.Namespace) -> int:
    from tokenyard import LLM, SamplingParams

    llm = LLM(model=args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    prompt = " ".join(args.prompt) or "Tell me about paged attention in one sentence."
    out = llm.generate([[{"role": "user", "content": prompt}]], params)[0]
    print(out.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
