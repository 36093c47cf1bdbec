"""Hugging Face models sequence-parallel, unedited: their attention through Ulysses, their inputs and loss per rank.

[Note: Hugging Face attention under Ulysses]
A transformers model calls its attention through ``AttentionInterface``: each attention layer looks up
``config._attn_implementation`` in the registry and calls ``fn(module, query, key, value, attention_mask,
scaling=, dropout=, **kwargs)`` with this rank's slice ``[B, heads, S/K, D]``. ``attach_ulysses`` registers, per
model config, a function under a name of its own that wraps the implementation the model had (sdpa, eager,
flash, flex), and points the config at it: no module code is changed, and ``undo`` restores the name and takes the
registration out again. The wrapper runs the original on the head-sharded whole sequence (ulysses.py), so kernels,
GQA and dropout are the model's own. What the original would get from the model is for the slice, so:

- the mask: a mask function registered under the same name, which the model's ``create_causal_mask`` calls once a
  forward, all-gathers the slices' 2D padding masks over the group (a rank's queries attend to every slice's keys)
  and hands the whole one (or None) to the attention (for a name the mask registry does not know it would return
  None, the padding dropped); the wrapper builds the whole sequence's mask from it with the original
  implementation's own mask function, as ``create_causal_mask`` would in one process: sdpa gets None (``is_causal``)
  without padding, eager its additive causal mask. So any padding, left or right, is exact. A prepared 4D mask
  cannot be rebuilt from its slice and is refused, as are non-causal attention (an encoder, a vision tower: their
  inputs are not split) and sliding windows;
- key/value heads: the implementations repeat them ``module.num_key_value_groups`` times, which stays right when
  K divides them (each rank gets H/K query and H_kv/K key/value heads); fewer than K would need a repeat the model
  does not know of, so a size that does not divide them is refused at attach time, before any collective;
- positions and labels (``causal_lm_inputs``): the model numbers a slice from 0 and shifts labels inside the slice
  (losing the target at each slice's end), so a rank passes its global positions (a forward pre-hook checks them,
  agreed over the group, which also refuses packed sequences) and its slice of labels shifted over the whole
  sequence (``shift_labels``), with ``num_items_in_batch`` making its loss sequence/parallel.py's ``token_mean``
  (ZeRO averages the ranks' gradients: see [Note: sequence-parallel groups] there).
"""

from __future__ import annotations

import inspect
import sys
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module

from lightning_zero.sequence.parallel import SequenceParallel
from lightning_zero.sequence.ulysses import check_heads
from lightning_zero.sharding import collectives

PREFIX = "lightning_zero_ulysses_"  # the registered names (one per model config and attach)


def attach_ulysses(module: Module, sequence: SequenceParallel | None) -> Callable[[], None]:
    """Every transformers ``PreTrainedModel`` in ``module`` runs its attention sequence-parallel over ``sequence``'s
    group (see [Note: Hugging Face attention under Ulysses]); returns ``undo``. Nothing to do without a group or
    such a model (our GPT splits its attention itself). Refuses, before changing anything, what cannot run so."""
    transformers = sys.modules.get("transformers")  # (not imported: no model of its can exist)
    if sequence is None or transformers is None:
        return lambda: None
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    models = {}  # one per config: a causal LM and the base model inside it share theirs
    for model in module.modules():
        if isinstance(model, transformers.PreTrainedModel) and id(model.config) not in models:
            _check_model(model, sequence.size)
            models[id(model.config)] = model
    attached: list[tuple[str, Any, str]] = []
    hooks: list[Any] = []

    def undo() -> None:
        for hook in hooks:
            hook.remove()
        hooks.clear()
        for name, config, previous in reversed(attached):
            config._attn_implementation_internal = previous
            for registry in (AttentionInterface, AttentionMaskInterface):  # (they have no unregister of their own)
                registry._global_mapping.pop(name, None)
        attached.clear()

    for model in models.values():
        previous, name = model.config._attn_implementation, f"{PREFIX}{uuid.uuid4().hex}"
        AttentionInterface.register(name, _ulysses_forward(previous, sequence))
        AttentionMaskInterface.register(name, _whole_padding_mask(sequence))
        attached.append((name, model.config, previous))
        # the field set_attn_implementation sets: that would also set the sub-models' configs, which get their own
        model.config._attn_implementation_internal = name
        hooks.append(model.register_forward_pre_hook(_PositionCheck(model, sequence), with_kwargs=True))
    return undo


def _check_model(model: Module, size: int) -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    kind, config = type(model).__name__, model.config
    implementation = config._attn_implementation
    if not getattr(model, "_can_set_attn_implementation", lambda: True)():
        raise ValueError(
            f"{kind} does not call its attention through transformers' AttentionInterface, so it cannot run"
            " sequence-parallel"
        )
    if isinstance(implementation, str) and implementation.startswith(PREFIX):
        raise ValueError(f"{kind} already runs its attention sequence-parallel")
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:  # (paged, hub kernels: no whole-sequence mask to build)
        raise ValueError(
            f"sequence parallelism runs {kind}'s attention as sdpa, eager, flash or flex attention, not"
            f" {implementation!r}"
        )
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int):
        check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, size, repeat=False)


class _PositionCheck:
    """A forward pre-hook: the model's ``position_ids`` must be this rank's global positions (``causal_lm_inputs``'
    ``sequence.positions``), agreed over the group (one small all-reduce a forward) so that every rank refuses alike:
    without them the model numbers each slice from 0, and packed sequences (positions restarting inside the
    sequence) would need masks the slices cannot build."""

    def __init__(self, model: Module, sequence: SequenceParallel) -> None:
        self.signature, self.sequence = inspect.signature(model.forward), sequence

    def __call__(self, model: Module, args: tuple, kwargs: dict) -> None:
        given = self.signature.bind_partial(*args, **kwargs).arguments
        tokens = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
        positions = given.get("position_ids")
        # (on the inputs' device, as the process group's backend wants it; one host sync, after the all-reduce)
        device = tokens.device if tokens is not None else next(model.parameters()).device
        wrong = torch.ones((), device=device)
        if tokens is not None and positions is not None and positions.shape[-1] == tokens.shape[1]:
            wrong = (positions != self.sequence.positions(tokens.shape[1], positions.device)).any().float()
        if collectives.all_reduce(wrong, dist.ReduceOp.MAX, group=self.sequence.group).item():
            raise ValueError(
                f"{type(model).__name__} runs sequence-parallel: every rank passes its slice's global position_ids,"
                " as lightning_zero.sequence.hf.causal_lm_inputs gives them (packed sequences, and generation with a"
                " cache, are not supported)"
            )


def _whole_padding_mask(sequence: SequenceParallel) -> Callable[..., Tensor | None]:
    """The registered mask function, called once a forward by the model's ``create_causal_mask``: the group's whole
    2D padding mask (all-gathered from each rank's slice), or None, for the attention to build the whole sequence's
    mask from (a name transformers' mask registry does not know would get no mask at all, padding dropped)."""
    from transformers.masking_utils import causal_mask_function

    def gather(*, mask_function: Callable, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
        if mask_function is not causal_mask_function:  # (sliding windows, bidirectional, overlays: config-wide)
            raise ValueError("sequence parallelism builds plain causal masks only (with padding), not the model's")
        return None if attention_mask is None else _whole_padding(attention_mask, sequence)

    return gather


def _ulysses_forward(implementation: str, sequence: SequenceParallel) -> Callable[..., tuple[Tensor, None]]:
    """The registered function: ``implementation`` over the group's whole sequence, for this rank's slice."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

    make_mask = ALL_MASK_ATTENTION_FUNCTIONS[implementation]
    original = AttentionInterface._global_mapping.get(implementation)  # (eager: none, see below)

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        _check_call(module, query, key, attention_mask, kwargs)
        length = query.shape[2] * sequence.size
        padding = attention_mask  # (the whole sequence's, from the mask function above)
        if padding is not None and padding.shape[-1] != length:
            raise ValueError(
                f"{type(module).__name__} got a mask of {padding.shape[-1]} positions, not the whole sequence's"
                f" {length}: sequence parallelism needs the model to build its mask with create_causal_mask"
            )
        mask = make_mask(
            batch_size=query.shape[0], q_length=length, kv_length=length, q_offset=0, kv_offset=0,
            mask_function=causal_mask_function, attention_mask=padding, allow_is_causal_skip=True,
            dtype=query.dtype, config=module.config, device=query.device,
        )  # fmt: skip
        # eager is no registered function: it is the model file's own, the default its layers look up
        attend = original or _eager_of(module)
        kwargs.pop("position_ids", None)  # (the slice's: read only to find packed sequences, which SP does not run)

        def whole(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [B, heads/K, S, D]
            out, _ = attend(module, q, k, v, mask, scaling=scaling, dropout=dropout, **kwargs)
            return out.transpose(1, 2)  # (Hugging Face's outputs are [B, S, heads, D])

        return sequence.attention(query, key, value, whole).transpose(1, 2).contiguous(), None

    return forward


def _check_call(module: Module, query: Tensor, key: Tensor, attention_mask: Any, kwargs: dict) -> None:
    """What the wrapper cannot run, refused alike on every rank of the group before any collective."""
    what = type(module).__name__
    if not getattr(module, "is_causal", True):
        raise ValueError(f"sequence parallelism runs causal self-attention only, not {what}'s (its input is not split)")
    if getattr(module, "sliding_window", None) is not None or kwargs.get("sliding_window") is not None:
        raise ValueError(f"sequence parallelism does not run {what}'s sliding-window attention")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"sequence parallelism runs no cache: {what} got {query.shape[2]} queries and {key.shape[2]} keys"
            " (pass use_cache=False)"
        )
    if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2):
        raise ValueError(
            "sequence parallelism rebuilds the attention mask for the whole sequence from a 2D padding mask (or"
            " none), and cannot from a prepared 4D one: pass the 2D mask's slice"
        )


def _whole_padding(mask: Tensor, sequence: SequenceParallel) -> Tensor:
    """The group's whole 2D padding mask ``[B, S]`` from each rank's slice ``[B, S/K]``, in rank order."""
    local = mask.to(torch.int32).contiguous()  # (gloo gathers no bool)
    gathered = torch.empty((sequence.size, *local.shape), dtype=local.dtype, device=local.device)
    collectives.all_gather(gathered, local, async_op=False, group=sequence.group)
    return gathered.permute(1, 0, 2).reshape(local.shape[0], -1).bool()


def _eager_of(module: Module) -> Callable[..., Any]:
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if found is None:
        raise ValueError(f"no eager_attention_forward beside {type(module).__name__}: run it as sdpa instead")
    return found


def causal_lm_inputs(
    sequence: SequenceParallel | None,
    input_ids: Tensor,
    labels: Tensor | None = None,
    *,
    attention_mask: Tensor | None = None,
    ignore_index: int = -100,
    world_size: int | None = None,
) -> dict[str, Any]:
    """The keyword arguments of a Hugging Face causal LM's forward for this rank, from the whole batch ``[B, S]``
    (labels as Hugging Face takes them: unshifted, ``ignore_index`` where left out): its slice of ``input_ids``
    (and of ``attention_mask``), its global ``position_ids``, its slice of the labels shifted over the whole
    sequence, and ``num_items_in_batch`` = the real targets of every rank / ``world_size`` (default: the world's),
    so that the model's loss is ``world_size * sum(this slice's losses) / count``: averaged over the ranks (ZeRO's
    gradients, a ``sync_dist`` mean), the mean over the global batch's real targets (sequence/parallel.py's
    ``token_mean``). With labels, collective: every rank calls it once per micro-batch. Without a group
    (``sequence_parallel_size`` 1), the model's plain arguments. The outputs (logits) are this rank's slice's."""
    if sequence is None:
        plain = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        return {k: v for k, v in plain.items() if v is not None}
    length = input_ids.shape[1]
    if labels is not None:  # (a length the group cannot split is refused on every rank, with the count's all-reduce)
        splits = length % sequence.size == 0
        shifted = sequence.split(F.pad(labels[:, 1:], (0, 1), value=ignore_index)) if splits else labels[:, :0]
        # position i predicts token i + 1: shifted before slicing, each slice's last position keeps its target
        unsplit = torch.full((), float(not splits), device=input_ids.device)  # (the backend's device; one sync)
        totals = torch.stack([(shifted != ignore_index).sum().float(), unsplit])
        collectives.all_reduce(totals, dist.ReduceOp.SUM)
        if totals[1].item():
            raise ValueError(
                f"a rank's batch has sequences whose length does not split into sequence_parallel_size"
                f" {sequence.size} (here {length} tokens): pad every batch to a multiple of it"
            )
    inputs: dict[str, Any] = {
        "input_ids": sequence.split(input_ids),
        "position_ids": sequence.positions(length // sequence.size, input_ids.device).unsqueeze(0),
        "use_cache": False,  # (a cache would hold the slice's keys: see [Note: Hugging Face attention under Ulysses])
    }
    if attention_mask is not None:
        inputs["attention_mask"] = sequence.split(attention_mask)
    if labels is None:
        return inputs
    world_size = dist.get_world_size() if world_size is None else world_size
    # the model's loss ignores labels given shift_labels, and computes one only if labels are given
    inputs.update(labels=shifted, shift_labels=shifted, num_items_in_batch=totals[0] / world_size)
    if ignore_index != -100:
        inputs["ignore_index"] = ignore_index
    return inputs
