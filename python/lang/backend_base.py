"""The backend interface: everything the interpreter asks of a runtime.

A backend sends `GenRequest`s (the Engine.generate arguments of one prompt) and returns the same
dicts as `Engine.generate`. `select` asks `score_choices`, which by default spells each choice
after the prompt in token ids and reads the prompt logprobs of a prefill-only request; backends
without prompt logprobs (OpenAI chat) override it or refuse clearly.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any, NamedTuple

from radixgen.lang.chat import ChatTemplate
from radixgen.lang.choices import TokenLogprobs

PREFILL_ONLY = {"max_new_tokens": 0}


class ChatContext(NamedTuple):
    """The conversation around a gen, for backends that take messages instead of text."""

    messages: list[dict[str, str]]  # finished turns
    role: str | None  # the open role, if any
    partial: str  # its content so far


class GenRequest(NamedTuple):
    text: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    chat: ChatContext | None = None
    lora_name: str | None = None  # the LoRA adapter to run on (the program's run option); None: the base model
    images: tuple = ()  # the sources of the images whose placeholders `text` holds, in order

    @property
    def n(self) -> int:
        return int(self.sampling_params.get("n", 1))

    def group_key(self) -> tuple:
        """Requests with equal keys go to the runtime as one batched call."""
        return (
            self.text is None,
            self.return_logprob,
            self.logprob_start_len,
            self.top_logprobs_num,
            self.return_text_in_logprobs,
            self.lora_name,
        )


class ScoredChoices(NamedTuple):
    input_token_logprobs: list[TokenLogprobs]  # per choice: its tokens after the prompt
    unconditional_token_logprobs: list[TokenLogprobs] | None
    usage: dict[str, int] | None = None  # prompt_tokens / cached_tokens summed over the scoring requests


class ScorePlan(NamedTuple):
    choices: list[str]
    warm: GenRequest | None  # the prompt's common part, sent first so every choice hits the cache
    requests: list[GenRequest]  # one prefill-only request per choice
    skips: list[int]  # per choice: logprob entries before the choice's first differing token


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_choices(prompt_ids: list[int], fulls: list[list[int]], choices: list[str],
                 lora_name: str | None = None) -> ScorePlan:
    """Spell each choice after the prompt in tokens (`fulls`: the tokens of prompt+choice). The
    prompt's last token may merge with the choice (" Paris" vs " Par" + "is"), so the scored span
    starts where the tokens of prompt+choice stop matching the prompt's own tokens."""
    starts = [common_prefix_len(prompt_ids, f) for f in fulls]
    for c, f, k in zip(choices, fulls, starts, strict=True):
        if k >= len(f):
            raise ValueError(f"select: choice {c!r} adds no token after the prompt")
    k_min = min(starts)
    warm = GenRequest(None, prompt_ids[:k_min], dict(PREFILL_ONLY), lora_name=lora_name) if k_min > 0 else None
    # One logprob_start_len for the batch (the smallest); each choice skips what precedes its span.
    requests = [GenRequest(None, f, dict(PREFILL_ONLY), True, k_min, 0, True, lora_name=lora_name) for f in fulls]
    return ScorePlan(list(choices), warm, requests, [k - k_min for k in starts])


def parse_choices(plan: ScorePlan, results: list[dict]) -> list[TokenLogprobs]:
    out = []
    for choice, skip, result in zip(plan.choices, plan.skips, results, strict=True):
        entries = result["meta_info"]["input_token_logprobs"][skip:]
        tokens = [(float(lp), int(tid), text) for lp, tid, text in entries if lp is not None]
        if not tokens:
            raise ValueError(f"select: cannot score choice {choice!r}: there is no text before it")
        out.append(tokens)
    return out


class BaseBackend:
    """Subclasses implement `_generate_group`, `_stream` and their async twins, and `model_info`."""

    is_chat_model = False  # True: gens need a ChatContext (messages), not a text prompt
    can_prefill = True  # accepts prefill-only requests (max_new_tokens=0) that warm its cache

    # ---- what subclasses provide
    def get_tokenizer(self) -> Any | None:
        """A local tokenizer, if the backend has one (used for the chat template)."""
        return None

    @property
    def model_info(self) -> dict[str, Any]:
        raise NotImplementedError

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, exactly as the runtime tokenizes a text prompt."""
        raise NotImplementedError(f"{type(self).__name__} cannot tokenize: select cannot be scored")

    def special_token(self, which: str) -> str | None:
        """The text of the "bos" or "eos" token, if the model has one."""
        return None

    def _generate_group(self, requests: list[GenRequest]) -> list[dict]:
        raise NotImplementedError

    async def _agenerate_group(self, requests: list[GenRequest]) -> list[dict]:
        raise NotImplementedError

    def generate_stream(self, request: GenRequest) -> Iterator[dict]:
        raise NotImplementedError

    def agenerate_stream(self, request: GenRequest) -> AsyncIterator[dict]:
        raise NotImplementedError

    def embed(self, text: str, dimensions: int | None = None) -> dict[str, Any]:
        """The embedding of `text`: {"embedding", "prompt_tokens", "cached_tokens"} (`rg.embed`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot embed")

    async def aembed(self, text: str, dimensions: int | None = None) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} cannot embed")

    def flush_cache(self) -> bool:
        raise NotImplementedError(f"{type(self).__name__} cannot flush a cache")

    def get_server_info(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} has no server info")

    def shutdown(self) -> None:
        pass

    # ---- shared
    @functools.cached_property
    def chat_template(self) -> ChatTemplate:
        """The model's template (from the tokenizer, else model_info), or ChatML if it has none."""
        template = ChatTemplate.from_tokenizer(self.get_tokenizer())
        if template is None:
            source = self.model_info.get("chat_template")
            if source:
                bos, eos = self.special_token("bos") or "", self.special_token("eos") or ""
                template = ChatTemplate.from_jinja(source, bos, eos)
            else:
                template = ChatTemplate.chatml()
        return template

    @property
    def image_token(self) -> str | None:
        """The text that marks an image's place in a prompt (the served model's; None: it takes no images)."""
        return self.model_info.get("image_token")

    @property
    def no_image_message(self) -> str:
        """Why `image()` is refused when `image_token` is None."""
        return "image(): the backend's model takes text only (it has no image placeholder)"

    def single_token_id(self, text: str) -> int | None:
        """The id of `text` if it is exactly one token (end-of-turn markers usually are)."""
        known = self.__dict__.setdefault("_single_token_ids", {})  # asked once per role begin: cache
        if text not in known:
            try:
                [ids] = self.tokenize([text], add_special_tokens=False)
            except NotImplementedError:
                ids = []
            known[text] = ids[0] if len(ids) == 1 else None
        return known[text]

    def unconditional_prompt(self) -> str:
        """The context for "no context": the BOS token, else EOS (a document boundary), else ''."""
        return self.special_token("bos") or self.special_token("eos") or ""

    def generate(self, requests: list[GenRequest]) -> list[Any]:
        """One result per request: a dict, or a list of n dicts when sampling_params.n > 1."""
        return _regroup(requests, {key: self._generate_group(group) for key, group in _groups(requests)})

    async def agenerate(self, requests: list[GenRequest]) -> list[Any]:
        flat = {key: await self._agenerate_group(group) for key, group in _groups(requests)}
        return _regroup(requests, flat)

    def score_choices(self, prompt: str, choices: list[str], unconditional: str | None,
                      lora_name: str | None = None, images: tuple = ()) -> ScoredChoices:
        steps = self._score_steps(prompt, choices, unconditional, lora_name, tuple(images))
        results = None
        while True:
            try:
                requests = steps.send(results)
            except StopIteration as stop:
                return stop.value
            results = self.generate(requests)

    async def ascore_choices(self, prompt: str, choices: list[str], unconditional: str | None,
                             lora_name: str | None = None, images: tuple = ()) -> ScoredChoices:
        steps = self._score_steps(prompt, choices, unconditional, lora_name, tuple(images))
        results = None
        while True:
            try:
                requests = steps.send(results)
            except StopIteration as stop:
                return stop.value
            results = await self.agenerate(requests)

    def _score_steps(
        self, prompt: str, choices: list[str], unconditional: str | None, lora_name: str | None,
        images: tuple = (),
    ) -> Generator[list[GenRequest], list[dict], ScoredChoices]:
        if images:  # the prompt with images; the unconditional context holds none
            scored = yield from self._image_score_steps(prompt, choices, lora_name, images)
            if unconditional is None:
                return scored
            plain = yield from self._score_steps(unconditional, choices, None, lora_name)
            total = {k: scored.usage[k] + plain.usage[k] for k in scored.usage}
            return ScoredChoices(scored.input_token_logprobs, plain.input_token_logprobs, total)
        prompts = [prompt] if unconditional is None else [prompt, unconditional]
        ids = self.tokenize([t for p in prompts for t in (p, *(p + c for c in choices))])
        n = len(choices)
        plans = [
            plan_choices(ids[i * (n + 1)], ids[i * (n + 1) + 1 : (i + 1) * (n + 1)], choices, lora_name)
            for i in range(len(prompts))
        ]
        warm = [p.warm for p in plans if p.warm is not None]
        warmed = (yield warm) if warm else []
        results = yield [r for p in plans for r in p.requests]
        parsed = [parse_choices(p, results[i * n : (i + 1) * n]) for i, p in enumerate(plans)]
        return ScoredChoices(parsed[0], parsed[1] if unconditional is not None else None, usage(warmed + results))

    def _image_score_steps(
        self, prompt: str, choices: list[str], lora_name: str | None, images: tuple
    ) -> Generator[list[GenRequest], list[dict], ScoredChoices]:
        """Choices after a prompt with images. The scoring requests are text with the images (so each is keyed in
        the radix tree exactly as the warm request that caches the prompt and its images), and the choice's span is
        found in the ids the runtime makes of them: the text is cut at the image placeholders and each piece
        tokenized apart (the first one as a plain prompt), as the runtime does; the warm request's prompt length
        says how many ids the images add."""
        mark = self.image_token
        pieces = prompt.split(mark) if mark else [prompt]
        if len(pieces) - 1 != len(images):
            raise ValueError(f"select: the text holds {len(pieces) - 1} image placeholders ({mark!r}) for "
                             f"{len(images)} images")
        for c in choices:
            if mark in c:
                raise ValueError(f"select: choice {c!r} holds the image placeholder {mark!r}")
        last = pieces[-1]
        first, *rest = self.tokenize([pieces[0]]) + self.tokenize([*pieces[1:-1], last, *(last + c for c in choices)],
                                                                  add_special_tokens=False)
        head = first + [t for ids in rest[: len(pieces) - 2] for t in ids]  # every piece before the last
        prompt_ids = head + rest[len(pieces) - 2]
        fulls = [head + ids for ids in rest[len(pieces) - 1 :]]
        starts = [common_prefix_len(prompt_ids, f) for f in fulls]
        for c, f, k in zip(choices, fulls, starts, strict=True):
            if k >= len(f):
                raise ValueError(f"select: choice {c!r} adds no token after the prompt")
        [warmed] = yield [GenRequest(prompt, None, dict(PREFILL_ONLY), lora_name=lora_name, images=images)]
        extra = warmed["meta_info"]["prompt_tokens"] - len(prompt_ids)  # the images' ids beyond the text's
        k_min = min(starts)
        results = yield [GenRequest(prompt + c, None, dict(PREFILL_ONLY), True, k_min + extra, 0, True,
                                    lora_name=lora_name, images=images) for c in choices]
        for c, f, r in zip(choices, fulls, results, strict=True):
            if r["meta_info"]["prompt_tokens"] != len(f) + extra:
                raise RuntimeError(f"select: the runtime tokenized the prompt with choice {c!r} into "
                                   f"{r['meta_info']['prompt_tokens']} ids, not the {len(f) + extra} expected")
        plan = ScorePlan(list(choices), None, [], [k - k_min for k in starts])
        return ScoredChoices(parse_choices(plan, results), None, usage([warmed, *results]))


def usage(results: list[dict]) -> dict[str, int]:
    """prompt_tokens and cached_tokens (prompt tokens the radix cache already held) of a call's requests."""
    metas = [r.get("meta_info") or {} for r in results]
    return {key: sum(m.get(key) or 0 for m in metas) for key in ("prompt_tokens", "cached_tokens")}


def _groups(requests: list[GenRequest]) -> list[tuple[tuple, list[GenRequest]]]:
    groups: dict[tuple, list[GenRequest]] = {}
    for r in requests:
        groups.setdefault(r.group_key(), []).append(r)
    return list(groups.items())


def _regroup(requests: list[GenRequest], flat_by_key: dict[tuple, list[dict]]) -> list[Any]:
    cursors = dict.fromkeys(flat_by_key, 0)
    out = []
    for r in requests:
        key = r.group_key()
        i = cursors[key]
        cursors[key] = i + r.n
        out.append(flat_by_key[key][i] if r.n == 1 else flat_by_key[key][i : i + r.n])
    return out
