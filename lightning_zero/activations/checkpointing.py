"""Activation checkpointing of a model's units (``ZeroConfig.activation_checkpointing``).

[Note: checkpointing a unit]
A unit module (the modules stage 3 gathers one at a time: sharding/stage3_setup.py's ``unit_modules``, at every
stage) runs its training forward inside torch's non-reentrant checkpoint, entered by a forward pre-hook and left
by a forward hook, so the model's structure, names and state dict stay the user's (torch's composable
``checkpoint`` works the same way, but its hooks cannot be removed at teardown). Autograd then keeps only what
the checkpoint saves: the unit's inputs, and with ``"selective"`` the outputs of the ops the policy keeps; in
backward, the first saved tensor the unit's backward unpacks re-runs its forward (``module(*args, **kwargs)``:
its other pre-hooks run again, ours are off while it does; torch stops it once backward has what it needs), with
the RNG state of the first forward, so dropout draws the same mask. Under stage 3 that recomputation goes through
the unit's forward hook, whose ``Schedule.recompute`` gathers it in backward's order on every rank
(stage3_schedule.py), prefetch included: nothing else is gathered for it. A forward without gradients
(evaluation, ``no_grad``) is not checkpointed. A checkpointed block gets no key/value cache in training (a
``transformers.Cache`` argument becomes None, ``use_cache`` False), as under Hugging Face's own checkpointing: its
recomputation would find the cache holding the forward's keys already.

[Note: the selective policy]
``"selective"`` keeps the outputs of matrix multiplications and attention and recomputes everything else
(torchtitan's op-level policy): those ops hold almost all of a transformer layer's FLOPs, so backward re-runs
only the cheap pointwise ops (norms, activations, dropout, residual adds) while the activations kept are a few
tensors of ``s*h`` to ``4*s*h`` elements per layer instead of every intermediate. Built on torch's policy API
(``create_selective_checkpoint_contexts``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch.nn import Module
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _checkpoint_without_reentrant_generator,
    create_selective_checkpoint_contexts,
)

from lightning_zero.activations.host_offload import HostActivations
from lightning_zero.config import ZeroConfig
from lightning_zero.sharding.stage3_setup import unit_modules

_aten = torch.ops.aten
# the ops whose outputs "selective" keeps (see [Note: the selective policy])
KEPT_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_fused_attention_overrideable",
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_aten, name)  # (a build without one of them)
)
# the leading parameters of torch's generator, which the hooks pass by position (a private function)
GENERATOR_PARAMETERS = ("fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keeps matmul and attention outputs, recomputes the rest (torch's policy-function signature)."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class UnitCheckpoints:
    """Checkpoints the forward of each of ``modules`` (see [Note: checkpointing a unit]); ``selective``: with the
    selective policy. ``offload``: where the checkpoint's own saved tensors (the unit's inputs) go (host_offload.py);
    its saving context is entered before the checkpoint and left after it, so only those go through it."""

    def __init__(self, modules: Sequence[Module], *, selective: bool, offload: HostActivations | None = None) -> None:
        self.modules = list(modules)
        self._selective = selective
        self.offload = offload
        self._recomputing: set[int] = set()  # ids of the modules whose forward re-runs now (hooks off)
        self._open: dict[int, tuple] = {}  # id(module) -> (its checkpoint, its saving context), pre-hook to hook
        self._handles = []
        for module in self.modules:  # (first: other pre-hooks run inside the checkpoint, and again when it recomputes)
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def memory_bytes(self) -> dict[str, int]:
        """With offload: the host pool's bytes (constant once the longest step has run)."""
        return {"host_activations": self.offload.pool.capacity} if self.offload is not None else {}

    def remove(self) -> None:
        """Removes the hooks from the modules, which run their plain forward from then on."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open.clear()

    def _contexts(self, module: Module) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        forward, recompute = (
            create_selective_checkpoint_contexts(selective_policy)
            if self._selective
            else (contextlib.nullcontext(), contextlib.nullcontext())
        )
        return forward, _Recomputing(self._recomputing, module, recompute)

    @torch._dynamo.disable
    def _enter(self, module: Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if id(module) in self._recomputing or not torch.is_grad_enabled():
            return None
        args, kwargs = _without_cache(module, args, kwargs)
        # Tensor keyword arguments travel as positional ones: the checkpoint saves (and offloads) those, and finds
        # the devices whose RNG state it restores among them.
        names = [key for key, value in kwargs.items() if isinstance(value, torch.Tensor)]
        rest = {key: value for key, value in kwargs.items() if key not in names}
        call = partial(_call, module, len(args), names, rest)
        checkpoint = _checkpoint_without_reentrant_generator(
            call, True, partial(self._contexts, module), "default", False, True, *args, *(kwargs[k] for k in names)
        )
        scope = contextlib.ExitStack()  # (the saving context stays under the checkpoint's hooks until the forward ends)
        if self.offload is not None:
            scope.enter_context(self.offload.saving())
        try:
            next(checkpoint)  # (saves the inputs, then enters the checkpoint's saved-tensor hooks)
        except BaseException:
            scope.close()
            raise
        self._open[id(module)] = (checkpoint, scope)
        return args, kwargs

    @torch._dynamo.disable
    def _leave(self, module: Module, args: tuple, output: Any) -> None:
        checkpoint, scope = self._open.pop(id(module), (None, None))
        if checkpoint is not None:
            try:
                next(checkpoint, None)  # (leaves the checkpoint's hooks; it ends there)
            finally:
                scope.close()


def _call(module: Module, positional: int, names: list[str], rest: dict, *tensors: Any) -> Any:
    """The recomputation: ``module`` called as it was (its hooks run, stage 3's gathering it)."""
    return module(*tensors[:positional], **rest, **dict(zip(names, tensors[positional:])))


def _without_cache(module: Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A training block's arguments with no Hugging Face key/value cache (see [Note: checkpointing a unit])."""
    cache = getattr(sys.modules.get("transformers"), "Cache", None)  # (only if the model's library is loaded)
    if cache is None or not module.training:
        return args, kwargs
    args = tuple(None if isinstance(value, cache) else value for value in args)
    kwargs = {key: None if isinstance(value, cache) else value for key, value in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


class _Recomputing:
    """While a module's forward re-runs in backward, our hooks leave it alone (no checkpoint inside one). A class,
    not a generator: a graph kept for a second backward recomputes again, entering it again."""

    def __init__(self, recomputing: set[int], module: Module, inner: contextlib.AbstractContextManager) -> None:
        self._recomputing, self._id, self._inner = recomputing, id(module), inner

    def __enter__(self) -> None:
        self._recomputing.add(self._id)
        self._inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self._inner.__exit__(*exc)
        finally:
            self._recomputing.discard(self._id)


def checkpointed_blocks(model: Module, config: ZeroConfig) -> list[Module]:
    """The modules ``config.activation_checkpointing`` checkpoints in ``model``: the children of its ``ModuleList``s,
    or those whose class ``config.unit_module_classes`` names (stage 3's units, without those it picks by size: an
    embedding or a head, whose recomputation saves nothing). Refuses a model with no blocks, one whose Hugging Face
    gradient checkpointing is on (it would be checkpointed twice), and one compiled around its blocks (blocks compiled
    one by one are checkpointed as they are)."""
    mode = config.activation_checkpointing
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError(
            f"zero.activation_checkpointing is {mode!r} and the model's own (Hugging Face) gradient checkpointing is"
            " on: choose one (model.gradient_checkpointing_disable(), or zero.activation_checkpointing: none)"
        )
    blocks = unit_modules(model, config.unit_module_classes)
    for compiled in (m for m in model.modules() if _compiled(m)):
        if any(block in set(compiled.modules()) - {compiled} for block in blocks):
            raise ValueError(
                f"zero.activation_checkpointing is {mode!r} and the model is compiled around its blocks (torch.compile"
                " traces their checkpoints, whose recomputation then runs another graph): compile the blocks one by"
                " one, as FSDP2 recommends (model.blocks[i] = torch.compile(block)), or set activation_checkpointing:"
                " none"
            )
    if not blocks:
        raise ValueError(
            f"zero.activation_checkpointing is {mode!r}, but the model has no blocks to checkpoint (no nn.ModuleList):"
            " name the block classes in zero.unit_module_classes, or set zero.activation_checkpointing: none"
        )
    return blocks


def _compiled(module: Module) -> bool:
    """``torch.compile(module)``'s wrapper, or a module compiled in place (``module.compile()``)."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or module._compiled_call_impl is not None


def checkpoint_units(model: Module, config: ZeroConfig, device: torch.device) -> UnitCheckpoints | None:
    """``config.activation_checkpointing`` on ``model``'s blocks (``checkpointed_blocks``), with
    ``config.offload_activations``; None for "none"."""
    if config.activation_checkpointing == "none":
        return None
    blocks = checkpointed_blocks(model, config)
    if tuple(inspect.signature(_checkpoint_without_reentrant_generator).parameters)[:6] != GENERATOR_PARAMETERS:
        raise RuntimeError(
            f"zero.activation_checkpointing needs torch's non-reentrant checkpoint generator as torch 2.13 has it"
            f" ({', '.join(GENERATOR_PARAMETERS)}); torch {torch.__version__}'s differs: install torch 2.13, or set"
            " zero.activation_checkpointing: none"
        )
    offloaded = config.offload_activations == "cpu"
    offload = HostActivations(device, pin_memory=config.offload_pin_memory) if offloaded else None
    return UnitCheckpoints(blocks, selective=config.activation_checkpointing == "selective", offload=offload)
