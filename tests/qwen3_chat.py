"""The tiny random Qwen3 with a Qwen3-style chat template written here: it renders tools (Hermes calls) and a
<think> block, so a server or Engine over it detects both formats from the template."""

from __future__ import annotations

import shutil
from pathlib import Path

from tiny_models import tiny_model_dir

QWEN3_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


def qwen3_chat_model(folder: Path) -> Path:
    """A copy of the tiny Qwen3 under `folder` with QWEN3_TEMPLATE as its chat template."""
    model = folder / "model"
    shutil.copytree(tiny_model_dir("qwen3"), model)
    (model / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    return model
