"""What a model folder says about pooling: which request kinds it serves (generate, embed, score), how its
hidden states become one vector (last token / mean / CLS, sentence-transformers' modules.json and
1_Pooling/config.json when present), whether vectors are normalised, whether `dimensions` may truncate them
(Matryoshka), and how a reranker's score is read (a classifier head, or the yes/no logits of a decoder).

Shared by the front process (which validates and post-processes) and the scheduler process (which pools), so
it imports nothing of either.

A decoder reranker (Qwen3-Reranker style) is marked in its config.json by `"classifier_from_token": ["no",
"yes"]`: its score is softmax over those two tokens' logits at the last position, the "yes" probability. It is a
causal LM still: it also generates and embeds (every decoder with an LM head serves all three kinds).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

RequestKind = Literal["generate", "embed", "score"]
PoolingType = Literal["last", "mean", "cls", "max"]

# HF architecture name -> (encoder family, has a sequence classification head)
ENCODER_ARCHITECTURES = {
    "BertModel": ("bert", False),
    "XLMRobertaModel": ("xlm-roberta", False),
    "RobertaModel": ("xlm-roberta", False),
    "BertForSequenceClassification": ("bert", True),
    "XLMRobertaForSequenceClassification": ("xlm-roberta", True),
    "RobertaForSequenceClassification": ("xlm-roberta", True),
}
# decoder bodies without an LM head: embedding models only (Qwen3-Embedding's checkpoints load as these)
EMBEDDING_ONLY_DECODERS = {"Qwen3Model", "Qwen2Model", "LlamaModel"}

_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max"}


def is_encoder(folder: Path) -> bool:
    """Whether the model folder holds an encoder (no KV cache, no generation: scheduler/encoder.py)."""
    names = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    return any(n in ENCODER_ARCHITECTURES for n in names)


class PoolingConfigError(ValueError):
    """A model folder whose pooling files ask for something not supported (named in the message)."""


@dataclass(frozen=True)
class PoolingSpec:
    """A model's pooling behaviour, read once from its folder (`PoolingSpec.read`)."""

    encoder: str | None  # the encoder family ("bert", "xlm-roberta"), None for a decoder
    pooling: PoolingType
    normalize: bool
    is_generation: bool  # serves generate requests (a decoder with an LM head)
    embeds: bool  # serves embed requests
    classifier: bool  # a cross-encoder: score = its classification head over (query, document)
    score_tokens: tuple[int, int] | None  # (no, yes) token ids of a decoder reranker
    hidden_size: int
    matryoshka: bool  # `dimensions` may truncate (then the vector is renormalised)
    prompts: dict[str, str]  # sentence-transformers' named instruction prefixes

    @property
    def scores(self) -> bool:
        return self.classifier or self.score_tokens is not None

    def kinds(self) -> tuple[RequestKind, ...]:
        kinds: list[RequestKind] = []
        if self.is_generation:
            kinds.append("generate")
        if self.embeds:
            kinds.append("embed")
        if self.scores:
            kinds.append("score")
        return tuple(kinds)

    @classmethod
    def read(cls, folder: Path, tokenizer=None) -> PoolingSpec:
        folder = Path(folder)
        hf = json.loads((folder / "config.json").read_text())
        names = hf.get("architectures") or []
        encoder = next((ENCODER_ARCHITECTURES[n] for n in names if n in ENCODER_ARCHITECTURES), None)
        embedding_only = any(n in EMBEDDING_ONLY_DECODERS for n in names)
        st_config = _json(folder / "config_sentence_transformers.json") or {}
        pooling, normalize = _sentence_transformers_pooling(folder)
        if pooling is None:  # no pooling files: the family's usual rule (BGE-style CLS; a decoder's last token)
            pooling = "cls" if encoder is not None else "last"
        if normalize is None:
            normalize = True
        score_tokens = None
        words = hf.get("classifier_from_token")
        if words is not None and encoder is None:
            if tokenizer is None:
                raise PoolingConfigError("classifier_from_token needs the tokenizer to find its tokens")
            score_tokens = _token_pair(words, tokenizer)
        classifier = encoder is not None and encoder[1]
        if encoder is None and pooling != "last":
            raise PoolingConfigError(f"pooling {pooling!r} on a decoder model is not supported (only last-token "
                                     f"pooling: the radix cache keeps no hidden states of cached prompt rows)")
        return cls(encoder=None if encoder is None else encoder[0], pooling=pooling, normalize=normalize,
                   is_generation=encoder is None and not embedding_only, embeds=not classifier,
                   classifier=classifier,
                   score_tokens=score_tokens, hidden_size=int(hf.get("hidden_size", 0)),
                   matryoshka=bool(hf.get("is_matryoshka") or hf.get("matryoshka_dimensions")),
                   prompts={str(k): str(v) for k, v in (st_config.get("prompts") or {}).items()})


def _json(path: Path) -> dict | list | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise PoolingConfigError(f"corrupt {path.name} in {path.parent}: {e}") from e


def _sentence_transformers_pooling(folder: Path) -> tuple[PoolingType | None, bool | None]:
    """(pooling, normalize) from modules.json and its Pooling module's config; (None, None) without them."""
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        return None, None
    pooling, normalize = None, False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            cfg = _json(folder / m.get("path", "1_Pooling") / "config.json") or {}
            modes = [mode for key, mode in _POOLING_MODES.items() if cfg.get(key)]
            others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _POOLING_MODES]
            if others or len(modes) != 1:
                raise PoolingConfigError(f"pooling config {cfg}: exactly one of {sorted(_POOLING_MODES)} is "
                                         f"supported")
            pooling = modes[0]
    return pooling, normalize


def _token_pair(words, tokenizer) -> tuple[int, int]:
    if not (isinstance(words, list) and len(words) == 2 and all(isinstance(w, str) for w in words)):
        raise PoolingConfigError(f"classifier_from_token must be two strings [no, yes], got {words!r}")
    ids = []
    for w in words:
        tok = tokenizer.convert_tokens_to_ids(w)
        if tok is None or tok == getattr(tokenizer, "unk_token_id", None):
            raise PoolingConfigError(f"classifier_from_token: {w!r} is not one token of the tokenizer")
        ids.append(int(tok))
    return ids[0], ids[1]


# ---------------------------------------------------------------- post-processing (front process)


def finish_vector(raw: list[float], normalize: bool, dimensions: int | None = None) -> list[float]:
    """The pooled vector as served: truncated to `dimensions` (Matryoshka), then L2-normalised if asked."""
    vec = raw[:dimensions] if dimensions is not None else list(raw)
    if normalize:
        norm = math.sqrt(sum(x * x for x in vec))
        if norm > 0:
            vec = [x / norm for x in vec]
    return vec


def score_of(raw: list[float]) -> float:
    """A relevance score in [0, 1] from what the scheduler pooled: one classifier logit -> its sigmoid; two
    logits (no, yes) -> the softmax probability of yes; several labels -> the first label's softmax."""
    if len(raw) == 1:
        return 1.0 / (1.0 + math.exp(-raw[0]))
    if len(raw) == 2:
        no, yes = raw
        return 1.0 / (1.0 + math.exp(no - yes))
    top = max(raw)
    exps = [math.exp(x - top) for x in raw]
    return exps[0] / sum(exps)
