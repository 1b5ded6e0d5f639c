"""radixgen as a Triton Inference Server Python-backend model (decoupled).

`initialize` starts radixgen's Engine in-process with the config's `engine_args`; `execute` hands each request
to a thread of its own (the Engine batches them continuously, so requests are never held for one another) and
returns at once; each thread answers through the request's response sender:

- text_input (one prompt, sent as it is) and the optional parameters, each mapped onto radixgen's request
  contract (radixgen.SamplingParams: max_tokens -> max_new_tokens, random_seed -> seed, stop_words -> stop,
  min_tokens -> min_new_tokens, the others by the same name); a bad value is an error response naming it;
- stream true: one response per new piece of text (text_output), then a final one; stream false: one
  response with the whole text. text_output holds the prompt too unless exclude_input_in_output (on the first
  response of a stream). The final response carries finish_reason, num_input_tokens, num_cached_tokens
  (the prompt tokens the radix cache already held) and num_output_tokens;
- a cancelled request (the client went away) is aborted in the Engine, which frees its KV cache.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

# input tensor -> the SamplingParams field it sets
PARAMETERS = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "min_p": "min_p", "random_seed": "seed", "repetition_penalty": "repetition_penalty",
              "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
              "min_tokens": "min_new_tokens"}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise ValueError(f"input '{name}': one element expected, got {values.size}")
    return values[0].item()


def _text(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def _texts(*values: str) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from radixgen import Engine

        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("the radixgen model is decoupled: set model_transaction_policy { decoupled: true }")
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        engine_args = json.loads(params.get("engine_args") or "{}")
        if not isinstance(engine_args, dict):
            raise ValueError("parameters.engine_args: a JSON object of radixgen.Engine keyword arguments")
        self.engine = Engine(**engine_args)
        self.threads: set[threading.Thread] = set()
        self.lock = threading.Lock()

    def execute(self, requests: list) -> None:
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            with self.lock:
                self.threads.add(thread)
            thread.start()
        return None  # decoupled: the answers go through each request's response sender

    def _serve(self, request) -> None:
        sender = request.get_response_sender()
        try:
            self._answer(request, sender)
        except Exception as e:  # noqa: BLE001 - the client gets the error, the model stays up
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))), flags=FINAL)
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def _answer(self, request, sender) -> None:
        prompts = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)
        if prompts.size != 1:
            raise ValueError(f"input 'text_input': one prompt per request, got {prompts.size}")
        prompt = _text(prompts[0])
        sampling = {}
        for name, field in PARAMETERS.items():
            value = _scalar(request, name)
            if value is not None:
                sampling[field] = value
        if sampling.get("seed") is not None and sampling["seed"] >= 2**63:
            sampling["seed"] -= 2**64  # a UINT64 seed as the signed 64 bits torch takes
        stops = pb_utils.get_input_tensor_by_name(request, "stop_words")
        if stops is not None:
            sampling["stop"] = [s for s in (_text(x) for x in stops.as_numpy().reshape(-1)) if s]
        stream = bool(_scalar(request, "stream") or False)
        prefix = "" if _scalar(request, "exclude_input_in_output") else prompt
        if not stream:
            out = self.engine.generate(prompt, sampling)
            sender.send(self._response(prefix + out["text"], out["meta_info"]), flags=FINAL)
            return
        chunks = self.engine.generate(prompt, sampling, stream=True)
        try:
            for chunk in chunks:
                if request.is_cancelled():
                    break  # closing the stream aborts the request
                meta = chunk["meta_info"]
                if meta.get("finish_reason") is None:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[
                        pb_utils.Tensor("text_output", _texts(prefix + chunk["delta"]))]))
                    prefix = ""
                else:
                    sender.send(self._response(prefix + chunk["delta"], meta), flags=FINAL)
                    return
        finally:
            chunks.close()
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError("cancelled")),
                    flags=FINAL)

    @staticmethod
    def _response(text: str, meta: dict) -> pb_utils.InferenceResponse:
        reason = (meta.get("finish_reason") or {}).get("type", "abort")
        counts = {"num_input_tokens": meta["prompt_tokens"], "num_cached_tokens": meta.get("cached_tokens", 0),
                  "num_output_tokens": meta["completion_tokens"]}
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", _texts(text)), pb_utils.Tensor("finish_reason", _texts(reason)),
            *(pb_utils.Tensor(k, np.array([v], dtype=np.uint32)) for k, v in counts.items())])

    def finalize(self) -> None:
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=30)
        self.engine.shutdown()
