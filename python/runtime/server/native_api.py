"""The native API: /generate mirrors Engine.generate (same arguments, same result dicts); tokenize and
detokenize."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixgen.runtime.server.errors import JSONResponse, bad_request, error_of
from radixgen.runtime.server.openai_api import SSE_DONE, EventStream, OpenAIServing, sse
from radixgen.runtime.server.protocol import DetokenizeRequest, GenerateRequest, TokenizeRequest
from radixgen.runtime.server.serving import Dispatcher, new_rid, until_disconnect


class NativeServing:
    def __init__(self, engine: Any, dispatcher: Dispatcher, openai: OpenAIServing):
        self.engine = engine
        self.dispatcher = dispatcher
        self.openai = openai  # shares the tokenizer helpers: token text cache, vocabulary checks
        self.tokenizer = engine.tokenizer

    async def generate(self, req: GenerateRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        if req.input_ids is not None:  # the engine checks too; this names the field the OpenAI way
            for ids in req.input_ids if req.is_batch else [req.input_ids]:
                self.openai.check_ids(ids, "input_ids")  # type: ignore[arg-type]
        rid = req.rid or new_rid()  # a batch or n > 1: the engine derives one rid per output from it
        kwargs: dict[str, Any] = {
            "prompt": req.text,
            "input_ids": req.input_ids,
            "sampling_params": req.sampling_params,
            "return_logprob": req.return_logprob,
            "logprob_start_len": req.logprob_start_len,
            "top_logprobs_num": req.top_logprobs_num,
            "return_text_in_logprobs": req.return_text_in_logprobs,
            "cache_salt": req.cache_salt,
        }
        if req.stream:
            (stream,) = await self.dispatcher.open([(rid, kwargs)], arrived, prime=True)
            return EventStream(self._stream(stream), lambda: self.dispatcher.abort(rid))
        call = self.engine.async_generate(rid=rid, **kwargs)
        return JSONResponse(await until_disconnect(request, self.dispatcher.call([rid], arrived, call)))

    async def _stream(self, stream: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        try:
            async with aclosing(stream) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    yield sse(chunk)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            yield sse(error_of(e).body())
        yield SSE_DONE

    # ------------------------------------------------------------ tokenizer endpoints

    def tokenize(self, req: TokenizeRequest) -> dict | list[dict]:
        if req.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(
                    req.messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as e:  # noqa: BLE001 - jinja raises its own kinds
                raise bad_request(f"messages: the chat template could not be applied: {e}", "messages") from e
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return {"tokens": ids, "count": len(ids)}
        texts = req.text if isinstance(req.text, list) else [req.text]
        outs = []
        for t in texts:
            ids = self.tokenizer.encode(t, add_special_tokens=req.add_special_tokens)
            outs.append({"tokens": ids, "count": len(ids)})
        return outs if isinstance(req.text, list) else outs[0]

    def detokenize(self, req: DetokenizeRequest) -> dict | list[dict]:
        batch = bool(req.tokens) and isinstance(req.tokens[0], list)
        seqs = req.tokens if batch else [req.tokens]
        outs = []
        for ids in seqs:
            self.openai.check_ids(ids, "tokens")  # type: ignore[arg-type]
            outs.append({"text": self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)})
        return outs if batch else outs[0]
