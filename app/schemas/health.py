"""Liveness and readiness bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Liveness(BaseModel):
    status: Literal["ok"] = "ok"


class TowerOut(BaseModel):
    digest: str = Field(description="Package fingerprint digest: the tower's weights plus every preprocessing setting.")
    tower_sha256: str = Field(description="sha256 over the vision tower's weights.")
    roles: list[str] = Field(description="The models that use this tower (e.g. embedding, reranker).")
    local: bool = Field(description="Whether the tower runs in this process (packages can be made here).")
    min_pixels: int
    max_pixels: int
    resize: str = Field(description="The resize implementation and its version.")


class Readiness(BaseModel):
    status: Literal["ready"] = "ready"
    checks: dict[str, bool] = Field(description="Each dependency and whether it is usable.")
    test_models: bool = Field(description="True when demo or random-weight test checkpoints serve instead of the "
                              "configured models (`models_label` says which).")
    models_label: str | None = Field(None, description="What the serving models are when they are not the "
                                     "configured ones; null otherwise.")
    towers: list[TowerOut] = Field(default_factory=list, description="Every distinct vision tower in use.")
    towers_shared: bool = Field(False, description="True when the models share one tower (one package per image).")
    unknown_towers: list[str] = Field(default_factory=list,
                                      description="Models whose tower is not known here (their images go raw).")
