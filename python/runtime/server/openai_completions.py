"""/v1/completions: text or token-id prompts (one or a batch), n choices each, echo and legacy logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from radixgen.common.http_errors import JSONResponse, bad_request, error_of
from radixgen.runtime.server.openai_stream import SSE_DONE, EventStream, Job, finish_reason_of, json_logprob, sse
from radixgen.runtime.server.protocol import CompletionRequest
from radixgen.runtime.server.serving import merge

if TYPE_CHECKING:
    from radixgen.runtime.server.openai_api import OpenAIServing


class CompletionServing:
    def __init__(self, api: OpenAIServing):
        self.api = api

    async def prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """(token ids, text) of each prompt of the request."""
        p = req.prompt
        if isinstance(p, str):
            texts = [p]
        elif all(isinstance(x, str) for x in p):
            texts = list(p)  # type: ignore[arg-type]
        else:
            ids_list = [p] if isinstance(p[0], int) else p
            for ids in ids_list:
                if not ids:
                    raise bad_request("prompt: a token-id prompt must not be empty", "prompt")
                self.api.budget(len(ids), None, "max_tokens", "prompt")  # a cheap refusal before the scan
                self.api.check_ids(ids, "prompt")  # type: ignore[arg-type]
            texts = [await self.api.off_loop("prompt", self.api.tokenizer.decode, x) for x in ids_list]
            return [list(x) for x in ids_list], texts  # type: ignore[arg-type]
        return [await self.api.encode(t) for t in texts], texts

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        api = self.api
        lora = api.admit(req)
        prompts, texts = await self.prompts(req)
        for ids in prompts:
            if not ids:
                raise bad_request("prompt: must not be empty", "prompt")
        constraint = api.constraint(req)
        sps = [
            api.sampling(req, api.budget(len(ids), req.max_tokens, "max_tokens", "prompt"), constraint)
            for ids in prompts
        ]
        want_lp = req.logprobs is not None
        rid = api.request_id(req, "cmpl-")
        jobs = api.jobs(
            prompts,
            req,
            sps,
            rid,
            lora=lora,
            return_logprob=want_lp,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if (want_lp and req.echo) else -1,
        )
        if req.stream:
            streams = await api.start_stream(jobs, rid, arrived)
            return EventStream(self.stream(req, jobs, streams, texts, rid), lambda: api.dispatcher.end_group(rid))
        outs = await api.run(request, jobs, rid, arrived)
        choices = []
        for job, out in zip(jobs, outs, strict=True):
            meta = out["meta_info"]
            prefix = texts[job.prompt] if req.echo else ""
            lp = None
            if want_lp:
                start = 0 if req.echo else len(texts[job.prompt])
                lp = self.logprobs(meta, req.echo, True, start)
            choices.append(
                {
                    "index": job.index,
                    "text": prefix + out["text"],
                    "logprobs": lp,
                    "finish_reason": finish_reason_of(meta),
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": api.response_model(req),
                "choices": choices,
                "usage": api.usage(outs, req.n),
            }
        )

    def logprobs(self, meta: dict, with_input: bool, with_output: bool, offset: int, out_from: int = 0) -> dict:
        """The legacy completions logprobs object over the prompt tokens (echo) and/or output tokens
        [out_from, ...)."""
        pairs: list[tuple[tuple, list | None]] = []
        if with_input:
            inp = meta.get("input_token_logprobs") or []
            tops = meta.get("input_top_logprobs") or [None] * len(inp)
            pairs += list(zip(inp, tops, strict=True))
        if with_output:
            outp = (meta.get("output_token_logprobs") or [])[out_from:]
            tops = (meta.get("output_top_logprobs") or [None] * (out_from + len(outp)))[out_from:]
            pairs += list(zip(outp, tops, strict=True))
        token_text = self.api.token_text
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for (lp, tid, *_), top in pairs:
            s = token_text(tid)
            tokens.append(s)
            token_logprobs.append(json_logprob(lp))
            offsets.append(offset)
            offset += len(s)
            top_logprobs.append(None if top is None else {token_text(t): json_logprob(x) for x, t, *_ in top})
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    async def stream(
        self, req: CompletionRequest, jobs: list[Job], streams: list, texts: list[str], rid: str
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        want_lp = req.logprobs is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": self.api.response_model(req)}

        def chunk(index: int, text: str, lp: dict | None, finish: str | None) -> bytes:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
            return sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})

        finals: list[dict | None] = [None] * len(jobs)
        sent_lp = [0] * len(jobs)
        offsets = [0 if req.echo else len(texts[j.prompt]) for j in jobs]
        started = [False] * len(jobs)
        try:
            async with aclosing(merge(streams)) as events:
                async for i, out in events:
                    job, meta = jobs[i], out["meta_info"]
                    if not started[i] and req.echo:  # the prompt (and its logprobs) come first
                        lp = self.logprobs(meta, True, False, 0) if want_lp else None
                        offsets[i] = len(texts[job.prompt])
                        yield chunk(job.index, texts[job.prompt], lp, None)
                    started[i] = True
                    finish = None
                    if meta.get("finish_reason") is not None:
                        finish = finish_reason_of(meta)
                        finals[i] = out
                    delta = out.get("delta", "")
                    lp = None
                    if want_lp:
                        lp = self.logprobs(meta, False, True, offsets[i], sent_lp[i])
                        sent_lp[i] += len(lp["tokens"])
                    offsets[i] += len(delta)
                    if delta or finish or (lp and lp["tokens"]):
                        yield chunk(job.index, delta, lp, finish)
            if include_usage:
                yield sse({**head, "choices": [], "usage": self.api.usage(finals, req.n)})  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            yield sse(error_of(e).body())
        yield SSE_DONE
