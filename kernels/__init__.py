"""Triton kernels, each beside a plain-torch reference with the same signature."""
