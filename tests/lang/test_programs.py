"""Programs on the default model, through the in-process Engine and through the HTTP API.

Everything is greedy, so each result can be checked against the same request sent to the Engine
directly: the language must produce exactly the text the runtime would for the rendered prompt.
"""

import asyncio
import json
import re

import pytest

import radixgen as sgl
from radixgen.lang.backend_engine import EngineBackend
from radixgen.lang.backend_http import RuntimeEndpoint
from radixgen.lang.ir import REGEX_INT

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module", params=["engine", "http"])
def backend(request, engine):
    if request.param == "engine":
        yield EngineBackend(engine)
        return
    endpoint = RuntimeEndpoint(request.getfixturevalue("server_url"))
    yield endpoint
    endpoint.shutdown()


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


def needs_constraints(engine):
    if not engine.model_info.get("supports_constraints"):
        pytest.skip("the Engine has no grammar backend yet (model_info.supports_constraints is False)")


def direct(engine, prompt, **params):
    """The same greedy request sent straight to the Engine."""
    return engine.generate(prompt, {**GREEDY, **params})["text"]


def mean(tokens):
    return sum(t[0] for t in tokens) / len(tokens)


# ------------------------------------------------------------------------------- few-shot QA

FEW_SHOT = (
    "Q: What is the capital of France?\nA: Paris\n\n"
    "Q: What is the capital of Germany?\nA: Berlin\n\n"
    "Q: What is the capital of Spain?\nA: Madrid\n\n"
)


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=4, stop="\n")


def test_few_shot_qa(backend, engine):
    state = few_shot_qa.run(question="What is the capital of Italy?", backend=backend, **GREEDY)
    prompt = FEW_SHOT + "Q: What is the capital of Italy?\nA:"
    assert state["answer"] == direct(engine, prompt, max_new_tokens=4, stop=["\n"])
    assert "\n" not in state["answer"] and state["answer"].strip()
    assert state.text() == prompt + state["answer"]
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 4 and meta["finish_reason"]["type"] in ("stop", "length")


# ---------------------------------------------------------------------------- multi-turn chat


@sgl.function
def chat_expr(s):
    s += sgl.system("You are a terse assistant.")
    s += sgl.user("Name a primary color.")
    s += sgl.assistant(sgl.gen("first", max_tokens=4))
    s += sgl.user("Name another one.")
    s += sgl.assistant(sgl.gen("second", max_tokens=4))


@sgl.function
def chat_blocks(s):
    with s.system():
        s += "You are a terse assistant."
    with s.user():
        s += "Name a primary color."
    with s.assistant():
        s += sgl.gen("first", max_tokens=4)
    s += sgl.user_begin() + "Name another one." + sgl.user_end()
    s += sgl.assistant_begin() + sgl.gen("second", max_tokens=4) + sgl.assistant_end()


def test_multi_turn_chat_both_forms(backend, engine, tokenizer):
    a = chat_expr.run(backend=backend, **GREEDY)
    b = chat_blocks.run(backend=backend, **GREEDY)
    assert a.text() == b.text() and a.messages() == b.messages()
    messages = a.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    # the text is exactly the template applied to the whole conversation
    assert a.text() == tokenizer.apply_chat_template(messages, tokenize=False)
    # each turn's gen stopped at the end-of-turn marker, like a direct request for that prompt
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert a["first"] == direct(engine, prompt, max_new_tokens=4)
    assert "<|im_end|>" not in a["first"] + a["second"]


# -------------------------------------------------------------------------------------- select


@sgl.function
def capital(s, method):
    s += "The capital of France is" + sgl.select("city", [" Paris", " London", " Tokyo"], choices_method=method)


def test_select_token_length_normalized_matches_prompt_logprobs(backend, engine, tokenizer):
    state = capital.run(method=sgl.token_length_normalized, backend=backend)
    assert state["city"] == " Paris"
    assert state.text() == "The capital of France is Paris"
    meta = state.get_meta_info("city")
    # the score of " Paris" is the mean prompt logprob of its tokens after the prompt, computed directly
    ids = tokenizer("The capital of France is Paris").input_ids
    start = len(tokenizer("The capital of France is").input_ids)
    ref = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start
    )
    expected = mean(ref["meta_info"]["input_token_logprobs"])
    assert meta["normalized_prompt_logprobs"][0] == pytest.approx(expected, abs=1e-3)
    assert meta["scores"] == meta["normalized_prompt_logprobs"]
    assert max(meta["scores"]) == meta["scores"][0]


def test_select_greedy_and_unconditional_methods(backend):
    greedy = capital.run(method=sgl.greedy_token_selection, backend=backend)
    meta = greedy.get_meta_info("city")
    first_tokens = [tokens[0][0] for tokens in meta["input_token_logprobs"]]
    assert greedy["city"] == [" Paris", " London", " Tokyo"][first_tokens.index(max(first_tokens))]

    uncond = capital.run(method="unconditional_likelihood_normalized", backend=backend)
    meta = uncond.get_meta_info("city")
    cond, prior = meta["input_token_logprobs"], meta["unconditional_token_logprobs"]
    assert len(prior) == 3 and all(prior)
    assert meta["scores"] == pytest.approx([mean(c) - mean(u) for c, u in zip(cond, prior, strict=True)])
    assert uncond["city"] == [" Paris", " London", " Tokyo"][meta["scores"].index(max(meta["scores"]))]


@sgl.function
def yes_no(s):
    s += "Is water wet? Answer: " + sgl.select("answer", ["yes", "no"])


def test_select_token_merge(backend):
    """'Answer: ' ends with a space token that merges with the choice into ' yes' / ' no'."""
    state = yes_no.run(backend=backend)
    meta = state.get_meta_info("answer")
    assert [[t[2] for t in tokens] for tokens in meta["input_token_logprobs"]] == [[" yes"], [" no"]]
    assert state.text() == "Is water wet? Answer: " + state["answer"]


# ------------------------------------------------------------------- constrained generation


@sgl.function
def typed(s):
    s += "Q: How many legs does a dog have?\nA:" + sgl.gen_int("legs", max_tokens=4)
    s += "\nQ: Is the sun hot? (True/False)\nA:" + sgl.gen("hot", dtype=bool, max_tokens=3)


def test_gen_int_and_dtype(backend, engine):
    """As in SGLang, a typed gen's variable holds the generated text; the program converts it."""
    needs_constraints(engine)
    state = typed.run(backend=backend, **GREEDY)
    assert isinstance(state["legs"], str) and re.fullmatch(REGEX_INT, state["legs"])
    assert int(state["legs"]) >= 0
    assert state["hot"].strip() in ("True", "False")
    assert state.text().endswith("A:" + state["hot"])
    state["legs"] = int(state["legs"])  # setting a variable on a finished state, as SGLang programs do
    assert isinstance(state["legs"], int)


@sgl.function
def person_json(s):
    s += "Write a JSON record of a person.\n"
    with s.var_scope("record"):
        s += '{"name": "' + sgl.gen("name", max_tokens=6, regex=r"[A-Z][a-z]{1,8}") + '", '
        s += '"age": ' + sgl.gen("age", max_tokens=4, regex=r"[1-9][0-9]?") + ", "
        s += '"city": "' + sgl.gen("city", max_tokens=6, regex=r"[A-Z][a-z]{1,10}") + '"}'


def test_regex_json_built_field_by_field(backend, engine):
    needs_constraints(engine)
    state = person_json.run(backend=backend, **GREEDY)
    record = json.loads(state["record"])
    assert record == {"name": state["name"], "age": int(state["age"]), "city": state["city"]}
    assert re.fullmatch(r"[A-Z][a-z]{1,8}", record["name"])


# -------------------------------------------------------------------------- control flow


@sgl.function
def branching(s):
    s += "Is the sky blue? Answer: " + sgl.select("yn", ["yes", "no"])
    if s["yn"] == "yes":  # read mid-run: waits for the select, then branches in Python
        s += "\nWhy is it blue?" + sgl.gen("why", max_tokens=3)
    else:
        s += "\nWhat color is it?" + sgl.gen("color", max_tokens=3)
    return s["yn"]


def test_reading_a_value_mid_run_to_branch(backend):
    state = branching.run(backend=backend, **GREEDY)
    question = "Why is it blue?" if state.ret_value == "yes" else "What color is it?"
    assert question in state.text()
    assert ("why" in state.variables) == (state.ret_value == "yes")


TOOL_PROMPT = (
    "Use the calculator. Write the expression, the calculator answers.\n"
    "Task: add 12 and 7\nCalc: 12+7\nResult: 19\n"
    "Task: multiply 6 and 4\nCalc: 6*4\nResult: 24\n"
)


def calculator(expr):
    if not re.fullmatch(r"[0-9+\-* ()]{1,20}", expr):
        return "error"
    return str(eval(expr))  # noqa: S307 - digits and operators only


@sgl.function
def tool_loop(s, tasks):
    s += TOOL_PROMPT
    calls = []
    for task in tasks:
        s += "Task: " + task + "\nCalc:" + sgl.gen("expr", max_tokens=6, stop="\n")
        expr = s["expr"].strip()
        result = calculator(expr)  # the program runs what the model wrote
        calls.append((expr, result))
        s += "\nResult: " + result + "\n"
    return calls


def test_tool_use_loop(backend):
    state = tool_loop.run(tasks=["add 3 and 5", "multiply 2 and 9"], backend=backend, **GREEDY)
    calls = state.ret_value
    assert len(calls) == 2
    for expr, result in calls:
        assert f"Calc: {expr}\nResult: {result}\n" in state.text()
    assert state["expr"].strip() == calls[-1][0]  # the variable holds the latest call


REACT_OBSERVATIONS = {"search": "Paris is in France.", "lookup": "France is in Europe."}


@sgl.function
def react(s, question):
    s += "Answer questions by choosing actions: search, lookup or finish.\n"
    s += "Question: " + question + "\n"
    actions = []
    for step in range(3):
        s += f"Step {step + 1} action:" + sgl.select("action", [" search", " lookup", " finish"])
        action = s["action"].strip()
        actions.append(action)
        if action == "finish":
            break
        s += "\nObservation: " + REACT_OBSERVATIONS[action] + "\n"
    return actions


def test_react_loop_of_selects(backend):
    state = react.run(question="Which continent is Paris in?", backend=backend)
    actions = state.ret_value
    assert 1 <= len(actions) <= 3 and all(a in ("search", "lookup", "finish") for a in actions)
    text = state.text()
    for step, action in enumerate(actions):
        assert f"Step {step + 1} action: {action}" in text
    assert text.count("Observation:") == sum(a != "finish" for a in actions)


# --------------------------------------------------------------------------------- fork/join


@sgl.function
def tree(s):
    s += "Three short tips for better sleep:\n"
    forks = s.fork(3)
    forks += lambda i: f"{i + 1}." + sgl.gen("tip", max_tokens=4, stop="\n")
    forks.join()
    s += "Summary:" + sgl.gen("summary", max_tokens=2)
    return [f.text() for f in forks]


def test_fork_join_with_per_branch_generation(backend):
    state = tree.run(backend=backend, **GREEDY)
    tips, metas = state["tip"], state.get_meta_info("tip")
    assert len(tips) == 3 and len(metas) == 3
    for i, (tip, branch_text) in enumerate(zip(tips, state.ret_value, strict=True)):
        prompt = f"Three short tips for better sleep:\n{i + 1}."
        assert branch_text == prompt + tip and "\n" not in tip
    # the shared prefix was prefilled once before the branches: each branch found it cached
    assert all(m["cached_tokens"] > 0 for m in metas)
    assert state.text().startswith("Three short tips for better sleep:\nSummary:")


@sgl.function
def concat(s):
    s += "Colors:"
    forks = s.fork(2)
    forks[0] += " red"
    forks[1] += " blue"
    forks.join(mode="concate_and_append")


def test_join_concate_and_append(backend):
    assert concat.run(backend=backend).text() == "Colors: red blue"


# --------------------------------------------------------------------------------- streaming


@sgl.function
def story(s):
    s += "Once upon a time"
    s += sgl.gen("story", max_tokens=5, ignore_eos=True)
    s += "\nThe end."


def test_streaming_by_variable(backend):
    state = story.run(backend=backend, stream=True, **GREEDY)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1  # it arrived in pieces, while the gen ran
    assert "".join(pieces) == state["story"]
    assert "".join(state.text_iter()) == state.text() == "Once upon a time" + state["story"] + "\nThe end."

    async def collect():
        state = story.run(backend=backend, stream=True, **GREEDY)
        return [p async for p in state.text_async_iter("story")], state["story"]

    pieces, full = asyncio.run(collect())
    assert "".join(pieces) == full


# ---------------------------------------------------------------------------- batch and async


def test_run_batch_order_and_progress_bar(backend, capsys):
    questions = [
        "What is the capital of Italy?",
        "What is the capital of Peru?",
        "What is the capital of Japan?",
    ]
    states = few_shot_qa.run_batch(
        [{"question": q} for q in questions], backend=backend, progress_bar=True, **GREEDY
    )
    for q, state in zip(questions, states, strict=True):
        assert state.text().startswith(FEW_SHOT + "Q: " + q + "\nA:")
        assert state.error() is None
        assert state.text() == FEW_SHOT + "Q: " + q + "\nA:" + state["answer"]
    assert "3/3" in capsys.readouterr().err


@sgl.function
async def async_agent(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))
    answer = await s.aget_var("answer")  # on the event loop: no thread blocks
    s += sgl.user("Repeat your answer in one word.")
    s += sgl.assistant(sgl.gen("again", max_tokens=3))
    return answer


def test_arun_under_asyncio(backend, tokenizer):
    async def main():
        return await asyncio.gather(
            async_agent.arun(question="Name a planet.", backend=backend, **GREEDY),
            chat_expr.arun(backend=backend, **GREEDY),
        )

    agent, chat = asyncio.run(main())
    assert agent.ret_value == agent["answer"] and agent["again"]
    assert [m["role"] for m in agent.messages()] == ["user", "assistant", "user", "assistant"]
    assert agent.messages()[1]["content"] == agent["answer"]
    assert chat.text() == tokenizer.apply_chat_template(chat.messages(), tokenize=False)


@sgl.function
def described(s, topic):
    s += "One word about " + topic + ":"
    s += sgl.gen("word", max_tokens=3, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
    branch = s.copy()
    branch += " and more"
    return branch


def test_bind_copy_and_output_logprobs(backend):
    state = described.bind(topic="the sea").run(backend=backend, **GREEDY)
    assert state.text() == "One word about the sea:" + state["word"]
    assert state.ret_value.text() == state.text() + " and more"  # the copy moved on, the state did not
    meta = state.get_meta_info("word")
    out, top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(out) == len(top) == meta["completion_tokens"] > 0
    for (logprob, _, text), candidates in zip(out, top, strict=True):
        assert isinstance(text, str) and len(candidates) == 2
        assert candidates[0][0] >= candidates[1][0]
        assert logprob == pytest.approx(candidates[0][0], abs=1e-4)  # greedy takes a most likely token


# -------------------------------------------------------------------------------------- errors


@sgl.function
def bad_params(s):
    s += "Hello"
    s += sgl.gen("x", max_tokens=4, top_p=5.0)  # the failing line
    s += sgl.gen("y", max_tokens=4)


def test_errors_surface_with_the_program_line(backend):
    with pytest.raises(sgl.ProgramError, match="top_p") as info:
        bad_params.run(backend=backend)
    assert 'sgl.gen("x", max_tokens=4, top_p=5.0)' in str(info.value)
    assert info.value.origin.function == "bad_params"
    [state] = bad_params.run_batch([{}], backend=backend, progress_bar=False)
    assert "top_p" in str(state.error()) and "y" not in state.variables
    with pytest.raises(sgl.ProgramError, match="top_p"):
        state["x"]


# ------------------------------------------------------------------------ OpenAI-compatible


def test_openai_backend_chat_and_completion_modes(server_url, engine, tokenizer):
    import openai

    model = openai.OpenAI(base_url=server_url + "/v1", api_key="EMPTY").models.list().data[0].id
    chat = sgl.OpenAI(model, base_url=server_url + "/v1", api_key="EMPTY")
    state = chat_expr.run(backend=chat, **GREEDY)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert state["first"] == direct(engine, prompt, max_new_tokens=4)
    with pytest.raises(sgl.ProgramError, match="select needs prompt logprobs"):
        yes_no.run(backend=chat)

    completion = sgl.OpenAI(model, is_chat_model=False, base_url=server_url + "/v1", api_key="EMPTY")
    state = few_shot_qa.run(question="What is the capital of Italy?", backend=completion, **GREEDY)
    assert state["answer"] == direct(
        engine, FEW_SHOT + "Q: What is the capital of Italy?\nA:", max_new_tokens=4, stop=["\n"]
    )
    via_api = yes_no.run(backend=completion).get_meta_info("answer")
    via_engine = yes_no.run(backend=EngineBackend(engine)).get_meta_info("answer")
    assert [[t[2] for t in c] for c in via_api["input_token_logprobs"]] == [[" yes"], [" no"]]
    assert via_api["scores"] == pytest.approx(via_engine["scores"], abs=1e-3)
