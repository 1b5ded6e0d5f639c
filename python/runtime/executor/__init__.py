"""Running the model, in the scheduler process and every other rank: the model runner and its forward
context, the KV pool, the fused CPU decode step, CUDA graphs, sampling, and the parallel group's collectives
and step transfers."""
