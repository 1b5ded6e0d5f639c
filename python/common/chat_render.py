"""The one place a conversation becomes prompt text: the model's chat template through its tokenizer.

Every front end renders with `render_chat` (the language's roles, the OpenAI chat endpoint, the native
/tokenize, the offline `LLM.chat`), so they all give the same text for the same messages. Each caller keeps
its own error wording (a 400 naming `messages`, a ValueError naming the conversation): a template's error
is raised as the template raised it. The text already holds the special tokens the template writes:
tokenize it without adding more (`add_special_tokens=False`).

The language's backends without a tokenizer (an OpenAI-compatible endpoint) render a jinja source of their
own (`radixgen.lang.chat.ChatTemplate.from_jinja`).
"""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template: str | None = None, **template_kwargs: Any) -> str:
    """`messages` ([{"role", "content", ...}]) as the model's prompt text. `continue_final_message`: the last
    (assistant) message stays open to be continued (then no generation prompt is added); `tools`: the tool
    definitions for templates that render them; `chat_template`: a template source instead of the model's;
    `template_kwargs`: the template's own variables (e.g. enable_thinking)."""
    if tools is not None:
        template_kwargs["tools"] = tools
    if chat_template is not None:
        template_kwargs["chat_template"] = chat_template
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, **template_kwargs)
