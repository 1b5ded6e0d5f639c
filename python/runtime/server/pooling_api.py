"""The pooling routes: OpenAI's /v1/embeddings, and /v1/rerank and /v1/score in the shape vLLM and SGLang serve
them (Cohere / Jina-style bodies). Each body -> Engine.async_embed / async_score -> the API's response; errors in
the OpenAI error shape. On a model that does not generate (an embedding model, a reranker) the generation routes
answer 400 naming what the model serves (`refuse_generation`)."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from radixgen.common.http_errors import APIError, JSONResponse, error_response

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")
HEALTH_TIMEOUT_S = 60.0
MAX_INPUTS = 2048  # texts in one request (OpenAI's limit for an embeddings batch)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class EmbeddingRequest(_Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class RerankDocument(_Strict):
    text: str


class RerankRequest(_Strict):
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_INPUTS)
    model: str | None = None
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    instruction: str | None = None  # a decoder reranker's task instruction


class ScoreRequest(_Strict):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    instruction: str | None = None


def _usage(results: list[dict]) -> dict:
    n = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    return {"prompt_tokens": n, "total_tokens": n, "prompt_tokens_details": {"cached_tokens": cached}}


def encode_base64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: the little-endian float32 bytes of the vector."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


def embedding_input(value: Any) -> dict:
    """The Engine keywords of an embeddings `input`: prompt (a string or strings) or input_ids (token arrays)."""
    if isinstance(value, str):
        return {"prompt": value}
    if not value:
        raise ValueError("input: must not be empty")
    if len(value) > MAX_INPUTS:
        raise ValueError(f"input: at most {MAX_INPUTS} inputs in one request, got {len(value)}")
    if isinstance(value[0], str):
        return {"prompt": list(value)}
    if isinstance(value[0], int):
        return {"input_ids": [list(value)]}
    return {"input_ids": [list(v) for v in value]}


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, list[str]]]:
    """(query, documents) groups of a /v1/score body: 1 to N, or N to N pairwise."""
    if isinstance(text_1, str):
        text_1 = [text_1]
    if isinstance(text_2, str):
        text_2 = [text_2]
    if not text_1 or not text_2:
        raise ValueError("text_1 and text_2: must not be empty")
    if len(text_1) == 1:
        return [(text_1[0], text_2)]
    if len(text_1) != len(text_2):
        raise ValueError(f"text_1 ({len(text_1)} texts) and text_2 ({len(text_2)} texts): give one text_1, or as "
                         f"many as text_2")
    return [(q, [d]) for q, d in zip(text_1, text_2, strict=True)]


def _check_alive(engine: Any) -> None:
    """503 at once when the scheduler is gone (a request sent to it would never be answered)."""
    if not engine.is_alive:
        raise APIError(503, "the scheduler process is not running", None, "scheduler_gone")


def pooling_router(engine: Any, model_name: str) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        _check_alive(engine)
        results = await engine.async_embed(**embedding_input(req.input), dimensions=req.dimensions)
        if isinstance(results, dict):
            results = [results]
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_base64(r["embedding"]) if req.encoding_format == "base64" else r["embedding"]}
                for i, r in enumerate(results)]
        return JSONResponse({"object": "list", "data": data, "model": req.model or model_name,
                             "usage": _usage(results)})

    @router.post("/v1/rerank")
    async def rerank(req: RerankRequest):
        _check_alive(engine)
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        results = await engine.async_score(req.query, docs, instruction=req.instruction)
        ranked = sorted(results, key=lambda r: -r["score"])[: req.top_n]
        out = []
        for r in ranked:
            item = {"index": r["index"], "relevance_score": r["score"]}
            if req.return_documents:
                item["document"] = {"text": docs[r["index"]]}
            out.append(item)
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": req.model or model_name, "results": out,
                             "usage": _usage(results)})

    @router.post("/v1/score")
    async def score(req: ScoreRequest):
        _check_alive(engine)
        groups = score_pairs(req.text_1, req.text_2)
        done = await asyncio.gather(*(engine.async_score(q, docs, instruction=req.instruction)
                                      for q, docs in groups))
        results = [r for group in done for r in group]
        data = [{"index": i, "object": "score", "score": r["score"]} for i, r in enumerate(results)]
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": req.model or model_name, "data": data, "usage": _usage(results)})

    return router


def refuse_generation(app, engine: Any) -> None:
    """On a model that does not generate: 400 on the generation routes, naming what it serves."""
    info = engine.model_info
    if info.get("is_generation", True):
        return
    kinds = ", ".join(info.get("request_kinds") or ())
    routes = {"embed": "/v1/embeddings", "score": "/v1/rerank, /v1/score"}
    where = "; ".join(routes[k] for k in info.get("request_kinds") or () if k in routes)

    @app.middleware("http")
    async def _refuse(request: Request, call_next):
        if request.url.path == "/health_generate":  # the model's own kind of request, end to end
            return await _health(engine, info.get("request_kinds") or ())
        if request.url.path in GENERATION_PATHS:
            return error_response(400, f"this model does not generate text (it serves: {kinds}); use {where}",
                                  None, "model_does_not_generate")
        return await call_next(request)


async def _health(engine: Any, kinds) -> JSONResponse:
    """/health_generate on a model that does not generate: one embed (or score) request through the scheduler."""
    call = engine.async_embed(input_ids=[0]) if "embed" in kinds else engine.async_score("ok", ["ok"])
    try:
        await asyncio.wait_for(call, HEALTH_TIMEOUT_S)
    except (RuntimeError, ValueError, asyncio.TimeoutError) as e:
        return error_response(503, f"the model failed a request: {str(e) or 'timed out'}", None, "unhealthy")
    return JSONResponse({"status": "ok"})
