"""The Hopper (SM90) forward kernel: ``fwd.py`` (roles), ``mainloop.py`` (the consumers' K/V
loop), ``epilogue.py`` (writing O and the LSE), ``config.py`` (what selects a kernel and the
rules that choose it), ``backend.py`` (the dispatcher's entry point: support, compile, launch), ``decode_passes.py``
(the split-KV combine and the KV-cache append),
``v_staging.py``/``v_transpose.py`` (fp8 V re-layout)."""
