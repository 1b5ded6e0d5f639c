"""What each IR node does to a state.

`execute(core, node)` is a generator: it yields the backend calls a node needs (`Generate`,
`Score`, `Wait`) and receives their results, so one interpreter serves every driver (a worker
thread, the caller's thread, an asyncio task; see drivers.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, NamedTuple

from radixgen.lang.agent import calls_grammar, open_think_block, split_output, thinking_params
from radixgen.lang.backend_base import PREFILL_ONLY, ChatContext, GenRequest, ScoredChoices
from radixgen.lang.chat import RoleFrame
from radixgen.lang.choices import decide
from radixgen.lang.global_config import global_config
from radixgen.lang.interpreter.errors import TraceStop
from radixgen.lang.interpreter.notifier import Notifier
from radixgen.lang.ir import (
    DTYPE_REGEX,
    DTYPE_STOPS,
    SAMPLING_FIELDS,
    Embed,
    Fork,
    Gen,
    Image,
    Join,
    Node,
    RoleBegin,
    RoleEnd,
    Select,
    Seq,
    SetVar,
    Text,
    VarScopeBegin,
    VarScopeEnd,
)

if TYPE_CHECKING:
    from radixgen.lang.interpreter.core import StateCore


# ---------------------------------------------------------------------------------------------
# Calls the interpreter yields to its driver


class Generate(NamedTuple):
    requests: list[GenRequest]
    on_chunk: Callable[[dict], None] | None = None  # set: stream the single request


class Score(NamedTuple):
    prompt: str
    choices: list[str]
    unconditional: str | None
    lora_name: str | None = None
    images: tuple = ()  # the sources of the images whose placeholders `prompt` holds, in order


class EmbedCall(NamedTuple):
    text: str
    dimensions: int | None
    images: tuple = ()


class Wait(NamedTuple):
    notifier: Notifier
    pred: Callable[[], bool]


class OpenRole(NamedTuple):
    role: str
    frame: RoleFrame
    content_start: int  # index in the text where the turn's content begins
    stop_token_id: int | None  # the end-of-turn marker as one token, when it is one


# ---------------------------------------------------------------------------------------------
# The nodes


def execute(core: StateCore, node: Node) -> Generator[Any, Any, None]:
    match node:
        case Seq(items):
            for item in items:
                yield from execute(core, item)
        case Text(value):
            core.append(value)
        case Image(source):
            append_image(core, source)
        case Gen():
            yield from execute_gen(core, node)
        case Select():
            yield from execute_select(core, node)
        case Embed(name, dimensions):
            if core.images:
                raise ValueError("embed: a program with images cannot be embedded (text only)")
            out = yield EmbedCall(core.text, dimensions)
            core.set_var(name, out["embedding"], {"prompt_tokens": out["prompt_tokens"],
                                                  "cached_tokens": out["cached_tokens"]})
        case RoleBegin(role):
            begin_role(core, role)
        case RoleEnd(role):
            end_role(core, role)
        case VarScopeBegin(name):
            core.scopes.append((name, len(core.text)))
        case VarScopeEnd(name):
            if not core.scopes or core.scopes[-1][0] != name:
                raise ValueError(f"var_scope {name!r} ends but it is not the innermost open scope")
            _, start = core.scopes.pop()
            core.set_var(name, core.text[start:])
        case SetVar(name, value):
            core.set_var(name, value)
        case Fork(children):
            yield from execute_fork(core, children)
        case Join(children, mode):
            yield from execute_join(core, children, mode)
        case _:
            raise TypeError(f"unknown expression {node!r}")


def append_image(core: StateCore, source: Any) -> None:
    """The backend's image placeholder into the text; the source goes with every request over this text."""
    token = core.backend.image_token
    if token is None:
        raise ValueError(core.backend.no_image_message)
    if core.backend.is_chat_model and core.role is None:  # text outside a turn is not sent to a chat model
        raise ValueError("image(): with a chat model an image goes inside a turn: user(image(x) + ...)")
    core.images.append(source)
    core.append(token)


def begin_role(core: StateCore, role: str) -> None:
    if core.role is not None:
        raise ValueError(f"cannot begin a {role!r} turn inside the open {core.role.role!r} turn")
    frame = core.backend.chat_template.frame(core.messages, role)
    core.append(frame.prefix)
    stop_id = core.backend.single_token_id(frame.end_of_turn) if frame.end_of_turn else None
    core.role = OpenRole(role, frame, len(core.text), stop_id)


def end_role(core: StateCore, role: str) -> None:
    if core.role is None or core.role.role != role:
        opened = core.role.role if core.role else None
        raise ValueError(f"cannot end a {role!r} turn: the open turn is {opened!r}")
    content = core.text[core.role.content_start :]
    suffix = core.backend.chat_template.closing(core.messages, role, content, core.role.frame)
    core.append(suffix)
    core.messages.append({"role": role, "content": content})
    core.role = None


def gen_request(core: StateCore, node: Gen) -> GenRequest:
    d = core.defaults
    params: dict[str, Any] = {}  # the run's defaults (stop_regex only when it has one), then the gen's own
    for key in SAMPLING_FIELDS:
        value = getattr(d, key)
        if value is not None:
            params[key] = list(value) if isinstance(value, tuple) else value
    for key, value in node.sampling_overrides().items():
        params[key] = list(value) if isinstance(value, tuple) else value
    # global_config's output settings: sent only when they differ from the runtime's defaults
    if not global_config.skip_special_tokens_in_output:
        params["skip_special_tokens"] = False
    if not global_config.spaces_between_special_tokens_in_out:
        params["spaces_between_special_tokens"] = False
    if core.role is not None and not core.backend.is_chat_model:
        # The turn's end marker ends the gen, so the text stays a well-formed conversation. As a
        # token id when it is one token: a stop string would hold back streamed text.
        marker, token = core.role.frame.end_of_turn, core.role.stop_token_id
        if token is not None and token not in params["stop_token_ids"]:
            params["stop_token_ids"].append(token)
        elif token is None and marker and marker not in params["stop"]:
            params["stop"].append(marker)
    n = node.n if node.n is not None else d.n
    if n > 1:
        params["n"] = n
    if node.dtype is not None:  # a dtype wins over a regex (gen() warned about it)
        params["regex"] = DTYPE_REGEX[node.dtype]
        params["stop"] += [t for t in DTYPE_STOPS[node.dtype] if t not in params["stop"]]
    elif node.regex is not None:
        params["regex"] = node.regex
    elif node.json_schema is not None:
        params["json_schema"] = node.json_schema
    if node.tools is not None:  # tool_choice required / named: the output is calls (lang/agent.py)
        grammar = calls_grammar(json.loads(node.tools), node.tool_choice, node.tool_call_parser,
                                node.parallel_tool_calls)
        if grammar is not None:
            params["ebnf"] = grammar
    if node.reasoning is not None:  # the constraint starts after the think block; the budget closes it
        params.update(thinking_params(params, node.choices, node.reasoning_parser, core.text,
                                      node.max_thinking_tokens))
    return_logprob = _pick(node.return_logprob, d.return_logprob, False)
    text_in_logprobs = _pick(node.return_text_in_logprobs, d.return_text_in_logprobs, False)
    chat = None
    if core.backend.is_chat_model:
        partial = core.text[core.role.content_start :] if core.role else ""
        chat = ChatContext(list(core.messages), core.role.role if core.role else None, partial)
    return GenRequest(
        text=core.text,
        input_ids=None,
        sampling_params=params,
        return_logprob=return_logprob,
        logprob_start_len=_pick(node.logprob_start_len, d.logprob_start_len, -1) if return_logprob else -1,
        top_logprobs_num=_pick(node.top_logprobs_num, d.top_logprobs_num, 0) if return_logprob else 0,
        return_text_in_logprobs=bool(return_logprob and text_in_logprobs),
        chat=chat,
        lora_name=d.lora_name,
        images=tuple(core.images),
    )


def _pick(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def execute_gen(core: StateCore, node: Gen) -> Generator[Any, Any, None]:
    """The variable holds the generated text (a list of n texts when n > 1), whatever the dtype:
    as in SGLang, a program converts it itself (`int(s["x"])`)."""
    if node.max_thinking_tokens is not None:  # the budget counts from an open block: the prompt opens it
        core.append(open_think_block(core.text, node.reasoning_parser))
    request = gen_request(core, node)
    tags = frozenset([node.name]) if node.name else frozenset()
    if core.stream and request.n == 1:
        start = len(core.text)

        def on_chunk(chunk: dict) -> None:
            delta = chunk.get("delta")
            if delta is None:  # a backend without deltas: derive them from the cumulative text
                delta = chunk["text"][len(core.text) - start :]
            core.append(delta, tags, chunk.get("meta_info"))

        [result] = yield Generate([request], on_chunk)
        if core.text[start:] != result["text"]:  # keep the final text authoritative
            core.text = core.text[:start] + result["text"]
        value, meta = result["text"], result["meta_info"]
    else:
        [result] = yield Generate([request])
        if request.n > 1:
            value, meta = [r["text"] for r in result], [r["meta_info"] for r in result]
            first = result[0]
        else:
            value, meta, first = result["text"], result["meta_info"], result
        core.append(first["text"], tags, first["meta_info"])
    core.cached_len = len(core.text)  # prompt and output are in the cache now
    if node.name and (node.tools is not None or node.reasoning is not None):
        out = split_output(value, json.loads(node.tools) if node.tools else None, node.tool_call_parser,
                           node.reasoning_parser if node.reasoning else None, request.text)
        value = out.content or ""
        if node.reasoning:
            core.set_var(node.reasoning, out.reasoning or "")
        if node.tools is not None:
            core.set_var(f"{node.name}_calls", out.calls)
    if node.name:
        core.set_var(node.name, value, meta)


def execute_select(core: StateCore, node: Select) -> Generator[Any, Any, None]:
    unconditional = None
    if getattr(node.method, "requires_unconditional_logprobs", False):
        # "No context": just the turn's header when inside a turn, else the BOS/EOS token.
        unconditional = core.role.frame.prefix if core.role else core.backend.unconditional_prompt()
    scored: ScoredChoices = yield Score(core.text, list(node.choices), unconditional, core.defaults.lora_name,
                                        tuple(core.images))
    decision = decide(
        node.method,
        list(node.choices),
        scored.input_token_logprobs,
        scored.unconditional_token_logprobs,
        node.temperature,
    )
    tags = frozenset([node.name]) if node.name else frozenset()
    core.append(decision.decision, tags)
    core.cached_len = len(core.text)  # every choice was prefilled after the text
    if node.name:
        meta = dict(decision.meta_info or {})
        meta.update(scored.usage or {})  # prompt_tokens / cached_tokens of the scoring requests
        core.set_var(node.name, decision.decision, meta)


def execute_fork(core: StateCore, children: tuple[StateCore, ...]) -> Generator[Any, Any, None]:
    if len(core.text) > core.cached_len and core.backend.can_prefill:
        # Cache the shared prefix once, so the branches' requests all start from a cache hit
        # (not needed when the text is what the last request read or wrote: that is cached).
        yield Generate([GenRequest(core.text, None, dict(PREFILL_ONLY), lora_name=core.defaults.lora_name,
                                   images=tuple(core.images))])
        core.cached_len = len(core.text)
    for child in children:
        child.init_from(core)


def execute_join(core: StateCore, children: tuple[StateCore, ...], mode: str) -> Generator[Any, Any, None]:
    if mode not in ("gather_variable", "concate_and_append"):
        raise ValueError(f"join.mode: must be 'gather_variable' or 'concate_and_append' (got {mode!r})")
    for child in children:
        yield Wait(child.changed, lambda child=child: child.idle)
    for child in children:
        if child.error is not None:
            raise child.error
    if mode == "gather_variable":
        names = [n for n in dict.fromkeys(n for c in children for n in sorted(c.assigned))]
        for name in names:
            metas = [c.meta_info.get(name) for c in children]
            core.set_var(name, [c.variables.get(name) for c in children], metas)
    else:
        core.append("".join(c.text[c.fork_start :] for c in children))
        for c in children:
            core.messages.extend(c.messages[c.fork_messages :])
            core.images.extend(c.images[c.fork_images :])


def run_traced(core: StateCore, node: Node) -> None:
    """Trace mode: run `node` without the model; stop the program at its first model call."""
    steps = execute(core, node)
    try:
        next(steps)
    except StopIteration:
        return
    raise TraceStop
