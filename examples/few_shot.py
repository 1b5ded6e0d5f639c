"""Few-shot question answering over a batch: the shared examples are computed once and cached.

python examples/few_shot.py
"""

import radixgen as sgl

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Canada?", "Ottawa"),
    ("What is the capital of Egypt?", "Cairo"),
]


@sgl.function
def few_shot_qa(s, question):
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")


def main() -> None:
    questions = [
        "What is the capital of Italy?",
        "What is the capital of Germany?",
        "What is the capital of Spain?",
        "What is the capital of Kenya?",
    ]
    with sgl.Engine() as engine:
        states = few_shot_qa.run_batch(
            [{"question": q} for q in questions], backend=engine, temperature=0, progress_bar=True
        )
        for q, state in zip(questions, states, strict=True):
            print(f"{q:40s} ->{state['answer']}")
        info = engine.get_server_info()
        print(f"cache hit rate: {info['cache_hit_rate']:.1%}")


if __name__ == "__main__":
    main()
