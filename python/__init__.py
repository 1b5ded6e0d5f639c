"""radixgen: structured generation programs over a radix-tree KV cache runtime."""
