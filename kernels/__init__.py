"""Kernels with pure-torch twins: C++ for CPUs (`tokenyard.kernels.cpu`), Triton for GPUs (`tokenyard.kernels.triton`)."""
