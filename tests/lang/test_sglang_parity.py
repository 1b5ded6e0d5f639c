"""SGLang frontend parity on the default model: typed gens hold text, the REGEX_* constants, run(n=...,
use_thread=...), run_batch(generator_style=...), global_config, num_api_spec_tokens, copy() as a block,
setting variables on a finished state, per-call cached tokens in the meta info."""

import json
import re
import warnings

import pytest

import radixgen as sgl
from radixgen.lang.backend_engine import EngineBackend
from radixgen.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def backend(engine):
    if not engine.model_info.get("supports_constraints"):
        pytest.skip("the Engine has no grammar backend (model_info.supports_constraints is False)")
    return EngineBackend(engine)


@pytest.fixture
def config():
    """global_config restored after the test."""
    saved = dict(vars(sgl.global_config))
    yield sgl.global_config
    for name, value in saved.items():
        object.__setattr__(sgl.global_config, name, value)


# Shaped like SGLang's own test programs (test_decode_json, test_dtype_gen), in our words.
@sgl.function
def city_json(s):
    s += "Write a JSON object with facts about Rome.\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + sgl.gen_string() + ",\n"
        s += '  "population": ' + sgl.gen_int() + ",\n"
        s += '  "area": ' + sgl.gen(dtype=int) + ",\n"
        s += '  "latitude": ' + sgl.gen(regex=REGEX_FLOAT, stop=[" ", "\n"]) + ",\n"
        s += '  "motto": ' + sgl.gen(regex=REGEX_STR) + "\n"
        s += "}"


def test_typed_gens_build_valid_json(backend):
    state = city_json.run(backend=backend, max_new_tokens=24, **GREEDY)
    record = json.loads(state["json_output"])
    assert isinstance(record["name"], str) and isinstance(record["population"], int)
    assert isinstance(record["area"], int) and isinstance(record["latitude"], (int, float))


@sgl.function
def typed_answers(s):
    s += "Q: What does DNS stand for?\nA:" + sgl.gen("str_res", dtype=str, stop="\n") + "\n"
    s += "Q: In which year did the Second World War end?\nA:" + sgl.gen("int_res", dtype=int) + "\n"
    s += "Q: What is the value of pi?\nA:" + sgl.gen("float_res", dtype=float) + "\n"
    s += "Q: Is the sky blue?\nA:" + sgl.gen("bool_res", dtype=bool) + "\n"


def test_typed_gens_store_the_generated_text(backend):
    state = typed_answers.run(backend=backend, **GREEDY)
    for name, pattern in [("str_res", REGEX_STR), ("int_res", REGEX_INT), ("float_res", REGEX_FLOAT),
                          ("bool_res", REGEX_BOOL)]:
        value = state[name]
        assert isinstance(value, str) and re.fullmatch(pattern, value), (name, value)
        assert ("A:" + value + "\n") in state.text()  # the variable is exactly the text the program shows
    assert state["str_res"].strip().startswith('"')
    # what SGLang programs do after a run: convert, and store back on the finished state
    state["int_res"] = int(state["int_res"])
    state["float_res"] = float(state["float_res"])
    state["bool_res"] = state["bool_res"].strip() == "True"
    assert isinstance(state["int_res"], int) and isinstance(state["float_res"], float)
    assert state.variables["bool_res"] in (True, False)


def test_dtype_with_regex_warns_and_uses_the_dtype(backend):
    with pytest.warns(UserWarning, match="both dtype and regex") as record:
        expr = "Q: How many legs does a cat have?\nA:" + sgl.gen("n", dtype=int, regex="[a-z]+", max_tokens=4)
    assert record[0].filename == __file__  # the warning points at the program line

    @sgl.function
    def prog(s):
        s += expr

    assert re.fullmatch(REGEX_INT, prog.run(backend=backend, **GREEDY)["n"])


@sgl.function
def two_answers(s):
    s += "Q: Name a fruit.\nA:" + sgl.gen("fruit", max_tokens=4, stop="\n")
    s += "\nQ: Name a color.\nA:" + sgl.gen("color", max_tokens=4, stop="\n", n=1)


def test_run_n_samples_every_gen_that_sets_none(backend):
    state = two_answers.run(backend=backend, n=3, temperature=1.0, max_new_tokens=4)
    fruits, metas = state["fruit"], state.get_meta_info("fruit")
    assert isinstance(fruits, list) and len(fruits) == 3 and all(isinstance(f, str) for f in fruits)
    assert len(metas) == 3
    assert state.text().startswith("Q: Name a fruit.\nA:" + fruits[0] + "\nQ:")  # the text follows the first
    assert isinstance(state["color"], str)  # a gen's own n wins over the run's


def test_use_thread_false_runs_in_the_callers_thread_with_the_same_result(backend):
    threaded = typed_answers.run(backend=backend, **GREEDY)
    inline = typed_answers.run(backend=backend, use_thread=False, **GREEDY)
    assert inline.text() == threaded.text()
    assert inline._core.mode == "inline"


@sgl.function
def forked(s):
    s += "List two animals.\n"
    forks = s.fork(2)
    forks += ["1.", "2."]  # one expression per branch
    forks += sgl.gen("animal", max_tokens=3, stop="\n")
    forks.join()
    with s.copy() as c:  # SGLang's form: the branch's variables come back when the block ends
        c += "3." + sgl.gen("third", max_tokens=3, stop="\n")


@pytest.mark.parametrize("use_thread", [True, False])
def test_fork_list_and_copy_block(backend, use_thread):
    state = forked.run(backend=backend, use_thread=use_thread, **GREEDY)
    assert len(state["animal"]) == 2 and all(isinstance(a, str) for a in state["animal"])
    assert state["third"] == [state["third"][0]] and isinstance(state["third"][0], str)


FEW = "Q: 1+1?\nA: 2\n\nQ: 2+2?\nA: 4\n\n"


@sgl.function
def arithmetic(s, question):
    s += FEW + "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3, stop="\n")


def test_run_batch_generator_style_yields_in_input_order(backend):
    questions = [{"question": f"{i}+{i}?"} for i in range(1, 6)]
    listed = arithmetic.run_batch(questions, backend=backend, **GREEDY)
    gen = arithmetic.run_batch(questions, backend=backend, generator_style=True, num_threads=2, **GREEDY)
    assert not isinstance(gen, list)
    got = list(gen)
    assert [s.text() for s in got] == [s.text() for s in listed]
    assert arithmetic.run_batch([], backend=backend) == []
    assert list(arithmetic.run_batch([], backend=backend, generator_style=True)) == []


def test_meta_info_has_the_cached_tokens_of_each_call(backend):
    arithmetic.run(question="3+3?", backend=backend, **GREEDY)
    meta = arithmetic.run(question="3+3?", backend=backend, **GREEDY).get_meta_info("answer")
    assert 0 < meta["cached_tokens"] <= meta["prompt_tokens"]  # the same prompt again: from the cache

    @sgl.function
    def pick(s):
        s += FEW + "Q: 5+5?\nA:" + sgl.select("answer", [" 10", " 11"])

    pick.run(backend=backend)
    meta = pick.run(backend=backend).get_meta_info("answer")
    assert meta["prompt_tokens"] > 0 and 0 < meta["cached_tokens"] <= meta["prompt_tokens"]


def test_global_config_default_backend_and_verbosity(backend, config, capsys):
    config.default_backend = backend  # what sgl.set_default_backend does
    assert sgl.get_default_backend() is backend
    config.verbosity = 2
    state = arithmetic.run(question="4+4?", **GREEDY)
    assert state.text() in capsys.readouterr().out
    config.verbosity = 0
    arithmetic.run(question="4+4?", **GREEDY)
    assert capsys.readouterr().out == ""


def test_global_config_output_settings_reach_the_runtime(backend, engine, config):
    # The model's chat markers are special tokens: with ignore_eos the gen writes past the end of
    # its turn, and only skip_special_tokens=False keeps the markers in the text.
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\nHi! How can I help you today?"

    @sgl.function
    def raw(s):
        s += prompt + sgl.gen("out", max_tokens=12, ignore_eos=True)

    config.skip_special_tokens_in_output = False
    kept = raw.run(backend=backend, **GREEDY)["out"]
    expected = engine.generate(prompt, {**GREEDY, "max_new_tokens": 12, "ignore_eos": True,
                                        "skip_special_tokens": False})["text"]
    assert kept == expected and "<|im_" in kept
    config.skip_special_tokens_in_output = True
    assert "<|im_" not in raw.run(backend=backend, **GREEDY)["out"]


def test_global_config_accepts_any_sglang_name(config):
    config.enable_parallel_encoding = False  # documented: stored, no effect here
    config.enable_precache_with_tracing = False
    with pytest.warns(UserWarning, match="no effect"):
        config.some_older_sglang_setting = 3
    assert config.some_older_sglang_setting == 3


def test_precache_with_tracing_off_still_runs(backend, config):
    config.enable_precache_with_tracing = False
    states = arithmetic.run_batch([{"question": "6+6?"}, {"question": "7+7?"}], backend=backend, **GREEDY)
    assert all(s.error() is None for s in states)


@sgl.function(num_api_spec_tokens=64)
def speculative(s):
    s += "Name: " + sgl.gen("name", max_tokens=4, stop="\n")


def test_num_api_spec_tokens_is_accepted_and_refused_only_for_openai(backend):
    assert speculative.num_api_spec_tokens == 64
    assert speculative.bind().num_api_spec_tokens == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(speculative.run(backend=backend, **GREEDY)["name"], str)  # a no-op here
    api = sgl.OpenAI("any-model", base_url="http://127.0.0.1:9/v1", api_key="EMPTY")  # never contacted
    with pytest.raises(NotImplementedError, match="num_api_spec_tokens"):
        speculative.run(backend=api)
    with pytest.raises(ValueError, match="num_api_spec_tokens"):
        sgl.function(num_api_spec_tokens=0)(lambda s: None)
