"""ZeroOptimizer: the user's torch optimizer, stepping only what this rank owns.

The user's optimizer (whatever ``configure_optimizers`` returned) is kept, with its param groups,
hyper-parameters and LR schedulers; only each group's ``params`` list is replaced by this rank's
pieces (views into the unit's fp32 master partition). One optimizer step is:

1. ``prepare_grads``: stage 1 reduce-scatters the accumulated gradients; one all-reduce (MAX) of the
   used-flags tells every rank which parameters got a gradient on any rank (and, in fp16, whether
   any gradient overflowed); each piece's ``.grad`` becomes a view of its fp32 reduced gradient, or
   None (as under DDP, the optimizer then leaves that parameter alone: no momentum, no weight decay).
2. optional clipping: ``clip_grad_norm_`` (one all-reduce of the squared norm, no host sync) or the
   precision plugin's clip-by-value on the pieces (elementwise, so sharding does not change it);
3. ``step``: the user's optimizer updates the pieces, then every unit all-gathers its updated
   partition into the flat parameter buffer that the model's parameters view. ``skip_step``
   instead drops the gradients and leaves everything else as it was.

``state_dict`` has the layout of the unsharded optimizer's (one entry per original parameter, full
shapes), so a checkpoint loads at any world size: ``load_state_dict`` slices out this rank's pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.grad_reduce import GradReducer
from lightning_zero.sharding.layout import Piece

# With 16-bit model weights the checkpoint's state of each parameter also holds its fp32 master
# weights under this key (the model's own state dict only has the rounded 16-bit copy).
MASTER_KEY = "zero_master_fp32"


@dataclass(frozen=True)
class Slot:
    """Where one of the optimizer's parameters lives: its unit, its index there, and this rank's piece."""

    unit: FlatUnit
    index: int
    piece: Piece | None  # None when this rank owns no part of the parameter
    tensor: Tensor | None  # the piece's view into the unit's master partition


class ZeroOptimizer:
    def __init__(
        self,
        optimizer: Optimizer,
        locate: Mapping[Parameter, tuple[FlatUnit, int]],
        reducer: GradReducer,
        *,
        group=None,
    ) -> None:
        """``locate`` maps each trainable parameter to (unit, index in the unit); frozen ones are absent."""
        if optimizer.state:
            raise ValueError(
                f"the optimizer {type(optimizer).__name__} already holds state before sharding; create it fresh in"
                " `configure_optimizers`"
            )
        self.optimizer = optimizer
        self.reducer = reducer
        self.group = group
        # For each group, each original parameter's slot (None when frozen); the numbering of the
        # unsharded optimizer's state dict follows these lists.
        self._slots: list[list[Slot | None]] = []
        for param_group in optimizer.param_groups:
            slots = []
            for p in param_group["params"]:
                if p in locate:
                    unit, index = locate[p]
                    piece, tensor = unit.piece_of(index)
                    slots.append(Slot(unit, index, piece, tensor))
                else:
                    slots.append(None)
            self._slots.append(slots)
            param_group["params"] = [s.tensor for s in slots if s is not None and s.tensor is not None]
        self.units = list({id(s.unit): s.unit for slots in self._slots for s in slots if s is not None}.values())
        self._prepared = False
        self._found_inf = False
        self.last_step_skipped = False
        self._consolidated: dict[str, Any] | None = None

    # --- what Lightning and LR schedulers read -----------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"

    # --- the step ----------------------------------------------------------------------------------
    # [Note: one pass to unscale and clip]
    # ``prepare_grads`` leaves the fp32 gradients as backward produced them: scaled by the fp16 loss
    # scale. The factor that turns them into the true, clipped gradients is kept pending in
    # ``_multiplier`` (1 / loss_scale, times the clip coefficient once one is known) and applied in
    # one multiply right before the optimizer step, or earlier by ``unscale_`` when something needs
    # the true values (clipping by value). Norms are computed on the scaled values and divided.

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.units:
            unit.zero_grad()

    def prepare_grads(self, *, check_finite: bool = False, loss_scale: float = 1.0) -> bool:
        """Reduces the gradients, tells which parameters got one on any rank, and hands them to the pieces.

        With ``check_finite`` (fp16) the same all-reduce also says whether any rank's gradient holds an
        inf or nan; that flag is read on the host (the only sync of the step) and returned. When it is
        set the pieces get no gradients: the caller skips the step. Idempotent within a step.
        """
        if self._prepared:
            return self._found_inf
        if self.reducer.backward_pending():
            raise RuntimeError(
                "a backward ran outside the Trainer's backward, so its gradients were never reduced; call"
                " `self.manual_backward(loss)` instead of `loss.backward()`"
            )
        stage1_units = [u for u in self.units if u.flat_grad is not None]
        if stage1_units:
            self.reducer.reduce_accumulated(stage1_units)
        self._found_inf = False
        if self.units:
            flags = [u.used for u in self.units]
            if check_finite:
                flags.append(torch.stack([u.nonfinite() for u in self.units]).amax(dim=0))
            flags = collectives.all_reduce(torch.cat(flags), dist.ReduceOp.MAX, group=self.group)
            self._found_inf = check_finite and bool(flags[-1])
            if not self._found_inf:
                sizes = [len(u.params) for u in self.units]
                for unit, used in zip(self.units, flags[: sum(sizes)].split(sizes)):
                    unit.attach_grads(used)
        self._multiplier: float | Tensor = 1.0 / loss_scale
        self._prepared = True
        return self._found_inf

    def grad_norm(self) -> Tensor:
        """The global L2 norm of the true (unscaled, clipped so far) gradients: the unsharded model's."""
        self.prepare_grads()
        device = self.units[0].master.device if self.units else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for unit in self.units:
            if unit.step_grad is not None:
                squares += torch.linalg.vector_norm(unit.step_grad, dtype=torch.float64).square()
        norm = collectives.all_reduce(squares, dist.ReduceOp.SUM, group=self.group).sqrt()
        return (norm * self._multiplier).float()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scales all gradients by min(1, max_norm / (norm + 1e-6)), as ``torch.nn.utils.clip_grad_norm_``.

        The factor joins the pending unscale (no pass over the gradients here); returns the norm.
        """
        norm = self.grad_norm()
        self._multiplier = self._multiplier * (max_norm / (norm + 1e-6)).clamp(max=1.0)
        return norm

    def unscale_(self) -> None:
        """Applies the pending unscale and clip factor to the gradients now."""
        multiplier, self._multiplier = self._multiplier, 1.0
        if isinstance(multiplier, float) and multiplier == 1.0:
            return
        for unit in self.units:
            if unit.step_grad is not None:
                unit.step_grad.mul_(multiplier)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.prepare_grads():
            raise RuntimeError("gradients overflowed: skip this step with skip_step() instead")
        self.unscale_()
        self.optimizer.step()
        for unit in self.units:
            unit.after_step(group=self.group)
            unit.release_grads()
        self._prepared = False
        self.last_step_skipped = False
        return loss

    def skip_step(self) -> None:
        """Leaves parameters and optimizer state untouched and drops this step's gradients (fp16 overflow)."""
        self.zero_grad()
        self._prepared = False
        self.last_step_skipped = True

    # --- state dict in the unsharded layout --------------------------------------------------------
    def _local_state(self) -> dict[tuple[int, int], dict[str, Any]]:
        """This rank's optimizer state per (group, parameter), with the element range it covers."""
        local = {}
        for g, slots in enumerate(self._slots):
            for j, slot in enumerate(slots):
                if slot is None or slot.tensor is None or slot.tensor not in self.optimizer.state:
                    continue
                state = {
                    k: v.detach().cpu() if torch.is_tensor(v) else v
                    for k, v in self.optimizer.state[slot.tensor].items()
                }
                if slot.unit.param_dtype != slot.tensor.dtype:  # 16-bit model weights: keep the fp32 master too
                    state[MASTER_KEY] = slot.tensor.detach().cpu()
                shape = tuple(slot.unit.params[slot.index].shape)
                local[(g, j)] = {"lo": slot.piece.lo, "hi": slot.piece.hi, "shape": shape, "state": state}
        return local

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: assembles the unsharded state dict on rank ``to`` (Lightning saves from rank 0)."""
        gathered = collectives.gather_object(self._local_state(), dst=to, group=self.group)
        if gathered is None:
            self._consolidated = None
            return
        flat_index, state = 0, {}
        groups = []
        for g, param_group in enumerate(self.optimizer.param_groups):
            indices = []
            for j in range(len(self._slots[g])):
                entries = [rank_state[(g, j)] for rank_state in gathered if (g, j) in rank_state]
                if entries:
                    state[flat_index] = _assemble(entries)
                indices.append(flat_index)
                flat_index += 1
            groups.append({**{k: v for k, v in param_group.items() if k != "params"}, "params": indices})
        self._consolidated = {"state": state, "param_groups": groups}

    def state_dict(self) -> dict[str, Any]:
        if self._consolidated is None:
            raise RuntimeError(
                "ZeroOptimizer.state_dict() needs consolidate_state_dict() to have run on every rank first,"
                " and is only available on the rank it consolidated to"
            )
        consolidated, self._consolidated = self._consolidated, None
        return consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads an unsharded optimizer state dict, keeping only this rank's pieces."""
        saved_groups = state_dict["param_groups"]
        expected = [len(slots) for slots in self._slots]
        if [len(sg["params"]) for sg in saved_groups] != expected:
            raise ValueError(
                "optimizer state does not match this optimizer: saved parameter counts per group"
                f" {[len(sg['params']) for sg in saved_groups]}, expected {expected}"
            )
        inner_state, inner_groups, inner_index = {}, [], 0
        for saved, slots in zip(saved_groups, self._slots):
            params = []
            for j, slot in enumerate(slots):
                if slot is None or slot.tensor is None:
                    continue
                saved_state = state_dict["state"].get(saved["params"][j])
                if saved_state is not None:
                    state = _slice(saved_state, slot.piece, slot.unit.layout.numels[slot.index])
                    if MASTER_KEY in state:
                        with torch.no_grad():
                            slot.tensor.copy_(state.pop(MASTER_KEY))
                    inner_state[inner_index] = state
                params.append(inner_index)
                inner_index += 1
            inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": params})
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for unit in self.units:
            unit.after_step()  # the loaded master weights become the parameters

    def state_nbytes(self) -> int:
        """Bytes of the wrapped optimizer's state on this rank (the master weights are the units')."""
        return sum(v.nbytes for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def _is_elementwise(value: Any, numel: int) -> bool:
    """Whether a state entry holds one value per parameter element (exp_avg, momentum_buffer, ...)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def _assemble(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Joins the pieces of one parameter's state from several ranks into tensors of the parameter's shape."""
    shape = entries[0]["shape"]
    full: dict[str, Any] = {}
    for key, value in entries[0]["state"].items():
        if not _is_elementwise(value, entries[0]["hi"] - entries[0]["lo"]):
            full[key] = value  # scalars such as Adam's step are equal on every piece
            continue
        tensor = torch.empty(shape, dtype=value.dtype)
        for entry in entries:
            tensor.view(-1)[entry["lo"] : entry["hi"]] = entry["state"][key]
        full[key] = tensor
    return full


def _slice(state: dict[str, Any], piece, numel: int) -> dict[str, Any]:
    return {k: v.reshape(-1)[piece.lo : piece.hi].clone() if _is_elementwise(v, numel) else v for k, v in state.items()}
