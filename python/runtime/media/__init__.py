"""Media preprocessing shared by both processes: the front end (the Engine) turns an image into a
`ProcessedImage` with its model's `MediaProcessor`; the scheduler process's model encodes it. See processor.py."""

from radixgen.runtime.media.processor import (  # noqa: F401
    MediaProcessor,
    MediaTokens,
    ProcessedImage,
    processor_for,
)
