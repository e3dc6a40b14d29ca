"""Pydantic request/response models, one module per feature; ``common`` holds the error envelope."""
