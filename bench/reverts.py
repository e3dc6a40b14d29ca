"""A/B switches for the benches' ``--revert`` (ingest_throughput, core_reuse, search_latency, and load_search's
server through :func:`bench.server.reverted_app`): each puts back one path as it was before a measured change, so
both arms run in one call on one box (boxes differ by up to 1.5x)."""

from __future__ import annotations

from typing import Any

REVERTS = {
    "stream": "GPU preprocessing on the model's stream",
    "pinned": "the package writers copy to pageable memory",
    "grouped": "GPU preprocessing image by image",
    "split": "one thread runs the towers and then waits for the LM pass, as before 2026-11-25's spy27",
    "commit": "one thread syncs and then commits each batch",
    "download": "the LM's vectors read back with .cpu(), a pageable copy",
    "pack": "the towers' thread also stores the packages, as before probe29",
    "pad": "the LM's ids padded a row at a time with torch calls",
    "writes": "the package writers copy each package to the host alone, not a batch at once",
    "cuts": "a packed batch cut into packages with one copy per part from Python",
    "sync": "one thread stores and then syncs each batch (blobs, vectors, package files, syncfs), as before disk30",
    "fanout": "one package writer writes a whole batch's files, as before disk30",
    "cudnn": "the tower's attention all FlashAttention, photos too, as before kernels32",
    "swiglu": "the LM's MLP as transformers runs it (SiLU, then the product), as before kernels32",
    "last": "the packed passes' final layer over every token, not only each sequence's last, as before kernels32",
    "merge": "the reranker's attention merge as torch ops (sub, sigmoid, cast, a broadcast lerp), not one kernel",
    "rope": "the vision tower's rotary embedding as Liger's (float32 casts, then its kernel), not one Triton kernel",
    "tower-sync": "an eager tower pass handed grid_thw on the GPU, which it reads back (9-13 stream syncs a pass)",
    "ann-stream": "the device search's mirror on the caller's stream, its read-back waiting behind the models' passes",
    "split-groups": "shortlists merged by the scheduler run as one chunk (eager unless its shape came back), not "
                    "one graph replay each",
    "tower-bulk": "no bulk tower graphs (the LM's only)",
}


def describe() -> str:
    return "A/B, comma-separated: " + ", ".join(f"{name} ({what})" for name, what in REVERTS.items())


def parse(text: str) -> set[str]:
    """The names of a comma-separated ``--revert`` value, refused (SystemExit) when unknown or incompatible: a
    bench whose server applies them (load_search) checks them before it starts one."""
    what = set(filter(None, text.split(",")))
    if what - REVERTS.keys():
        raise SystemExit(f"unknown --revert {sorted(what - REVERTS.keys())}: {describe()}")
    if {"sync", "commit"} <= what:  # both fold the sync stage into a neighbour: not the old layout either way
        raise SystemExit("--revert sync and commit cannot be combined")
    return what


def revert(text: str) -> None:
    """Patch the paths named in ``text`` (a ``--revert`` value, :func:`parse`) back (see :data:`REVERTS`)."""
    import torch

    import retrieval.packages.writer as writer
    import retrieval.qwen.gpu_preprocess as gpu_preprocess
    from indexer.jobs.pipeline import BatchProcessor

    what = parse(text)
    # (switch, first stage, second stage, the stage whose thread then runs both; the other passes batches on)
    for name, first, second, runs in (("pack", "encode", "pack", "encode"), ("split", "encode", "embed", "encode"),
                                      ("sync", "store", "sync", "store"), ("commit", "sync", "commit", "commit")):
        if name in what:
            _fold(BatchProcessor, first, second, runs)
    if "fanout" in what:
        writer.FAN_OUT = False
    if "cudnn" in what:
        import retrieval.qwen.cudnn_attention as cudnn_attention

        cudnn_attention.ENABLED = False
    if "ann-stream" in what:
        import retrieval.index.device_search as device_search

        device_search.SIDE_STREAM = False
    if "split-groups" in what:
        import rerank.packed_prefix as packed_prefix

        packed_prefix.SPLIT = False
    if "merge" in what:
        import retrieval.qwen.merge_kernel as merge_kernel

        merge_kernel.ENABLED = False
    if "tower-sync" in what:
        import retrieval.qwen.vision as vision

        vision.PRECOMPUTED = False
    if "tower-bulk" in what:
        import retrieval.qwen.vision as vision

        vision.BULK_IMAGE_PATCHES = 0  # read when the encoder is built
    if "rope" in what:
        import retrieval.qwen.rope_kernel as rope_kernel

        rope_kernel.ENABLED = False
    if "last" in what:
        import retrieval.qwen.packed as packed

        packed.PRUNE = False
    if "swiglu" in what:
        import retrieval.qwen.fused_kernels as fused_kernels

        fused_kernels.FUSED_MLP = False
    if "writes" in what:  # no joint form: the writers copy each package to the host on its own
        import retrieval.packages.store as package_store

        pack_many = package_store.pack_many
        package_store.pack_many = lambda *args: (pack_many(*args)[0], None)
    if "cuts" in what:
        import retrieval.packages.storage_form as storage_form

        storage_form._split_copy = lambda t, sizes, dim: [  # type: ignore[assignment]
            c.clone(memory_format=torch.contiguous_format) for c in torch.split(t, sizes, dim)]
    if "pad" in what:
        import rerank.prefix as prefix
        import retrieval.qwen.forward as forward
        import retrieval.qwen.graphed_lm as graphed_lm

        graphed_lm.right_pad = forward.right_pad = prefix.right_pad = _right_pad  # graphed, eager, rerank
    if "download" in what:
        import retrieval.embedding.local as local_embedder

        local_embedder.download = lambda t: t.cpu()
    if "stream" in what:
        gpu_preprocess.GpuPreprocessor.run = lambda self, images, cpu_map: (  # type: ignore[method-assign]
            self.process(images, cpu_map), None)
    if "grouped" in what:
        gpu_preprocess.GROUP_PIXELS = 1  # one image per pass
    if "pinned" in what:
        def pageable(tensors: dict[str, Any], ready: Any, stream: Any) -> dict[str, Any]:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                return {k: v.to("cpu") for k, v in tensors.items()}

        writer._to_host = pageable


def _fold(cls: Any, first: str, second: str, runs: str) -> None:
    """Stages ``first`` then ``second`` both run by stage ``runs``'s thread, the other passing batches on."""
    run_first, run_second = getattr(cls, first), getattr(cls, second)
    setattr(cls, runs, lambda self, batch: run_second(self, run_first(self, batch)))
    setattr(cls, second if runs == first else first, lambda self, batch: batch)


def _right_pad(seqs: Any, pad_id: int, *, rows: Any = None, width: Any = None) -> Any:
    import torch

    ids = torch.full((len(seqs) if rows is None else rows, max(map(len, seqs)) if width is None else width),
                     pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):  # three torch calls per row, as before 2026-11-25's probe29
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask
