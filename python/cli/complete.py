"""`radixgen complete [PROMPT]`: complete one prompt (the argument, or stdin) and print the text as it comes."""

from __future__ import annotations

import argparse
import json
import sys

from radixgen.cli.chat import open_model
from radixgen.cli.common import add_engine_args, add_remote_args, add_sampling_args, sampling_from_args

DESCRIPTION = __doc__.removeprefix("`radixgen complete [PROMPT]`: ")
USAGE = ("radixgen complete [PROMPT | -] [--model M | --url URL [--api-key KEY]] [--chat] [--json] "
         "[sampling flags] [engine flags]")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt; '-' or none: read stdin")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    parser.add_argument("--json", action="store_true", help="print one JSON object: text and token counts")
    parser.set_defaults(model_path=None)  # the model: --model (chat also takes it as a positional MODEL)
    add_remote_args(parser)
    add_engine_args(parser)
    add_sampling_args(parser)  # after the engine's flags: a sampling field whose flag they hold is --set's


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sampling = sampling_from_args(args, parser)
    if args.prompt is None or args.prompt == "-":
        if sys.stdin.isatty() and args.prompt is None:
            parser.error("argument PROMPT: give a prompt, or pipe one on stdin")
        prompt = sys.stdin.read()
    else:
        prompt = args.prompt
    if not prompt:
        parser.error("argument PROMPT: the prompt is empty")
    try:
        model = open_model(args, parser)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"radixgen complete: {e}", file=sys.stderr)
        return 1
    try:
        pieces = model.chat([{"role": "user", "content": prompt}], sampling) if args.chat else \
            model.complete(prompt, sampling)
        text = []
        for piece in pieces:
            text.append(piece)
            if not args.json:
                print(piece, end="", flush=True)
        stats = model.last
        if args.json:
            print(json.dumps({"text": "".join(text), "prompt_tokens": stats.prompt_tokens,
                              "cached_tokens": stats.cached_tokens, "completion_tokens": stats.completion_tokens,
                              "seconds": round(stats.seconds, 4)}, ensure_ascii=False))
        else:
            print()
            if sys.stderr.isatty():
                print(stats.line(), file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a refused (RequestError, a server's 4xx) or failed request: say why
        print(f"\nradixgen complete: {e}", file=sys.stderr)
        return 1
    finally:
        model.close()
