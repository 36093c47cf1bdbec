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

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_zero.sharding import collectives
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.grad_reduce import GradReducer

# With 16-bit model weights the checkpoint's state of each parameter also holds its fp32 master
# weights under this key (the model's own state dict only has the rounded 16-bit copy).
MASTER_KEY = "zero_master_fp32"


class ZeroOptimizer:
    def __init__(
        self,
        optimizer: Optimizer,
        group_params: Sequence[Sequence[Parameter]],
        group_units: Sequence[FlatUnit | None],
        reducer: GradReducer,
        *,
        group=None,
    ) -> None:
        if optimizer.state:
            raise ValueError(
                f"the optimizer {type(optimizer).__name__} already holds state before sharding; create it fresh in"
                " `configure_optimizers`"
            )
        self.optimizer = optimizer
        self.reducer = reducer
        self.group = group
        self.units = [u for u in group_units if u is not None]
        self._group_units = list(group_units)
        # For each group, each original parameter's index in its unit (None when frozen).
        self._unit_index: list[list[int | None]] = []
        for params, unit in zip(group_params, group_units):
            position = {id(p): i for i, p in enumerate(unit.params)} if unit is not None else {}
            self._unit_index.append([position.get(id(p)) for p in params])
        for param_group, unit in zip(optimizer.param_groups, group_units):
            param_group["params"] = list(unit.piece_tensors) if unit is not None else []
        self._prepared = False
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
            unit.gather_params(group=self.group)
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
        for g, (unit, indices) in enumerate(zip(self._group_units, self._unit_index)):
            if unit is None:
                continue
            piece_of = {pc.param: (pc, t) for pc, t in zip(unit.pieces, unit.piece_tensors)}
            for j, i in enumerate(indices):
                if i is None or i not in piece_of or piece_of[i][1] not in self.optimizer.state:
                    continue
                piece, tensor = piece_of[i]
                state = {
                    k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in self.optimizer.state[tensor].items()
                }
                if unit.flat_param.dtype != tensor.dtype:  # 16-bit model weights: keep the fp32 master too
                    state[MASTER_KEY] = tensor.detach().cpu()
                local[(g, j)] = {"lo": piece.lo, "hi": piece.hi, "shape": tuple(unit.params[i].shape), "state": state}
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
            for j in range(len(self._unit_index[g])):
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
        if len(saved_groups) != len(self.optimizer.param_groups) or any(
            len(sg["params"]) != len(idx) for sg, idx in zip(saved_groups, self._unit_index)
        ):
            raise ValueError(
                "optimizer state does not match this optimizer: saved parameter counts per group"
                f" {[len(sg['params']) for sg in saved_groups]}, expected {[len(idx) for idx in self._unit_index]}"
            )
        inner_state, inner_groups, inner_index = {}, [], 0
        for saved, unit, indices in zip(saved_groups, self._group_units, self._unit_index):
            piece_of = {pc.param: (pc, t) for pc, t in zip(unit.pieces, unit.piece_tensors)} if unit is not None else {}
            params = []
            for j, i in enumerate(indices):
                if i is None or i not in piece_of:
                    continue
                saved_state = state_dict["state"].get(saved["params"][j])
                if saved_state is not None:
                    piece, tensor = piece_of[i]
                    state = _slice(saved_state, piece, unit.layout.numels[i])
                    if MASTER_KEY in state:
                        with torch.no_grad():
                            tensor.copy_(state.pop(MASTER_KEY))
                    inner_state[inner_index] = state
                params.append(inner_index)
                inner_index += 1
            inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": params})
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    def nbytes(self) -> dict[str, int]:
        totals = {"parameters": 0, "gradients": 0, "master": 0}
        for unit in self.units:
            for key, value in unit.nbytes().items():
                totals[key] += value
        totals["optimizer_state"] = sum(
            v.nbytes for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        )
        return totals


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
