"""The server's threads-per-op rule (app/threads.py): one thread for narrow models on a CPU, torch's default
for wide ones and on accelerators, and an explicit setting always wins."""

from __future__ import annotations

import pytest

from rubricsearch.app.threads import NARROW, op_threads


@pytest.mark.parametrize(("setting", "device", "width", "expected"), [
    (0, "cpu", 128, 1),  # tiny and demo checkpoints
    (0, "cpu", NARROW, None),  # small and larger: ops big enough to split
    (0, "cpu", 2048, None),
    (0, "cuda", 128, None),  # host threads only launch kernels
    (0, "cpu", None, None),  # no local embedder
    (3, "cpu", 2048, 3),
    (2, "cuda", 128, 2),
])
def test_op_threads(setting: int, device: str, width: int | None, expected: int | None) -> None:
    assert op_threads(setting, device=device, width=width) == expected
