"""From a model and the user's optimizers to flat units (stages 1 and 2), one gradient reducer and ZeroOptimizers."""

from __future__ import annotations

from collections.abc import Sequence

from torch.nn import Module, Parameter
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.sharding import collectives
from lightning_zero.sharding.backward_end import BackwardEnd
from lightning_zero.sharding.flat_unit import FlatUnit
from lightning_zero.sharding.grad_reduce import GradReducer, ReduceSettings
from lightning_zero.sharding.layout import build_layout
from lightning_zero.sharding.optimizer_check import check_elementwise
from lightning_zero.sharding.param_gather import ParamGathers, runs_compiled_code
from lightning_zero.sharding.step_state import StepState
from lightning_zero.sharding.topology import Topology
from lightning_zero.sharding.unit_set import ParamActivation
from lightning_zero.sharding.zero_optimizer import ZeroOptimizer


def check_optimizer_params(model: Module, optimizers: Sequence[Optimizer], *, rank: int, group=None) -> dict:
    """Raises, before anything is modified, if a parameter sits in two groups, if a trainable parameter
    is in no optimizer, or if the ranks disagree about the parameters (which would hang collectives).
    Returns the module's parameter names."""
    names = {p: n for n, p in model.named_parameters(remove_duplicate=True)}
    group_params = [list(g["params"]) for opt in optimizers for g in opt.param_groups]
    seen: dict = {}
    for params in group_params:
        for p in params:
            if p not in names:
                raise ValueError(
                    f"an optimizer holds a parameter of shape {tuple(p.shape)} that is not a parameter of the"
                    " LightningModule; only the module's own parameters can be sharded"
                )
            if p in seen:
                raise ValueError(f"parameter {names[p]!r} appears in more than one optimizer param group")
            seen[p] = True
    orphans = [n for p, n in names.items() if p.requires_grad and p not in seen]
    if orphans:
        raise ValueError(
            f"parameters {orphans} require grad but are in no optimizer param group; add them to an optimizer"
            " or set requires_grad=False"
        )
    signature = [[(names[p], tuple(p.shape), str(p.dtype), p.requires_grad) for p in params] for params in group_params]
    for r, other in enumerate(collectives.all_gather_object(signature, group=group)):
        if other != signature:
            raise RuntimeError(
                f"rank {rank} and rank {r} see different optimizer parameters (names, shapes, dtypes or order);"
                " build param groups from lists in module order, not from sets"
            )
    return names


def units_per_param_group(
    optimizers: Sequence[Optimizer], names: dict, config: ZeroConfig, *, rank: int, world_size: int
) -> list[FlatUnit]:
    """Stages 1 and 2: one unit per param group, over its trainable parameters."""
    units = []
    for opt in optimizers:
        for param_group in opt.param_groups:
            trainable = [p for p in param_group["params"] if p.requires_grad]
            if trainable:
                layout = build_layout([p.numel() for p in trainable], world_size, config.reduce_bucket_size)
                names_ = [names[p] for p in trainable]
                options = config.unit_options(trainable[0].dtype)
                units.append(FlatUnit(trainable, names_, layout, rank, full_grad=config.stage == 1, **options))
    return units


def check_units_follow_optimizers(optimizers: Sequence[Optimizer], units: Sequence[FlatUnit]) -> None:
    """Raises, before anything is built, if an optimizer cannot be wrapped or a unit is split across optimizers."""
    for optimizer in optimizers:
        check_elementwise(optimizer)
    holder = {id(p): k for k, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]}
    for unit in units:
        owners = {holder[id(p)] for p in unit.params}
        if len(owners) > 1:
            raise ValueError(
                f"the parameters of one unit ({unit.names[0]}, ...) are split across optimizers {sorted(owners)};"
                " with stage 3 every unit's parameters must be stepped by one optimizer"
            )


def make_reducer(
    units: Sequence[FlatUnit],
    params: Sequence[Parameter],  # the module's parameters, in module order
    config: ZeroConfig,
    *,
    step: StepState,
    backward_end: BackwardEnd,
    model: Module,
    topology: Topology,
    gathers: ParamGathers | None = None,
    marks_micro_batches: bool = True,
) -> GradReducer:
    """The gradient reducer of ``units`` (see grad_reduce.py), communicating on ``topology``'s groups."""
    world_size = topology.shard_size
    settings = ReduceSettings(
        stage=config.stage,
        world_size=world_size,
        overlap=config.overlap_comm,
        max_inflight_bytes=config.max_inflight_bytes,
        coalesce_numel=config.reduce_bucket_size if config.stage == 3 else 0,
        group=topology.shard_group,
        host_world=topology.host_world,
        average_over=world_size * topology.replicas,
        two_level=_two_level(config, topology),
    )
    position = {p: i for i, p in enumerate(params)}
    options = {"model": model, "marks_micro_batches": marks_micro_batches, "gathers": gathers}
    return GradReducer(units, position, settings, step=step, backward_end=backward_end, **options)


def replicated_training(
    module: Module,
    optimizers: Sequence[Optimizer],
    names: dict,
    config: ZeroConfig,
    topology: Topology,
    *,
    step: StepState,
    backward_end: BackwardEnd,
    marks_micro_batches: bool,
) -> tuple[list[FlatUnit], ParamGathers | None, GradReducer]:
    """Stages 1 and 2: a unit per param group, their post-step gathers (param_gather.py) and their reducer."""
    units = units_per_param_group(optimizers, names, config, rank=topology.shard_rank, world_size=topology.shard_size)
    check_units_follow_optimizers(optimizers, units)
    gathers = None
    if config.stage < 3:  # (not a stage-3 module made whole by gather_module: its runs gather nothing after a step)
        # torch.compile would trace the post-step gathers' overlapping mode and recompile as it comes and goes
        overlap = config.overlap_param_gather and not runs_compiled_code(module)
        gathers = ParamGathers(units, overlap=overlap, group=topology.shard_group)
    reducer = make_reducer(
        units, list(names), config, step=step, backward_end=backward_end, model=module, topology=topology,
        gathers=gathers, marks_micro_batches=marks_micro_batches,
    )  # fmt: skip
    return units, gathers, reducer


def wrap_optimizers(
    optimizers: Sequence[Optimizer],
    units: Sequence[FlatUnit],
    names: dict,  # parameter -> name, in module order (as check_optimizer_params returns them)
    reducer: GradReducer,
    *,
    config: ZeroConfig,
    topology: Topology,
    gathers: ParamGathers | None = None,
    activation: ParamActivation | None = None,
) -> list[ZeroOptimizer]:
    """A ZeroOptimizer around each user optimizer, stepping ``units``' pieces (stages 1 and 2: spread by
    ``gathers`` after a step). ``activation``: gives parameters added later (``add_param_group``) their units."""
    locate = {p: (u, i) for u in units for i, p in enumerate(u.params)}
    options = {"gathers": gathers, "fused_step": config.fused_step, "topology": topology, "activation": activation}
    return [ZeroOptimizer(opt, locate, names, reducer, **options) for opt in optimizers]


def _two_level(config: ZeroConfig, topology: Topology) -> dict | None:
    """ZeRO++'s quantized gradients over more than one node (on one node there is nothing to cross)."""
    if not config.quantized_gradients or topology.cross_group is None:
        return None
    return {
        "node_size": topology.node_size,
        "node_group": topology.node_group,
        "cross_group": topology.cross_group,
        "block": config.quantization_block_size,
        "bits": config.quantized_gradient_bits,
    }
