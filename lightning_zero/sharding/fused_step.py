"""The fused AdamW step inside ZeRO: one kernel pass over every bucket chunk of the units' partitions.

[Note: the fused ZeRO step]
With ``ZeroConfig.fused_step`` on ("auto": where a kernel runs, the CUDA kernels for device masters and the
host kernel for offloaded ones; "always": everywhere, CPU masters taking the host kernel, or the CUDA
kernels' pure-torch reference where no C compiler is found, which is how the CPU tests check this code;
"never") and a wrapped ``torch.optim.AdamW`` (no amsgrad, maximize, capturable, differentiable or tensor lr)
or ``FusedAdamW``, a unit whose pieces all got a gradient on some rank and share one step count is stepped
by the fused AdamW kernel (host: ``kernels.host``) on each run of adjacent pieces in one bucket and one
param group (stages 1 and 2: one run per bucket; stage 3: a module's matrices and vectors may sit in two
groups), all of a step's device runs in one multi-tensor launch (``plan_multi_adamw``: a table of runs and their
spans, sent with one asynchronous copy). One pass reads the fp32 gradient the optimizer would read
(``step_grad``, as unscaling or clipping by value left it), applies the still pending unscale and clip
factor (a device scalar: no host sync on the device path), updates the fp32 master and both moments, and
writes the parameters' 16-bit copy straight into the buffer the all-gather sends (stages 1 and 2: the chunk
of the flat buffer; stage 3: the shard), so the post-step copy is skipped. Offloaded units write it into a
host staging buffer instead (``UnitTraining.staged_params``, pinned on CUDA), which the post-step copy sends as
it is: 2 bytes per element over the bus, and no second pass over the master. All host runs of a step go to
the host kernel in one call, threaded over the whole of them. Any other unit takes the optimizer's own step,
as before. Adam's moments live in one flat fp32 buffer per unit; each piece's optimizer state holds views of
them (and its own ``step``), so checkpoints save and load the usual per-parameter state; state that arrives
otherwise (a checkpoint, a step taken by the optimizer itself) is copied into the flat buffers on the next
fused step. By default the fp16 overflow decision is the host's one read (zero_optimizer.py's [Note: host
syncs]): a skipped step never reaches this code.

[Note: device step counts]
With ``LossScaleConfig(skip_on_device=True)`` every fp16 step reaches it, with the all-reduced overflow flag
unread. The kernels (and their reference) skip on it, so a unit's step count cannot be known on the host:
it lives on the master's device, one fp32 tensor per unit that all its pieces' states hold (so "do they
share one count" stays a host question: is it the same tensor), advanced by ``1 - found_inf`` right before
the launch that reads it. A unit that takes the optimizer's own step instead (a piece without a gradient,
counts that differ, the host kernel of an offloaded unit after reading the flag, which is on the host
there) gets a host count per piece back first: torch's AdamW would advance a shared one once per piece.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.kernels import host
from lightning_zero.kernels.adamw import AdamWRun, FusedAdamW, plan_multi_adamw
from lightning_zero.kernels.loader import use_kernels
from lightning_zero.sharding.flat_unit import FlatUnit


def supports(optimizer: Optimizer) -> bool:
    """Whether the fused step computes exactly what ``optimizer`` would."""
    if isinstance(optimizer, FusedAdamW):
        return True
    if type(optimizer) is not torch.optim.AdamW:
        return False
    unsupported = ("amsgrad", "maximize", "capturable", "differentiable", "fused")  # fused: device step tensors
    return all(not any(g.get(k) for k in unsupported) and not torch.is_tensor(g["lr"]) for g in optimizer.param_groups)


class FusedAdamWStep:
    """Steps the eligible units by the fused AdamW kernels, instead of ``optimizer``'s own step (see the Notes).

    Args:
        optimizer: the wrapped optimizer, one ``supports``: its param groups and per-piece state.
        mode: ``ZeroConfig.fused_step``, "auto" or "always" (see [Note: the fused ZeRO step]).
    """

    def __init__(self, optimizer: Optimizer, mode: str) -> None:
        self.optimizer = optimizer
        self.mode = mode  # "auto" or "always"
        self._moments: dict[int, tuple[Tensor, Tensor]] = {}  # id(unit) -> flat exp_avg, exp_avg_sq
        self._counts: dict[int, Tensor] = {}  # id(unit) -> the step count its pieces share (skipping on the device)

    @staticmethod
    def _runs(unit: FlatUnit, group_of: dict[int, dict]) -> list[tuple[int, int, dict, Tensor | None]] | None:
        """The unit's partition as runs of adjacent pieces in one bucket and one param group:
        (start, end, group, where its 16-bit parameters go); None if a piece is in no group of ours
        (``group_of``: id of each piece tensor -> its param group)."""
        runs: list[list] = []
        for piece, tensor in zip(unit.training.pieces, unit.training.piece_tensors):
            group = group_of.get(id(tensor))
            if group is None:
                return None
            bucket = unit.layout.buckets[unit.layout.param_bucket[piece.param]]
            lo, hi = piece.partition_offset, piece.partition_offset + piece.numel
            if runs and runs[-1][2] is group and runs[-1][3] is bucket and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, group, bucket])
        if _stages_params(unit):
            unit.training.stage_params(written=sorted((lo, hi) for lo, hi, *_ in runs))
        return [(lo, hi, group, _lowp_target(unit, bucket, lo, hi)) for lo, hi, group, bucket in runs]

    def backend(self, unit: FlatUnit) -> str | None:
        """What steps ``unit``: "cuda", "host", "reference", or None (the optimizer itself)."""
        master = unit.training.master_view(0, 1)
        if use_kernels(master):
            return "cuda"
        on_host = master.device.type == "cpu" and (self.mode == "always" or unit.offload is not None)
        if on_host and host.available():
            return "host"
        return "reference" if self.mode == "always" else None

    def step(self, units: list[FlatUnit], multiplier: float | Tensor, found_inf: Tensor | None = None) -> set[int]:
        """Steps every eligible unit and drops its pieces' gradients (so the optimizer's own step skips
        them); returns their ids. ``found_inf``: the fp16 overflow flag, to skip on without reading it
        (see [Note: device step counts])."""
        done = set()
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}  # once per step
        host_runs: list[AdamWRun] = []
        device_runs: list[AdamWRun] = []  # the CUDA kernels' (or, on CPU masters, their reference's)
        # the pending factor, once per step: a device scalar for the kernels (no sync), a number for the host
        # kernel (one read, made only when some unit steps on the host)
        scale = {"inv_scale": multiplier} if isinstance(multiplier, float) else {"multiplier": multiplier.float()}
        host_mul: float | None = multiplier if isinstance(multiplier, float) else None
        stepped: list[tuple[FlatUnit, list[dict], float | None, bool]] = []
        device_counts: list[Tensor] = []
        skipped_on_host: bool | None = None  # the flag, read once a step by the host kernel's units (offloaded)
        for unit in units:
            pieces = unit.training.piece_tensors
            backend = self.backend(unit) if pieces else None
            states = [self.optimizer.state[t] for t in pieces]
            on_device = found_inf is not None and backend in ("cuda", "reference")
            if found_inf is not None and backend == "host" and skipped_on_host is None:
                skipped_on_host = bool(found_inf.item())  # offloaded: the flag is on the host already
            if backend is None or (backend == "host" and skipped_on_host) or any(t.grad is None for t in pieces):
                self._to_host_counts(unit, states)
                continue
            count = self._device_count(unit, states) if on_device else _shared_count(states)
            runs = self._runs(unit, group_of) if count is not None else None
            if runs is None:
                self._to_host_counts(unit, states)
                continue
            if on_device:
                device_counts.append(count)
            step = count if on_device else count + 1  # a device count is advanced before the launch reads it
            exp_avg, exp_avg_sq = self._flat_moments(unit, states)
            for lo, hi, group, lowp in runs:
                beta1, beta2 = group["betas"]
                hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"])
                hyper.update(weight_decay=group["weight_decay"], step=step if on_device else int(step))
                # what the optimizer would read (clipping by value acts on it), its moments and the master
                tensors = (
                    unit.training.master_view(lo, hi - lo),
                    unit.training.step_grad[lo:hi],
                    exp_avg[lo:hi],
                    exp_avg_sq[lo:hi],
                )
                if backend == "host":
                    host_mul = float(multiplier) if host_mul is None else host_mul
                    host_runs.append(AdamWRun(*tensors, grad_mul=host_mul, lowp_out=lowp, **hyper))
                else:
                    device_runs.append(AdamWRun(*tensors, lowp_out=lowp, **hyper))
            stepped.append((unit, states, None if on_device else step, all(lowp is not None for *_, lowp in runs)))
        if found_inf is not None and device_runs:
            scale["found_inf"] = (found_inf > 0).to(device_runs[0].param.device, torch.int32).reshape(())
        # both check their inputs before either steps anything: on an error nothing below has changed
        step_devices = plan_multi_adamw(device_runs, **scale)  # one launch for every CUDA run of the step
        host.adamw_step(host_runs)
        if device_counts:
            torch._foreach_add_(device_counts, 1.0 - scale["found_inf"].float())
        step_devices()
        for unit, states, step, params_written in stepped:
            for state, tensor in zip(states, unit.training.piece_tensors):
                if step is not None:
                    state["step"].fill_(step)
                tensor.grad = None
            if params_written:  # the post-step copy is done
                unit.training.mark_params_written()
            done.add(id(unit))
        return done

    def _device_count(self, unit: FlatUnit, states: list[dict]) -> Tensor | None:
        """The step count the unit's pieces share on the master's device (their states hold this one tensor),
        made from their host counts when they do not hold it yet; None if those differ."""
        count = self._counts.get(id(unit))
        if count is not None and all(s.get("step") is count for s in states):
            return count
        host_count = _shared_count(states)
        if host_count is None:
            return None
        count = torch.full(
            (), host_count, dtype=torch.float32, device=unit.training.master_view(0, 1).device
        )  # (no copy)
        for state in states:
            state["step"] = count
        self._counts[id(unit)] = count
        return count

    def _to_host_counts(self, unit: FlatUnit, states: list[dict]) -> None:
        """Gives each piece a host count of its own where they share the unit's device count, for the optimizer's
        own step (which would advance a shared one once per piece)."""
        count = self._counts.pop(id(unit), None)
        if count is not None:
            on_host = count.cpu()  # one read for the unit
            for state in states:
                if state.get("step") is count:
                    state["step"] = on_host.clone()

    def _flat_moments(self, unit: FlatUnit, states: list[dict]) -> tuple[Tensor, Tensor]:
        """The unit's flat moments, with every piece's state pointing into them (adopting what it held)."""
        master = unit.training.master_chunk(unit.layout.buckets[0])
        if id(unit) not in self._moments:
            zeros = torch.zeros(unit.layout.partition_numel, dtype=torch.float32, device=master.device)
            self._moments[id(unit)] = (zeros, zeros.clone())
        flat = self._moments[id(unit)]
        for piece, state in zip(unit.training.pieces, states):
            views = [m[piece.partition_offset : piece.partition_offset + piece.numel] for m in flat]
            for key, view in zip(("exp_avg", "exp_avg_sq"), views):
                held = state.get(key)
                if held is not None and held.data_ptr() != view.data_ptr():
                    view.copy_(held.reshape(-1))
                state[key] = view
            state.setdefault("step", torch.tensor(0.0))
        return flat


def _shared_count(states: list[dict]) -> float | None:
    """The host step count all of a unit's pieces have (0 for fresh ones), None if they differ."""
    counts = {_host_count(s) if s else 0.0 for s in states}
    return counts.pop() if len(counts) == 1 else None


def _host_count(state: dict) -> float:
    """A piece's step count, kept on the host: one brought on a device (FusedAdamW's counts under a GradScaler,
    from a checkpoint of a run without ZeRO) moves here once, rather than being read every step."""
    count = state["step"]
    if torch.is_tensor(count) and count.device.type != "cpu":
        state["step"] = count = count.cpu()
    return float(count)


def _stages_params(unit: FlatUnit) -> bool:
    """An offloaded unit whose 16-bit parameters live on the device (all but stage 3's host shards with
    ``offload_param``): the step writes their copy on the host, into ``staged_params``. Decided by where
    the configuration puts them, not by the device, so the CPU tests take the CUDA path's steps."""
    if unit.offload is None or unit.param_dtype == torch.float32 or unit.training.master is None:
        return False
    return unit.param_shard is None or not unit.offload.params


def _lowp_target(unit: FlatUnit, bucket, lo: int, hi: int) -> Tensor | None:
    """Where the step writes the 16-bit parameters of partition elements [lo, hi) (in ``bucket``'s chunk),
    if the parameters are 16-bit: an offloaded unit's staging buffer or host shard; else the shard (stage
    3) or the flat buffer's chunk (stages 1 and 2) when on the master's device."""
    if unit.param_dtype == torch.float32 or unit.training.master is None:
        return None
    if unit.offload is not None:
        if not _stages_params(unit):
            return unit.param_shard[lo:hi]
        return None if unit.training.staged_params is None else unit.training.staged_params[lo:hi]
    if unit.param_shard is not None:
        return unit.param_shard[lo:hi] if unit.param_shard.device == unit.training.master.device else None
    if unit.flat_param.device != unit.training.master.device:
        return None
    return unit.param_chunk(bucket)[lo - bucket.partition_offset : hi - bucket.partition_offset]
