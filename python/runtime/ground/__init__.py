"""The runtime's ground floor: what layers and models need while a step runs, and nothing above them.

forward_context.py (the per-step context attention and the linear methods read, installed with `with`),
parallel_context.py (the parallel axes and their collectives handed to a model), sharding.py (which heads,
vocabulary rows, MLP columns and layers a rank holds: pure arithmetic), kv_pool.py (the K/V buffers, their
per-layer views, the free-slot allocator, the request->slot table). The executor, the models, the layers, LoRA
and the scheduler's KV manager and tiers import these; these import nothing of the runtime above them.
"""
