"""radixgen in one page: a multi-turn chat, a JSON extraction and a select on the bundled model,
with what the radix cache saved at each step.

python examples/quickstart.py          (what `make demo` runs)
"""

import json

import radixgen as sgl


@sgl.function
def multi_turn(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=32))
    s += sgl.user(question_2)  # the second turn reuses the first one from the cache
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=32))


# An enum where the answer is one of a known set, short fields and a precise instruction: the bundled
# 135M model gets these right. (A worked example in the prompt made it copy the example's city.)
COUNTRIES = ["Portugal", "Spain", "France", "Italy", "Germany", "Brazil", "Japan"]
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "enum": COUNTRIES},
    },
    "required": ["city", "country"],
}


@sgl.function
def extract(s, sentence):
    s += sgl.system("Extract the city mentioned in the sentence and the country it is in, as JSON.")
    s += sgl.user(sentence)
    s += sgl.assistant(sgl.gen("record", max_tokens=32, json_schema=CITY_SCHEMA))


@sgl.function
def classify(s, review):
    s += "Review: " + review + "\nThe sentiment of this review is"
    s += sgl.select("sentiment", [" positive", " negative", " neutral"])


def cache_line(meta: dict) -> str:
    """What the radix cache saved for one call: the prompt tokens it already held."""
    return f"   [radix cache: {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens reused]"


def main() -> None:
    engine = sgl.Engine()  # the bundled SmolLM2-135M-Instruct
    sgl.set_default_backend(engine)
    try:
        print("== multi-turn chat")
        state = multi_turn.run(
            question_1="What is the capital of France?",
            question_2="Name one famous museum there.",
            temperature=0,
        )
        turn = 0
        for m in state.messages():
            print(f"{m['role']:>9}: {m['content']}")
            if m["role"] == "assistant":
                turn += 1
                print(cache_line(state.get_meta_info(f"answer_{turn}")))

        print("\n== JSON extraction")
        if engine.model_info.get("supports_constraints"):
            for sentence in [
                "Last summer we flew to Lisbon to visit my cousin.",
                "My sister studies architecture in Paris.",
                "I grew up in Rio de Janeiro.",
            ]:
                state = extract.run(sentence=sentence, temperature=0)
                print(f"{sentence}\n -> {json.loads(state['record'])}")
                print(cache_line(state.get_meta_info("record")))
        else:
            print("(skipped: this runtime has no grammar backend)")

        print("\n== select")
        for review in [
            "The food was wonderful and the staff were friendly.",
            "Cold soup, rude waiter, never again.",
        ]:
            state = classify.run(review=review)
            meta = state.get_meta_info("sentiment")
            print(f"{review}\n -> sentiment:{state['sentiment']}  scores:", [round(x, 3) for x in meta["scores"]])
            print(cache_line(meta))

        info = sgl.get_server_info()
        print(f"\noverall: {info['cache_hit_rate']:.1%} of prompt tokens came from the radix cache")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
