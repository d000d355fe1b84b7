"""The CUDA cases check correctness, not speed: one tile configuration per kernel (no
autotuning), which saves a compile per candidate."""

import os

os.environ.setdefault("VLLM_COMPACTION_TUNE", "0")
