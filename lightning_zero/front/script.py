"""``lightning_zero.initialize``: ZeRO in a plain PyTorch training script launched by torchrun, as
``deepspeed.initialize`` gives it (the third front door of the engine, after the Trainer and Fabric).

    engine = lightning_zero.initialize(model, optimizer, ZeroConfig(stage=2), precision="bf16-mixed")
    for x, y in loader:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()                        # the optimizer's step, then its zero_grad
    engine.save("ckpt", step=step)           # collective; engine.load("ckpt") -> {"step": ...}
    engine.close()                           # every rank done: the process group goes

A model that needs the process group to be built (sequence parallelism: ``ZeroConfig(sequence_parallel_size=K)``,
the GPT built with its groups) starts it first, as ``deepspeed.init_distributed`` does:

    session = lightning_zero.init_distributed(ZeroConfig(stage=3, sequence_parallel_size=2))
    model = GPT(cfg, sequence=session.sequence_parallel)
    sampler = DistributedSampler(data, **session.sampler_kwargs)   # the ranks of a group read the same samples
    engine = session.initialize(model, torch.optim.AdamW(model.parameters()))

Under the hood it is Fabric with ``ZeroFabricStrategy`` (fabric.py), set up from torchrun's environment:
the process group, the device of this local rank, and the same sharded checkpoints as the Trainer's.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric import Fabric
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.front.fabric import ZeroFabricStrategy
from lightning_zero.sequence.parallel import SequenceParallel


class ScriptEngine:
    """The model and optimizer of a plain PyTorch script, sharded: what ``initialize`` returns, as
    ``deepspeed.initialize`` returns its engine. Call it as the model (``engine(x)``: a training forward when
    gradients are enabled), then ``backward``, ``clip_grad_norm_`` if wanted, and ``step``; ``no_sync`` around
    the micro-batches before a step's last. Every method that communicates is collective: call it on every rank.
    It runs on Lightning Fabric with ``ZeroFabricStrategy``; ``initialize`` makes it, not user code.

    Args:
        fabric: the launched Fabric whose strategy is a ``ZeroFabricStrategy``.
        module: the model as ``fabric.setup`` returned it.
        optimizer: the optimizer as ``fabric.setup`` returned it.

    Raises:
        RuntimeError: ``clip_grad_norm_`` on a non-finite gradient norm; under "16-mixed", ``step`` when gradients
            still overflow at the minimum loss scale (``LossScaleConfig(raise_at_min_scale=True)``, the default).
        CheckpointError: ``save`` or ``load`` of a checkpoint that cannot be written or read (one line, every rank).
        KeyError: ``load`` of a checkpoint without this optimizer's state (one saved with the weights alone).

    Example:
        ```python
        engine = lightning_zero.initialize(model, optimizer, ZeroConfig(stage=2), precision="bf16-mixed")
        for x, y in loader:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        engine.save("ckpt", epoch=1)
        engine.close()
        ```
    """

    def __init__(self, fabric: Fabric, module: Module, optimizer: Any) -> None:
        self.fabric, self.module, self.optimizer = fabric, module, optimizer
        self.rank, self.world_size, self.device = fabric.global_rank, fabric.world_size, fabric.device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: Tensor) -> None:
        """Runs backward from ``loss`` (scaled by the loss scale under "16-mixed"); the gradients are reduced across
        the ranks as they complete (stage 1: in the backward of a step's last micro-batch). Collective.

        Args:
            loss: the scalar loss of this rank's micro-batch.
        """
        self.fabric.backward(loss)

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """For the micro-batches before a step's last (gradient accumulation): ``with engine.no_sync():
        engine.backward(loss)``; stage 1 then only accumulates the gradients locally."""
        with self.fabric.no_backward_sync(self.module, enabled=True):
            yield

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clips the step's gradients to a global L2 norm of ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``
        over the whole (unsharded) model. Call it after ``backward`` and before ``step``. Collective.

        Args:
            max_norm: the largest global L2 norm the gradients keep.

        Returns:
            The global L2 norm of the gradients before clipping (a scalar tensor).

        Raises:
            RuntimeError: the norm is not finite (inf or nan).
        """
        return self.fabric.clip_gradients(self.module, self.optimizer, max_norm=max_norm)

    def step(self) -> None:
        """The optimizer's step, then its ``zero_grad``. Under "16-mixed" a step whose gradients overflowed on any
        rank is skipped on every rank and the loss scale backs off. Collective.

        Raises:
            LossScaleAtMinimumError: (a RuntimeError) under "16-mixed", gradients still overflow at the minimum
                loss scale, with ``LossScaleConfig(raise_at_min_scale=True)`` (the default; else a warning).
        """
        self.optimizer.step()
        self.optimizer.zero_grad()

    def train(self, mode: bool = True) -> ScriptEngine:
        """Sets the model's training mode, as ``nn.Module.train``.

        Args:
            mode: True for training mode, False for evaluation mode.

        Returns:
            This engine.
        """
        self.module.train(mode)
        return self

    def eval(self) -> ScriptEngine:
        """Sets the model to evaluation mode, as ``nn.Module.eval``; returns this engine."""
        return self.train(False)

    def state_dict(self) -> dict[str, Tensor]:
        """The whole model's state dict on every rank (fp32 masters where training is mixed). Collective.

        Returns:
            The state dict, each tensor whole.
        """
        return self.fabric.strategy.get_module_state_dict(self.module)

    def save(self, path: str | os.PathLike, **extra: Any) -> None:
        """A sharded checkpoint directory: the model, the optimizer and ``extra`` (plain values). This door's own
        state is that dict; Fabric's strategy adds the keys a Trainer resumes from and ``ZeroEngine.save`` the rest.
        The Trainer, ``load``, ``consolidate`` and the exports read it at any world size and stage. Collective.

        Args:
            path: the checkpoint directory to write (one that is a checkpoint already is replaced).
            **extra: plain values to keep with it (numbers, strings, tensors and containers of them, which
                ``load`` unpickles safely), returned by ``load``.

        Raises:
            CheckpointError: the save failed (or, with ``ZeroConfig(async_save=True)``, an earlier one did), or
                ``path`` exists and is neither a checkpoint nor an empty directory; the same one line on every rank.
        """
        self.fabric.save(Path(path), {"model": self.module, "optimizer": self.optimizer, **extra})

    def close(self) -> None:
        """The script's end: every rank waits for the others, then the process group is destroyed. A rank that
        exits while another still talks to it can abort in gloo's threads ("terminate called without an active
        exception", also in a script of torch.distributed alone)."""
        self.fabric.barrier()
        if dist.is_initialized():
            dist.destroy_process_group()

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Restores the model and optimizer from a checkpoint of this engine, Fabric's or the Trainer's (any world
        size and stage; through Fabric's strategy and ``ZeroEngine.load``); returns its other entries. Collective.

        Args:
            path: the checkpoint (a directory of ours, a plain Lightning file or a DCP directory).

        Returns:
            The checkpoint's other entries: what ``save`` was given as ``extra``.

        Raises:
            CheckpointError: the checkpoint is missing, incomplete, damaged or does not fit the model, or holds
                objects safe unpickling refuses; the same one line on every rank.
            KeyError: the checkpoint holds no state for the optimizer (saved with the weights alone).
        """
        return self.fabric.load(Path(path), {"model": self.module, "optimizer": self.optimizer})


class Session:
    """The process group this script's ranks share, before the model is sharded: what ``init_distributed``
    returns (not made by user code), for a model that needs the groups to be built (sequence parallelism).

    Args:
        fabric: the launched Fabric whose strategy is a ``ZeroFabricStrategy``.

    Raises:
        ValueError: ``initialize`` of a model or optimizer the engine cannot shard (the message says why).
    """

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric

    @property
    def sequence_parallel(self) -> SequenceParallel | None:
        """This rank's sequence-parallel group (``ZeroConfig.sequence_parallel_size``), or None."""
        return self.fabric.strategy.sequence_parallel

    @property
    def sampler_kwargs(self) -> dict[str, int]:
        """A ``DistributedSampler``'s ``num_replicas`` and ``rank``: the data-parallel replicas (every rank of a
        sequence-parallel group reads its replica's samples)."""
        return self.fabric.strategy.distributed_sampler_kwargs

    def initialize(self, model: Module, optimizer: Optimizer) -> ScriptEngine:
        """Shards ``model`` and ``optimizer`` (collective: every rank calls it).

        Args:
            model: the model, built on every rank alike (with this session's ``sequence_parallel`` if it takes one).
            optimizer: its optimizer, over ``model``'s parameters.

        Returns:
            The engine that trains them.

        Raises:
            ValueError: a model or optimizer the engine cannot shard (the message says why).
        """
        module, optimizer = self.fabric.setup(model, optimizer)
        return ScriptEngine(self.fabric, module, optimizer)


def init_distributed(
    config: ZeroConfig | None = None, *, precision: str = "32-true", accelerator: str = "auto"
) -> Session:
    """Joins the ranks torchrun started (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``; one process alone without
    them) under ``config`` (``ZeroConfig()``, stage 2, by default) in ``precision`` ("32-true", "bf16-mixed" or
    "16-mixed"): the process group and ``config``'s groups, before the model is built. Collective. Use it, as
    ``deepspeed.init_distributed``, when the model needs the groups to be built; else ``initialize`` does both.

    Args:
        config: the typed configuration; ``ZeroConfig()`` by default.
        precision: "32-true", "bf16-mixed" or "16-mixed".
        accelerator: Fabric's accelerator ("auto", "cuda", "cpu").

    Returns:
        The session, whose ``initialize`` shards the model.

    Raises:
        TypeError: ``config`` is not a ``ZeroConfig``.
        ValueError: a precision or accelerator that is not supported, or a group size (``shard_group_size``,
            ``sequence_parallel_size``, ``node_size``) that does not divide the world, or an unusable ``nvme_path``.
        RuntimeError: the accelerator asked for is not available on this machine.

    Example:
        ```python
        session = lightning_zero.init_distributed(ZeroConfig(stage=3, sequence_parallel_size=2))
        model = GPT(cfg, sequence=session.sequence_parallel)
        engine = session.initialize(model, torch.optim.AdamW(model.parameters()))
        ```
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))  # (one node without it)
    nodes = max(1, int(os.environ.get("WORLD_SIZE", str(local))) // local)
    strategy = ZeroFabricStrategy(config if config is not None else ZeroConfig())
    fabric = Fabric(strategy=strategy, accelerator=accelerator, devices=local, num_nodes=nodes, precision=precision)
    fabric.launch()
    return Session(fabric)


def initialize(
    model: Module,
    optimizer: Optimizer,
    config: ZeroConfig | None = None,
    *,
    precision: str = "32-true",
    accelerator: str = "auto",
) -> ScriptEngine:
    """Shards ``model`` and ``optimizer`` over the ranks torchrun started under ``config`` in ``precision`` (see
    ``init_distributed``): ``init_distributed(...).initialize(model, optimizer)``. Collective. ZeRO in a plain
    PyTorch script, as ``deepspeed.initialize`` gives it.

    Args:
        model: the model, built on every rank alike.
        optimizer: its optimizer, over ``model``'s parameters.
        config: the typed configuration; ``ZeroConfig()`` (stage 2) by default.
        precision: "32-true", "bf16-mixed" or "16-mixed".
        accelerator: Fabric's accelerator ("auto", "cuda", "cpu").

    Returns:
        The engine that trains them (``engine(x)``, ``engine.backward(loss)``, ``engine.step()``).

    Raises:
        TypeError: ``config`` is not a ``ZeroConfig``.
        ValueError: a precision or accelerator that is not supported, a group size that does not divide the world,
            or a model or optimizer the engine cannot shard (the message says why).
        RuntimeError: the accelerator asked for is not available on this machine.

    Example:
        ```python
        engine = lightning_zero.initialize(model, optimizer, ZeroConfig(stage=2), precision="bf16-mixed")
        ```
    """
    return init_distributed(config, precision=precision, accelerator=accelerator).initialize(model, optimizer)
