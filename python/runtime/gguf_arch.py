"""What llama.cpp's GGUF files of some architectures say differently from a Hugging Face config: the config.json
fields they imply beyond the shared ones (loader._write_gguf_metadata), and the tensors they store in another form.

- gpt-oss: expert blocks (count, used count, width), YaRN rotary (beta 32 / 1, not truncated, as the published
  configs), sliding-window layers on the even layers (llama.cpp's pattern 2), biases everywhere;
- Gemma 2 / Gemma 3: soft-caps, the query scale (llama.cpp's: 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the
  27B shapes), the window pattern (Gemma 2: even layers; Gemma 3: all but every 6th), Gemma 3's local rotary base;
  the norms are stored as 1 + w (`stored_norm_offset`);
- SmolLM3: every 4th layer without rotary (llama.cpp's pattern).
"""

from __future__ import annotations

from typing import Any

# GGUF general.architecture -> the HF model_type its config.json gets
MODEL_TYPES = {"gpt-oss": "gpt_oss", "gemma3": "gemma3_text"}
_WINDOW_PATTERNS = {"gpt-oss": 2, "gemma2": 2, "gemma3": 6}  # every n-th layer is full attention
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B shapes, whose query scale is hidden / heads


def model_type(arch: str) -> str:
    return MODEL_TYPES.get(arch, arch)


def end_tokens(arch: str) -> tuple[str, ...]:
    """The tokens that end an assistant turn besides the file's one eos token (gpt-oss's harmony format ends a turn
    with <|return|> or, for a tool call, <|call|>; the published generation_config stops at both)."""
    return ("<|return|>", "<|call|>") if arch == "gpt-oss" else ()


def stored_norm_offset(arch: str, gguf_name: str) -> float:
    """What llama.cpp added to a GGUF norm weight (Gemma's (1 + w) norms are stored as 1 + w): the loader subtracts
    it, so the file's tensor is the checkpoint's w."""
    return 1.0 if arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight") else 0.0


def _layer_types(arch: str, meta, layers: int) -> list[str]:
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:  # per layer: true where the layer is windowed
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    n = int(pattern) if isinstance(pattern, (int, float)) and pattern else _WINDOW_PATTERNS[arch]
    return ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers)]


def arch_config(arch: str, meta, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """config.json fields of a GGUF file of `arch` beyond the shared ones (meta(key, default): the file's
    `<arch>.<key>` field)."""
    if arch == "gpt-oss":
        cfg: dict[str, Any] = {
            "model_type": "gpt_oss", "num_local_experts": int(meta("expert_count")),
            "num_experts_per_tok": int(meta("expert_used_count")),
            "intermediate_size": int(meta("expert_feed_forward_length")),
            "sliding_window": int(meta("attention.sliding_window")),
            "layer_types": _layer_types(arch, meta, layers), "attention_bias": True,
            "swiglu_limit": 7.0, "hidden_act": "silu"}
        factor = meta("rope.scaling.factor")
        if factor is not None and str(meta("rope.scaling.type", "yarn")) == "yarn":
            cfg["rope_scaling"] = {
                "rope_type": "yarn", "factor": float(factor), "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": int(meta("rope.scaling.original_context_length"))}
        return cfg
    if arch in ("gemma2", "gemma3"):
        scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
        cfg = {"model_type": model_type(arch), "query_pre_attn_scalar": scalar,
               "hidden_activation": "gelu_pytorch_tanh", "sliding_window": int(meta("attention.sliding_window")),
               "layer_types": _layer_types(arch, meta, layers)}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if meta(key) is not None:
                cfg[key] = float(meta(key))
        if arch == "gemma3":
            cfg["rope_local_base_freq"] = float(meta("rope.freq_base_swa", 10000.0))
            if str(meta("rope.scaling.type", "none")) == "linear" and meta("rope.scaling.factor"):
                cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
        return cfg
    if arch == "smollm3":
        return {"no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(layers)]}
    return {}
