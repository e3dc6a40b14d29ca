"""Cross-request batching of language-model passes, one scheduler per loaded model.

Requests (searches, /v1/embeddings, /v1/rerank, ingestion batches) hand their LM inputs to the model's
scheduler and wait; one worker thread runs every forward pass of the model. What queues while a pass runs
goes into the next one (continuous batching: an idle device starts at once, a busy one gets larger passes;
``max_wait_s`` can hold a tiny batch back a few milliseconds instead, which costs a one-image search that wait
and leaves the GPU idle between passes under load). Each pass is filled round-robin across the
waiting requests under a row and padded-token budget, so one large request (an ingestion batch, a long
document list) takes its share of every pass while a one-item search still gets into the next one. This
is the dynamic batching TEI and vLLM do; here it also keeps request threads free for their CPU work
(decoding, tokenising, preprocessing) instead of queueing on a model lock.

Work of another shape (the reranker's shared-prefix groups: one prompt prefix, many continuations) is
merged too, by its own function (:meth:`LMScheduler.merged`): groups waiting from any requests go to one
call, which runs all their prefixes in one pass and all their continuations in a few more.

On a GPU one worker runs every pass, so the device never runs two of the model's passes at once (they would
share one stream anyway). On a CPU merging saves little, since a small model's passes cost their FLOPs, not
launches: one shortlist costs the same per search alone or merged with fifteen others. What a loaded CPU
server lacked was parallelism: one worker kept 1.3 of 2 cores busy. So a CPU scheduler runs one worker per
core, each taking the next pass while the others run theirs (their kernels release the GIL).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.qwen.engine.forward import LMInput, last_hidden_states, plan_batches
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen

T = TypeVar("T")
# One forward pass: last-token hidden states ``[B, H]`` of a batch (the plain runtime's padded pass, or another
# implementation of the same function that a runtime hands in).
LMPass = Callable[[LoadedQwen, Sequence[LMInput], int], torch.Tensor]


class GraphPasses(Protocol):
    """Passes that a runtime replays instead of running them (the accelerated plug-in's CUDA graphs)."""

    @property
    def counters(self) -> dict[str, int]: ...

    def fits(self, batch: Sequence[LMInput]) -> bool: ...

    def run(self, batch: Sequence[LMInput]) -> torch.Tensor: ...


def default_workers(device: torch.device) -> int:
    """One worker on an accelerator (its passes queue on one stream); one per core the process may use on a
    CPU, where concurrent passes run on different cores."""
    if device.type != "cpu":
        return 1
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@dataclass(eq=False)
class _Request:
    inputs: Sequence[LMInput]
    out: torch.Tensor
    next: int = 0  # first item not yet scheduled
    left: int = 0  # items not yet computed
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def waiting(self) -> int:
        return len(self.inputs) - self.next


@dataclass(eq=False)
class _Item:
    """One unit of mergeable work for ``run_many`` (e.g. a shared-prefix group), with its cost in tokens."""

    run_many: Callable[[list[Any]], list[Any]]
    item: Any
    cost: int
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class LMScheduler:
    """Merges concurrent LM work for one model into shared forward passes; see the module docstring."""

    def __init__(self, loaded: LoadedQwen, pad_id: int, *, max_batch: int, max_tokens: int,
                 max_wait_s: float = 0.0, lm_pass: LMPass = last_hidden_states, graphs: GraphPasses | None = None,
                 workers: int | None = None) -> None:
        """``lm_pass``: how a batch runs (the padded forward unless the runtime hands in another); ``graphs``:
        the passes it fits run as replays instead. ``workers``: threads running passes; by default one on an
        accelerator, one per core on a CPU."""
        self.workers = workers or default_workers(loaded.device)
        if self.workers > 1 and loaded.device.type != "cpu":
            # Graph replays reuse static input buffers and every pass shares one stream: a second worker would
            # overwrite a queued replay's inputs.
            raise InvalidInput(f"more than one LM worker runs only on a CPU (got {self.workers} on "
                               f"{loaded.device.type}); leave lm_workers at 0 or 1 there")
        self.loaded, self.pad_id, self.graphs = loaded, pad_id, graphs
        self._plain = lm_pass
        self.max_batch, self.max_tokens, self.max_wait_s = max_batch, max_tokens, max_wait_s
        self._cond = threading.Condition()
        self._requests: deque[_Request] = deque()
        self._items: deque[_Item] = deque()
        self._threads: list[threading.Thread] = []
        self._retired: set[threading.Thread] = set()  # told by close() to exit once the queues are empty
        self.counters = {"passes": 0, "rows": 0, "merged_passes": 0, "group_calls": 0, "groups": 0,
                         "graph_passes": 0}

    @property
    def stats(self) -> dict[str, int]:
        """The scheduler's counters and, with graphs, their captures and replays."""
        return {**self.counters, **(self.graphs.counters if self.graphs is not None else {})}

    # -- callers --------------------------------------------------------------------------------
    def run(self, inputs: Sequence[LMInput]) -> torch.Tensor:
        """Last-token hidden states, float32 ``[N, H]`` on the model device, in input order."""
        with torch.inference_mode():  # written by the worker, which runs in inference mode
            out = torch.empty((len(inputs), self.loaded.hidden_size), dtype=torch.float32, device=self.loaded.device)
        if not inputs:
            return out
        request = _Request(inputs, out, left=len(inputs))
        with self._cond:
            self._requests.append(request)
            self._start()
            self._cond.notify()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return out

    def merged(self, items: Sequence[Any], run_many: Callable[[list[Any]], list[T]],
               costs: Sequence[int]) -> list[T]:
        """Results of ``run_many`` for ``items``, which the worker merges with other requests' items for
        the same ``run_many`` (up to ``max_tokens`` of ``costs`` per call); in order."""
        queued = [_Item(run_many, item, cost) for item, cost in zip(items, costs, strict=True)]
        if not queued:
            return []
        with self._cond:
            self._items.extend(queued)
            self._start()
            self._cond.notify()
        for entry in queued:
            entry.done.wait()
        for entry in queued:
            if entry.error is not None:
                raise entry.error
        return [entry.result for entry in queued]

    def depth(self) -> int:
        """Items and jobs waiting for the device (admission control reads this)."""
        with self._cond:
            return sum(r.waiting for r in self._requests) + len(self._items)

    def close(self) -> None:
        """Let the workers finish the queued work, then stop and join them (a later request starts new ones).

        A daemon worker still running when the interpreter exits is torn down under torch's C++ threads,
        which can abort the process after its last output."""
        with self._cond:
            workers, self._threads = self._threads, []
            self._retired.update(workers)
            self._cond.notify_all()
        for thread in workers:
            thread.join()

    # -- the worker -----------------------------------------------------------------------------
    def _start(self) -> None:
        """Under ``_cond``: bring the workers up to ``workers`` (idle ones exit after a minute)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        while len(self._threads) < self.workers:
            thread = threading.Thread(target=self._loop, name="lm-scheduler", daemon=True)
            self._threads.append(thread)
            thread.start()

    @torch.inference_mode()
    def _loop(self) -> None:
        while True:
            with self._cond:
                me = threading.current_thread()
                while not self._requests and not self._items:
                    if me in self._retired:
                        self._retired.discard(me)
                        return
                    if (not self._cond.wait(timeout=60.0) and not self._requests and not self._items
                            and me in self._threads):
                        self._threads.remove(me)  # idle: a later request restarts it
                        return
            self._gather()
            with self._cond:
                group = self._pick_items()
            if group:
                self._run_items(group)
                continue
            with self._cond:
                picks = self._pick()
            if picks:
                self._run_batch(picks)

    def _gather(self) -> None:
        """Wait up to ``max_wait_s`` for more requests while the pending work is far from one full pass."""
        deadline = time.monotonic() + self.max_wait_s
        with self._cond:
            while (sum(r.waiting for r in self._requests) + len(self._items) < self.max_batch // 2
                   and (left := deadline - time.monotonic()) > 0):
                self._cond.wait(left)

    def _pick(self) -> list[tuple[_Request, int]]:
        """Items for the next pass, round-robin across requests (a fair share each) under the budgets."""
        picks: list[tuple[_Request, int]] = []
        while len(picks) < self.max_batch:
            progressed = False
            for request in list(self._requests):
                if request.waiting == 0 or len(picks) >= self.max_batch:
                    continue
                width = len(request.inputs[request.next].ids)
                widest = max([width] + [len(r.inputs[i].ids) for r, i in picks])
                if picks and widest * (len(picks) + 1) > self.max_tokens:
                    continue
                picks.append((request, request.next))
                request.next += 1
                progressed = True
            if not progressed:
                break
        for request in [r for r in self._requests if r.waiting == 0]:
            self._requests.remove(request)  # fully scheduled: its results arrive with the running passes
        return picks

    def _run_batch(self, picks: list[tuple[_Request, int]]) -> None:
        inputs = [r.inputs[i] for r, i in picks]
        error: BaseException | None = None
        try:
            for rows in plan_batches(inputs, self.max_batch, self.max_tokens):
                graphed = self.graphs is not None and self.graphs.fits([inputs[k] for k in rows])
                states = self._pass([inputs[k] for k in rows], graphed).to(torch.float32)
                if len(states) != len(rows):
                    raise RuntimeError(f"a pass of {len(rows)} rows returned {len(states)}")
                for first, stop, request, index in _runs([picks[k] for k in rows]):
                    # rows of its own (other workers write other rows); one copy per run of consecutive items
                    request.out[index : index + stop - first] = states[first:stop]
                self._count(passes=1, rows=len(rows), graph_passes=int(graphed),
                            merged_passes=int(len({id(picks[k][0]) for k in rows}) > 1))
        except BaseException as exc:  # a bad batch fails the requests in it, never the worker
            error = exc
        finished = []
        with self._cond:  # another worker may be finishing passes of the same requests
            for request, _ in picks:
                request.left -= 1
                request.error = request.error or error
            for request in {id(r): r for r, _ in picks}.values():
                if request.error is not None:  # nothing more of it is run
                    request.next = len(request.inputs)
                    if request in self._requests:
                        self._requests.remove(request)
                    finished.append(request)
                elif request.left == 0:
                    finished.append(request)
        for request in finished:
            request.done.set()

    def _pass(self, batch: list[LMInput], graphed: bool) -> torch.Tensor:
        if self.graphs is None or not graphed:
            return self._plain(self.loaded, batch, self.pad_id)
        return self.graphs.run(batch)

    def _count(self, **add: int) -> None:
        with self._cond:
            for key, value in add.items():
                self.counters[key] += value

    def _pick_items(self) -> list[_Item]:
        """The oldest waiting items of one ``run_many``, in order, within ``max_tokens`` of cost."""
        if not self._items:
            return []
        run_many = self._items[0].run_many
        picked: list[_Item] = []
        cost = 0
        for entry in list(self._items):
            if entry.run_many is not run_many:
                continue
            if picked and cost + entry.cost > self.max_tokens:
                break
            picked.append(entry)
            cost += entry.cost
        for entry in picked:
            self._items.remove(entry)
        return picked

    def _run_items(self, picked: list[_Item]) -> None:
        try:
            results = picked[0].run_many([entry.item for entry in picked])
            for entry, result in zip(picked, results, strict=True):
                entry.result = result
            self._count(group_calls=1, groups=len(picked))
        except BaseException as exc:  # a failing call fails its items, never the worker
            if len(picked) == 1:
                picked[0].error = exc
            else:  # find the item it failed on: each alone
                for entry in picked:
                    self._run_items([entry])
                return
        for entry in picked:
            entry.done.set()


def _runs(picks: Sequence[tuple[_Request, int]]) -> list[tuple[int, int, _Request, int]]:
    """``(first, stop, request, index)`` for each run of picks that are consecutive items of one request:
    rows ``first:stop`` of the pass are its items ``index...`` (a pass of one request's equal-length items,
    such as an ingestion batch of one image size, is one run)."""
    runs: list[tuple[int, int, _Request, int]] = []
    for k, (request, index) in enumerate(picks):
        if runs and runs[-1][2] is request and runs[-1][3] + k - runs[-1][0] == index:
            runs[-1] = (runs[-1][0], k + 1, request, runs[-1][3])
        else:
            runs.append((k, k + 1, request, index))
    return runs
