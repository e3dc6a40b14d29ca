"""The Qwen3-VL text decoder over *packed* sequences: every sequence laid end to end in one ``[tokens, H]``
row, attention told apart by cumulative lengths (FlashAttention's variable-length form).

A right-padded batch pays for its padding in every matrix product, and its attention needs an explicit mask,
which sends PyTorch's SDPA to the memory-efficient kernel, makes transformers copy the keys and values to all
query heads (``repeat_kv``) and, for the reranker's shared prefixes, join each row's prefix to its own keys
(``torch.cat`` per layer and row). Packed, the matrix products see only real tokens and attention is one
FlashAttention call per kind: causal within each sequence, and — for continuations of a shared prefix —
non-causal over the group's prefix keys, the two merged exactly by their log-sum-exp (softmax over the union of
the keys = the LSE-weighted mean of the softmaxes over each part). Grouped-query heads go to the kernel as they
are.

:func:`decode` runs the layers as ``Qwen3VLTextModel.forward`` does (DeepStack included, the same modules and
the same rotary and norm functions, so Liger's fused kernels apply); it takes its attention as a
function, so one body serves a plain pass, a prefix pass that keeps its keys and values, and a continuation pass
that attends to them. Without FlashAttention (the CPU, float32) :func:`varlen_attention` computes the same
thing segment by segment; the tests compare both with the padded transformers pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from rubricsearch.retrieval.packages import VisualPackage
from rubricsearch.retrieval.qwen.engine.forward import LMInput, gathered, mrope_positions, upload
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Segments:
    """Sequence boundaries of a pack: ``cu`` (int32, on the device) and, on the host, the lengths."""

    cu: torch.Tensor
    lengths: list[int]
    longest: int  # FlashAttention's max_seqlen: at least the longest length (a bucket, for graphs)

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device, longest: int | None = None) -> Segments:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(list(lengths), dtype=torch.int32).cumsum(0)
        return cls(upload(cu, device), list(lengths), max(max(lengths, default=1), longest or 1, 1))


@dataclass
class Pack:
    """The device tensors of one packed pass."""

    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [3, T] M-RoPE positions
    image_index: torch.Tensor  # [I] pack index of each image token, in package order
    image_embeds: torch.Tensor  # [I, H]
    deepstack: torch.Tensor  # [levels, I, H]


def sequence_positions(loaded: LoadedQwen, ids: Sequence[int], packages: Sequence[VisualPackage]) -> np.ndarray:
    """``[3, len(ids)]`` M-RoPE positions of one sequence on its own (:func:`forward.mrope_positions`), read-only.

    A continuation's positions after a prefix are its own plus ``prefix.max() + 1``: M-RoPE advances one
    counter, text by one per token and an image by its larger merged side, and every position of the
    continuation is that counter plus an offset within it (``Qwen3VLModel.get_rope_index`` does the same).
    So a reference's continuation has the same positions in every shortlist: they are cached (a loaded server
    spent a fifth of its GIL time recomputing them)."""
    merge = int(loaded.model.config.vision_config.spatial_merge_size)
    return _positions(tuple(ids), tuple(p.grid_thw for p in packages), loaded.image_token_id, merge)


@functools.lru_cache(maxsize=4096)
def _positions(ids: tuple[int, ...], grids: tuple[tuple[int, int, int], ...], image_token_id: int,
               merge: int) -> np.ndarray:
    t = torch.tensor([ids], dtype=torch.long)
    out = mrope_positions(t, torch.ones_like(t), list(grids), image_token_id, merge)[:, 0].numpy()
    out.flags.writeable = False
    return out


def build_pack(loaded: LoadedQwen, ids: np.ndarray, positions: np.ndarray, packages: Sequence[VisualPackage],
               levels: int, *, image_slots: int | None = None) -> Pack:
    """Device tensors for packed ``ids`` (pads included). ``image_slots`` pads the image-token list to a fixed
    size for graphs: extra slots write to the last token, which is always a pad."""
    device, dtype, hidden = loaded.device, loaded.dtype, loaded.hidden_size
    index = np.flatnonzero(ids == loaded.image_token_id)
    if image_slots is not None and image_slots > len(index):
        index = np.concatenate([index, np.full(image_slots - len(index), len(ids) - 1, dtype=index.dtype)])
    extra = len(index) - sum(int(p.embeds.shape[0]) for p in packages)
    embeds = [gathered([p.embeds for p in packages], device, dtype)] if packages else []
    deep = [gathered([p.deepstack for p in packages], device, dtype, dim=1)] if packages else []
    if extra:
        embeds.append(torch.zeros((extra, hidden), dtype=dtype, device=device))
        deep.append(torch.zeros((levels, extra, hidden), dtype=dtype, device=device))
    return Pack(
        ids=upload(torch.from_numpy(ids), device),
        positions=upload(torch.from_numpy(positions), device),
        image_index=upload(torch.from_numpy(index), device),
        image_embeds=torch.cat(embeds) if embeds else torch.zeros((0, hidden), dtype=dtype, device=device),
        deepstack=torch.cat(deep, dim=1) if deep else torch.zeros((levels, 0, hidden), dtype=dtype, device=device),
    )


def flash_ok(loaded: LoadedQwen) -> bool:
    """FlashAttention's variable-length kernel runs here (CUDA, half precision, head_dim <= 256)."""
    return loaded.device.type == "cuda" and loaded.dtype in (torch.float16, torch.bfloat16) and loaded.head_dim <= 256


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sq: Segments, sk: Segments, *,
                     causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed ``q [Tq, heads, D]`` over ``k, v [Tk, kv_heads, D]``, segment ``i`` of the queries
    over segment ``i`` of the keys (``causal``: aligned at the end, as FlashAttention does). Returns the output
    ``[Tq, heads, D]`` and the float32 log-sum-exp ``[heads, Tq]``. A query segment whose key segment is empty
    (only pad rows have one) gets output 0 and log-sum-exp ``-inf`` from the loop below but ``+inf`` from
    FlashAttention: finite either way, and never read."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = torch.ops.aten._flash_attention_forward(q, k, v, sq.cu, sk.cu, sq.longest, sk.longest, 0.0, causal,
                                                      False, scale=scale)
        lse = out[1]
        if lse.dim() != 2:  # the padded [batch, heads, max_q] layout of older FlashAttention builds
            raise RuntimeError(f"unexpected log-sum-exp shape {tuple(lse.shape)} from FlashAttention")
        return out[0], lse[:, : q.shape[0]]
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    qa = ka = 0
    for nq, nk in zip(sq.lengths, sk.lengths, strict=True):
        if nq and nk:
            qs = q[qa:qa + nq].float()
            ks, vs = (t[ka:ka + nk].float().repeat_interleave(groups, dim=1) for t in (k, v))
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
            if causal:
                seen = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
                scores = scores.masked_fill(~seen.to(q.device), float("-inf"))
            lse[:, qa:qa + nq] = torch.logsumexp(scores, dim=-1)
            o[qa:qa + nq] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vs)
        qa, ka = qa + nq, ka + nk
    return o.to(q.dtype), lse


def merge_attention(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Attention over the union of two key sets from the attention over each: the outputs weighted by their
    softmax mass ``exp(lse)``, i.e. ``b + sigmoid(lse_a - lse_b) * (a - b)`` — one element-wise pass over the
    outputs. A set without keys has weight 0 on the loop's ``-inf`` but weight 1 (output 0) on FlashAttention's
    ``+inf``: only pad rows have such a set, and their other set always has keys, so the result stays finite."""
    (oa, la), (ob, lb) = a, b
    kernel = _merge_kernel() if oa.is_cuda else None
    if kernel is not None and kernel.usable(oa, la, ob, lb):
        return kernel.merge(oa, la, ob, lb)
    weight = torch.sigmoid(la - lb).T[..., None]  # [T, heads, 1], float32
    return torch.lerp(ob, oa, weight.to(oa.dtype))


@functools.cache
def _merge_kernel() -> ModuleType | None:
    """:mod:`~.kernels.merge_kernel` (Triton: one kernel instead of four, a non-vectorised one),
    imported on the first CUDA merge; None on a CUDA build without Triton, found once rather than at every
    layer's merge."""
    try:
        from rubricsearch.retrieval.plugins.accelerated.kernels import merge_kernel
    except ImportError:
        return None
    return merge_kernel


def _modeling() -> Any:
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    return modeling_qwen3_vl


def decode(text: Any, pack: Pack, attend: Attend, last: torch.Tensor | None = None,
           attend_last: Attend | None = None) -> torch.Tensor:
    """Final-norm hidden states of a pack: ``Qwen3VLTextModel.forward`` with ``attend(layer, q, k, v)`` (``[T,
    heads, D]`` after the q/k norms and rotary) in place of its attention. ``[T, H]``, or with ``last`` (token
    indices) the states of those tokens only, ``[len(last), H]``.

    Both models read only each sequence's last token, so with ``attend_last`` the final layer runs its attention,
    output projection, MLP and norm for the ``last`` tokens alone: ``attend_last`` gets their queries and every
    token's keys and values. The matrix products it skips, most of one layer's (a few percent of a pass's), change
    nothing in its result (a final layer that takes DeepStack features runs whole)."""
    rotate = _modeling().apply_rotary_pos_emb  # looked up per call: the fused kernels switch it
    hidden = text.embed_tokens(pack.ids)
    if pack.image_embeds.shape[0]:
        hidden = hidden.index_copy(0, pack.image_index, pack.image_embeds)
    cos, sin = text.rotary_emb(hidden[None], pack.positions[:, None, :])  # [1, T, D]
    tokens = hidden.shape[0]
    deep = pack.deepstack.shape[0] if pack.image_embeds.shape[0] else 0
    for index, layer in enumerate(text.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_norm(attn.q_proj(x).view(1, tokens, -1, attn.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(1, tokens, -1, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(tokens, -1, attn.head_dim)
        q, k = rotate(q, k, cos, sin)  # [1, heads, T, D], as transformers lays them out
        if (last is not None and attend_last is not None and index == len(text.layers) - 1
                and index >= deep):
            out = attend_last(index, q[0].transpose(0, 1)[last], k[0].transpose(0, 1), v)
            kept = hidden[last] + attn.o_proj(out.reshape(out.shape[0], -1))
            kept = kept + layer.mlp(layer.post_attention_layernorm(kept))
            final: torch.Tensor = text.norm(kept)
            return final
        out = attend(index, q[0].transpose(0, 1), k[0].transpose(0, 1), v)
        hidden = hidden + attn.o_proj(out.reshape(tokens, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if index < deep:
            hidden = hidden.index_add(0, pack.image_index, pack.deepstack[index])
    normed: torch.Tensor = text.norm(hidden)
    return normed if last is None else normed[last]


def scale_of(text: Any) -> float:
    return float(text.layers[0].self_attn.scaling)


def token_bytes(loaded: LoadedQwen) -> int:
    """Transient memory per packed token of one layer at its peak: the MLP's three ``[T, intermediate]``
    activations, a few ``[T, H]`` copies, and the float32 attention outputs that :func:`merge_attention`
    combines. Layers run one after another, so this bounds a whole pass."""
    text = loaded.config.text_config
    itemsize = torch.finfo(loaded.dtype).bits // 8
    attention = 3 * 4 * int(text.num_attention_heads) * loaded.head_dim
    return itemsize * (3 * int(text.intermediate_size) + 10 * int(text.hidden_size)) + attention


def kv_bytes(loaded: LoadedQwen) -> int:
    """Memory per prefix token of the keys and values kept for all layers while its continuations run."""
    text = loaded.config.text_config
    itemsize = torch.finfo(loaded.dtype).bits // 8
    return 2 * int(text.num_key_value_heads) * loaded.head_dim * itemsize * int(text.num_hidden_layers)


def flash_varlen_works(loaded: LoadedQwen) -> bool:
    """Whether this build's FlashAttention takes packed grouped-query inputs and returns the log-sum-exp in the
    ``[heads, tokens]`` layout :func:`merge_attention` needs, checked once per device, dtype and head shape
    against the reference loop (some builds pad it per sequence, some GPUs lack the kernel): the reranker keeps
    its padded path otherwise."""
    return flash_ok(loaded) and _flash_varlen_probe(*_probe_key(loaded))


def _probe_key(loaded: LoadedQwen) -> tuple[str, torch.dtype, int, int, int]:
    """What the probes' results depend on: device, dtype, query and key-value heads, head size."""
    text = loaded.config.text_config
    return (str(loaded.device), loaded.dtype, int(text.num_attention_heads), int(text.num_key_value_heads),
            loaded.head_dim)


@functools.lru_cache(maxsize=8)
def _flash_varlen_probe(device_name: str, dtype: torch.dtype, heads: int, kv: int, dim: int) -> bool:
    device = torch.device(device_name)
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths_q, lengths_k = [5, 0, 9], [7, 0, 3]
    q = torch.randn(sum(lengths_q), heads, dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(sum(lengths_k), kv, dim, generator=gen).to(device, dtype) for _ in range(2))
    sq, sk = Segments.of(lengths_q, device), Segments.of(lengths_k, device)
    try:
        got = varlen_attention(q, k, v, sq, sk, causal=False, scale=dim ** -0.5)
    except RuntimeError:
        return False
    want = varlen_attention(q.cpu(), k.cpu(), v.cpu(), sq, sk, causal=False, scale=dim ** -0.5)
    return bool(torch.allclose(got[0].float().cpu(), want[0].float(), atol=2e-2)
                and torch.allclose(got[1].cpu(), want[1], atol=2e-2))


def flash_varlen_grad_works(loaded: LoadedQwen) -> bool:
    """Whether FlashAttention's variable-length kernel also gives the gradients of the queries, keys and values here
    (causal segments whose keys outnumber their queries, grouped-query heads), checked once per device, dtype and
    head shape against the reference loop's: the passes with gradients stay padded otherwise."""
    return flash_varlen_works(loaded) and _flash_varlen_grad_probe(*_probe_key(loaded))


@functools.lru_cache(maxsize=8)
def _flash_varlen_grad_probe(device_name: str, dtype: torch.dtype, heads: int, kv: int, dim: int) -> bool:
    device = torch.device(device_name)
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths_q, lengths_k = [5, 3], [9, 3]
    inputs = [torch.randn(sum(n), h, dim, generator=gen) for n, h in ((lengths_q, heads), (lengths_k, kv),
                                                                       (lengths_k, kv))]
    weight = torch.randn(sum(lengths_q), heads, dim, generator=gen)

    def grads(on: torch.device, as_dtype: torch.dtype) -> list[torch.Tensor]:
        q, k, v = (t.to(on, as_dtype).requires_grad_(True) for t in inputs)
        sq, sk = Segments.of(lengths_q, on), Segments.of(lengths_k, on)
        out = varlen_attention(q, k, v, sq, sk, causal=True, scale=dim ** -0.5)[0]
        return [g.float().cpu() for g in torch.autograd.grad((out.float() * weight.to(on)).sum(), [q, k, v])]

    try:
        got = grads(device, dtype)
    except RuntimeError:
        return False
    want = grads(torch.device("cpu"), torch.float32)
    return all(float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.99
               for a, b in zip(got, want, strict=True))


@dataclass(frozen=True)
class PackKey:
    """The sizes of a packed last-token pass (what a CUDA graph of it is captured for): packed tokens, segments
    (rows), image-token slots, DeepStack levels and FlashAttention's ``max_seqlen``."""

    tokens: int
    rows: int
    image_slots: int
    levels: int
    longest: int


def bucket(n: int, step: int, shift: int = 4) -> int:
    """``n`` rounded up to a multiple of ``step`` or of 1/2**shift..2/2**shift of ``n``, whichever is coarser."""
    grain = max(step, 1 << max(0, n.bit_length() - shift))
    return -(-n // grain) * grain


BULK_SHIFT = 5  # ingestion passes: sizes at most 1/16 over (less at 448 px), a few keys per mixed-size set


def pack_key(batch: Sequence[LMInput], *, bucketed: bool) -> PackKey:
    """``bucketed``: sizes rounded up (:func:`bucket`, :data:`BULK_SHIFT`) so that batches of other images and
    sizes share a graph; the pad tokens go to the spare segments, none longer than ``longest``. Else the exact
    sizes (the eager pass)."""
    lengths = [len(x.ids) for x in batch]
    images = sum(int(p.embeds.shape[0]) for x in batch for p in x.packages)
    levels = next((p.levels for x in batch for p in x.packages), 0)
    if not bucketed:
        return PackKey(sum(lengths), len(lengths), images, levels, max(lengths))
    tokens, rows = bucket(sum(lengths) + 1, 64, BULK_SHIFT), bucket(len(lengths) + 1, 8)
    return PackKey(tokens, rows, bucket(images, 64, BULK_SHIFT) if images else 0, levels,
                   bucket(max(segment_lengths(lengths, tokens, rows)), 64))


def segment_lengths(lengths: Sequence[int], tokens: int, segments: int) -> list[int]:
    """``lengths``, then the ``tokens`` they leave spread evenly over the spare segments up to ``segments`` (some
    may be empty)."""
    spare, pad = segments - len(lengths), tokens - sum(lengths)
    share, more = divmod(pad, spare) if spare else (0, 0)
    return [*lengths, *([share + 1] * more), *([share] * (spare - more))]


def last_token_inputs(loaded: LoadedQwen, batch: Sequence[LMInput], pad_id: int, key: PackKey
                      ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The device tensors of :func:`last_token_pass` for ``batch`` laid out at ``key``'s sizes (pad tokens are
    ``pad_id``, pad rows read the last pad token), and the segment lengths (the CPU attention loops over them)."""
    lengths = [len(x.ids) for x in batch]
    total = sum(lengths)
    ids = np.full(key.tokens, pad_id, dtype=np.int64)
    ids[:total] = np.fromiter((t for x in batch for t in x.ids), dtype=np.int64, count=total)
    positions = np.zeros((3, key.tokens), dtype=np.int64)
    positions[:, :total] = np.concatenate([sequence_positions(loaded, x.ids, x.packages) for x in batch], axis=1)
    packages = [p for x in batch for p in x.packages]
    pack = build_pack(loaded, ids, positions, packages, key.levels, image_slots=key.image_slots)
    segments = segment_lengths(lengths, key.tokens, key.rows)
    last = np.full(key.rows, key.tokens - 1, dtype=np.int64)
    last[: len(lengths)] = np.cumsum(lengths) - 1
    device = loaded.device
    tensors = {"cu": Segments.of(segments, device).cu, "ones": Segments.of([1] * key.rows, device).cu,
               "last": upload(torch.from_numpy(last), device), **vars(pack)}
    return tensors, segments


def last_token_pass(text: Any, t: dict[str, torch.Tensor], key: PackKey, segments: Sequence[int]) -> torch.Tensor:
    """``[key.rows, H]`` final-norm state of each segment's last token: one causal pass over the pack, the final
    layer for the last tokens only. No host data and no sync on a GPU (a CUDA graph holds it)."""
    seg, ones = Segments(t["cu"], list(segments), key.longest), Segments(t["ones"], [1] * key.rows, 1)
    scale = scale_of(text)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(q, k, v, seg, seg, causal=True, scale=scale)[0]

    def attend_last(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(q, k, v, ones, seg, causal=True, scale=scale)[0]  # one query per sequence

    pack = Pack(**{f: t[f] for f in ("ids", "positions", "image_index", "image_embeds", "deepstack")})
    return decode(text, pack, attend, t["last"], attend_last)


def last_token_states(loaded: LoadedQwen, batch: Sequence[LMInput], pad_id: int) -> torch.Tensor:
    """``[B, H]`` final-norm state of each sequence's last token (``forward.last_hidden_states``), from one
    packed causal pass: ingestion's large LM passes on a GPU pay for no padding and no attention mask.
    Exact sizes: no pad token, so ``pad_id`` fills nothing (the signature is the padded pass's)."""
    key = pack_key(batch, bucketed=False)
    tensors, segments = last_token_inputs(loaded, batch, pad_id, key)
    return last_token_pass(loaded.model.language_model, tensors, key, segments)
