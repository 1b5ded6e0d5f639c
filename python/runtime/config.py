"""Frozen configuration records, resolved and validated before anything is built.

Longer than 400 lines: RuntimeConfig is the one declaration of every runtime option (each flag's default, check
and help text in one place, which the server, the Engine and the offline API read), and the model config records
beside it are what those options are checked against; split, a new option would need edits in several files."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from radixgen.common.lora_names import check_target_names, parse_lora_paths
from radixgen.common.options import check_choice, option, split_addr

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
LOAD_FORMATS = ("auto", "dummy")
JSON_WHITESPACE = ("compact", "flexible")  # grammar_json_whitespace
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none", "int8", "int4", "awq", "gptq", "gguf", "fp8")  # quantization
# kv_cache_dtype: auto (the model dtype) or the code dtype of an 8-bit pool (radixgen.kernels.kv_quant)
KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
HICACHE_WRITE_POLICIES = ("write_back", "write_through")
HICACHE_KV_FORMATS = {"auto": None, "model": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
SPECULATIVE_ALGORITHMS = ("none", "ngram", "draft")
# other spellings of speculative_algorithm, any case: SGLang's (NGRAM, STANDALONE) and vLLM's (draft_model)
SPECULATIVE_ALIASES = {"standalone": "draft", "draft_model": "draft"}
MAX_SPECULATIVE_TOKENS = 16


def _text_model_type(text: dict) -> str:
    """The architecture key of a vision-language model's language model, from its text config's model_type."""
    kind = text.get("model_type", "llama")
    keys = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
    if kind not in keys:
        raise ValueError(f"unsupported language model {kind!r} in a vision-language model (supported: "
                         f"{sorted(keys)})")
    return keys[kind]


def _qwen2(text: dict) -> str:
    """Qwen2-VL's language model: the Qwen2 decoder, with M-RoPE (ModelConfig.mrope_section)."""
    return "qwen2"


# multimodal architecture key -> (text config -> the language model's architecture key)
MULTIMODAL_ARCHITECTURES = {"llava": _text_model_type, "qwen2_vl": _qwen2, "qwen2_5_vl": _qwen2}


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts config's expert blocks: `top_k` of `num_experts` experts per token, each a gated MLP
    of `intermediate_size`; norm_topk_prob: the k routing weights renormalised to sum 1; a shared expert of
    `shared_intermediate_size` (0: none) behind a sigmoid gate (Qwen2-MoE); `sparse_layers` the layers with an
    expert block (the others have the dense MLP of ModelConfig.intermediate_size: Qwen's decoder_sparse_step and
    mlp_only_layers)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")

    @classmethod
    def from_hf(cls, arch: str, hf: dict[str, Any]) -> MoEConfig | None:
        """The expert blocks of an `arch` config (None: a dense architecture)."""
        layers = range(hf["num_hidden_layers"])
        # published Qwen configs say num_experts, transformers 5 saves them as num_local_experts (Mixtral's name)
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if arch == "mixtral":  # every layer; softmax, top-k, renormalised
            return cls(experts, hf["num_experts_per_tok"], hf["intermediate_size"], True, tuple(layers))
        if arch == "deepseek_v2":  # dense until first_k_dense_replace, then every moe_layer_freq-th layer
            first, freq = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
            return cls(hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                       bool(hf.get("norm_topk_prob", False)), tuple(i for i in layers if i >= first and i % freq == 0),
                       hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0))
        if arch not in ("qwen2_moe", "qwen3_moe") or not experts:  # num_experts 0: every layer dense
            return None
        step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
        sparse = tuple(i for i in layers if i not in dense and (i + 1) % step == 0)
        shared = hf.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0
        return cls(experts, hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                   bool(hf.get("norm_topk_prob", False)), sparse, int(shared or 0))


ROPE_TYPES = ("default", "llama3", "linear", "yarn")  # layers/rotary.py


def rope_of(hf: dict[str, Any], layer_type: str = "full_attention") -> tuple[float, dict | None, list | None]:
    """(rope_theta, rope_scaling or None, mrope_section or None) of a config, for layers of `layer_type` where
    transformers 5 nests its rope_parameters per layer type (Gemma 3: sliding_attention / full_attention)."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    rope_scaling, rope_theta = hf.get("rope_scaling"), hf.get("rope_theta")
    if rope_theta is None:  # transformers >= 5 folds rope_theta into rope_parameters
        rope_theta = params.get("rope_theta", 10000.0)
    if rope_scaling is None and params.get("rope_type", "default") != "default":
        rope_scaling = params
    mrope = (rope_scaling or params).get("mrope_section")
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind == "mrope" or mrope is not None:  # Qwen2-VL's config names its M-RoPE a rope type
            kind = "default"
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        rope_scaling = None if kind == "default" else {**rope_scaling, "rope_type": kind}
    return float(rope_theta), rope_scaling, mrope


def sliding_windows(hf: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), () where none has one: transformers' layer_types where
    the config has them, else the older fields (Mistral: every layer; Qwen2: use_sliding_window from
    max_window_layers on; Gemma 2: even layers; Gemma 3: all but every sliding_window_pattern-th)."""
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if not window or window >= hf.get("max_position_embeddings", 1 << 62):
        return ()  # no window, or one no context fills
    types = hf.get("layer_types")
    if types is None:
        model_type = hf.get("model_type", "")
        if model_type == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        elif model_type in ("gemma3", "gemma3_text"):
            pattern = hf.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        elif "use_sliding_window" in hf:  # Qwen2's fields
            first = hf.get("max_window_layers") or 0
            types = ["sliding_attention" if hf["use_sliding_window"] and i >= first else "full_attention"
                     for i in range(n)]
        else:
            types = ["sliding_attention"] * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown} (supported: sliding_attention, full_attention)")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs of a Hugging Face config.json."""

    architecture: str  # key of models.MODEL_REGISTRY
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # the expert blocks of a mixture-of-experts model
    # a vision-language model (models/multimodal.py): the language model's architecture key, and the whole
    # Hugging Face config (vision_config, projector, image token); None for a text model
    text_architecture: str | None = None
    multimodal: dict | None = None
    # Qwen2-VL's M-RoPE: the rotary frequencies' split over temporal / height / width position ids (None: plain)
    mrope_section: tuple[int, ...] | None = None
    # per layer: the sliding window of its attention (0: full attention); () where no layer has one
    sliding_windows: tuple[int, ...] = ()
    # the (text) config.json itself, where an architecture's file reads the fields only it has
    hf: dict | None = field(default=None, compare=False, repr=False)

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: full attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads="
                f"{self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        from radixgen.runtime.architectures import architecture_of

        arch = architecture_of(hf)
        full, text_arch = None, None
        if arch in MULTIMODAL_ARCHITECTURES:  # the text fields are the language model's (text_config)
            full, text = hf, {**hf, **(hf.get("text_config") or {})}
            text_arch = MULTIMODAL_ARCHITECTURES[arch](text)
            for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
                if key in hf and key not in (hf.get("text_config") or {}):
                    text[key] = hf[key]
            hf = text
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        kv_heads = hf.get("num_key_value_heads") or num_heads
        if arch == "deepseek_v2":  # the pool holds the compressed latent (models/deepseek_v2.py): one KV head of
            # half its width in K and the other half in V
            latent = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
            if latent % 2:
                raise ValueError(f"kv_lora_rank + qk_rope_head_dim = {latent} must be even")
            head_dim, kv_heads = latent // 2, 1
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta, rope_scaling, mrope = rope_of(hf)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            # a decoder body without an LM head (an embedding model): the head shares the embedding, so a step's
            # logits are defined; its embed requests read hidden states (runtime/pooling.py)
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)) or _headless(hf),
            rope_scaling=rope_scaling,
            attention_bias=(arch == "qwen2" or bool(hf.get("attention_bias", False))
                            or (arch == "qwen2_moe" and bool(hf.get("qkv_bias", True)))),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=MoEConfig.from_hf(arch, hf),
            text_architecture=text_arch,
            multimodal=full,
            mrope_section=tuple(mrope) if mrope is not None else None,
            sliding_windows=sliding_windows(hf),
            hf=hf,
        )


def _headless(hf: dict) -> bool:
    from radixgen.runtime.pooling import EMBEDDING_ONLY_DECODERS

    return any(n in EMBEDDING_ONLY_DECODERS for n in hf.get("architectures") or ())


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the Engine and scheduler are built from. Unknown keys are rejected by from_kwargs."""

    model: str | None = option(
        None, "Hugging Face folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
        flags=("--model", "--model-path"))
    dtype: str = option("auto", "weights and activations; auto: bfloat16 on CUDA and on x86 CPUs (AMX / "
                        "AVX512-BF16, or the C kernels' float32 math on bf16 weights), else float32",
                        choices=("auto", *DTYPES))
    device: str = option("cpu", "cpu, cuda or cuda:N")
    load_format: str = option("auto", "auto: the checkpoint's weights; dummy: random weights (benchmarks)",
                              choices=LOAD_FORMATS)
    max_total_tokens: int = option(0, "KV cache slots; 0: sized from --max-kv-memory-gb")
    max_kv_memory_gb: float = option(2.0, "KV cache memory when --max-total-tokens is 0 (per rank)")
    max_running_requests: int = option(128, "requests decoded together at most")
    context_length: int = option(0, "longest prompt + output; 0: the model's max_position_embeddings (capped at 8192)")
    chunked_prefill_size: int = option(512, "a longer prompt is prefilled in chunks of this many tokens; "
                                       "<= 0: no chunking")
    max_prefill_tokens: int = option(2048, "token budget of one prefill (extend) batch")
    schedule_policy: str = option("lpm", "order of waiting requests: lpm (longest cached prefix first), dfs-weight "
                                  "(depth-first over the radix tree), fcfs", choices=SCHEDULE_POLICIES)
    disable_radix_cache: bool = option(False, "no prefix reuse: every prompt is computed in full")
    page_size: int = option(1, "tokens per radix-tree key (prefixes are reused in whole pages)")
    seed: int = option(0, "seed of the dummy weights (--load-format dummy)")
    max_queue_wait_steps: int = option(64, "ageing bound: a waiting request is admitted after at most this many steps")
    grammar_compile_timeout_s: float = option(30.0, "seconds; a constraint whose grammar takes longer to compile "
                                              "fails its request")
    grammar_strict_json: bool = option(False, "reject JSON schemas with keywords the grammar cannot enforce "
                                       "(default: a warning)")
    grammar_json_whitespace: str = option("compact", "JSON output from a schema: compact (no whitespace) or flexible "
                                          "(bounded runs of whitespace)", choices=JSON_WHITESPACE)
    enable_jump_forward: bool = option(False, "prefill the text a grammar forces instead of decoding it token by token")
    num_threads: int = option(0, "torch intra-op threads of the scheduler process (of each rank's process with "
                              "tensor / pipeline parallelism); 0: torch's default (with several ranks on a node, "
                              "its CPUs split between them)")
    disable_cpu_kernels: bool = option(False, "CPU: plain torch ops instead of the C kernels and oneDNN-packed weights")
    deterministic: bool = option(False, "batch-invariant kernels: a request's output ids and logprobs are the same "
                                 "bits whatever else is batched with it, its prefill chunking, its cache hits or "
                                 "speculation (CPU, bf16 weights, AVX512-BF16; other combinations are refused)")
    disable_cuda_graph: bool = option(False, "CUDA: decode steps run eagerly instead of replaying CUDA graphs")
    cuda_graph_max_bs: int = option(160, "CUDA: largest decode batch captured in a graph (also capped by "
                                    "--max-running-requests)")
    # ---- quantized weights (layers/quantization)
    quantization: str = option(
        "auto", "linear layers' weights: auto (the checkpoint's quantization_config: awq, gptq or fp8; else none; "
        "a .gguf file on the CPU: gguf, its own blocks, except in deterministic mode or without the C kernels; on "
        "CUDA dequantized), none (a .gguf file dequantized to the dtype), int8 (per output channel, quantized at "
        "load), int4 (CPU: groups of 64 "
        "input columns, fp16 scale and offset, quantized at load; experts and every linear layer but the LM head), "
        "awq / gptq (int4 checkpoints), gguf (a .gguf file run from its own Q4_0 / Q4_1 / Q8_0 / Q6_K blocks; an "
        "expert block's too), fp8 (e4m3 checkpoints, or quantized at load)", choices=QUANTIZATIONS,
        flags=("--quantization", "-q"))
    # ---- KV cache quantization (issue 15)
    kv_cache_dtype: str = option("auto", "KV cache storage: auto (the model dtype), or int8 / fp8_e4m3 codes with a "
                                 "bf16 scale per token and KV head (about twice the tokens in the same memory)",
                                 choices=tuple(KV_CACHE_DTYPES))
    kv_huge_pages: bool = option(False, "CPU: the KV pool in transparent huge pages: attention and decode a few "
                                 "percent faster, but a fresh pool's first writes may wait for the kernel to compact "
                                 "memory (seconds on a long-running machine: a restarted server's first requests)")
    # ---- the hierarchical cache (runtime/scheduler/tiers/): evicted prefixes move to host memory and disk
    enable_hierarchical_cache: bool = option(False, "keep KV evicted from the pool in a host-memory tier (and, with "
                                             "--kv-cache-dir, a disk tier), loaded back when a request reuses it")
    hicache_ratio: float = option(2.0, "host tier size as a multiple of the KV pool's tokens")
    hicache_size: float = option(0.0, "host tier size in GB (overrides --hicache-ratio; 0: the ratio)")
    hicache_write_policy: str = option("write_back", "write_back: KV moves down a tier when it is evicted; "
                                       "write_through: also written to the disk tier as soon as it is cached "
                                       "(where a restart and other replicas find it)", choices=HICACHE_WRITE_POLICIES)
    hicache_kv_format: str = option("auto", "host / disk tier storage: auto (the pool's 8-bit codes for an 8-bit "
                                    "pool; int8 on the CPU, about twice the tokens per byte, not bit-exact; the "
                                    "model dtype on CUDA), model (the pool's format, bit-exact), int8, fp8_e4m3",
                                    choices=tuple(HICACHE_KV_FORMATS))
    kv_cache_dir: str | None = option(None, "disk tier of the hierarchical cache (implies it): page files kept "
                                      "across restarts and shared by servers of the same model (needs --page-size "
                                      ">= 4)")
    hicache_disk_size: float = option(16.0, "disk tier size in GB (least recently used pages go first)")
    # ---- tensor and pipeline parallelism, single- and multi-node (runtime/executor/distributed.py)
    tp_size: int = option(1, "tensor parallelism: ranks that split every layer (attention heads, MLP columns, "
                          "vocabulary)", flags=("--tp-size", "--tensor-parallel-size"))
    pp_size: int = option(1, "pipeline parallelism: stages that split the layers (micro-batches in flight)",
                          flags=("--pp-size", "--pipeline-parallel-size"))
    ep_size: int = option(1, "expert parallelism (mixture-of-experts models): the tensor-parallel ranks of a stage "
                          "form ep_size groups, each holding 1/ep_size of every expert block's experts (and splitting "
                          "their MLP columns over its tp_size / ep_size ranks); must divide tp_size, as SGLang's",
                          flags=("--ep-size", "--expert-parallel-size", "--ep"))
    nnodes: int = option(1, "machines the tp_size * pp_size ranks are spread over, as many on each")
    node_rank: int = option(0, "this machine's index: node 0 serves; the others run only their ranks")
    dist_init_addr: str | None = option(None, "host:port where node 0 meets the other ranks (needed with "
                                        "--nnodes > 1; default: a free loopback port)")
    dist_timeout: float = option(120.0, "seconds: a collective, transfer or join that takes longer fails the group")
    # ---- LoRA adapters (runtime/lora/): many adapters over the base model, mixed in one batch
    enable_lora: bool = option(False, "serve LoRA adapters (implied by --lora-paths); load more at run time "
                               "with /load_lora_adapter")
    lora_paths: tuple[str, ...] = option((), "LoRA adapters (PEFT folders) loaded at start: NAME=PATH, or PATH "
                                         "(named after its folder)", several=True)
    max_loras: int = option(8, "LoRA adapters resident at once (the pool's slots); others are read from disk when "
                            "a request needs them, replacing the least recently used",
                            flags=("--max-loras", "--max-loras-per-batch"))
    max_lora_rank: int = option(0, "largest LoRA rank the pool holds; 0: the largest of --lora-paths (16 without)")
    lora_target_modules: tuple[str, ...] = option(
        (), "modules the pool holds LoRA weights for (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, "
        "or all); default: those of --lora-paths, all without", several=True)

    # ---- speculative decoding (runtime/scheduler/speculative/)
    speculative_algorithm: str = option(
        "none", "speculative decoding: none; ngram (drafts copied from the request's own prompt and output and "
        "from what earlier requests generated after the same context, no extra model); draft (a small model of "
        "the same vocabulary drafts, --speculative-draft-model-path). Any case; SGLang's NGRAM and STANDALONE too",
        choices=(*SPECULATIVE_ALGORITHMS, *SPECULATIVE_ALIASES), flags=("--speculative-algorithm",), any_case=True)
    speculative_draft_model: str | None = option(
        None, "the draft model of --speculative-algorithm draft (given alone, it implies that algorithm): a Hugging "
        "Face folder or .gguf file (the target model's own path works, for testing)",
        flags=("--speculative-draft-model-path", "--speculative-draft-model"))
    num_speculative_tokens: int = option(
        7, "draft tokens per request and step at most (speculation adapts the number to how many get accepted; "
        f"1..{MAX_SPECULATIVE_TOKENS}; at most 7 where the fused CPU decode step verifies)",
        flags=("--speculative-num-draft-tokens", "--num-speculative-tokens"))

    # ---- image input (runtime/media/, models/multimodal.py)
    max_image_pixels: int = option(16_777_216, "an image whose width * height (decoded) is larger is refused (400)")
    max_images_per_request: int = option(16, "a prompt with more images is refused (400)")
    allow_remote_media: bool = option(False, "fetch http(s) image URLs (OpenAI image_url, image_data); off: only "
                                      "data URLs, base64, paths and bytes")
    max_media_bytes: int = option(20 << 20, "largest image file read or fetched, in bytes")
    allowed_local_media_path: str | None = option(
        None, "a folder whose image files HTTP clients may name by path (image_data, image_url: an absolute path or "
        "file:// URL under it); none: the HTTP APIs read no local file (in-process callers may pass any path)")
    media_fetch_timeout_s: float = option(10.0, "seconds: an http(s) image fetch that takes longer fails its request")
    encoder_cache_tokens: int = option(32768, "encoder outputs kept for reuse (LRU, by image content hash), in "
                                       "image tokens; 0: none kept")

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, ("auto", *DTYPES))
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        check_choice("grammar_json_whitespace", self.grammar_json_whitespace, JSON_WHITESPACE)
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("page_size", "max_running_requests", "max_prefill_tokens", "cuda_graph_max_bs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_total_tokens", "context_length", "num_threads", "max_queue_wait_steps",
                     "encoder_cache_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.max_kv_memory_gb > 0:
            raise ValueError(f"max_kv_memory_gb must be > 0, got {self.max_kv_memory_gb}")
        for name in ("max_image_pixels", "max_images_per_request", "max_media_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.media_fetch_timeout_s > 0:
            raise ValueError(f"media_fetch_timeout_s must be > 0, got {self.media_fetch_timeout_s}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        self._check_parallel()
        self._check_speculative()
        self._check_lora()
        self._check_hicache()
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be a bool, got {self.deterministic!r}")
        if self.deterministic:
            from radixgen.runtime.deterministic import check_config

            check_config(self)

    def _check_parallel(self) -> None:
        for name in ("tp_size", "pp_size", "ep_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}: expert parallelism splits "
                             f"the experts over groups of the tensor-parallel ranks (use --tp-size "
                             f"{self.ep_size} --ep-size {self.ep_size} for experts split over {self.ep_size} ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if (self.tp_size * self.pp_size) % self.nnodes:
            raise ValueError(f"tp_size * pp_size = {self.tp_size * self.pp_size} ranks do not split evenly over "
                             f"nnodes={self.nnodes}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr (host:port of node 0) is needed with nnodes > 1")
        if self.dist_init_addr is not None:
            split_addr(self.dist_init_addr)
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if not isinstance(algo, str):
            raise ValueError(f"speculative_algorithm must be a string, got {algo!r}")
        algo = SPECULATIVE_ALIASES.get(algo.lower(), algo.lower())
        if algo == "none" and self.speculative_draft_model is not None:
            algo = "draft"  # as vLLM's speculative_model alone
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)} (or "
                             f"{', '.join(SPECULATIVE_ALIASES)}); got {self.speculative_algorithm!r}")
        object.__setattr__(self, "speculative_algorithm", algo)  # the one spelling the runtime reads
        if algo == "draft" and not self.speculative_draft_model:
            raise ValueError("speculative_algorithm='draft' needs speculative_draft_model (a model path)")
        if algo == "ngram" and self.speculative_draft_model is not None:
            raise ValueError("speculative_draft_model is only used with speculative_algorithm='draft' (got 'ngram')")
        if algo != "none" and self.pp_size > 1:
            raise ValueError("speculative decoding does not run with pp_size > 1 (the pipeline scheduler keeps "
                             "several steps in flight and verifies none); use pp_size=1 or no speculation")
        if algo == "draft" and self.tp_size > 1:
            raise ValueError("speculative_algorithm='draft' does not run with tp_size > 1 (the draft model would "
                             "need its own sharded group); use speculative_algorithm='ngram' with tensor parallelism")
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {n!r}")

    def _check_hicache(self) -> None:
        check_choice("hicache_write_policy", self.hicache_write_policy, HICACHE_WRITE_POLICIES)
        check_choice("hicache_kv_format", self.hicache_kv_format, tuple(HICACHE_KV_FORMATS))
        if not self.hicache_enabled:
            return
        if not self.hicache_ratio > 0 or self.hicache_size < 0 or not self.hicache_disk_size > 0:
            raise ValueError(f"hicache_ratio and hicache_disk_size must be > 0 and hicache_size >= 0, got "
                             f"{self.hicache_ratio}, {self.hicache_disk_size}, {self.hicache_size}")
        if self.disable_radix_cache:
            raise ValueError("the hierarchical cache needs the radix cache (drop disable_radix_cache)")
        if self.world_size > 1:
            raise ValueError("the hierarchical cache is not supported with tensor or pipeline parallelism yet "
                             "(its host and disk tiers are one process's); use tp_size=1 and pp_size=1")
        if self.speculative_algorithm == "draft":
            raise ValueError("the hierarchical cache does not keep a draft model's KV: use speculative_algorithm="
                             "'ngram' (or none) with it")
        pool, host = self.kv_code_dtype, HICACHE_KV_FORMATS[self.hicache_kv_format]
        if pool is not None and host is not None and host != pool:
            raise ValueError(f"hicache_kv_format={self.hicache_kv_format!r} over an 8-bit pool of "
                             f"kv_cache_dtype={self.kv_cache_dtype!r}: the host tier keeps the pool's own codes "
                             f"(use auto or model)")
        if self.kv_cache_dir is not None and self.page_size < 4:
            raise ValueError(f"kv_cache_dir: the disk tier writes one file per page; page_size={self.page_size} "
                             f"is too small (use --page-size 16 or more)")

    @property
    def hicache_enabled(self) -> bool:
        return self.enable_hierarchical_cache or self.kv_cache_dir is not None

    @property
    def hicache_code_dtype(self) -> torch.dtype | None:
        """The host / disk tier's code dtype (None: the pool's format, values in the model dtype or its codes)."""
        if self.kv_code_dtype is not None or self.hicache_kv_format == "model":
            return self.kv_code_dtype
        if self.hicache_kv_format == "auto":  # (the deterministic mode keeps the pool's bits: reloaded, exact)
            return torch.int8 if self.device == "cpu" and not self.deterministic else None
        return HICACHE_KV_FORMATS[self.hicache_kv_format]

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 0:
            raise ValueError(f"max_lora_rank must be >= 0, got {self.max_lora_rank}")
        parse_lora_paths(self.lora_paths)
        check_target_names(self.lora_target_modules)
        if self.lora_enabled and self.world_size > 1:  # the adapter pool and its loads live on one rank
            raise ValueError(f"LoRA adapters (enable_lora / lora_paths) are not supported with tensor or pipeline "
                             f"parallelism (tp_size={self.tp_size}, pp_size={self.pp_size}): serve them with "
                             f"tp_size=1 and pp_size=1")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> RuntimeConfig:
        for alias, name in ENGINE_ALIASES.items():  # vLLM's keywords
            if alias in kwargs:
                if name in kwargs:
                    raise ValueError(f"give one of {alias} and {name}, not both")
                kwargs[name] = kwargs.pop(alias)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown Engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[resolve_dtype(self.dtype, self.device)]

    @property
    def kv_code_dtype(self) -> torch.dtype | None:
        """The code dtype of an 8-bit KV pool; None: the pool holds the model dtype."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype]


ENGINE_ALIASES = {"tensor_parallel_size": "tp_size", "pipeline_parallel_size": "pp_size",
                  "expert_parallel_size": "ep_size"}


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto`: bf16 on CUDA; on the CPU bf16 wherever bf16 weights are multiplied fast, float32 elsewhere (see
    cpu_keeps_bf16). float32 and bfloat16 by name are taken as they are."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_keeps_bf16() else "float32"


def cpu_keeps_bf16() -> bool:
    """Whether bf16 weights run at least as fast as float32 ones here: AMX or AVX512-BF16 (bf16 dot products), or
    the C kernels' build for this CPU multiplies bf16 weights in float32 registers (AVX2 and FMA: every x86-64 CPU
    of the last decade), which reads half float32's bytes a decode step and matched oneDNN's float32 prefill.
    Without the C kernels (no compiler, RADIXGEN_DISABLE_CPU_KERNELS=1, another architecture) bf16 matmuls would
    be torch's, several times slower than float32 on CPUs without bf16 instructions."""
    if cpu_has_fast_bf16():
        return True
    from radixgen.kernels import cpu  # builds the kernels on first use: only when auto has to decide

    kl = cpu.lib()
    return kl is not None and kl.has_fast_bf16_linear


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16 make bf16 GEMMs several times faster than fp32 on this CPU. Under RADIXGEN_CPU_ISA naming
    another CPU's build (the emulation of an older CPU), that CPU's answer: only cooperlake has AVX512-BF16."""
    isa = os.environ.get("RADIXGEN_CPU_ISA") or "native"
    if isa != "native":
        return isa == "cooperlake"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
