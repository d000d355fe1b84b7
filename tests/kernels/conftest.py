"""The kernel cases run in their own interpreter (see test_paged_bias_attention.py), where
``TRITON_INTERPRET=1`` is set before Triton is imported on CPU-only machines."""
