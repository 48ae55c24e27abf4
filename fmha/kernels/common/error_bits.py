"""The bits kernels OR into the device error flag (``fmha.device_errors`` reports them). Plain
Python, so the host imports it without the DSL; in kernels/common, so a change to it changes the
kernel cache's key."""

BAD_OFFSETS = 1  # varlen cu_seqlens out of order, out of range, or longer than max_seqlen
BAD_CACHE_LENGTH = 2  # a KV cache length below 0 or past what the cache holds
BAD_BLOCK_TABLE = 4  # a block-table entry that is not a page, for a position below the length
