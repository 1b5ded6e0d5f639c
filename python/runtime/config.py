"""Frozen configuration records, resolved and validated before anything is built."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads="
                f"{self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        from radixgen.runtime.models import architecture_of

        arch = architecture_of(hf)
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # transformers >= 5 folds rope_theta into rope_parameters
        params = hf.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = params.get("rope_theta", 10000.0)
        if rope_scaling is None and params.get("rope_type", "default") != "default":
            rope_scaling = params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
            if kind == "default":
                rope_scaling = None
        window = hf.get("sliding_window")
        if window is not None and hf.get("use_sliding_window", True) and window < hf.get(
            "max_position_embeddings", 0
        ):
            raise ValueError(f"sliding-window attention is not supported (config.sliding_window={window})")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the Engine and scheduler are built from. Unknown keys are rejected by from_kwargs."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bfloat16 where the CPU supports it fast, else float32
    device: str = "cpu"
    load_format: str = "auto"  # auto | dummy
    max_total_tokens: int = 0  # KV slots; 0: sized from max_kv_memory_gb
    max_kv_memory_gb: float = 2.0
    max_running_requests: int = 128
    context_length: int = 0  # 0: the model's max_position_embeddings (capped at 8192)
    chunked_prefill_size: int = 512  # <= 0 disables chunking
    max_prefill_tokens: int = 2048  # token budget of one extend batch
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    page_size: int = 1
    seed: int = 0
    max_queue_wait_steps: int = 64  # ageing bound: a request waits at most this many steps
    grammar_compile_timeout_s: float = 30.0
    grammar_strict_json: bool = False
    grammar_json_whitespace: str = "compact"
    enable_jump_forward: bool = False
    num_threads: int = 0  # torch intra-op threads in the scheduler; 0: torch default
    disable_cpu_kernels: bool = False  # CPU: plain torch ops instead of the C kernels and oneDNN-packed weights
    disable_cuda_graph: bool = False  # CUDA devices: decode steps run eagerly instead of replaying graphs
    cuda_graph_max_bs: int = 160  # largest decode batch captured (also capped by max_running_requests)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_total_tokens < 0:
            raise ValueError(f"max_total_tokens must be >= 0, got {self.max_total_tokens}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.grammar_json_whitespace not in ("compact", "flexible"):
            raise ValueError("grammar_json_whitespace must be 'compact' or 'flexible'")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> RuntimeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown Engine option(s) {unknown}; known: {sorted(known - {'extra'})}")
        return cls(model=model, **kwargs)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[resolve_dtype(self.dtype, self.device)]


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16 make bf16 GEMMs several times faster than fp32 on this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
