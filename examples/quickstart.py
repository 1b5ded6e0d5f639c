"""radixgen in one page: a multi-turn chat, a JSON extraction and a select on the bundled model,
with what the radix cache saved at each step.

    python examples/quickstart.py                   (what `make demo` runs)
    python examples/quickstart.py --dtype float32   (twice the weights' bytes, the same answers)

The bundled model is small (SmolLM2-135M-Instruct, 135M parameters): every answer below is made right by
what the program gives it, said next to each section, with a margin that survives the other bf16 rounding
of CPUs without AMX or AVX512-BF16 (tests/e2e/test_demo.py checks each printed answer on several).
"""

import argparse
import json
import re

import radixgen as sgl


@sgl.function
def multi_turn(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=32))
    s += sgl.user(question_2)  # the second turn reuses the first one from the cache
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=32))


# Two worked examples, as earlier chat turns, show the format and that the country is the city's: without
# them the model's pick for Paris was France by a hair over Spain, and a CPU that rounds bf16 otherwise printed
# Spain. The schema keeps it to what can be right: the city is a phrase of the sentence itself (with the
# examples alone, the model copied their city), the country one of a known set.
COUNTRIES = ["Portugal", "Spain", "France", "Italy", "Germany", "Brazil", "Japan"]
WORKED_EXAMPLES = [
    ("We changed trains in Munich on the way.", {"city": "Munich", "country": "Germany"}),
    ("The conference is in Osaka this year.", {"city": "Osaka", "country": "Japan"}),
]


def phrases(sentence: str, longest: int = 3) -> list[str]:
    """Every run of 1 to `longest` words of `sentence`, in order: the city is one of them."""
    words = re.findall(r"[\w'-]+", sentence)
    runs = (" ".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, min(i + longest, len(words)) + 1))
    return list(dict.fromkeys(runs))


def city_schema(sentence: str) -> dict:
    return {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": phrases(sentence)},
            "country": {"type": "string", "enum": COUNTRIES},
        },
        "required": ["city", "country"],
    }


@sgl.function
def extract(s, sentence):
    s += sgl.system("Extract the city mentioned in the sentence and the country it is in, as JSON.")
    for text, record in WORKED_EXAMPLES:
        s += sgl.user(text)
        s += sgl.assistant(json.dumps(record))
    s += sgl.user(sentence)
    s += sgl.assistant(sgl.gen("record", max_tokens=32, json_schema=city_schema(sentence)))


# Labelled reviews before the one to classify, and two choices: the model continues the pattern.
LABELLED_REVIEWS = [
    ("Great coffee and a lovely view.", "positive"),
    ("The room was dirty and nobody helped us.", "negative"),
    ("Fast delivery, and it works perfectly.", "positive"),
    ("It broke after one day and support never answered.", "negative"),
]


@sgl.function
def classify(s, review):
    for text, label in LABELLED_REVIEWS:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += "Review: " + review + "\nSentiment:"
    s += sgl.select("sentiment", [" positive", " negative"])


def cache_line(meta: dict) -> str:
    """What the radix cache saved for one call: the prompt tokens it already held."""
    return f"   [radix cache: {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens reused]"


def main(dtype: str = "auto") -> None:
    engine = sgl.Engine(dtype=dtype)  # the bundled SmolLM2-135M-Instruct
    sgl.set_default_backend(engine)
    try:
        print(f"== multi-turn chat ({engine.model_info['dtype']}, greedy; the system prompt asks for one sentence)")
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

        print(f"\n== JSON extraction ({len(WORKED_EXAMPLES)} worked examples as earlier turns; a JSON schema: the "
              f"city one of the sentence's phrases, the country one of {len(COUNTRIES)})")
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

        print(f"\n== select ({len(LABELLED_REVIEWS)} labelled reviews first; the scores are the model's "
              "mean log-probability of each choice)")
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="weights and activations (auto: bfloat16 wherever it runs fast, see resolve_dtype)")
    main(parser.parse_args().dtype)
