"""Streaming: print a program's text while it is generated, all of it or one variable.

python examples/streaming.py
"""

import asyncio

import radixgen as sgl


@sgl.function
def story(s, topic):
    s += sgl.user(f"Write a two-sentence story about {topic}.")
    s += sgl.assistant(sgl.gen("story", max_tokens=48))
    s += sgl.user("Give it a title.")
    s += sgl.assistant(sgl.gen("title", max_tokens=12))


def main() -> None:
    with sgl.Engine() as engine:
        sgl.set_default_backend(engine)
        state = story.run(topic="a lighthouse", stream=True, temperature=0)
        for piece in state.text_iter("story"):  # only the story, as it is produced
            print(piece, end="", flush=True)
        print("\n-- title:", state["title"])

        async def stream_async() -> None:
            state = story.run(topic="a robot", stream=True, temperature=0)
            async for piece in state.text_async_iter():  # the whole text, chat markup included
                print(piece, end="", flush=True)
            print()

        asyncio.run(stream_async())


if __name__ == "__main__":
    main()
