"""Quantized checkpoints end to end: AWQ, GPTQ (v1 and v2 zeros, activation order) and FP8 checkpoints written by
the tests from the tiny random models (quant_checkpoints.py, packed from the formats' public descriptions),
loaded by our runner with their quantization_config picked up from config.json, against transformers running
the same dequantized weights: float32 on the C kernels and on plain torch, bf16 on the C kernels with the fused
decode step. And a checkpoint whose tensors do not match its quantization config, or a request that does not
match the checkpoint, is an error naming the problem."""

from __future__ import annotations

import pytest
from quant_checkpoints import reference_model, write_awq, write_fp8, write_gptq
from test_model_forward import Driver, prompts, ref_logits, rel_err

from radixgen.kernels import cpu
from radixgen.runtime.config import RuntimeConfig
from radixgen.runtime.executor.model_runner import ModelRunner
from radixgen.runtime.loader import ModelLoadError

CHECKPOINTS = {  # name -> (writer, keyword arguments)
    "awq-g32": (write_awq, {"group": 32}),
    "awq-g64-qwen2": (write_awq, {"group": 64, "arch": "qwen2"}),
    "gptq-v1": (write_gptq, {"group": 32}),
    "gptq-v2-act-order": (write_gptq, {"group": 32, "act_order": True, "v2": True}),
    "gptq-tied": (write_gptq, {"group": 64, "arch": "llama-tied"}),
    "fp8": (write_fp8, {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {name: writer(root / name, **kw) for name, (writer, kw) in CHECKPOINTS.items()}


def runner(folder, dtype="float32", **kw) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model=str(folder), dtype=dtype, max_total_tokens=2048, max_running_requests=8,
                                     **kw))


def check_against(r: ModelRunner, ref, tol: float) -> None:
    """A batch of unequal prompts, then greedy decode steps, against transformers."""
    ps = prompts(3, [11, 4, 23], seed=3)
    d = Driver(r, seed=2)
    out = d.step({f"r{i}": p for i, p in enumerate(ps)})
    for i, p in enumerate(ps):
        assert rel_err(out[f"r{i}"], ref_logits(ref, p)) < tol, ("prefill", i)
    seqs = {f"r{i}": list(p) for i, p in enumerate(ps)}
    last = {k: v[-1] for k, v in out.items()}
    for step in range(4):
        last = d.greedy(last, seqs)
        for k in last:
            assert rel_err(last[k], ref_logits(ref, seqs[k])[-1]) < tol, (step, k)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("path", ["c", "torch"])
def test_float32_matches_transformers_on_the_dequantized_weights(checkpoints, name, path):
    folder, dense = checkpoints[name]
    r = runner(folder, disable_cpu_kernels=path == "torch")
    method = name.split("-")[0]
    assert r.quantization.method == method  # from config.json
    names = r.ops.linear_methods(r.model)
    assert any(n.startswith(method) for n in names), names
    check_against(r, reference_model(folder, dense), 1e-4)


@pytest.mark.skipif(not (cpu.available() and cpu.lib().has_decode_step), reason="needs AVX512-BF16")
@pytest.mark.parametrize("name", ["awq-g32", "gptq-v1", "gptq-v2-act-order", "gptq-tied"])
def test_bf16_on_the_c_kernels_and_the_fused_step(checkpoints, name):
    folder, dense = checkpoints[name]
    r = runner(folder, "bfloat16")
    act_order = "act-order" in name
    assert (r.fused_decode is None) == act_order  # permuted inputs stay out of the fused step
    check_against(r, reference_model(folder, dense), 3e-2)


def test_a_checkpoint_whose_tensors_do_not_match_its_config(checkpoints, tmp_path):
    """awq in config.json over dense tensors; an awq group size that the tensors do not have."""
    import json
    import shutil

    from tiny_models import tiny_model_dir

    dense_dir = tmp_path / "dense-says-awq"
    shutil.copytree(tiny_model_dir("llama"), dense_dir)
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    (dense_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.\w+\.\w+_proj\.weight'.*quantization 'awq'"):
        runner(dense_dir)
    wrong_group, _ = write_awq(tmp_path / "awq-group", group=32, config_group=64)
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.\w+\.\w+_proj\.(qzeros|scales)'.*shape"):
        runner(wrong_group)


def test_requests_that_do_not_match_the_checkpoint(checkpoints):
    from tiny_models import tiny_model_dir

    awq, _ = checkpoints["awq-g32"]
    for q in ("none", "int8", "gptq", "gguf"):
        with pytest.raises(ValueError, match="checkpoint is quantized with awq"):
            runner(awq, quantization=q)
    with pytest.raises(ValueError, match="needs an AWQ checkpoint, but the checkpoint is not quantized"):
        runner(tiny_model_dir("llama"), quantization="awq")
    with pytest.raises(ValueError, match="quantization must be one of"):
        RuntimeConfig(quantization="int3")
