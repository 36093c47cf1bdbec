"""The ``lightning-zero`` command.

- ``fit | validate | test | predict``: Lightning's CLI, with the ZeRO strategies registered and their
  options documented in ``--help`` as the ``--zero.*`` group (the stage comes from
  ``--trainer.strategy zero1|zero2|zero3``). ``--deepspeed_config ds_config.json`` reads a DeepSpeed
  config into the strategy, the precision and the Trainer's arguments. Any LightningModule and
  LightningDataModule can be named by class path; ``configs/`` trains the package's GPT.
- ``estimate``: per-rank memory of ddp / zero1 / zero2 / zero3 before a run.
- ``consolidate CKPT_DIR OUT``: a plain state dict from a sharded checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import lightning_zero  # noqa: F401  (registers the zero strategies)
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.format import CheckpointError
from lightning_zero.config import ZeroConfig
from lightning_zero.deepspeed_config import read_deepspeed_config
from lightning_zero.estimate import estimate, format_table, parse_bytes, shape_of_count, smallest_fitting
from lightning_zero.strategy import ZeroStrategy

ZERO_NAMES = ("zero1", "zero2", "zero3")


class ZeroCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(ZeroConfig, "zero", skip={"stage"}, instantiate=False)
        parser.add_argument(
            "--deepspeed_config",
            default=None,
            help="A DeepSpeed JSON config: sets trainer.strategy (zero<stage>), the zero options, the precision"
            " (fp16 with its loss scaling, or bf16), gradient clipping and accumulation, and data.batch_size.",
        )
        parser.add_argument(
            "--deepspeed_ignore",
            type=list[str],
            default=[],
            help="Top-level keys of the DeepSpeed config to drop on purpose, e.g. [optimizer, scheduler]",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("deepspeed_config"):
            _apply_deepspeed(config, config.deepspeed_config, tuple(config.deepspeed_ignore))

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = config.trainer.strategy
        if isinstance(strategy, str) and strategy in ZERO_NAMES:
            kwargs["strategy"] = ZeroStrategy(ZeroConfig(stage=int(strategy[-1]), **dict(config.zero)))
        return super().instantiate_trainer(**kwargs)


def _apply_deepspeed(config, path: str, ignore: tuple[str, ...]) -> None:
    settings = read_deepspeed_config(path, ignore=ignore)
    config.trainer.strategy = f"zero{settings.zero.stage}"
    config.zero = {k: v for k, v in dataclasses.asdict(settings.zero).items() if k != "stage"}
    if settings.precision == "16-mixed":
        scale = dataclasses.asdict(settings.loss_scale)
        plugin = {
            "class_path": "lightning_zero.ZeroPrecision",
            "init_args": {"precision": "16-mixed", "loss_scale": scale},
        }
        config.trainer.precision, config.trainer.plugins = None, [plugin]
    elif settings.precision is not None:
        config.trainer.precision = settings.precision
    if settings.gradient_clip_val is not None:
        config.trainer.gradient_clip_val = settings.gradient_clip_val
    if settings.accumulate_grad_batches is not None:
        config.trainer.accumulate_grad_batches = settings.accumulate_grad_batches
    if settings.micro_batch_size is not None:
        init_args = config.get("data", {}).get("init_args") if config.get("data") else None
        if init_args is None or "batch_size" not in init_args:
            raise ValueError(
                "the DeepSpeed config sets train_micro_batch_size_per_gpu, but the data module has no batch_size"
            )
        init_args.batch_size = settings.micro_batch_size
    rank_zero_info(f"lightning-zero: applied the DeepSpeed config {path}")


def consolidate_main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-zero consolidate",
        description="Write the plain fp32 state dict of a sharded checkpoint directory (streamed, parameter by"
        " parameter). The output loads with torch.load (or safetensors) and module.load_state_dict.",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory written by the ZeRO strategies")
    parser.add_argument("output", help="the output file: .pt, or .safetensors")
    parsed = parser.parse_args(args)
    try:
        out = consolidate(parsed.checkpoint, parsed.output)
    except CheckpointError as error:
        parser.exit(2, f"lightning-zero consolidate: error: {error}\n")
    print(f"wrote {out}")


def estimate_main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-zero estimate",
        description="Per-rank bytes of parameters, gradients and optimizer state (Adam) under ddp, zero1, zero2"
        " and zero3, as the strategies allocate them (padding included; activations not counted).",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=float, help="the number of trainable parameters, e.g. 1.3e9")
    model.add_argument("--model", help="a lightning-zero YAML config: its model is built on the meta device")
    parser.add_argument("--devices", type=int, default=1, help="devices (processes) per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument(
        "--device-memory", help="memory per device, e.g. 80GB or 80GiB: names the smallest stage that fits"
    )
    parsed = parser.parse_args(args)
    world = parsed.devices * parsed.nodes
    try:
        capacity = parse_bytes(parsed.device_memory) if parsed.device_memory else None
    except ValueError as error:
        parser.error(str(error))
    if parsed.params is not None:
        shape, config = shape_of_count(int(parsed.params)), ZeroConfig()
    else:
        from lightning_zero.estimate_model import shape_of_config

        shape, config = shape_of_config(parsed.model)
    table = estimate(shape, world, parsed.precision, config)
    print(
        f"{shape.psi:,} trainable parameters on {world} ranks ({parsed.devices} per node x {parsed.nodes} nodes),"
        f" precision {parsed.precision}; per rank (the rank that needs the most), GiB:"
    )
    print(format_table(table, capacity))
    if capacity is not None:
        fitting = smallest_fitting(table, capacity)
        verdict = f"the smallest stage that fits: {fitting}" if fitting else "none fits: add devices or nodes"
        print(f"{parsed.device_memory} per device ({capacity:,} bytes), activations not counted: {verdict}")


def main(args: list[str] | None = None) -> None:
    args = sys.argv[1:] if args is None else args
    commands = {"consolidate": consolidate_main, "estimate": estimate_main}
    if args[:1] and args[0] in commands:
        commands[args[0]](args[1:])
        return
    if args[:1] in (["-h"], ["--help"]):
        print(
            "lightning-zero: fit | validate | test | predict (Lightning's CLI, below), estimate, consolidate\n"
            "  lightning-zero estimate --help     memory per rank for ddp / zero1 / zero2 / zero3\n"
            "  lightning-zero consolidate --help  a plain state dict from a sharded checkpoint\n"
        )
    ZeroCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
