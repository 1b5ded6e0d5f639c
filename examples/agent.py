"""A tool-calling agent on the bundled default model: `gen(..., tools=[...])` reads the model's calls (in
the Hermes `<tool_call>` format its system prompt teaches) into `s["<name>_calls"]`, the program runs the
stub tools and answers with their results, and the next turn's prompt extends this one's, so the radix
cache serves every earlier turn. A tool_choice naming a tool makes the model call it, with arguments that
are valid under the tool's schema (a grammar from the call marker on).

    python examples/agent.py
"""

import json

import radixgen as rg
from radixgen.lang.agent import tools_prompt

WEATHER = {"Paris": (21.0, "sunny"), "Oslo": (4.0, "snow"), "Lima": (18.5, "fog")}

GET_WEATHER = {"name": "get_weather", "description": "The current weather of a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": sorted(WEATHER)}},
    "required": ["city"], "additionalProperties": False}}


def to_fahrenheit(celsius: float) -> float:
    """Converts a temperature from degrees Celsius to degrees Fahrenheit."""
    return round(celsius * 9 / 5 + 32, 1)


def get_weather(city: str) -> dict:
    celsius, sky = WEATHER.get(city, (None, "unknown city"))
    return {"city": city, "celsius": celsius, "sky": sky}


RUN = {"get_weather": get_weather, "to_fahrenheit": to_fahrenheit}
TOOLS = [GET_WEATHER, to_fahrenheit]
# The 135M default model rarely decides to call by itself: each step names the tool it must call
# (tool_choice="auto" lets the model answer or call; a larger model runs with "auto" until it answers).
PLAN = ["get_weather", "to_fahrenheit"]


@rg.function
def agent(s, question):
    s += rg.system("You are a weather assistant.\n\n" + tools_prompt(TOOLS))
    s += rg.user(question)
    trace = []
    for tool_choice in PLAN:
        s += rg.assistant(rg.gen("turn", tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                                 max_tokens=60))
        meta = s.get_meta_info("turn")
        trace.append({"cached": meta["cached_tokens"], "prompt": meta["prompt_tokens"]})
        for call in s["turn_calls"]:
            result = RUN[call.name](**call.arguments)
            trace[-1].setdefault("calls", []).append(f"{call.name}({json.dumps(call.arguments)}) -> {result}")
            s += rg.user(f"<tool_response>\n{json.dumps(result)}\n</tool_response>")
    s += rg.user("Now answer my question in one sentence, without calling a tool.")
    s += rg.assistant(rg.gen("answer", max_tokens=40))
    meta = s.get_meta_info("answer")
    trace.append({"cached": meta["cached_tokens"], "prompt": meta["prompt_tokens"], "answer": s["answer"]})
    return trace


def main() -> None:
    with rg.Engine() as engine:
        questions = ["Is it warm in Paris, in Fahrenheit?", "How cold is Oslo in Fahrenheit?"]
        states = agent.run_batch([{"question": q} for q in questions], backend=engine, temperature=0)
        for q, state in zip(questions, states, strict=True):
            print("Q:", q)
            for k, step in enumerate(state.ret_value):
                print(f"  step {k}: {step['cached']}/{step['prompt']} prompt tokens from the cache")
                for line in step.get("calls", []):
                    print("    call", line)
                if "answer" in step:
                    print("    answer", repr(step["answer"]))
        print(f"cache hit rate: {engine.get_server_info()['cache_hit_rate']:.2f}")


if __name__ == "__main__":
    main()
