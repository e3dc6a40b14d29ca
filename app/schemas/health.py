"""Liveness and readiness bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Liveness(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ready"] = "ready"
    checks: dict[str, bool] = Field(description="Each dependency and whether it is usable.")
    test_models: bool = Field(description="True when offline random-weight test checkpoints are served.")
