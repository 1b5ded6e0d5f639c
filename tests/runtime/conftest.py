"""Fixtures shared by the scheduler-level tests: the tiny Llama and its tokenizer (a module may define its own)."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model_dir

from radixgen.runtime.loader import load_tokenizer


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)
