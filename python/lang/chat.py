"""Roles rendered with the model's own chat template, one turn at a time.

A role's text is found by rendering the conversation so far with and without one more message
whose content is a marker: what the template adds before the marker is the role's prefix, what it
adds after is its suffix. When the turn ends, the template is rendered again with the real content,
so the text a multi-turn program builds is exactly what the template gives for the whole
conversation (including anything it inserts on its own, such as a default system prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from radixgen.common.chat_render import render_chat

# Private-use code points: never in real text, survive every template we know of.
MARK = "\ue000radixgen-content\ue001"

# Used when the model has no chat template (base models, most OpenAI-compatible endpoints).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class RoleFrame(NamedTuple):
    prefix: str  # appended when the role begins
    suffix: str  # appended when it ends (recomputed from the real content then)
    end_of_turn: str | None  # the marker that closes the turn: a stop string for gens inside it


class ChatTemplate:
    """Renders `[{"role", "content"}, ...]` lists to text with one template."""

    def __init__(self, render: Callable[[list[dict[str, str]]], str], name: str = "template"):
        self._render = render
        self.name = name

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate | None:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            return None

        def render(messages: list[dict[str, str]]) -> str:
            return render_chat(tokenizer, messages, add_generation_prompt=False)

        return cls(render, name="tokenizer")

    @classmethod
    def from_jinja(cls, source: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(source)

        def render(messages: list[dict[str, str]]) -> str:
            return template.render(
                messages=messages, add_generation_prompt=False, bos_token=bos_token, eos_token=eos_token
            )

        return cls(render, name="jinja")

    @classmethod
    def chatml(cls) -> ChatTemplate:
        return cls.from_jinja(CHATML_TEMPLATE)

    def render(self, messages: list[dict[str, str]]) -> str:
        if not messages:
            return ""  # some templates index messages[0]; nothing to render anyway
        try:
            return self._render(messages)
        except Exception as e:
            roles = [m["role"] for m in messages]
            raise ValueError(f"the chat template rejects the conversation {roles}: {e}") from e

    def frame(self, history: list[dict[str, str]], role: str) -> RoleFrame:
        """Prefix and suffix of a `role` turn following `history`."""
        before = self.render(history)
        full = self.render([*history, {"role": role, "content": MARK}])
        if not full.startswith(before):
            raise ValueError(f"the chat template is not incremental: adding a {role!r} turn rewrites earlier turns")
        prefix, found, suffix = full[len(before) :].partition(MARK)
        if not found:
            raise ValueError(f"the chat template drops the content of {role!r} messages")
        return RoleFrame(prefix, suffix, end_of_turn_marker(suffix))

    def closing(self, history: list[dict[str, str]], role: str, content: str, frame: RoleFrame) -> str:
        """What the template appends after `content` to end this turn."""
        full = self.render([*history, {"role": role, "content": content}])
        added = full[len(self.render(history)) :]
        if added.startswith(frame.prefix + content):
            return added[len(frame.prefix) + len(content) :]
        # The template rewrites the content (e.g. trims it); keep our text and close the turn.
        return frame.suffix


def end_of_turn_marker(suffix: str) -> str | None:
    """The first word of a turn's suffix: `<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3."""
    words = suffix.split()
    return words[0] if words else None
