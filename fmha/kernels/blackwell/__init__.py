"""The Blackwell (SM100) forward kernel: ``config`` (what selects a kernel), ``fwd`` (the kernel
and its load and MMA warps), ``softmax`` / ``correction`` (the other roles), ``tmem`` (the TMEM
plan), ``kv_walk`` (the K/V tiles a CTA visits), ``backend`` (the dispatcher's view)."""
