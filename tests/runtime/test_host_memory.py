"""keep_freed_host_memory: after it, a large tensor allocated again after being freed reuses the freed pages
instead of faulting fresh ones in (run in a subprocess: the setting is process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from radixgen.runtime.executor.model_runner import keep_freed_host_memory

def faults_of_a_fresh_16mb_tensor():
    torch.empty(4 << 20).fill_(1.0)  # allocated, touched, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(4 << 20).fill_(2.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults_of_a_fresh_16mb_tensor()
ok = keep_freed_host_memory()
faults_of_a_fresh_16mb_tensor()  # the first cycle after it may still fault (in about 1 process of 4 here)
kept = max(faults_of_a_fresh_16mb_tensor() for _ in range(3))  # from then on, as every step: none
print(default, ok, kept)
"""


def test_freed_blocks_are_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    default, ok, kept = int(out[0]), out[1] == "True", int(out[2])
    assert ok
    if default < 100:  # fresh memory came as a few huge pages: too few faults to tell the two apart
        pytest.skip(f"{default} faults for 16 MiB of fresh memory (transparent huge pages)")
    assert kept < default / 10


TOKENIZER_SCRIPT = """
import sys
from radixgen.runtime.loader import load_tokenizer
tok = load_tokenizer(None)
registry = "transformers.models.auto.tokenization_auto" in sys.modules
from transformers import AutoTokenizer
auto = AutoTokenizer.from_pretrained(str(tok.name_or_path))
texts = ["The lighthouse keeper", "  two spaces\\n\\nand lines", "<|im_start|>user\\nhé<|im_end|>", "1234567 tokens"]
chat = [{"role": "user", "content": "hi"}]
same = all(tok(t).input_ids == auto(t).input_ids and tok.decode(tok(t).input_ids) == auto.decode(auto(t).input_ids)
           for t in texts)
same &= tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
    chat, tokenize=False, add_generation_prompt=True)
same &= (type(tok), tok.all_special_ids, tok.eos_token_id, len(tok)) == (type(auto), auto.all_special_ids,
                                                                         auto.eos_token_id, len(auto))
print(registry, same)
"""


def test_the_default_tokenizer_loads_without_transformers_model_registry():
    """The bundled model's tokenizer is a plain fast one, built by its class: the same tokenizer AutoTokenizer
    builds, without importing the registry of every model family (about 80 MB resident in each process)."""
    out = subprocess.run([sys.executable, "-c", TOKENIZER_SCRIPT], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]
