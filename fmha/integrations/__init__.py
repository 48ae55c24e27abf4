"""Ways to use fmha from other libraries without calling it by hand.

* ``fmha.integrations.sdpa``: fmha as PyTorch's flash attention implementation behind
  ``torch.nn.functional.scaled_dot_product_attention`` (torch's flash-attention impl registry).
* ``fmha.integrations.transformers``: ``attn_implementation="fmha"`` for Hugging Face
  transformers models.

Each is imported on its own (``import fmha.integrations.transformers``); nothing here imports
them, and fmha's core never imports this package. docs/integrations.md says what each serves.
"""
