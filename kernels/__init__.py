"""Triton kernels, each with a pure-torch twin (the CPU path and the tests use the twin)."""
