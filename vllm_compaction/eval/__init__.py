"""Evaluation tasks on real text and the reconstruction metrics."""

from vllm_compaction.eval.niah import (
    NeedleInstance,
    NeedlePrompt,
    make_needle,
    needle_prompt,
    score_answer,
)
from vllm_compaction.eval.reconstruction import Reconstruction, reconstruction
from vllm_compaction.eval.tasks import TASKS, TaskInstance, make_task, task_prompt

__all__ = [
    "NeedleInstance",
    "NeedlePrompt",
    "make_needle",
    "needle_prompt",
    "score_answer",
    "Reconstruction",
    "reconstruction",
    "TASKS",
    "TaskInstance",
    "make_task",
    "task_prompt",
]
