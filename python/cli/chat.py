"""`radixgen chat [MODEL]`: an interactive chat in the terminal, on an in-process Engine or a server (--url).

Replies are streamed; after each, its tokens/s and how many prompt tokens came from the radix cache (every
earlier turn should). Ctrl-C stops a reply and keeps the session; Ctrl-D or /quit ends it. A line ending with a
backslash continues on the next line; a line of three quotes opens a block closed by another.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from radixgen.cli.common import (
    add_engine_args,
    add_remote_args,
    add_sampling_args,
    check_remote,
    checked_sampling,
    engine_kwargs,
    parse_field_value,
    sampling_from_args,
    start_engine,
)

DESCRIPTION = __doc__.split("\n\n", 1)[0].removeprefix("`radixgen chat [MODEL]`: ") + (
    " Commands in the chat: /help, /system TEXT, /reset, /save FILE, /set FIELD VALUE, /set, /quit.")

USAGE = "radixgen chat [MODEL] [--url URL [--api-key KEY]] [--system TEXT] [sampling flags] [engine flags]"

HELP = """commands:
  /system TEXT       set the system prompt (/system alone clears it)
  /reset             forget the conversation (the system prompt stays)
  /save FILE         write the conversation and settings as JSON
  /set FIELD VALUE   set a sampling field (temperature, top_p, max_new_tokens, stop, ...); /set lists them
  /quit              leave (or Ctrl-D); Ctrl-C stops a reply
a line ending with \\ continues on the next; \"\"\" opens a block until the next \"\"\""""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_path", nargs="?", metavar="MODEL",
                        help="a model folder or a .gguf file (default: the bundled model); or --model")
    parser.add_argument("--system", help="the system prompt")
    add_remote_args(parser)
    add_engine_args(parser)
    add_sampling_args(parser)  # after the engine's flags: a sampling field whose flag they hold is --set's


def open_model(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The LocalModel or RemoteModel the arguments name (MODEL / --model, or --url)."""
    from radixgen.cli.talk import LocalModel, RemoteModel

    check_remote(args, parser)
    kwargs = engine_kwargs(args)
    if args.model_path is not None and "model" in kwargs:
        parser.error("argument MODEL: give the model once (MODEL or --model)")
    model = args.model_path or kwargs.pop("model", None)
    if args.url is not None:
        return RemoteModel(args.url, args.api_key, model)
    if model is not None and not Path(model).expanduser().exists():
        parser.error(f"argument {'MODEL' if args.model_path else '--model'}: no such file or folder: {model}")
    return LocalModel(start_engine(model, kwargs))


class ChatSession:
    """The conversation, the settings and the commands; `turn` streams one reply."""

    def __init__(self, model, sampling: dict[str, Any], system: str | None, out=sys.stdout) -> None:
        self.model, self.sampling, self.system, self.out = model, dict(sampling), system, out
        self.messages: list[dict[str, str]] = []

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def conversation(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def command(self, line: str) -> bool:
        """Run a /command; False when the session ends."""
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        if name in ("quit", "exit", "bye"):
            return False
        if name in ("help", "?"):
            self.say(HELP)
        elif name == "system":
            self.system = rest or None
            self.say(f"system prompt {'set' if rest else 'cleared'}")
        elif name in ("reset", "clear"):
            self.messages.clear()
            self.say("conversation cleared")
        elif name == "save":
            self.save(rest)
        elif name == "set":
            self.set(rest)
        else:
            self.say(f"unknown command /{name} (/help lists them)")
        return True

    def save(self, path: str) -> None:
        if not path:
            self.say("usage: /save FILE")
            return
        doc = {"model": self.model.name, "sampling": self.sampling, "messages": self.conversation()}
        try:
            Path(path).expanduser().write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            self.say(f"cannot save: {e}")
            return
        self.say(f"saved {len(self.messages)} messages to {path}")

    def set(self, rest: str) -> None:
        name, _, text = rest.partition(" ")
        if not name:
            self.say("sampling fields set: " + (json.dumps(self.sampling) if self.sampling else "none (defaults)"))
            return
        if not text.strip():
            self.say("usage: /set FIELD VALUE")
            return
        try:
            value = parse_field_value(name, text.strip())
            self.sampling = checked_sampling({**self.sampling, name: value})
        except ValueError as e:
            self.say(f"error: {e}")
            return
        self.say(f"{name} = {json.dumps(value)}")

    def turn(self, text: str) -> None:
        """One reply, streamed; Ctrl-C stops it (what came so far stays in the conversation)."""
        self.messages.append({"role": "user", "content": text})
        pieces: list[str] = []
        stopped = False
        try:
            for piece in self.model.chat(self.conversation(), self.sampling):
                pieces.append(piece)
                print(piece, end="", file=self.out, flush=True)
        except KeyboardInterrupt:
            stopped = True
        except Exception as e:  # noqa: BLE001 - a refused or failed request ends the turn, not the session
            self.messages.pop()
            self.say(f"\nerror: {e}")
            return
        self.messages.append({"role": "assistant", "content": "".join(pieces)})
        self.say("\n[stopped]" if stopped else "")
        if self.model.last is not None:
            self.say(self.model.last.line())


def read_message(prompt: str = ">>> ") -> str:
    """One message: continued lines (a trailing backslash) and \"\"\" blocks joined with newlines."""
    first = input(prompt)
    if first.strip() == '"""':
        lines = []
        while (line := input("... ")).strip() != '"""':
            lines.append(line)
        return "\n".join(lines)
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(input("... "))
    return "\n".join(lines)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sampling = sampling_from_args(args, parser)
    try:
        model = open_model(args, parser)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"radixgen chat: {e}", file=sys.stderr)
        return 1
    history = _load_history()
    session = ChatSession(model, sampling, args.system)
    session.say(f"chatting with {model.name}; /help for commands, Ctrl-D to leave")
    try:
        while True:
            try:
                line = read_message()
            except KeyboardInterrupt:
                session.say("\n(Ctrl-D or /quit to leave)")
                continue
            except EOFError:
                session.say("")
                return 0
            if not line.strip():
                continue
            if line.startswith("/") and not session.command(line.strip()):
                return 0
            if not line.startswith("/"):
                session.turn(line)
    finally:
        model.close()
        _save_history(history)


HISTORY_LINES = 1000


def _load_history() -> Path | None:
    """Line editing and the input history of earlier sessions (readline; absent on some platforms): kept in the
    radixgen cache folder as chat_history."""
    try:
        import readline
    except ImportError:
        return None
    from radixgen.runtime.loader import cache_root

    path = cache_root() / "chat_history"
    try:
        readline.read_history_file(str(path))
    except OSError:
        pass
    return path


def _save_history(path: Path | None) -> None:
    if path is None:
        return
    import readline

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.set_history_length(HISTORY_LINES)
        readline.write_history_file(str(path))
    except OSError:
        pass
