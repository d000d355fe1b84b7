"""The kernel cases (``*_cases.py``) run in their own interpreter (``test_kernel_cases.py``), where
``TRITON_INTERPRET=1`` is set before Triton is imported on CPU-only machines."""
