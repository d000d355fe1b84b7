"""Evaluation tasks on real text (needle-in-a-haystack, ...)."""

from vllm_compaction.eval.niah import NeedleInstance, NeedlePrompt, make_needle, needle_prompt, score_answer

__all__ = ["NeedleInstance", "NeedlePrompt", "make_needle", "needle_prompt", "score_answer"]
