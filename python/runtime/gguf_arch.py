"""What llama.cpp's GGUF files of some architectures say differently from a Hugging Face config: the config.json
fields they imply beyond the shared ones (loader._write_gguf_metadata), and the tensors they store in another form.

- gpt-oss: expert blocks (count, used count, width), YaRN rotary (beta 32 / 1, not truncated, as the published
  configs), sliding-window layers on the even layers (llama.cpp's pattern 2), biases everywhere;
- Gemma 2 / Gemma 3: soft-caps, the query scale (llama.cpp's: 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the
  27B shapes), the window pattern (Gemma 2: even layers; Gemma 3: all but every 6th), Gemma 3's local rotary base;
  the norms are stored as 1 + w (`stored_norm_offset`);
- SmolLM3: every 4th layer without rotary (llama.cpp's pattern);
- DeepSeek-V2 ("deepseek2"): the latent attention's ranks and head widths (newer files give the per-head widths as
  key_length_mla / value_length_mla and the latent's as key_length / value_length, older ones the per-head widths
  as key_length / value_length), the expert block's counts and scaling, YaRN's magnitude (yarn_log_multiplier is
  0.1 * mscale_all_dim; llama.cpp takes mscale equal to it). Softmax routing only: a file whose experts are gated
  by a sigmoid (DeepSeek-V3's) is refused.
"""

from __future__ import annotations

from typing import Any

# GGUF general.architecture -> the HF model_type its config.json gets
MODEL_TYPES = {"gpt-oss": "gpt_oss", "gemma3": "gemma3_text", "deepseek2": "deepseek_v2"}
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
    if arch == "deepseek2":
        return _deepseek2_config(meta, heads)
    if arch == "smollm3":
        return {"no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(layers)]}
    return {}


_SIGMOID_GATING = 2  # llama.cpp's expert_gating_func values: 1 softmax, 2 sigmoid


def refusal(arch: str, meta, tensor_names) -> str | None:
    """Why a GGUF file of `arch` cannot be run as its architecture here (None: it can): llama.cpp writes
    DeepSeek-V3 as "deepseek2" too, its experts routed by a sigmoid with a per-expert bias (exp_probs_b)."""
    if arch != "deepseek2":
        return None
    if int(meta("expert_gating_func", 1) or 1) == _SIGMOID_GATING or any(
            n.endswith(".exp_probs_b.bias") for n in tensor_names):
        return ("its experts are routed by a sigmoid with a bias (DeepSeek-V3's routing), which is not supported: "
                "DeepSeek-V2 / V2-Lite's softmax routing only")
    return None


def _deepseek2_config(meta, heads: int) -> dict[str, Any]:
    rope = int(meta("rope.dimension_count"))
    key, value = meta("attention.key_length_mla"), meta("attention.value_length_mla")
    if key is None:  # an older file: the per-head widths as the plain key / value lengths
        key, value = meta("attention.key_length"), meta("attention.value_length")
    groups = int(meta("expert_group_count", 1) or 1)
    cfg: dict[str, Any] = {
        "model_type": "deepseek_v2", "num_key_value_heads": heads, "head_dim": rope,
        "kv_lora_rank": int(meta("attention.kv_lora_rank")), "q_lora_rank": meta("attention.q_lora_rank"),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": int(key) - rope, "v_head_dim": int(value),
        "n_routed_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count")),
        "moe_intermediate_size": int(meta("expert_feed_forward_length")),
        "n_shared_experts": int(meta("expert_shared_count", 0) or 0),
        "first_k_dense_replace": int(meta("leading_dense_block_count", 0) or 0), "moe_layer_freq": 1,
        "routed_scaling_factor": float(meta("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(meta("expert_weights_norm", False)), "scoring_func": "softmax",
        "topk_method": "group_limited_greedy" if groups > 1 else "greedy", "n_group": groups,
        "topk_group": int(meta("expert_group_used_count", 1) or 1)}
    if cfg["q_lora_rank"] is not None:
        cfg["q_lora_rank"] = int(cfg["q_lora_rank"])
    if str(meta("rope.scaling.type", "none")) == "yarn" and meta("rope.scaling.factor"):
        scaling = {"rope_type": "yarn", "factor": float(meta("rope.scaling.factor")),
                   "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
                   "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
                   "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0))}
        log_mul = meta("rope.scaling.yarn_log_multiplier")
        if log_mul:
            scaling["mscale"] = scaling["mscale_all_dim"] = float(log_mul) / 0.1
        cfg["rope_scaling"] = scaling
    return cfg
