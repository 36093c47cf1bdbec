"""ZeroOptimizer: the user's torch optimizer, stepping only what this rank owns.

The user's optimizer (whatever ``configure_optimizers`` returned) is kept, with its param groups,
hyper-parameters and LR schedulers; each group's ``params`` list is replaced by this rank's pieces (views
into the unit's fp32 master partition), and any state it holds by its pieces of it. One optimizer step is:

1. ``prepare_grads``: one all-reduce (MAX) of the host-side used-flags tells every rank which
   parameters got a gradient on any rank (in fp16 a second one, of a device flag, whether any
   gradient overflowed: the step's only host sync, see [Note: host syncs]); each piece's ``.grad``
   becomes a view of its fp32 reduced gradient, or None (as under DDP, the optimizer then leaves
   that parameter alone: no momentum, no weight decay).
2. optional clipping: ``clip_grad_norm_`` (one all-reduce of the squared norm, no host sync) or the
   precision plugin's clip-by-value on the pieces (elementwise, so sharding does not change it);
3. ``step``: the user's optimizer updates the pieces, then every unit all-gathers its updated
   partition into the flat parameter buffer that the model's parameters view (stages 1 and 2:
   overlapped with the next forward, see param_gather.py). ``skip_step`` instead drops the
   gradients and leaves everything else as it was.

[Note: host syncs]
In fp32 and bf16 a step never waits for the device: which parameters got a gradient is recorded on the host by the
gradient hooks (a bytearray per unit) and all-reduced on a CPU process group (the topology's ``host_world``), clipping
keeps its factor on the device, and the optimizer runs without reading anything back. fp16 reads one flag, whether any
rank's gradients overflowed: the skip decision is the host's (Lightning steps LR schedulers and counts steps on the
host, and the loss scaler's next scale must be known before the next backward), as in torch's GradScaler. With
``LossScaleConfig.skip_on_device`` it does not: the flag stays on the device and the fused AdamW step skips on it there
(fused_step.py); only a step in which some unit takes the optimizer's own step (another optimizer, pieces whose step
counts differ, an offloaded unit) reads it.

Its state is saved and loaded per rank by ``lightning_zero.checkpoint`` (sharded checkpoints that
load at any world size), never gathered in one place.

[Note: an Optimizer to whoever asks]
A ZeroOptimizer is a ``torch.optim.Optimizer`` to the code that checks (torch's LR schedulers and SWALR, Lightning's LR
finder and callbacks), without ``Optimizer.__init__``, which would take the parameters as its own: ``param_groups`` are
the views below, ``state`` and ``defaults`` the wrapped optimizer's, and the step hooks torch's
``register_step_pre_hook``/``register_step_post_hook`` add run around ``step`` as they run around torch's own."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit, unshard_together
from lightning_zero.sharding.fused_step import FusedAdamWStep, supports
from lightning_zero.sharding.grad_reduce import GradReducer
from lightning_zero.sharding.layout import Piece
from lightning_zero.sharding.offload import use_fused_host_step, wait_for_device
from lightning_zero.sharding.optimizer_check import shard_held_state
from lightning_zero.sharding.param_gather import ParamGathers
from lightning_zero.sharding.param_group_view import HOOKS, ParamGroupView
from lightning_zero.sharding.swapped import nvme_step_for
from lightning_zero.sharding.topology import Topology


@dataclass(frozen=True)
class Slot:
    """Where one of the optimizer's parameters lives: its unit, its index there, and this rank's piece."""

    unit: FlatUnit
    index: int
    piece: Piece | None  # None when this rank owns no part of the parameter
    tensor: Tensor | None  # the piece's view into the unit's master partition


class ZeroOptimizer(Optimizer):
    """The user's torch optimizer, stepping only this rank's pieces of the units (see the module docstring)."""

    def __init__(
        self,
        optimizer: Optimizer,
        locate: Mapping[Parameter, tuple[FlatUnit, int]],
        names: Mapping[Parameter, str],
        reducer: GradReducer,
        *,
        gathers: ParamGathers | None = None,
        fused_step: str = "never",
        topology: Topology,
        activation: Callable[[list[Parameter]], tuple[dict, dict]] | None = None,
    ) -> None:
        """``locate`` maps each trainable parameter to (unit, index in the unit); frozen ones are absent.
        ``fused_step``: see fused_step.py. ``topology``: the shard group, and with hybrid sharding the
        replicate group of the ranks holding the same partitions (topology.py). ``activation``: gives
        parameters added by ``add_param_group`` their units (unit_set.py's ``ParamActivation``)."""
        shard_held_state(optimizer.state, locate)  # (Adagrad's, from its __init__: see optimizer_check.py)
        for hooks in HOOKS:
            setattr(self, hooks, OrderedDict())
        self.optimizer = optimizer
        self.reducer = reducer
        self.gathers = gathers  # stages 1 and 2
        self.group = topology.shard_group
        self.host_group = topology.host(self.group)
        self.replicate_group = topology.replicate_group
        self.host_replicate_group = topology.host_replicate
        self.world_host_group = topology.host_world  # decisions every rank must share
        self.activation = activation  # see add_param_group
        # per group, each original parameter's slot (None: frozen): the unsharded state dict's numbering follows them
        self._slots: list[list[Slot | None]] = []
        self._group_names: list[list[str]] = []
        self._views: list[ParamGroupView] = []
        for param_group in optimizer.param_groups:
            params = list(param_group["params"])
            self._adopt(param_group, params, locate, names)
        self.units = list({id(s.unit): s.unit for slots in self._slots for s in slots if s is not None}.values())
        self.fused = FusedAdamWStep(optimizer, fused_step) if fused_step != "never" and supports(optimizer) else None
        self.nvme = nvme_step_for(optimizer, self.units, self.world_host_group)  # (units on NVMe: swapped.py)
        if any(unit.offload is not None for unit in self.units):  # after: what it sets is not the user's choice
            use_fused_host_step(optimizer)
        self._prepared = False
        self._found_inf = False
        self._multiplier: float | Tensor = 1.0
        self.last_step_skipped = False
        self.loss_scale = 1.0  # the fp16 loss scale backward used (the precision plugin keeps it current)

    def scaled_by(self, loss_scale: float | Tensor) -> None:
        """The fp16 loss scale the backward about to run multiplies the loss by (the precision plugin's)."""
        self.loss_scale = loss_scale

    def _adopt(self, inner: dict[str, Any], params: list[Parameter], locate: Mapping, names: Mapping) -> None:
        """Points ``inner`` (a group of the wrapped optimizer) at this rank's pieces of ``params``."""
        slots = []
        for p in params:
            if p in locate:
                unit, index = locate[p]
                piece, tensor = unit.training.piece_of(index)
                slots.append(Slot(unit, index, piece, tensor))
            else:
                slots.append(None)
        self._slots.append(slots)
        self._group_names.append([names[p] for p in params])
        inner["params"] = [s.tensor for s in slots if s is not None and s.tensor is not None]
        self._views.append(ParamGroupView(inner, params))

    # --- what Lightning, LR schedulers and callbacks read --------------------------------------------
    @property
    def param_groups(self) -> list[ParamGroupView]:
        """The user's param groups, listing the model's parameters (param_group_view.py's [Note: param group views])."""
        return self._views

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds parameters to train from now on (e.g. a backbone unfrozen by ``BackboneFinetuning``): their
        units get master weights and gradients (collective: every rank adds the same group)."""
        params = list(param_group["params"])
        if self.activation is None:
            raise RuntimeError("parameters can be added once the ZeRO strategy has set the optimizer up")
        locate, names = self.activation(params)
        self.optimizer.add_param_group({**param_group, "params": [torch.zeros(0)]})  # defaults filled in
        inner = self.optimizer.param_groups[-1]
        self._adopt(inner, params, locate, names)
        self.units += [u for u in dict.fromkeys(unit for unit, _ in locate.values()) if u not in self.units]
        self.nvme = nvme_step_for(self.optimizer, self.units, self.world_host_group)  # (the new group checked too)
        if any(unit.offload is not None for unit in self.units):
            use_fused_host_step(self.optimizer)

    @property
    def state(self) -> dict:
        """The wrapped optimizer's state, keyed by this rank's pieces."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"

    def module_params(self) -> list[Parameter]:
        """The model's trainable parameters this optimizer steps, in its param groups' order."""
        return [s.unit.params[s.index] for slots in self._slots for s in slots if s is not None]

    def params_with_grads(self) -> list[Parameter]:
        """Inside the step: the model's parameters that got a gradient on some rank (DDP's non-None ``.grad``)."""
        return [
            s.unit.params[s.index]
            for slots in self._slots
            for s in slots
            if s is not None and (s.unit.training.used_anywhere is None or s.unit.training.used_anywhere[s.index])
        ]

    # --- the step ----------------------------------------------------------------------------------
    # [Note: one pass to unscale and clip]
    # ``prepare_grads`` leaves the fp32 gradients as backward produced them: scaled by the fp16 loss
    # scale. The factor that turns them into the true, clipped gradients is kept pending in
    # ``_multiplier`` (1 / loss_scale, times the clip coefficient once one is known) and applied in
    # one multiply right before the optimizer step, or earlier by ``unscale_`` when something needs
    # the true values (clipping by value). Norms are computed on the scaled values and divided.

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.units:
            unit.training.zero_grad()
        self._prepared = False

    def prepare_grads(
        self, *, check_finite: bool = False, loss_scale: float | Tensor = 1.0, on_device: bool = False
    ) -> bool | Tensor:
        """Reduces the gradients, tells which parameters got one on any rank, and hands them to the pieces.

        With ``check_finite`` (fp16) a second all-reduce says whether any rank's gradient holds an
        inf or nan; that flag is read on the host (the only sync of the step, see [Note: host syncs])
        and returned. When it is set the pieces get no gradients: the caller skips the step. With
        ``on_device`` the flag is returned unread (a device tensor), the pieces get their gradients, and
        ``step`` skips on it on the device. Idempotent within a step.
        """
        if self._prepared:
            return self._found_inf
        if self.gathers is not None:
            self.gathers.wait_all()  # a bucket no forward waited on (its modules did not run) is done
        if any(u.training.needs_reduction() for u in self.units):  # stage 1 (the same on every rank)
            self.reducer.reduce_pending()
        self._found_inf = False
        if self.replicate_group is not None:
            self._average_replicas([u.training.reduced for u in self.units])
        if self.units:
            # The used flags first, even on a step that will be skipped: the collectives issued here never
            # depend on the overflow flag, whatever a rank found in its own partitions.
            flags = bytearray().join(u.training.used for u in self.units)  # the tensor below writes into it
            collectives.all_reduce(
                torch.frombuffer(flags, dtype=torch.uint8), dist.ReduceOp.MAX, group=self.world_host_group
            )
            if check_finite:
                overflow = torch.stack([u.training.nonfinite() for u in self.units]).amax(dim=0)
                found = collectives.all_reduce(overflow, dist.ReduceOp.MAX, group=self._group_for(overflow))
                self._found_inf = found if on_device else bool(found.item())
            if self._found_inf is not True:  # (a flag left on the device: gradients attached, step skips on it)
                start = 0
                for unit in self.units:
                    unit.training.attach_grads(flags[start : start + len(unit.params)])
                    start += len(unit.params)
        self._multiplier = 1.0 / loss_scale
        self._prepared = True
        return self._found_inf

    def grad_norm(self) -> Tensor:
        """The global L2 norm of the true (unscaled, clipped so far) gradients: the unsharded model's.

        Safe anywhere in a step, and changes nothing: before the step it is the norm of the gradients
        accumulated so far (stage 1 reduce-scatters them into a temporary for it). Collective: every
        rank must call it (as every rank runs the same Lightning hooks).
        """
        if self._prepared:
            grads, multiplier = (
                [u.training.step_grad for u in self.units if u.training.step_grad is not None],
                self._multiplier,
            )
        else:
            grads, multiplier = self._current_grads(), 1.0 / self.loss_scale
        squares = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else self._device())
        for grad in grads:
            squares += torch.linalg.vector_norm(grad, dtype=torch.float64).square().to(squares.device)
        norm = collectives.all_reduce(squares, dist.ReduceOp.SUM, group=self._group_for(squares)).sqrt()
        return (norm * multiplier).float()

    def _device(self) -> torch.device:
        return self.units[0].flat_param.device if self.units else torch.device("cpu")

    def _group_for(self, tensor: Tensor):
        """The process group that reduces ``tensor``: the host group for host tensors (offload)."""
        return self.host_group if tensor.device.type == "cpu" else self.group

    def _current_grads(self) -> list[Tensor]:
        """This rank's reduced gradient partitions as accumulated so far, without preparing the step
        (with hybrid sharding: copies, averaged over the replicas)."""
        pending = [u for u in self.units if u.training.reduced is None]  # stage 1 between micro-batches
        reduced = self.reducer.peek_accumulated(pending) if pending else {}
        grads = [reduced.get(id(u), u.training.reduced) for u in self.units]
        if self.replicate_group is not None and not self._prepared:  # (prepared: summed already)
            grads = [g.clone() if g is u.training.reduced else g for g, u in zip(grads, self.units)]
            self._average_replicas(grads)
        return grads

    def _average_replicas(self, grads: list[Tensor]) -> None:
        """Hybrid sharding: each partition becomes the sum over the replicas of its shard, in place (the gradients were
        divided by every rank's count on their way into the buckets: this completes the average; see topology.py's
        [Note: hybrid sharding]). One all-reduce per partition, in unit order, all in flight at once, then waited on."""
        works = []
        for grad in grads:
            group = self.host_replicate_group if grad.device.type == "cpu" else self.replicate_group
            works.append(collectives.all_reduce_async(grad, dist.ReduceOp.SUM, group=group))
        for work in works:
            work.wait()

    def grad_norms_by_param(self, norm_type: float = 2.0) -> dict[str, Tensor]:
        """Each parameter's gradient norm and the total, keyed like Lightning's ``grad_norm`` utility.

        One all-reduce of a vector of per-parameter partial sums; nothing is gathered. Collective.
        """
        if norm_type <= 0 or norm_type == float("inf"):
            raise ValueError(f"norm_type must be a finite number > 0, got {norm_type!r}")
        grads = {id(u): g for u, g in zip(self.units, self._current_grads())}
        names = [n for slots, ns in zip(self._slots, self._group_names) for s, n in zip(slots, ns) if s is not None]
        slots = [s for slots in self._slots for s in slots if s is not None]
        device = next(iter(grads.values())).device if grads else self._device()
        partial = torch.zeros(len(slots), dtype=torch.float64, device=device)
        for k, slot in enumerate(slots):
            if slot.piece is not None:
                lo = slot.piece.partition_offset
                piece = grads[id(slot.unit)][lo : lo + slot.piece.numel]
                partial[k] = piece.double().abs().pow(norm_type).sum()
        collectives.all_reduce(partial, dist.ReduceOp.SUM, group=self._group_for(partial))
        scale = 1.0 / self.loss_scale
        norms = (partial.pow(1.0 / norm_type) * scale).float()
        out = {f"grad_{float(norm_type)}_norm/{n}": norms[k] for k, n in enumerate(names)}
        out[f"grad_{float(norm_type)}_norm_total"] = (partial.sum().pow(1.0 / norm_type) * scale).float()
        return out

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scales all gradients by min(1, max_norm / (norm + 1e-6)), as ``torch.nn.utils.clip_grad_norm_``.

        The factor joins the pending unscale (no pass over the gradients here); returns the norm.
        """
        norm = self.grad_norm()
        self._multiplier = self._multiplier * (max_norm / (norm + 1e-6)).clamp(max=1.0)
        return norm

    def unscale_(self, skip: set[int] = frozenset()) -> None:
        """Applies the pending unscale and clip factor to the gradients now (but those of units in ``skip``,
        by id, which the fused step applied it to)."""
        multiplier, self._multiplier = self._multiplier, 1.0
        if isinstance(multiplier, float) and multiplier == 1.0:
            return
        for unit in self.units:
            if unit.training.step_grad is not None and id(unit) not in skip:
                unit.training.step_grad.mul_(multiplier)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (closure,), {})
        loss = self._step(closure)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (closure,), {})
        return loss

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = self.prepare_grads()
        if found_inf is True:
            raise RuntimeError("gradients overflowed: skip this step with skip_step() instead")
        found_inf = found_inf if torch.is_tensor(found_inf) else None  # skipping on the device
        wait_for_device(self.units)  # offloaded: the last step's copies to the device have read the master
        swapped = self.nvme.step(self.units, self._multiplier, found_inf) if self.nvme is not None else set()
        rest = [unit for unit in self.units if id(unit) not in swapped]
        fused = self.fused.step(rest, self._multiplier, found_inf) if self.fused is not None else set()
        self.unscale_(skip=fused | swapped)
        # skipping on the device, what the fused step did not take reads the flag (see [Note: host syncs])
        if found_inf is None or not any(t.grad is not None for t in self.pieces()) or not found_inf.item():
            self.optimizer.step()
        if self.gathers is not None:
            self.gathers.launch(self.units, self.reducer.order)
        else:  # stage 3: the shards follow; the units kept gathered (persistent) are gathered again, at once
            for unit in self.units:
                unit.refresh_shard()
            unshard_together([u for u in self.units if u.gathered], group=self.group)
        for unit in self.units:
            unit.training.release_grads()
        self._prepared = False
        self.last_step_skipped = False
        return loss

    def skip_step(self) -> None:
        """Leaves parameters and optimizer state untouched and drops this step's gradients (fp16 overflow)."""
        self.zero_grad()  # (unprepared too)
        self.last_step_skipped = True

    # --- checkpoints --------------------------------------------------------------------------------
    def pieces(self) -> list[Tensor]:
        """This rank's pieces (what the wrapped optimizer steps), with gradients in the step (NVMe's: placeholders)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def param_names(self) -> list[list[str]]:
        """Each param group's parameters by name (frozen ones included), as a checkpoint records them."""
        return [list(names) for names in self._group_names]

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(
            "a ZeroOptimizer's state is sharded across ranks: save it with trainer.save_checkpoint(...) or"
            " fabric.save(...), which write each rank's part (lightning_zero.checkpoint)"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError(
            "a ZeroOptimizer's state is sharded across ranks: load it with trainer.fit(..., ckpt_path=...), which"
            " reads each rank's part (lightning_zero.checkpoint)"
        )

    def state_nbytes(self) -> int:
        """Bytes of the wrapped optimizer's state on this rank (masters: the units'), and of NVMe's ring of buffers."""
        ring = sum(buffer.nbytes for buffer in self.nvme.ring) if self.nvme is not None else 0
        return ring + sum(v.nbytes for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
