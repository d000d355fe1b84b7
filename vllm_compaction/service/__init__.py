"""The compaction service: jobs, workers, conversations and the ``/v1/compact`` API.

Independent of vLLM (FastAPI + pydantic); ``vllm_compaction.vllm.endpoints`` mounts it in
vLLM's OpenAI server and serves the resulting caches.
"""
