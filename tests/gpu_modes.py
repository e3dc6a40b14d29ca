"""What the GPU test modules share: the model modes they run in and the reset of the process-wide kernels."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# eager, torch.compile'd blocks (``compile=True``),
# Liger's kernels (``fused_kernels=True``)
MODES: dict[str, dict[str, bool]] = {"eager": {}, "compiled": {"compile": True}, "fused": {"fused_kernels": True}}


@pytest.fixture(autouse=True)
def _reference_kernels_after() -> Iterator[None]:
    """The fused rotary functions are process-wide: the official references of later tests need theirs back."""
    yield
    from rubricsearch.retrieval.plugins.accelerated.kernels.fused_kernels import use_reference_kernels

    use_reference_kernels()


def options(mode: str) -> dict[str, bool]:
    if mode == "fused":
        pytest.importorskip("liger_kernel", reason="the fused kernels come with the gpu extra (liger-kernel)")
    return MODES[mode]
