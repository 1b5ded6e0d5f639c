"""radixgen in one page: a multi-turn chat, a JSON extraction and a select on the bundled model.

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


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}


@sgl.function
def extract(s, sentence):
    s += sgl.user("Extract the city and its country from this sentence as JSON.\n" + sentence)
    s += sgl.assistant(sgl.gen("record", max_tokens=40, json_schema=CITY_SCHEMA))


@sgl.function
def classify(s, review):
    s += "Review: " + review + "\nThe sentiment of this review is"
    s += sgl.select("sentiment", [" positive", " negative", " neutral"])


def main() -> None:
    engine = sgl.Engine()  # the bundled SmolLM2-135M-Instruct
    sgl.set_default_backend(engine)
    try:
        state = multi_turn.run(
            question_1="What is the capital of France?",
            question_2="Name one famous museum there.",
            temperature=0,
        )
        print("== multi-turn chat")
        for m in state.messages():
            print(f"{m['role']:>9}: {m['content']}")

        print("\n== JSON extraction")
        if engine.model_info.get("supports_constraints"):
            state = extract.run(sentence="Last summer we flew to Lisbon to visit my cousin.", temperature=0)
            print(json.loads(state["record"]))
        else:
            print("(skipped: this runtime has no grammar backend)")

        print("\n== select")
        state = classify.run(review="The food was wonderful and the staff were friendly.")
        meta = state.get_meta_info("sentiment")
        print(f"sentiment:{state['sentiment']}  scores:", [round(x, 3) for x in meta["scores"]])

        info = sgl.get_server_info()
        print(f"\ncache hit rate: {info['cache_hit_rate']:.1%} of prompt tokens came from the radix cache")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
