"""What every part of radixgen shares (the frontend language, the runtime, the router): declarations and small
helpers that import nothing else of radixgen."""
