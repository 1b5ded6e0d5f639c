"""Fork/join: explore several branches in parallel from one cached prefix, then merge them.

python examples/fork_join.py
"""

import radixgen as sgl


@sgl.function
def tips(s, topic):
    s += sgl.user(f"Give one short tip about {topic}.")
    s += sgl.assistant_begin()
    forks = s.fork(3)  # the prefix is prefilled once; each branch starts from the cache
    forks += lambda i: ["A tip about food:", "A tip about your bedroom:", "A tip about your evenings:"][i]
    forks += sgl.gen("tip", max_tokens=24, min_tokens=3, stop="\n")
    forks.join()  # s["tip"] is the list of the three branches' tips
    s += "Here are three tips."
    s += sgl.assistant_end()
    s += sgl.user("Which of these tips is the easiest to follow?\n" + "\n".join(s["tip"]))
    s += sgl.assistant(sgl.gen("verdict", max_tokens=32))


def main() -> None:
    with sgl.Engine() as engine:
        state = tips.run(topic="sleeping well", backend=engine, temperature=0)
        for i, tip in enumerate(state["tip"], 1):
            print(f"branch {i}: {tip}")
        print("verdict:", state["verdict"])
        print(
            [m["cached_tokens"] for m in state.get_meta_info("tip")],
            "tokens of each branch came from the cache",
        )


if __name__ == "__main__":
    main()
