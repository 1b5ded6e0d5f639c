"""The pooling stage of an encoder model (BERT / XLM-R: BGE, E5, cross-encoder rerankers), in the scheduler
process. An encoder has no KV cache and no decode steps: each step takes the waiting requests in arrival order
(up to a token budget) and runs one bidirectional forward per request, then pools its hidden states (or scores
them with the classification head) and finishes it. It answers the same messages as the decoder scheduler
(core.py), so the process loop and the Engine treat it alike.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from pathlib import Path

import torch

from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.weights import iter_safetensors
from radixgen.runtime.messages import (
    AbortRequest,
    ControlKind,
    ControlReply,
    ControlRequest,
    FinishReason,
    GenerateRequest,
    ReadySignal,
    ReqOutput,
)
from radixgen.runtime.models.bert import BertEncoder
from radixgen.runtime.pooling import PoolingSpec

logger = logging.getLogger(__name__)


def pool_hidden(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """(T, H) hidden states of one sequence -> (H,) float32: its first token's (CLS), mean, max, or last token's."""
    if pooling == "max":
        return hidden.float().amax(dim=0)
    if pooling == "cls":
        return hidden[0].float()
    if pooling == "mean":
        return hidden.float().mean(dim=0)
    return hidden[-1].float()


class NoKV:
    """An encoder keeps no KV: the figures the process loop reads of a KV manager."""

    capacity = 0

    def close(self) -> None:
        pass


class EncoderRunner:
    """The encoder model of a folder, on the configured device and dtype."""

    def __init__(self, cfg: RuntimeConfig, model_path: str, spec: PoolingSpec) -> None:
        folder = Path(model_path)
        self.hf_config = json.loads((folder / "config.json").read_text())
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype
        self.spec = spec
        model = BertEncoder(self.hf_config, spec.encoder, spec.classifier)
        model.load_weights(iter_safetensors(folder))
        self.model = model.to(self.device, self.dtype).eval()
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.context_length = self.model.max_tokens

    @torch.inference_mode()
    def run(self, input_ids: list[int], token_type_ids: list[int] | None) -> list[float]:
        """What the request asked for: the pooled vector (not normalised), or the classifier's logits."""
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        types = torch.zeros_like(ids)
        if token_type_ids is not None and self.spec.encoder == "bert":  # XLM-R has one token type
            types = torch.tensor(token_type_ids, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, types)  # (T, H)
        if self.spec.classifier:
            return self.model.classify(hidden).float().tolist()
        return pool_hidden(hidden, self.spec.pooling).tolist()


class EncoderScheduler:
    """Waiting requests -> one forward each per step (up to `max_prefill_tokens` tokens a step) -> finished."""

    def __init__(self, cfg: RuntimeConfig, runner: EncoderRunner) -> None:
        self.cfg, self.runner = cfg, runner
        self.waiting: deque[GenerateRequest] = deque()
        self.aborted: set[str] = set()
        self.outbox: list = []
        self.kv = NoKV()
        self.counters = dict(num_requests=0, prompt_tokens=0, failed_requests=0, forward_passes=0)
        self.waits_in_background = False

    def ready_signal(self) -> ReadySignal:
        r = self.runner
        return ReadySignal(num_slots=r.context_length, context_length=r.context_length, vocab_size=r.vocab_size,
                           dtype=str(r.dtype).removeprefix("torch."),
                           max_running_requests=self.cfg.max_running_requests, grammar=False)

    def handle_message(self, msg) -> None:
        match msg:
            case GenerateRequest():
                self.counters["num_requests"] += 1
                self.waiting.append(msg)
            case AbortRequest(rid=rid):
                self.aborted.add(rid)
            case ControlRequest(reply_id=reply_id, kind=kind):
                self.outbox.append(ControlReply(reply_id, self.control(kind)))
            case _:  # LoRA, tree snapshots: an encoder has neither; the caller gets a clear answer
                reply_id = getattr(msg, "reply_id", None)
                if reply_id is None:
                    raise TypeError(f"unknown message {type(msg).__name__}")
                self.outbox.append(ControlReply(reply_id, f"{type(msg).__name__} is not supported by an encoder "
                                                          f"model"))

    def control(self, kind: ControlKind):
        if kind == ControlKind.SERVER_INFO:
            return {"cache": None, "num_running": 0, "num_waiting": len(self.waiting), "stats": dict(self.counters),
                    "cache_hit_rate": 0.0, "invariant_ok": True, "encoder": self.runner.spec.encoder}
        if kind == ControlKind.FLUSH_CACHE:
            return True
        raise ValueError(f"unknown control request {kind!r}")

    def step(self) -> bool:
        if not self.waiting:
            return False
        budget = self.cfg.max_prefill_tokens
        while self.waiting and (budget > 0 or not self.outbox):
            msg = self.waiting.popleft()
            budget -= len(msg.input_ids)
            self.outbox.append(self.run_one(msg))
        self.counters["forward_passes"] += 1
        if not self.waiting:
            self.aborted.clear()  # aborts of requests already answered
        return True

    def run_one(self, msg: GenerateRequest) -> ReqOutput:
        n = len(msg.input_ids)
        if msg.rid in self.aborted:
            self.aborted.discard(msg.rid)
            return ReqOutput(msg.rid, [], FinishReason.abort("aborted by the client"), n, 0)
        try:
            if msg.kind == "generate":
                raise ValueError("this is an encoder model: it serves embed and score requests, not generation")
            if msg.kind == "score" and not self.runner.spec.classifier:
                raise ValueError("this embedding model has no classification head: it does not score")
            if msg.kind == "embed" and self.runner.spec.classifier:
                raise ValueError("this cross-encoder scores (query, document) pairs: it does not embed")
            pooled = self.runner.run(msg.input_ids, msg.token_type_ids)
        except ValueError as e:
            return ReqOutput(msg.rid, [], FinishReason.abort(str(e), 400), n, 0)
        except Exception as e:  # noqa: BLE001 - fails this request alone
            logger.exception("the encoder forward of %s failed", msg.rid)
            self.counters["failed_requests"] += 1
            return ReqOutput(msg.rid, [], FinishReason.abort(f"{type(e).__name__}: {e}", 500), n, 0)
        self.counters["prompt_tokens"] += n
        return ReqOutput(msg.rid, [], FinishReason.stop(None), n, 0, pooled=pooled)

    def is_idle(self) -> bool:
        return not self.waiting

    def invariant_holds(self) -> bool:
        return True
