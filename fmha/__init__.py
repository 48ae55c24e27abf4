"""fmha: fused multi-head attention forward kernels (CuTe DSL) with an exact PyTorch reference."""

__version__ = "0.1.0"
