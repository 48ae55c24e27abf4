"""The Blackwell (SM100) forward kernel: ``config`` (what selects a kernel), ``fwd`` (the kernel
and its load and MMA warps), ``softmax`` / ``correction`` (the other roles), ``tmem`` (the TMEM
plan), ``backend`` (the dispatcher's view). The K/V tiles a CTA visits are the shared walk
(``fmha.kernels.common.kv_walk``)."""
