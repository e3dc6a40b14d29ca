"""Clients for model servers that run outside this process (vLLM's OpenAI-compatible server)."""

from rubricsearch.retrieval.remote.vllm_client import VLLMClient, embedding_conversation

__all__ = ["VLLMClient", "embedding_conversation"]
