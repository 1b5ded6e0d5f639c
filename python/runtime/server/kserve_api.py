"""KServe v2 (Triton's HTTP protocol): /v2/health/live|ready, /v2 (server metadata), /v2/models/{m} (model
metadata), /v2/models/{m}/ready and /config, /v2/models/{m}/infer, /v2/repository/index, and Triton's
generate extension (/v2/models/{m}/generate, /generate_stream as SSE); each model route also under
/versions/1.

A model is the served model or a loaded LoRA adapter, by name (another name is a 404). Its tensors are the
LLM backends' usual set: text_input (BYTES, one prompt per element, sent as it is: no chat template) and
optional one-element parameters mapped onto the request contract (max_tokens, temperature, top_p, top_k,
min_p, random_seed, repetition_penalty, presence_penalty, frequency_penalty, min_tokens, stop_words);
text_output holds the prompt and its completion unless exclude_input_in_output, and finish_reason /
num_input_tokens / num_cached_tokens / num_output_tokens when their return_* flag is set. In /generate the
tensors are the body's keys (and those of its `parameters`). Errors are {"error": "..."} (api_errors.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson
from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import Response

from radixgen.common.http_errors import APIError, JSONResponse, bad_request, error_of
from radixgen.runtime.server.api_errors import ErrorShape
from radixgen.runtime.server.kserve_tensors import HEADER_LENGTH, read_request, write_response
from radixgen.runtime.server.openai_stream import EventStream, Job, finish_reason_of, sse
from radixgen.runtime.server.protocol import CompletionRequest
from radixgen.runtime.server.serving import merge

if TYPE_CHECKING:
    from radixgen.runtime.server.metrics import ServerMetrics
    from radixgen.runtime.server.openai_api import OpenAIServing

ERROR_SHAPE = ErrorShape("/v2", lambda status, message, code: {"error": message})
VERSION = "1"
# parameter tensor -> (its datatype in the metadata, the request field it sets)
PARAMETERS = {"max_tokens": ("INT32", "max_tokens"), "temperature": ("FP32", "temperature"),
              "top_p": ("FP32", "top_p"), "top_k": ("INT32", "top_k"), "min_p": ("FP32", "min_p"),
              "random_seed": ("UINT64", "seed"), "repetition_penalty": ("FP32", "repetition_penalty"),
              "presence_penalty": ("FP32", "presence_penalty"), "frequency_penalty": ("FP32", "frequency_penalty"),
              "min_tokens": ("INT32", "min_tokens")}
FLAGS = ("exclude_input_in_output", "return_finish_reason", "return_num_input_tokens", "return_num_cached_tokens",
         "return_num_output_tokens", "stream")
# outputs -> (datatype, the flag that asks for it)
OUTPUTS = {"text_output": ("BYTES", None), "finish_reason": ("BYTES", "return_finish_reason"),
           "num_input_tokens": ("UINT32", "return_num_input_tokens"),
           "num_cached_tokens": ("UINT32", "return_num_cached_tokens"),
           "num_output_tokens": ("UINT32", "return_num_output_tokens")}
EMPTY_ONLY = {"bad_words": "bad words lists", "beam_width": "beam search"}


def _one(name: str, data: list) -> Any:
    if len(data) != 1:
        raise bad_request(f"input '{name}': one element expected, got {len(data)}")
    return data[0]


class V2Request(NamedTuple):
    """A v2 request's inputs, checked."""

    shape: list[int]  # text_input's shape (the outputs have it too)
    prompts: list[str]
    comp: CompletionRequest  # its parameters as a completion request (onto the request contract)
    flags: dict[str, bool]
    lora: str | None


class KServeServing:
    def __init__(self, api: OpenAIServing):
        self.api = api

    # ------------------------------------------------------------ metadata

    def model(self, name: str, ver: str | None = None) -> str | None:
        """The LoRA adapter a model name selects (None: the base model); 404 for an unknown model / version."""
        adapters = self.api.engine.lora_adapters or {}
        if name != self.api.model_name and name not in adapters:
            raise APIError(404, f"Request for unknown model: '{name}' is not found")
        if ver not in (None, "", VERSION):
            raise APIError(404, f"Request for unknown model: '{name}' version {ver} is not found")
        return name if name in adapters else None

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "radixgen", "version": version("radixgen"), "extensions": ["binary_tensor_data", "generate"]}

    def model_metadata(self, name: str) -> dict[str, Any]:
        inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [-1]},
                  *({"name": n, "datatype": t, "shape": [1]} for n, (t, _) in PARAMETERS.items()),
                  {"name": "stop_words", "datatype": "BYTES", "shape": [-1]},
                  *({"name": f, "datatype": "BOOL", "shape": [1]} for f in FLAGS)]
        outputs = [{"name": n, "datatype": t, "shape": [-1]} for n, (t, _) in OUTPUTS.items()]
        return {"name": name, "versions": [VERSION], "platform": "radixgen", "inputs": inputs, "outputs": outputs}

    def model_config(self, name: str) -> dict[str, Any]:
        meta = self.model_metadata(name)
        dims = lambda t: {"name": t["name"], "data_type": "TYPE_" + ("STRING" if t["datatype"] == "BYTES"  # noqa: E731
                                                                     else t["datatype"]), "dims": t["shape"]}
        return {"name": name, "platform": "radixgen", "backend": "radixgen", "max_batch_size": 0,
                "input": [dims(t) for t in meta["inputs"]], "output": [dims(t) for t in meta["outputs"]],
                "model_transaction_policy": {"decoupled": False}}

    # ------------------------------------------------------------ inference

    def _parse(self, name: str, inputs: dict[str, tuple[list[int], list]], lora: str | None) -> V2Request:
        if "text_input" not in inputs:
            raise bad_request("input 'text_input': required (BYTES, one prompt per element)")
        shape, prompts = inputs["text_input"]
        if not prompts:
            raise bad_request("input 'text_input': no prompt")
        fields: dict[str, Any] = {}
        flags = dict.fromkeys(FLAGS, False)
        for key, (_, data) in inputs.items():
            if key == "text_input":
                continue
            if key in PARAMETERS:
                fields[PARAMETERS[key][1]] = _one(key, data)
            elif key == "stop_words":
                stops = [s for s in data if s]
                if any(not isinstance(s, str) for s in stops):
                    raise bad_request("input 'stop_words': strings")
                if stops:
                    fields["stop"] = stops
            elif key in FLAGS:
                value = _one(key, data)
                if not isinstance(value, bool):
                    raise bad_request(f"input '{key}': a BOOL, got {value!r}")
                flags[key] = value
            elif key in EMPTY_ONLY:
                if any(x not in ("", 0, 1) for x in data) or (key == "bad_words" and any(data)):
                    raise bad_request(f"input '{key}': {EMPTY_ONLY[key]} are not supported by this server")
            else:
                known = ["text_input", *PARAMETERS, "stop_words", *FLAGS]
                raise bad_request(f"input '{key}': unknown (known: {', '.join(known)})")
        if isinstance(fields.get("seed"), int) and fields["seed"] >= 2**63:
            fields["seed"] -= 2**64  # a UINT64 seed as the signed 64 bits torch takes
        for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if isinstance(fields.get(f), int) and not isinstance(fields[f], bool):
                fields[f] = float(fields[f])
        try:
            comp = CompletionRequest.model_validate({"model": lora or name, "prompt": prompts, **fields})
        except ValidationError as e:
            err = e.errors()[0]
            field = next((k for k, (_, f) in PARAMETERS.items() if f == (err["loc"] or ("",))[0]), None)
            where = f"input '{field}': " if field else ""
            raise bad_request(where + str(err["msg"]).removeprefix("Value error, ")) from None
        if "max_tokens" not in fields:
            comp.max_tokens = None  # what the context leaves (CompletionRequest's own default is 16)
        return V2Request(shape, prompts, comp, flags, lora)

    async def _jobs(self, r: V2Request, prefix: str) -> tuple[list[Job], str]:
        api, comp = self.api, r.comp
        ids = [await api.encode(p) for p in r.prompts]
        for k, x in enumerate(ids):
            if not x:
                raise bad_request(f"input 'text_input': prompt {k} is empty")
        sps = [api.sampling(comp, api.budget(len(x), comp.max_tokens, "max_tokens", "text_input"), {}) for x in ids]
        rid = api.request_id(comp, prefix)
        return api.jobs(ids, comp, sps, rid, lora=r.lora), rid

    @staticmethod
    def _values(r: V2Request, k: int, out: dict, text: str) -> dict[str, Any]:
        """Output name -> value for prompt k (text: the text_output)."""
        meta = out["meta_info"]
        values = {"text_output": text}
        if r.flags["return_finish_reason"]:
            values["finish_reason"] = finish_reason_of(meta) if meta.get("finish_reason") else ""
        if r.flags["return_num_input_tokens"]:
            values["num_input_tokens"] = meta["prompt_tokens"]
        if r.flags["return_num_cached_tokens"]:
            values["num_cached_tokens"] = meta.get("cached_tokens", 0)
        if r.flags["return_num_output_tokens"]:
            values["num_output_tokens"] = meta["completion_tokens"]
        return values

    async def infer(self, name: str, ver: str | None, request: Request) -> Response:
        arrived = time.perf_counter()
        lora = self.model(name, ver)
        body, inputs = read_request(await request.body(), request.headers.get(HEADER_LENGTH))
        r = self._parse(name, inputs, lora)
        if r.flags["stream"]:
            raise bad_request("input 'stream': /infer answers once; use /generate_stream to stream")
        wanted, binary = self._outputs(body, r)
        jobs, rid = await self._jobs(r, "infer-")
        outs = await self.api.run(request, jobs, rid, arrived)
        rows = [self._values(r, k, out, ("" if r.flags["exclude_input_in_output"] else r.prompts[k]) + out["text"])
                for k, out in enumerate(outs)]
        tensors = [(n, OUTPUTS[n][0], r.shape, [row[n] for row in rows]) for n in wanted]
        head = {"model_name": name, "model_version": VERSION, **({"id": body["id"]} if "id" in body else {})}
        content, headers = write_response(head, tensors, binary)
        return Response(content, headers=headers)

    @staticmethod
    def _outputs(body: dict[str, Any], r: V2Request) -> tuple[list[str], set[str]]:
        """The outputs to send (requested, else text_output and those the return_* flags ask for), and which of
        them as binary data."""
        default_binary = bool((body.get("parameters") or {}).get("binary_data_output"))
        requested = body.get("outputs")
        if requested is None:
            names = [n for n, (_, flag) in OUTPUTS.items() if flag is None or r.flags[flag]]
            return names, set(names) if default_binary else set()
        names, binary = [], set()
        for k, o in enumerate(requested if isinstance(requested, list) else [None]):
            n = o.get("name") if isinstance(o, dict) else None
            if n not in OUTPUTS:
                raise bad_request(f"outputs[{k}]: unknown output {n!r} (known: {', '.join(OUTPUTS)})")
            flag = OUTPUTS[n][1]
            if flag is not None and not r.flags[flag]:
                r.flags[flag] = True  # asking for the output is asking for its value
            names.append(n)
            if (o.get("parameters") or {}).get("binary_data", default_binary):
                binary.add(n)
        return names, binary

    async def generate(self, name: str, ver: str | None, body: Any, request: Request, stream: bool) -> Response:
        arrived = time.perf_counter()
        lora = self.model(name, ver)
        if not isinstance(body, dict):
            raise bad_request("the body is a JSON object of inputs")
        params = body.get("parameters") or {}
        if not isinstance(params, dict):
            raise bad_request("parameters: an object")
        given = {k: v for k, v in body.items() if k not in ("id", "parameters")}
        both = sorted(set(given) & set(params))
        if both:
            raise bad_request(f"{both[0]}: given both as an input and in parameters")
        inputs = {k: ([1], v if isinstance(v, list) else [v]) for k, v in {**given, **params}.items()}
        if len(inputs.get("text_input", ([], []))[1]) > 1:
            raise bad_request("text_input: /generate takes one prompt (/infer takes a batch)")
        r = self._parse(name, inputs, lora)
        jobs, rid = await self._jobs(r, "generate-")
        head = {"model_name": name, "model_version": VERSION, **({"id": body["id"]} if "id" in body else {})}
        prefix = "" if r.flags["exclude_input_in_output"] else r.prompts[0]
        if not stream:
            if r.flags["stream"]:
                raise bad_request("stream: /generate answers once; use /generate_stream to stream")
            (out,) = await self.api.run(request, jobs, rid, arrived)
            return JSONResponse({**head, **self._values(r, 0, out, prefix + out["text"])})
        streams = await self.api.start_stream(jobs, rid, arrived)
        return EventStream(self._events(r, head, prefix, streams), lambda: self.api.dispatcher.end_group(rid))

    async def _events(self, r: V2Request, head: dict, prefix: str, streams: list) -> AsyncIterator[bytes]:
        try:
            async with aclosing(merge(streams)) as chunks:
                async for _, out in chunks:
                    yield sse({**head, **self._values(r, 0, out, prefix + out.get("delta", ""))})
                    prefix = ""  # the prompt goes with the first response only
        except Exception as e:  # noqa: BLE001 - the status line is sent: report it in the stream
            yield sse({"error": error_of(e).message})


def kserve_router(api: OpenAIServing, metrics: ServerMetrics) -> APIRouter:
    serving = KServeServing(api)
    router = APIRouter()

    @router.get("/v2/health/live")
    async def live():
        return Response(status_code=200)

    @router.get("/v2/health/ready")
    async def ready():
        if not api.engine.is_alive:
            raise APIError(503, "the scheduler process is not running")
        return Response(status_code=200)

    @router.get("/v2")
    async def server_metadata():
        return JSONResponse(serving.server_metadata())

    @router.post("/v2/repository/index")  # Triton's model repository extension: what is served
    async def repository_index():
        names = [api.model_name, *(api.engine.lora_adapters or {})]
        return JSONResponse([{"name": n, "version": VERSION, "state": "READY"} for n in names])

    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{ver}"):
        @router.get(base)
        async def model_metadata(name: str, ver: str | None = None):
            serving.model(name, ver)
            return JSONResponse(serving.model_metadata(name))

        @router.get(base + "/ready")
        async def model_ready(name: str, ver: str | None = None):
            serving.model(name, ver)
            if not api.engine.is_alive:
                raise APIError(503, "the scheduler process is not running")
            return Response(status_code=200)

        @router.get(base + "/config")
        async def model_config(name: str, ver: str | None = None):
            serving.model(name, ver)
            return JSONResponse(serving.model_config(name))

        @router.post(base + "/infer")
        async def infer(name: str, request: Request, ver: str | None = None):
            metrics.requests.inc(api="kserve_infer")
            return await serving.infer(name, ver, request)

        @router.post(base + "/generate")
        async def generate(name: str, request: Request, ver: str | None = None):
            metrics.requests.inc(api="kserve_generate")
            return await serving.generate(name, ver, await _json(request), request, stream=False)

        @router.post(base + "/generate_stream")
        async def generate_stream(name: str, request: Request, ver: str | None = None):
            metrics.requests.inc(api="kserve_generate")
            return await serving.generate(name, ver, await _json(request), request, stream=True)

    return router


async def _json(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
