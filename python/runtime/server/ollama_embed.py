"""Ollama's /api/embed: {"model", "input": a string or strings} -> {"model", "embeddings": [[...]], ...}, over
Engine.async_embed. Errors in Ollama's shape ({"error": message}, 400 for a bad body)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from radixgen.common.http_errors import JSONResponse, error_of

MAX_INPUTS = 2048


class OllamaEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str
    input: str | list[str]
    truncate: bool = True  # Ollama's default: an input past the context length is cut to fit (else a 400)
    dimensions: int | None = Field(None, ge=1)
    options: dict | None = None
    keep_alive: str | int | None = None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def ollama_embed_router(engine: Any) -> APIRouter:
    router = APIRouter()

    @router.post("/api/embed")
    async def embed(request: Request):
        start = time.perf_counter_ns()
        try:
            req = OllamaEmbedRequest.model_validate(await request.json())
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return _error(400, f"{where}: {first['msg']}" if where else first["msg"])
        except ValueError as e:  # not JSON
            return _error(400, f"invalid JSON body: {e}")
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts or len(texts) > MAX_INPUTS:
            return _error(400, f"input: give 1 to {MAX_INPUTS} texts")
        try:
            if req.truncate:  # the tokens that fit the context (one position is the request's own)
                limit = engine.limits.context_length - 1
                ids = [t[:limit] for t in await engine.async_tokenize(list(texts))]
                results = await engine.async_embed(input_ids=ids, dimensions=req.dimensions)
            else:
                results = await engine.async_embed(list(texts), dimensions=req.dimensions)
        except Exception as e:  # noqa: BLE001 - answered in Ollama's shape
            err = error_of(e)
            return _error(err.status, err.body()["error"]["message"])
        return JSONResponse({"model": req.model, "embeddings": [r["embedding"] for r in results],
                             "total_duration": time.perf_counter_ns() - start, "load_duration": 0,
                             "prompt_eval_count": sum(r["prompt_tokens"] for r in results)})

    return router
