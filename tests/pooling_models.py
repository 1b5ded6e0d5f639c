"""Tiny random embedding and reranker models, built with transformers' own classes and saved with the files
sentence-transformers reads (modules.json, 1_Pooling/config.json): a BERT embedder (mean pooling), a BERT
cross-encoder, a Qwen3 body embedder (last-token pooling, Matryoshka) and a Qwen3 yes/no reranker. The BERT
models carry a small WordPiece tokenizer; the Qwen3 ones the default model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import build_once, copy_default_tokenizer, hf_config

WORDS = ("the a of and to in is it that for on with as was at by be this are from or an cat dog sat mat "
         "what capital france paris berlin germany city river food apple bread rain sun weather query document "
         "hello world yes no good bad").split()
BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128)


def _bert_tokenizer(folder: Path) -> int:
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789.,?!", *WORDS]
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    vocab = list(dict.fromkeys(vocab))
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    return len(vocab)


def _randomize(model) -> None:
    with torch.no_grad():  # larger than the default init, so outputs are far from uniform
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.02)


def _sentence_transformers_files(folder: Path, mode: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    cfg = {"word_embedding_dimension": 0, "pooling_mode_cls_token": mode == "cls",
           "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
           "pooling_mode_lasttoken": mode == "last"}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


def _edit_config(folder: Path, **extra) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(extra)
    (folder / "config.json").write_text(json.dumps(cfg))


def bert_embed_dir(root=None, mode: str = "mean") -> Path:
    def build(tmp: Path) -> None:
        import transformers as tf

        n = _bert_tokenizer(tmp)
        torch.manual_seed(7)
        model = tf.BertModel(tf.BertConfig(vocab_size=n, **BERT))
        _randomize(model)
        model.save_pretrained(tmp)
        _sentence_transformers_files(tmp, mode, normalize=True)

    return build_once(f"bert-embed-{mode}", root, build)


def xlmr_embed_dir(root=None) -> Path:
    """An XLM-R body (positions numbered from pad_token_id + 1, one token type) with CLS pooling."""

    def build(tmp: Path) -> None:
        import transformers as tf

        n = _bert_tokenizer(tmp)
        torch.manual_seed(11)
        cfg = tf.XLMRobertaConfig(vocab_size=n, type_vocab_size=1, pad_token_id=0, **{**BERT,
                                  "max_position_embeddings": 130})
        model = tf.XLMRobertaModel(cfg)
        _randomize(model)
        model.save_pretrained(tmp)
        _sentence_transformers_files(tmp, "cls", normalize=False)

    return build_once("xlmr-embed-cls", root, build)


def bert_cross_dir(root=None) -> Path:
    def build(tmp: Path) -> None:
        import transformers as tf

        n = _bert_tokenizer(tmp)
        torch.manual_seed(8)
        model = tf.BertForSequenceClassification(tf.BertConfig(vocab_size=n, num_labels=1, **BERT))
        _randomize(model)
        model.save_pretrained(tmp)

    return build_once("bert-cross", root, build)


def qwen3_embed_dir(root=None) -> Path:
    def build(tmp: Path) -> None:
        import transformers as tf

        torch.manual_seed(9)
        model = tf.Qwen3Model(hf_config("qwen3"))
        _randomize(model)
        model.save_pretrained(tmp)
        copy_default_tokenizer(tmp)
        _sentence_transformers_files(tmp, "last", normalize=True)
        _edit_config(tmp, is_matryoshka=True)
        (tmp / "config_sentence_transformers.json").write_text(json.dumps(
            {"prompts": {"query": "Instruct: find the answer\nQuery:", "document": ""}}))

    return build_once("qwen3-embed", root, build)


def qwen3_reranker_dir(root=None) -> Path:
    def build(tmp: Path) -> None:
        import transformers as tf

        torch.manual_seed(10)
        model = tf.Qwen3ForCausalLM(hf_config("qwen3"))
        _randomize(model)
        model.save_pretrained(tmp)
        copy_default_tokenizer(tmp)
        _edit_config(tmp, classifier_from_token=["no", "yes"])

    return build_once("qwen3-reranker", root, build)
