"""An asyncio agent loop: the model picks tools with `select`, the program runs them, several
agents run concurrently on one event loop (no threads: `arun` awaits the Engine's async API).

    python examples/agent_loop.py
"""

import asyncio
import re

import radixgen as sgl

FACTS = {"paris": "Paris has about 2.1 million inhabitants.", "rome": "Rome was founded in 753 BC."}


def search(query: str) -> str:
    for key, fact in FACTS.items():
        if key in query.lower():
            return fact
    return "No result."


def calculate(expr: str) -> str:
    if not re.fullmatch(r"[0-9+\-*/ ().]{1,30}", expr):
        return "error: not an arithmetic expression"
    return str(eval(expr))  # noqa: S307 - digits and operators only


@sgl.function
async def agent(s, question):
    s += sgl.system("Solve the task. Tools: search <query>, calculate <expression>, or finish <answer>.")
    s += sgl.user(question)
    trace = []
    for _ in range(3):
        with s.assistant():
            s += "Action:" + sgl.select("tool", [" search", " calculate", " finish"])
            s += sgl.gen("arg", max_tokens=16, stop="\n")
        tool, arg = (await s.aget_var("tool")).strip(), (await s.aget_var("arg")).strip()
        if tool == "finish":
            return trace + [("finish", arg)]
        observation = search(arg) if tool == "search" else calculate(arg)
        trace.append((tool, arg, observation))
        s += sgl.user("Observation: " + observation)
    return trace


async def main() -> None:
    with sgl.Engine() as engine:
        questions = ["How many people live in Paris?", "What is 17 * 23?"]
        states = await asyncio.gather(*(agent.arun(question=q, backend=engine, temperature=0) for q in questions))
        for q, state in zip(questions, states, strict=True):
            print("Q:", q)
            for step in state.ret_value:
                print("   ", step)


if __name__ == "__main__":
    asyncio.run(main())
