"""The server's threads-per-op rule (app/threads.py): one thread for narrow models on a CPU, torch's default
for wide ones and on accelerators."""

from __future__ import annotations

import pytest

from rubricsearch.app.threads import NARROW, op_threads


@pytest.mark.parametrize(("device", "width", "expected"), [
    ("cpu", 128, 1),  # tiny and demo checkpoints
    ("cpu", NARROW - 1, 1),
    ("cpu", NARROW, None),  # small and larger: ops big enough to split
    ("cpu", 2048, None),
    ("cuda", 128, None),  # host threads only launch kernels
    ("cpu", None, None),  # no local embedder
])
def test_op_threads(device: str, width: int | None, expected: int | None) -> None:
    assert op_threads(device=device, width=width) == expected
