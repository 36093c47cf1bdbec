"""Activation bytes per rank, counted on the meta device: what autograd keeps from a forward to its backward with
and without the engine's activation checkpointing and its host offload (activations/).

[Note: counting activations]
The model's forward and a cross-entropy loss on its output run once on the meta device (nothing allocated) for one
micro-batch, with a saved-tensor hook and a dispatch mode that record, for each block (``checkpointed_blocks``) and
for the rest of the model, the bytes of every distinct storage saved for backward, the bytes of the block's inputs
(what a checkpoint keeps) and of the outputs of the ops the selective policy keeps (checkpointing.py's
``KEPT_OPS``). Parameters (and views of them) are not activations. Then the peak each configuration holds:

- ``none``: everything saved, in every block and outside them;
- ``units``: outside the blocks, every block's inputs, and the largest block's saved tensors, which its
  recomputation holds during its backward;
- ``selective``: as ``units``, every block also keeping its matmul and attention outputs (the recomputation
  then holding the rest of the largest block);
- with ``offload``: the block inputs are in the host pool (``host``), the device holding those of the two blocks
  being recomputed and prefetched;

and in every mode, while a block's backward runs, the gradients of its largest intermediate and of its input.
These are the bytes torch's ``MemTracker`` reports at the peak outside parameters, gradients and optimizer state
(tests/unit/test_activations.py compares them for a GPT).

A rank's micro-batch is the same under every stage (ZeRO shards model states, not activations), so these
bytes add to the model states of ``estimate``. Attention that materializes its scores (``s x s`` per head) counts
them as the model's own attention does on the meta device (torch's ``scaled_dot_product_attention`` picks a fused
kernel where one exists, as on a GPU; the CPU's math fallback keeps them).

Under sequence parallelism (sequence/) a rank's micro-batch is its slice, S/K positions of each sample, except
inside attention, which holds every position of H/K heads (ulysses.py). ``profiled_rank(K)`` stands in for the
group when one process profiles one of its ranks: the model takes it as it takes ``SequenceParallel`` and its
attention turns q, k, v from ``[B, H, S/K, D]`` into fresh ``[B, H/K, S, D]`` tensors and the output back as the
all-to-alls do (shapes only: the values are fake anyway), so the full-sequence head blocks attention saves count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_zero.activations.checkpointing import KEPT_OPS
from lightning_zero.sequence.parallel import SequenceParallel
from lightning_zero.sequence.ulysses import check_heads


@dataclass
class _Region:
    """What one block (or the rest of the model) saves, by storage (held, so no address is reused meanwhile)."""

    saved: dict[int, torch.UntypedStorage] = field(default_factory=dict)  # saved for backward
    inputs: dict[int, torch.UntypedStorage] = field(default_factory=dict)  # the block's input tensors
    kept: dict[int, torch.UntypedStorage] = field(default_factory=dict)  # outputs of the ops "selective" keeps

    @staticmethod
    def total(storages: dict[int, torch.UntypedStorage]) -> int:
        return sum(storage.nbytes() for storage in storages.values())


@dataclass(frozen=True)
class ActivationProfile:
    """What one micro-batch saves for backward (see [Note: counting activations]), in bytes."""

    before: int  # saved outside the blocks until the last block ends (embeddings; freed last in backward)
    after: int  # saved outside the blocks after it (final norm, head, loss; freed before the blocks' backward)
    blocks: list[int]  # saved inside each block (its input included where a first op saves it)
    inputs: list[int]  # each block's inputs
    kept: list[int]  # each block's kept matmul and attention outputs
    largest: list[int]  # each block's largest saved tensor

    def held(self, mode: str, *, offload: bool = False) -> tuple[int, int]:
        """(device bytes, host pool bytes) at the peak under ``mode`` ("none", "units" or "selective")."""
        # a block's backward holds gradients too: of its largest intermediate and of its input (the residual stream)
        gradients = max((g + i for g, i in zip(self.largest, self.inputs)), default=0)
        if mode == "none":
            return self.before + self.after + sum(self.blocks) + gradients, 0
        kept = self.kept if mode == "selective" else [0] * len(self.blocks)
        kept_inputs = [0 if offload else i for i in self.inputs]
        forward_end = self.before + self.after + sum(kept_inputs) + sum(kept)
        fetched = 2 if offload else 1  # (offloaded: its input back, and the next block's, prefetched)
        backward = [  # block k recomputed: what comes before it, its input, and the rest of its saved tensors
            self.before + sum(kept_inputs[:k]) + sum(kept[: k + 1]) + fetched * self.inputs[k]
            + self.blocks[k] - self.inputs[k] - kept[k]
            for k in range(len(self.blocks))
        ]  # fmt: skip
        return max([forward_end, *backward]) + gradients, sum(self.inputs) if offload else 0


class _Recorder(TorchDispatchMode):
    """Records, per region, the storages saved for backward and the outputs of the kept ops."""

    def __init__(self, model: Module, blocks: list[Module]) -> None:
        super().__init__()
        self.parameters = {p.untyped_storage()._cdata for p in model.parameters()}
        self.regions: list[_Region] = [_Region() for _ in range(len(blocks) + 1)]  # [0]: outside every block
        self.current = 0
        self.after: dict[int, torch.UntypedStorage] = {}  # saved outside the blocks once the last one ended
        self._last = blocks[-1] if blocks else None
        self._index = {id(b): k + 1 for k, b in enumerate(blocks)}
        self._inputs_seen: set[int] = set()  # (an input passed to every block, a mask, counts once)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.current and func in KEPT_OPS:
            _add(self.regions[self.current].kept, tree_flatten(out)[0])
        return out

    def pack(self, tensor: Tensor) -> Tensor:
        if tensor.untyped_storage()._cdata not in self.parameters:
            _add(self.after if self.current == 0 and self._last is None else self.regions[self.current].saved, [tensor])
        return tensor

    def enter(self, module: Module, args: tuple, kwargs: dict) -> None:
        self.current = self._index[id(module)]
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        fresh = [t for t in tensors if t.untyped_storage()._cdata not in self._inputs_seen]
        _add(self.regions[self.current].inputs, fresh)
        self._inputs_seen.update(t.untyped_storage()._cdata for t in fresh)

    def leave(self, module: Module, args: tuple, output: Any) -> None:
        self.current = 0
        if module is self._last:
            self._last = None


def _add(storages: dict[int, torch.UntypedStorage], tensors: list) -> None:
    for tensor in tensors:
        if isinstance(tensor, Tensor):
            storage = tensor.untyped_storage()
            storages.setdefault(storage._cdata, storage)


def profile_activations(
    model: Module, blocks: list[Module], forward: Callable[[], Tensor], *, loss: bool = True
) -> ActivationProfile:
    """Runs ``forward()`` (the model on its example inputs, on the meta device or any other) and, with ``loss``,
    a cross-entropy on its output, recording what ``blocks`` and the rest save (see [Note: counting activations])."""
    recorder = _Recorder(model, blocks)
    handles = [b.register_forward_pre_hook(recorder.enter, with_kwargs=True) for b in blocks]
    handles += [b.register_forward_hook(recorder.leave) for b in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), recorder:
            out = forward()
            if loss:
                logits = out.flatten(0, -2).float()
                F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))
    finally:
        for handle in handles:
            handle.remove()
    outside, *inside = recorder.regions
    return ActivationProfile(
        before=_Region.total(outside.saved),
        after=_Region.total(recorder.after),
        blocks=[_Region.total(r.saved) for r in inside],
        inputs=[_Region.total(r.inputs) for r in inside],
        kept=[_Region.total(r.kept) for r in inside],
        largest=[max((storage.nbytes() for storage in r.saved.values()), default=0) for r in inside],
    )


class _ProfiledRank(SequenceParallel):
    def check_sliced(self, tokens: Tensor) -> None:
        """Nothing to compare with: the profile's rank is alone."""

    def slice_mean(self, total: Tensor, count: Tensor) -> Tensor:
        """The slice's own mean (alone: no group to count the others' tokens with)."""
        return total / count

    def attention(self, q: Tensor, k: Tensor, v: Tensor, attention: Callable[..., Tensor], **kwargs: Any) -> Tensor:
        """Ulysses' attention with each all-to-all replaced by a copy of the received tensor's shape."""
        check_heads(q.shape[1], k.shape[1], self.size)
        if k.shape[1] < self.size:  # (key/value heads repeated to one per rank, as ulysses.py does)
            k, v = (t.repeat_interleave(self.size // t.shape[1], dim=1) for t in (k, v))
        b, h, s, d = q.shape
        q, k, v = (t.reshape(b, t.shape[1] // self.size, s * self.size, d).clone() for t in (q, k, v))
        return attention(q, k, v, **kwargs).reshape(b, h, s, d).clone()


def profiled_rank(size: int) -> SequenceParallel:
    """One rank of a sequence-parallel group of ``size``, alone, for a profile (see [Note: counting activations])."""
    return _ProfiledRank(group=None, rank=0, size=size, data_rank=0, data_size=1)


MODES = (("none", False), ("units", False), ("selective", False), ("units", True), ("selective", True))
LONGEST = 1 << 24  # tokens: the longest sequence the search tries


def mode_name(mode: str, offload: bool) -> str:
    """The row name of an activation checkpointing ``mode`` (``+offload`` with its checkpoints on the host)."""
    return f"{mode}+offload" if offload else mode


def longest_fitting(
    profile: Callable[[int], ActivationProfile], budget: int, mode: str, offload: bool, *, multiple: int = 1
) -> int:
    """The longest sequence (up to ``LONGEST`` times ``multiple``), a multiple of ``multiple`` (a sequence-parallel
    group's size: the lengths it splits), whose activations under ``mode`` fit ``budget`` device bytes; 0 if not
    even the shortest does. Activations grow with the sequence, almost in proportion: the search starts where the
    line through two sequence lengths crosses the budget, gallops to a bracket and bisects it (a few profiles where
    the growth is linear, as with fused attention), in steps of ``multiple`` tokens."""

    def need(steps: int) -> int:
        return profile(multiple * steps).held(mode, offload=offload)[0]

    if budget < need(1):
        return 0
    at_1k, at_2k = need(1024), need(2048)
    guess = min(max(int(1024 + (budget - at_1k) * 1024 / max(at_2k - at_1k, 1)), 1), LONGEST)
    step = 1  # (invariant once bracketed: low fits, high does not or is past the limit)
    if need(guess) <= budget:
        low = guess
        while low + step <= LONGEST and need(low + step) <= budget:
            low, step = low + step, 2 * step
        high = min(low + step, LONGEST + 1)
    else:
        high = guess
        while high - step > 1 and need(high - step) > budget:
            high, step = high - step, 2 * step
        low = max(high - step, 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if need(middle) <= budget else (low, middle)
    return multiple * low
