"""The one place a conversation becomes prompt text: the model's chat template through its tokenizer.

Every front end renders with `render_chat` (the language's roles, the OpenAI chat endpoint, the native
/tokenize, the offline `LLM.chat`), so they all give the same text for the same messages. Each caller keeps
its own error wording (a 400 naming `messages`, a ValueError naming the conversation): a template's error
is raised as the template raised it. The text already holds the special tokens the template writes:
tokenize it without adding more (`add_special_tokens=False`).

Images in a message (`content_text`) stand in the text as the model's image placeholder; the Engine puts the
image's tokens there.

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


IMAGE_DETAILS = ("auto", "low", "high")
_OTHER_MEDIA = {"video_url": "video", "input_audio": "audio", "audio_url": "audio"}  # parts of media not taken


def content_text(content: Any, image_token: str | None, where: str) -> tuple[str, list[Any]]:
    """A message's `content` (a string, or a list of OpenAI content parts) as template text, and the images it
    holds in order. Parts: {"type": "text", "text"}; {"type": "image_url", "image_url": {"url", "detail"}} (the
    URL a data URL, an http(s) URL or base64; `detail` auto / low / high, which this runtime's processors take at
    the model's one resolution); {"type": "image_pil", "image_pil": a PIL image} (vLLM's offline form). Each
    image stands in the text as `image_token`, the model's placeholder, which the Engine replaces by the image's
    tokens. A ValueError names `where` for a part it does not know, or any image when `image_token` is None (a
    model that takes text only)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of content parts")
    texts, images = [], []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        if kind in _OTHER_MEDIA:
            raise ValueError(f"{where}[{k}]: {_OTHER_MEDIA[kind]} input ({kind} parts) is not supported "
                             f"(image_url parts are)")
        if kind not in ("image_url", "image_pil"):
            raise ValueError(f"{where}[{k}]: unsupported content part type {kind!r} (text, image_url)")
        if image_token is None:
            raise ValueError(f"{where}[{k}]: image input is not supported: the served model takes text only")
        if kind == "image_pil":
            images.append(part.get("image_pil"))
        else:
            spec = part.get("image_url")
            spec = {"url": spec} if isinstance(spec, str) else spec
            if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                raise ValueError(f"{where}[{k}]: image_url must be an object with a string url")
            if set(spec) - {"url", "detail"}:
                raise ValueError(f"{where}[{k}]: image_url takes url and detail, got {sorted(spec)}")
            if spec.get("detail", "auto") not in IMAGE_DETAILS:
                raise ValueError(f"{where}[{k}]: image_url.detail must be one of {IMAGE_DETAILS}, "
                                 f"got {spec.get('detail')!r}")
            images.append(spec["url"])
        texts.append(image_token)
    return "".join(texts), images
