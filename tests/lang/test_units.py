"""The language without a model: IR, select scoring math, token merges, chat-template rendering."""

import asyncio
import math
import random
import threading
from types import SimpleNamespace

import pytest

import radixgen as sgl
from radixgen.lang.backend_base import GenRequest, ScorePlan, parse_choices, plan_choices
from radixgen.lang.backend_engine import EngineBackend
from radixgen.lang.backend_http import parse_sse_line, raise_for_error
from radixgen.lang.backend_openai import choice_span
from radixgen.lang.chat import ChatTemplate
from radixgen.lang.choices import ChoicesDecision, decide, resolve_method
from radixgen.lang.interpreter import Notifier, ProgramError, SamplingDefaults, caller_origin, produced_names
from radixgen.lang.ir import Gen, RoleBegin, RoleEnd, Select, Seq, Text, as_node


@pytest.fixture(scope="module")
def tokenizer():
    from radixgen.runtime.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def trace_backend(tokenizer):
    """The real interpreter and chat template, for programs traced up to their first model call."""
    return EngineBackend(SimpleNamespace(tokenizer=tokenizer, model_info={}))


def lp(*values):
    return [(v, 100 + i, None) for i, v in enumerate(values)]


# ------------------------------------------------------------------------------------------ IR


def test_concatenation_builds_one_flat_sequence():
    expr = "Q: " + sgl.gen("a", max_tokens=4) + "\n" + ("A: " + sgl.select("b", ["x", "y"]))
    assert isinstance(expr, Seq)
    kinds = [type(n).__name__ for n in expr.items]
    assert kinds == ["Text", "Gen", "Text", "Text", "Select"]
    assert expr.items[1] == Gen(name="a", max_new_tokens=4)
    assert produced_names(expr) == {"a": 1, "b": 1}


def test_roles_and_gen_forms():
    assert sgl.user("hi") == Seq((RoleBegin("user"), Text("hi"), RoleEnd("user")))
    assert sgl.assistant_begin() == RoleBegin("assistant")
    g = sgl.gen("n", dtype=int, stop="\n")
    assert g.dtype == "int" and g.stop == ("\n",)
    assert sgl.gen_int("n").dtype == "int" and sgl.gen_string("s").dtype == "str"
    s = sgl.gen("c", choices=["a", "b"])
    assert isinstance(s, Select) and s.method is sgl.token_length_normalized and s.temperature == 0.0
    assert sgl.gen(json_schema={"type": "object"}).json_schema == '{"type": "object"}'


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: sgl.gen("x", regex="[0-9]+", json_schema={"type": "integer"}), "at most one of"),
        (lambda: sgl.gen("x", regex="(unclosed"), "gen.regex"),
        (lambda: sgl.gen("x", dtype=list), "gen.dtype"),
        (lambda: sgl.gen("", max_tokens=3), "gen.name"),
        (lambda: sgl.gen("x", n=0), "gen.n"),
        (lambda: sgl.select("x", []), "select.choices"),
        (lambda: sgl.select("x", ["a", ""]), "select.choices"),
        (lambda: sgl.select("x", ["a"], temperature=-1), "select.temperature"),
        (lambda: sgl.select("x", ["a"], choices_method="best"), "choices_method"),
        (lambda: as_node(3), "cannot append"),
    ],
)
def test_bad_expressions_are_rejected_when_built(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


# ---------------------------------------------------------------------------- scoring methods


def test_token_length_normalized_picks_highest_mean():
    d = decide(sgl.token_length_normalized, ["a", "b", "c"], [lp(-1, -1), lp(-0.5, -2.0, -0.1), lp(-3)], None)
    assert d.decision == "b"
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.0, -2.6 / 3, -3.0])
    assert d.meta_info["scores"] == pytest.approx([-1.0, -2.6 / 3, -3.0])
    assert d.meta_info["choices_method"] == "token_length_normalized"


def test_greedy_token_selection_differs_from_the_mean():
    # a: better first token, worse mean; c: better mean
    logprobs = [lp(-0.1, -3.0), lp(-0.5, -0.01)]
    assert decide(sgl.greedy_token_selection, ["a", "c"], logprobs, None).decision == "a"
    assert decide(sgl.token_length_normalized, ["a", "c"], logprobs, None).decision == "c"


def test_greedy_token_selection_pads_short_choices_with_their_mean_and_breaks_ties_first():
    # position 0 ties; "a" continues with its mean (-0.2) which beats "ab"'s -0.5
    d = decide(sgl.greedy_token_selection, ["a", "ab"], [lp(-0.2), lp(-0.2, -0.5)], None)
    assert d.decision == "a"
    assert d.meta_info["greedy_logprob_matrix"] == [[-0.2, -0.2], [-0.2, -0.5]]
    # three-way elimination: position 0 keeps x and z, position 1 keeps z
    d = decide(sgl.greedy_token_selection, ["x", "y", "z"], [lp(-1, -2, -9), lp(-3, 0, 0), lp(-1, -1, -9)], None)
    assert d.decision == "z"
    assert decide(sgl.greedy_token_selection, ["p", "q"], [lp(-1, -1), lp(-1, -1)], None).decision == "p"


def test_unconditional_likelihood_normalized_subtracts_the_prior():
    cond = [lp(-1, -1), lp(-2, -2)]
    uncond = [lp(-0.5, -0.5), lp(-3, -3)]
    d = decide(sgl.unconditional_likelihood_normalized, ["common", "apt"], cond, uncond)
    assert d.decision == "apt"
    assert d.meta_info["scores"] == pytest.approx([-0.5, 1.0])
    # mean difference even when the two spellings have different token counts
    d = decide(sgl.unconditional_likelihood_normalized, ["a", "b"], [lp(-1, -3), lp(-1)], [lp(-1), lp(-4, -2)])
    assert d.meta_info["scores"] == pytest.approx([-1.0, 2.0])
    with pytest.raises(ValueError, match="unconditional"):
        decide(sgl.unconditional_likelihood_normalized, ["a"], [lp(-1)], None)


def test_temperature_samples_from_softmax_of_scores():
    rng = random.Random(0)
    logprobs = [lp(0.0), lp(math.log(3.0))]  # probabilities 1/4, 3/4 at temperature 1
    picks = [decide(sgl.token_length_normalized, ["a", "b"], logprobs, None, 1.0, rng).decision for _ in range(4000)]
    assert 0.72 < picks.count("b") / len(picks) < 0.78
    with pytest.raises(ValueError, match="temperature"):
        decide(sgl.greedy_token_selection, ["a", "b"], logprobs, None, 1.0, rng)


def test_custom_method_with_sglang_signature():
    class Shortest:
        requires_unconditional_logprobs = False

        def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, **kwargs):
            best = min(range(len(choices)), key=lambda i: len(input_token_logprobs[i]))
            return ChoicesDecision(choices[best], {"lengths": [len(t) for t in input_token_logprobs]})

    method = resolve_method(Shortest())
    d = decide(method, ["long", "s"], [lp(-1, -1, -1), lp(-9)], None)
    assert d.decision == "s" and d.meta_info["lengths"] == [3, 1]
    assert resolve_method("greedy_token_selection") is sgl.greedy_token_selection


# ------------------------------------------------------------------------------- token merges


def test_plan_finds_the_merged_prompt_token(tokenizer):
    def tok(texts):
        return [tokenizer(t).input_ids for t in texts]

    prompt, choices = "It is", ["n", " not"]  # "It is"+"n" -> "It", " isn": the last prompt token merges
    [prompt_ids, *fulls] = tok([prompt, *(prompt + c for c in choices)])
    plan = plan_choices(prompt_ids, fulls, choices)
    assert len(prompt_ids) == 2
    assert plan.requests[0].logprob_start_len == 1  # the smallest start: " isn" replaces " is"
    assert plan.skips == [0, 1]
    assert plan.warm == GenRequest(None, prompt_ids[:1], {"max_new_tokens": 0})
    assert [r.input_ids for r in plan.requests] == fulls
    assert all(r.sampling_params == {"max_new_tokens": 0} for r in plan.requests)
    # what the runtime returns for positions >= 1; " not" skips the prompt's own " is"
    results = [
        {"meta_info": {"input_token_logprobs": [(-4.0, fulls[0][1], " isn")]}},
        {"meta_info": {"input_token_logprobs": [(-0.1, fulls[1][1], " is"), (-2.0, fulls[1][2], " not")]}},
    ]
    assert parse_choices(plan, results) == [[(-4.0, fulls[0][1], " isn")], [(-2.0, fulls[1][2], " not")]]


def test_plan_trailing_space_merges_into_every_choice(tokenizer):
    prompt, choices = "Answer: ", ["yes", "no"]
    ids = [tokenizer(t).input_ids for t in (prompt, *(prompt + c for c in choices))]
    plan = plan_choices(ids[0], ids[1:], choices)
    assert tokenizer.decode(ids[0][-1:]) == " "
    assert plan.skips == [0, 0] and plan.requests[0].logprob_start_len == len(ids[0]) - 1
    assert [tokenizer.decode(f[len(ids[0]) - 1 :]) for f in ids[1:]] == [" yes", " no"]


def test_plan_without_merge_and_without_context():
    plan = plan_choices([5, 6, 7], [[5, 6, 7, 8], [5, 6, 7, 9, 10]], ["a", "bc"])
    assert plan.skips == [0, 0] and plan.requests[1].logprob_start_len == 3
    empty = plan_choices([], [[8], [9, 10]], ["a", "bc"])
    assert empty.warm is None
    results = [
        {"meta_info": {"input_token_logprobs": [(None, 8, None)]}},
        {"meta_info": {"input_token_logprobs": []}},
    ]
    with pytest.raises(ValueError, match="no text before it"):
        parse_choices(ScorePlan(["a", "bc"], None, empty.requests, [0, 0]), results)


def test_openai_echo_span_includes_the_merged_token():
    logprobs = SimpleNamespace(tokens=["Answer", ":", " yes"], token_logprobs=[None, -1.0, -0.5], text_offset=[0, 6, 7])
    response = SimpleNamespace(choices=[SimpleNamespace(logprobs=logprobs)])
    assert choice_span(response, "Answer: ", "yes") == [(-0.5, -1, " yes")]


# ----------------------------------------------------------------------------- chat templates


def test_role_frames_of_the_default_model(tokenizer):
    t = ChatTemplate.from_tokenizer(tokenizer)
    first_user = t.frame([], "user")
    assert first_user.prefix.startswith("<|im_start|>system\n")  # SmolLM2 adds its default system turn
    assert first_user.prefix.endswith("<|im_start|>user\n")
    assert first_user.suffix == "<|im_end|>\n" and first_user.end_of_turn == "<|im_end|>"
    assert t.frame([], "system").prefix == "<|im_start|>system\n"
    later = t.frame([{"role": "user", "content": "hi"}], "assistant")
    assert later.prefix == "<|im_start|>assistant\n"


def test_jinja_rendering_matches_the_tokenizer(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke."},
    ]
    jinja = ChatTemplate.from_jinja(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)
    assert jinja.render(messages) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert jinja.render(messages[:1]) == tokenizer.apply_chat_template(messages[:1], tokenize=False)


def test_templates_that_cannot_be_rendered_turn_by_turn_are_refused():
    counting = ChatTemplate.from_jinja("{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="not incremental"):
        counting.frame([{"role": "user", "content": "a"}], "user")
    dropping = ChatTemplate.from_jinja("{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    with pytest.raises(ValueError, match="drops the content"):
        dropping.frame([], "user")
    strict = ChatTemplate.from_jinja("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.frame([], "user")


@sgl.function
def chat_calls(s, form):
    if form == "expr":
        s += sgl.user("What is 2+2?")
        s += sgl.assistant("4")
        s += sgl.user("And 3+3?")
    elif form == "with":
        with s.user():
            s += "What is 2+2?"
        with s.assistant():
            s += "4"
        with s.user():
            s += "And 3+" + "3?"
    else:
        s += sgl.user_begin() + "What is 2+2?" + sgl.user_end()
        s += sgl.assistant_begin() + "4" + sgl.assistant_end()
        s += sgl.user_begin() + "And 3+3?" + sgl.user_end()
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


@pytest.mark.parametrize("form", ["expr", "with", "begin_end"])
def test_multi_turn_text_is_the_whole_conversation_template(form, tokenizer, trace_backend):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat_calls.trace_prompt({"form": form}, trace_backend) == expected


def test_system_turn_replaces_the_default_one(tokenizer, trace_backend):
    @sgl.function
    def prog(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("a"))

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prog.trace_prompt({}, trace_backend) == expected


def test_run_batch_shared_prefix_is_the_common_rendered_text(trace_backend):
    @sgl.function
    def qa(s, question):
        s += sgl.system("You answer questions about geography in one word.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("a"))

    prefix = qa.shared_prefix(
        [{"question": "Capital of France?"}, {"question": "Capital of Peru?"}], trace_backend, None
    )
    assert prefix.startswith("<|im_start|>system\nYou answer questions")
    assert prefix.endswith("<|im_start|>user\nCapital of ")
    assert qa.shared_prefix([{"question": "A"}, {"question": "B"}], trace_backend, None).endswith("user\n")


def test_async_programs_run_only_with_arun(trace_backend):
    @sgl.function
    async def agent(s):
        s += sgl.gen("x")

    assert agent.is_async
    with pytest.raises(TypeError, match="arun"):
        agent.run(backend=trace_backend)
    with pytest.raises(TypeError, match="first parameter"):
        sgl.function(lambda: None)
    with pytest.raises(TypeError, match="unknown argument"):
        chat_calls.bind(question="x")


def test_roles_must_nest_properly(trace_backend):
    @sgl.function
    def bad(s):
        s += sgl.user_begin()
        s += sgl.assistant_begin()
        s += sgl.gen("x")

    state = bad._start(trace_backend, SamplingDefaults(), False, "trace")
    with pytest.raises(ValueError, match="inside the open 'user' turn"):
        bad.func(state)


# ------------------------------------------------------------------------- plumbing pieces


def test_sse_lines_and_http_errors():
    assert parse_sse_line('data: {"text": "a", "delta": "a"}') == {"text": "a", "delta": "a"}
    assert parse_sse_line("data: [DONE]") is None and parse_sse_line("") is None
    with pytest.raises(RuntimeError, match="boom"):
        parse_sse_line('data: {"error": {"message": "boom"}}')
    with pytest.raises(ValueError, match="top_p"):
        raise_for_error(400, {"error": {"message": "sampling_params.top_p: must be in (0, 1]"}})
    with pytest.raises(RuntimeError, match="503"):
        raise_for_error(503, {"error": {"message": "gone"}})
    raise_for_error(200, {})


def test_program_error_names_the_line():
    origin = caller_origin()
    err = ProgramError(ValueError("bad thing"), origin)
    assert "ValueError: bad thing" in str(err)
    assert f"test_units.py:{origin.lineno}" in str(err) and "origin = caller_origin()" in str(err)


def test_notifier_wakes_threads_and_coroutines():
    n, box = Notifier(), []

    def setter():
        box.append(1)
        n.bump()

    async def main():
        threading.Timer(0.05, setter).start()
        await n.wait_async(lambda: bool(box))
        return len(box)

    assert asyncio.run(main()) == 1
    threading.Timer(0.05, setter).start()
    n.wait(lambda: len(box) == 2)
    assert box == [1, 1]


# ------------------------------------------------------------------------------ SGLang parity


def test_regex_constants_mean_what_sglang_programs_expect():
    import re

    from radixgen.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

    for pattern, good, bad in [
        # numbers as SGLang's: no leading space, trailing spaces / newlines (also their stops)
        (REGEX_INT, ["24", "-3", "+0", "365\n", "7 \n", "9" * 19], ["2.5", "abc", "", " 24", " ", "\n7", "9" * 20]),
        (REGEX_FLOAT, ["3.14", "-0.5", "2", ".5", "10.25 ", "3." + "1" * 16],
         ["3.", "pi", "1e5", " 3.14", "1.2.3", "3." + "1" * 17]),
        (REGEX_BOOL, ["True", " False"], ["true", "yes"]),
        (REGEX_STR, ['"Paris"', ' "New York"', '""'], ["Paris", '"a"b"', '"line\nbreak"']),
    ]:
        assert all(re.fullmatch(pattern, g) for g in good), pattern
        assert not any(re.fullmatch(pattern, b) for b in bad), pattern
    for text in ['"Paris"', ' "a b"']:  # a generated string is valid JSON as it is
        assert isinstance(__import__("json").loads(text), str)


def test_gen_signature_follows_sglang():
    g = sgl.gen("x", 8, 2, 3, "\n")  # name, max_tokens, min_tokens, n, stop
    assert (g.max_new_tokens, g.min_new_tokens, g.n, g.stop) == (8, 2, 3, ("\n",))
    i = sgl.gen_int("y", 4, 2, "\n")  # name, max_tokens, n, stop
    assert (i.dtype, i.max_new_tokens, i.n, i.stop) == ("int", 4, 2, ("\n",))
    assert sgl.gen("z", stop_regex=["a+", "b"]).stop_regex == "(?:a+)|(?:b)"
    assert sgl.gen("z", stop_regex=[]).stop_regex is None


def test_dtype_and_regex_warns_at_the_program_line():
    with pytest.warns(UserWarning, match="both dtype and regex") as record:
        g = sgl.gen("x", dtype=float, regex="[0-9]+")
    assert record[0].filename == __file__ and g.dtype == "float"


def test_run_defaults_take_sglang_list_forms():
    d = SamplingDefaults(stop_regex=[], n=2)
    assert d.stop_regex is None and d.n == 2
    with pytest.raises(ValueError, match="run.n"):
        SamplingDefaults(n=0)


def test_global_config_is_the_default_backend_store(trace_backend):
    saved = sgl.global_config.default_backend
    try:
        sgl.set_default_backend(trace_backend)
        assert sgl.global_config.default_backend is trace_backend and sgl.get_default_backend() is trace_backend
        sgl.global_config.default_backend = None
        with pytest.raises(ValueError, match="no backend"):
            sgl.function(lambda s: None).run()
    finally:
        sgl.global_config.default_backend = saved
