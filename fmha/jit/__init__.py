"""Compiling and launching CuTe DSL kernels from the host, shared by every kernel: the target
architecture, fake tensors (so that compiling needs no GPU), the on-disk cache of compiled
kernels and the GPU facts a launch needs."""
