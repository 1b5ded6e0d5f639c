"""The pooling stage of a decoder's step: embed and score requests are prefill-only requests of the same batch,
over the same radix cache as generation. When a request's prompt is computed, the step's logits row at its last
position gives what it asked for: an embed request its final (normed) hidden state there (last-token pooling, the
row the model runner kept: executor/model_runner.py `last_hidden`), a score request the logits of the reranker's
(no, yes) tokens. Normalisation and truncation are the front process's (runtime/pooling.py), so one cached
computation serves every variant.
"""

from __future__ import annotations

import torch

from radixgen.runtime.pooling import PoolingSpec


class DecoderPooler:
    def __init__(self, spec: PoolingSpec) -> None:
        self.spec = spec

    @staticmethod
    def wants_hidden(reqs) -> bool:
        """Whether a step's requests include an embed request (the runner then keeps the hidden rows)."""
        return any(r.kind == "embed" for r in reqs)

    def output(self, req, row: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> list[float]:
        """The pooled result of `req`, whose last prompt position is logits row `row`. ValueError (the request's
        fault: a 400) for a kind this model does not serve."""
        if req.kind not in self.spec.kinds():
            raise ValueError(f"this model does not serve {req.kind} requests (it serves: "
                             f"{', '.join(self.spec.kinds())})")
        if row < 0:
            raise RuntimeError(f"{req.rid}: no logits row at its last prompt position")
        if req.kind == "score":
            no, yes = self.spec.score_tokens
            return logits[row, [no, yes]].float().tolist()
        if hidden is None:
            raise RuntimeError("the step kept no hidden rows for an embed request")
        return hidden[row].float().tolist()
