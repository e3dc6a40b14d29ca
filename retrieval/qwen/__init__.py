"""Qwen3-VL plumbing shared by the embedder and the reranker (loading, prompts, vision tower, LM pass)."""
