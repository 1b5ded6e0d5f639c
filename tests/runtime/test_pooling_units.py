"""PoolingSpec's reading of model folders and the front process's post-processing, without a model."""

from __future__ import annotations

import base64
import json
import math
import struct

import pytest

from radixgen.runtime.pooling import PoolingConfigError, PoolingSpec, finish_vector, score_of
from radixgen.runtime.server.pooling_api import embedding_input, encode_base64, score_pairs


def _folder(tmp_path, arch: str, pooling: dict | None = None, normalize: bool = True, **config):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "hidden_size": 8, **config}))
    if pooling is not None:
        modules = [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (tmp_path / "modules.json").write_text(json.dumps(modules))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


class _Tok:
    unk_token_id = 0
    vocab = {"no": 5, "yes": 6}

    def convert_tokens_to_ids(self, w):
        return self.vocab.get(w, 0)


def test_folders_and_their_kinds(tmp_path):
    (tmp_path / "a").mkdir()
    bert = PoolingSpec.read(_folder(tmp_path / "a", "BertModel", {"pooling_mode_max_tokens": True}, False))
    assert (bert.encoder, bert.pooling, bert.normalize, bert.kinds()) == ("bert", "max", False, ("embed",))
    (tmp_path / "b").mkdir()
    cross = PoolingSpec.read(_folder(tmp_path / "b", "XLMRobertaForSequenceClassification"))
    assert (cross.encoder, cross.kinds()) == ("xlm-roberta", ("score",))
    (tmp_path / "c").mkdir()
    body = PoolingSpec.read(_folder(tmp_path / "c", "Qwen3Model", is_matryoshka=True))
    assert (body.pooling, body.kinds(), body.matryoshka) == ("last", ("embed",), True)
    (tmp_path / "d").mkdir()
    reranker = PoolingSpec.read(_folder(tmp_path / "d", "Qwen3ForCausalLM", classifier_from_token=["no", "yes"]),
                                _Tok())
    assert reranker.score_tokens == (5, 6) and reranker.kinds() == ("generate", "embed", "score")


@pytest.mark.parametrize("arch, pooling, config, match", [
    ("Qwen3Model", {"pooling_mode_mean_tokens": True}, {}, "decoder"),
    ("BertModel", {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, {}, "exactly one"),
    ("BertModel", {"pooling_mode_weightedmean_tokens": True}, {}, "exactly one"),
    ("Qwen3ForCausalLM", None, {"classifier_from_token": ["no", "maybe"]}, "not one token"),
    ("Qwen3ForCausalLM", None, {"classifier_from_token": "yes"}, "two strings"),
])
def test_unsupported_pooling_is_named(tmp_path, arch, pooling, config, match):
    with pytest.raises(PoolingConfigError, match=match):
        PoolingSpec.read(_folder(tmp_path, arch, pooling, **config), _Tok())


def test_post_processing():
    v = finish_vector([3.0, 4.0, 12.0], normalize=True, dimensions=2)
    assert v == pytest.approx([0.6, 0.8])
    assert finish_vector([3.0, 4.0], normalize=False) == [3.0, 4.0]
    assert score_of([0.0]) == pytest.approx(0.5)
    assert score_of([1.0, 3.0]) == pytest.approx(1 / (1 + math.exp(-2.0)))
    packed = base64.b64decode(encode_base64([1.5, -2.25]))
    assert struct.unpack("<2f", packed) == (1.5, -2.25)
    assert embedding_input("x") == {"prompt": "x"}
    assert embedding_input(["x", "y"]) == {"prompt": ["x", "y"]}
    assert embedding_input([1, 2]) == {"input_ids": [[1, 2]]}
    assert score_pairs("q", ["a", "b"]) == [("q", ["a", "b"])]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", ["a"]), ("r", ["b"])]
    with pytest.raises(ValueError, match="as many"):
        score_pairs(["q", "r"], ["a", "b", "c"])
