"""The reranker's prompt exactly as the official ``Qwen3VLReranker`` builds it."""

from __future__ import annotations

from typing import Any

from rubricsearch.retrieval.qwen.model.prompts import Content, content_parts

RERANK_DEFAULT_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
RERANK_SYSTEM = (
    'Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
    'Note that the answer can only be "yes" or "no".'
)


def rerank_conversation(query: Content, document: Content, instruction: str | None) -> list[dict[str, Any]]:
    """Fixed system prompt; ``<Instruct>: …<Query>:…\\n<Document>:…`` as one user turn."""
    instruct = instruction if instruction else RERANK_DEFAULT_INSTRUCTION
    user: list[dict[str, Any]] = [{"type": "text", "text": "<Instruct>: " + instruct}]
    for prefix, side in (("<Query>:", query), ("\n<Document>:", document)):
        user.append({"type": "text", "text": prefix})
        user += [{"type": "text", "text": "NULL"}] if side.empty else content_parts(side)
    return [
        {"role": "system", "content": [{"type": "text", "text": RERANK_SYSTEM}]},
        {"role": "user", "content": user},
    ]
