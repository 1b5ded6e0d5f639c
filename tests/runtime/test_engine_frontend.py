"""The Engine's front end on the default model: requests the KV pool cannot hold, duplicate rids, text that is not
Unicode, strict types, seeds per choice, hostile sampling values, tokenization off the event loop, and a request
whose detokenization fails while the others finish."""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixgen.common.sampling_params import MAX_SEED
from radixgen.runtime.engine import Engine, RequestError, RequestFailed

KV_SLOTS = 600
HANG_GUARD_S = 600
LONG = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    eng = Engine(max_total_tokens=KV_SLOTS)
    yield eng
    eng.shutdown()


def idle_and_consistent(engine: Engine) -> None:
    info = engine.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["invariant_ok"] is True


def test_a_request_larger_than_the_kv_pool_is_refused_naming_both_sizes(engine):
    assert engine.model_info["num_kv_slots"] == KV_SLOTS < engine.model_info["context_length"]
    ids = [42] * 550
    with pytest.raises(RequestError, match=rf"needs 649 KV cache slots.*\({KV_SLOTS} tokens\)") as e:
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 100})
    assert "550 tokens" in str(e.value) and "max_new_tokens (100)" in str(e.value)
    with pytest.raises(RequestError, match="KV pool"):
        asyncio.run(engine.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 100}, stream=True))
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 2
    idle_and_consistent(engine)


def test_a_duplicate_rid_is_refused_and_the_original_runs_to_its_end(engine):
    stream = engine.generate("Count to ten:", LONG, rid="dup", stream=True)
    first = next(stream)
    assert first["meta_info"]["completion_tokens"] >= 1
    with pytest.raises(RequestError, match="'dup' is already in use"):
        engine.generate("Other", {"max_new_tokens": 2}, rid="dup")
    with pytest.raises(RequestError, match="'dup' is already in use"):
        engine.generate("Other", {"max_new_tokens": 2}, rid="dup", stream=True)

    async def again():
        return await engine.async_generate("Other", {"max_new_tokens": 2}, rid="dup", stream=True)

    with pytest.raises(RequestError, match="'dup' is already in use"):
        asyncio.run(again())
    chunks = [first, *stream]
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": 24} and final["completion_tokens"] == 24
    alone = engine.generate("Count to ten:", LONG)
    assert "".join(c["delta"] for c in chunks) == alone["text"]
    # the rid is free again once its request is over
    assert engine.generate("Hi", {"max_new_tokens": 1}, rid="dup")["meta_info"]["id"] == "dup"
    idle_and_consistent(engine)


def test_text_that_is_not_unicode_is_a_request_error(engine):
    for kwargs, field in ((dict(prompt="a\ud800b"), "prompt"), (dict(prompt=["ok", "\udfff"]), "prompt"),
                          (dict(prompt="ok", sampling_params={"stop": "\ud800"}), "sampling_params.stop"),
                          (dict(prompt="ok", sampling_params={"stop_regex": "x\ud800"}), "sampling_params.stop_regex"),
                          (dict(prompt="ok", rid="\ud800"), "rid")):
        with pytest.raises(RequestError, match=rf"^{field}: invalid text: lone surrogate"):
            engine.generate(**kwargs)
    with pytest.raises(RequestError, match="^prompt: invalid text"):
        asyncio.run(engine.async_generate(prompt="\ud800"))


def test_types_are_never_coerced(engine):
    cases = [(dict(input_ids=[True]), "input_ids"), (dict(input_ids=[[1, 2], [3.0]]), "input_ids"),
             (dict(prompt="x", sampling_params={"max_new_tokens": "10"}), "sampling_params.max_new_tokens"),
             (dict(prompt="x", sampling_params={"max_new_tokens": True}), "sampling_params.max_new_tokens"),
             (dict(prompt="x", sampling_params={"ignore_eos": "yes"}), "sampling_params.ignore_eos"),
             (dict(prompt="x", sampling_params={"temperature": "0"}), "sampling_params.temperature"),
             (dict(prompt="x", return_logprob=1), "return_logprob"), (dict(prompt=5), "prompt")]
    for kwargs, field in cases:
        with pytest.raises(RequestError, match=rf"^{field}"):
            engine.generate(**kwargs)


def test_hostile_sampling_values(engine):
    greedy = engine.generate("The sky is", {"max_new_tokens": 6, "temperature": 0.0})
    tiny = engine.generate("The sky is", {"max_new_tokens": 6, "temperature": 1e-300}, return_logprob=True,
                           top_logprobs_num=3)
    assert tiny["output_ids"] == greedy["output_ids"]
    assert all(lp <= 0 for lp, _, _ in tiny["meta_info"]["output_token_logprobs"])
    with pytest.raises(RequestError, match=r"^sampling_params\.repetition_penalty"):
        engine.generate("x", {"repetition_penalty": 1e-300})
    with pytest.raises(RequestError, match=r"^sampling_params\.seed"):
        engine.generate("x", {"seed": 2**64})
    with pytest.raises(RequestError, match=r"^sampling_params\.seed: with n=4"):
        engine.generate("x", {"seed": MAX_SEED - 1, "n": 4, "max_new_tokens": 1})
    extreme = engine.generate("x", {"seed": MAX_SEED - 1, "n": 2, "max_new_tokens": 3, "repetition_penalty": 0.01,
                                    "temperature": 1e-5, "frequency_penalty": -2.0, "top_p": 1e-9})
    assert [len(o["output_ids"]) for o in extreme] == [3, 3]
    idle_and_consistent(engine)


def test_choice_k_of_a_seeded_request_samples_with_seed_plus_k():
    """In the deterministic mode, where a row's bits do not follow its batch: outside it the three choices decode as
    one batch of 3 rows and a request alone as 1 row, and the default model's own GGUF blocks (int4 layouts on
    AVX512-BF16 builds) round a row by how many share the call, which at temperature 1 can flip a sampled token."""
    eng = Engine(max_total_tokens=KV_SLOTS, deterministic=True)
    try:
        params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
        fanned = eng.generate("Once upon a time", {**params, "seed": 1234, "n": 3})
        alone = [eng.generate("Once upon a time", {**params, "seed": 1234 + k})["output_ids"] for k in range(3)]
        assert [o["output_ids"] for o in fanned] == alone
        assert len({tuple(ids) for ids in alone}) > 1  # the seeds do sample apart
    finally:
        eng.shutdown()


def test_tokenization_runs_off_the_event_loop(engine):
    text = "radix trees share prefixes. " * 40000  # ~1 MB: long enough to tokenize for a while
    threads = []
    real = engine.tokenize

    def recording(texts, add_special_tokens=True):
        threads.append(threading.current_thread().name)
        return real(texts, add_special_tokens)

    async def main():
        ticks = 0
        task = asyncio.ensure_future(engine.async_tokenize([text]))
        while not task.done():  # the loop keeps turning while the tokenizer works
            ticks += 1
            await asyncio.sleep(0)
        (ids,) = await task
        return ticks, ids

    ticks, ids = asyncio.run(main())
    assert ticks > 1 and ids == engine.tokenizer(text).input_ids
    engine.tokenize = recording
    try:
        with pytest.raises(RequestError, match="context length"):
            asyncio.run(engine.async_generate(text))
    finally:
        del engine.tokenize
    assert threads and threads[0].startswith("radixgen-tokenize")


def test_a_detokenization_failure_fails_that_request_alone(engine, monkeypatch):
    real_states = Engine._states

    def poisoned(self, reqs, text_in_logprobs):
        states = real_states(self, reqs, text_in_logprobs)
        for st in states:
            if st.rid == "poison":
                def add(ids, _real=st.detok.add, _detok=st.detok):
                    if len(_detok.ids) >= 3:  # fail mid-stream, while the scheduler still runs it
                        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
                    return _real(ids)
                st.detok.add = add
        return states

    monkeypatch.setattr(Engine, "_states", poisoned)

    async def main():
        calls = [engine.async_generate("Tell me a story.", LONG, rid=rid) for rid in ("a", "poison", "b", "c")]
        # a generous guard: were the receiver thread to die, the others would otherwise wait forever
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), HANG_GUARD_S)

    a, poison, b, c = asyncio.run(main())
    assert isinstance(poison, RequestFailed)
    assert "'poison' failed: its output could not be detokenized (UnicodeDecodeError" in str(poison)
    for out in (a, b, c):
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    monkeypatch.undo()
    assert engine.generate("Tell me a story.", LONG, rid="poison")["text"] == a["text"]
    idle_and_consistent(engine)


def test_a_segmented_prompt_is_its_segments_ids_and_media_is_refused_naming_it(engine):
    from radixgen.common.prompt import MediaSegment, Prompt

    greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    (head,), (tail,) = engine.tokenize(["The capital of France"]), engine.tokenize([" is"], add_special_tokens=False)
    expected = engine.generate(input_ids=head + tail, sampling_params=greedy)
    got = engine.generate(Prompt.of("The capital of France", tail), greedy)
    assert got["output_ids"] == expected["output_ids"]
    assert got["meta_info"]["prompt_tokens"] == len(head + tail)
    image = MediaSegment.of_bytes("image", b"\x89PNG fake")
    for call in (lambda p: engine.generate(p, greedy), lambda p: asyncio.run(engine.async_generate(p, greedy))):
        with pytest.raises(RequestError, match=r"prompt\[1\]: image input is not supported: the served model "
                                               r"\(llama\) takes text only"):
            call([Prompt.of("a"), Prompt.of("Describe", image)])
    idle_and_consistent(engine)
