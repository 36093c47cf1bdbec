"""The ``lightning-zero`` command.

- ``fit | validate | test | predict``: Lightning's CLI, with the ZeRO strategies registered and their
  options documented in ``--help`` as the ``--zero.*`` group (the stage comes from
  ``--trainer.strategy zero1|zero2|zero3``). ``--deepspeed_config ds_config.json`` reads a DeepSpeed
  config into the strategy, the precision and the Trainer's arguments. Any LightningModule and
  LightningDataModule can be named by class path; ``configs/`` trains the package's GPT.
- ``estimate``: per-rank memory of ddp / zero1 / zero2 / zero3 before a run.
- ``consolidate CKPT_DIR OUT``: the fp32 weights of a sharded checkpoint, as a Lightning checkpoint (``.ckpt``,
  for ``load_from_checkpoint``) or a plain state dict (``.pt``, ``.safetensors``) (``--trust-pickles``: only
  for a checkpoint you trust, whose Lightning state safe loading refuses); with ``--hf`` a Hugging Face
  directory, with ``--dcp`` a torch.distributed.checkpoint directory for FSDP2.
- ``convert-deepspeed DS_DIR OUT.ckpt``: a DeepSpeed ZeRO checkpoint as a plain Lightning
  checkpoint file, to resume from under any stage (migration in).

Bad input (a config value, an argument, a DeepSpeed config, a checkpoint) is answered with one line,
``lightning-zero <command>: error: <what is wrong and what is allowed>``, and exit code 2, before any
process is launched or any file written; ``--debug`` (or ``LIGHTNING_ZERO_DEBUG=1``) raises it with its
traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import sys
import warnings
from argparse import ArgumentError
from pathlib import Path

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import lightning_zero  # noqa: F401  (registers the zero strategies)
from lightning_zero.activations.checkpointing import checkpointed_blocks
from lightning_zero.checkpoint.atomic import check_not_a_link
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.dcp_export import export_dcp
from lightning_zero.checkpoint.deepspeed_import import convert as convert_deepspeed
from lightning_zero.checkpoint.format import (
    CheckpointError,
    UnsafePickleError,
    check_files,
    read_metadata,
    unsafe_pickle_error,
)
from lightning_zero.checkpoint.hugging_face import export_hugging_face
from lightning_zero.cli.args import InputError, Parser
from lightning_zero.cli.estimate import estimate_main
from lightning_zero.config import ZeroConfig, stage_of_strategy
from lightning_zero.deepspeed_config import read_deepspeed_config
from lightning_zero.front.strategy import ZeroStrategy
from lightning_zero.sequence.ulysses import check_heads, declared_heads

DEBUG_ENV = "LIGHTNING_ZERO_DEBUG"
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
# What bad input raises while a command is set up (parsed, validated, its Trainer built): one line.
SETUP_ERRORS = (ArgumentError, ValueError, TypeError, OSError, CheckpointError, MisconfigurationException)


@contextlib.contextmanager
def _setup_errors_are_input_errors():
    try:
        yield
    except SETUP_ERRORS as error:
        raise InputError(str(error)) from error


class ZeroCLI(LightningCLI):
    """Lightning's CLI with the ``--zero.*`` options and ``--deepspeed_config``, which checks its input before
    anything is built or launched and trains with a ZeroStrategy when ``--trainer.strategy`` names a stage."""

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        # A parse error raises instead of printing the usage block: main() reports it in one line.
        return super().init_parser(exit_on_error=False, **kwargs)

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

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        # Everything checkable without building anything is checked here: before the seed is set, the
        # model built or rank 1 launched (it re-runs this command only once rank 0 is past this point).
        with _setup_errors_are_input_errors():
            try:
                super().parse_arguments(parser, args)
            except ArgumentError as error:
                if "zero.stage" not in str(error):
                    raise
                raise ValueError(f"{error} (the stage is chosen with --trainer.strategy zero1|zero2|zero3)") from None
            config = self.config[self.config.subcommand] if self.config.get("subcommand") else self.config
            if config.get("deepspeed_config"):
                _apply_deepspeed(config, config.deepspeed_config, tuple(config.deepspeed_ignore))
            stage = stage_of_strategy(config.trainer.strategy)
            self.zero_config = None if stage is None else ZeroConfig(stage=stage, **dict(config.zero))
            _check_sequence_parallel(self.zero_config, config.trainer)
            if stage is not None and config.get("ckpt_path"):
                _check_checkpoint(str(config.ckpt_path))

    def _parse_ckpt_path(self) -> None:
        # Lightning reads a single-file checkpoint's hyper-parameters here (safely): its refusal or a file
        # that does not load is bad input too.
        try:
            super()._parse_ckpt_path()
        except pickle.UnpicklingError as error:  # (Lightning loads it with weights_only=True whatever we say)
            ckpt_path = Path(self.config[self.config.subcommand].get("ckpt_path"))
            refused = str(unsafe_pickle_error(ckpt_path, error)).partition("; only if you trust")[0]
            raise InputError(
                f"{refused}; Lightning's CLI reads a checkpoint file's hyper-parameters safely, whatever"
                " --weights_only says: resume from Python, with torch.serialization.add_safe_globals([the classes"
                " named]), if you trust it"
            ) from error
        except (RuntimeError, EOFError) as error:
            ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
            raise InputError(f"{ckpt_path}: not a readable checkpoint file: {str(error).splitlines()[0]}") from error

    def instantiate_classes(self) -> None:
        with _setup_errors_are_input_errors():  # Lightning's and the modules' own checks of their arguments
            super().instantiate_classes()
            built = next(self.model.parameters(), None) is not None  # (else built in configure_model, on each rank)
            if self.zero_config is not None and self.zero_config.activation_checkpointing != "none" and built:
                checkpointed_blocks(self.model, self.zero_config)
            if self.zero_config is not None and self.zero_config.sequence_parallel_size > 1:
                for heads, kv_heads, repeat in declared_heads(self.model):  # (before rank 1 is launched)
                    check_heads(heads, kv_heads, self.zero_config.sequence_parallel_size, repeat=repeat)

    def instantiate_trainer(self, **kwargs) -> pl.Trainer:
        if self.zero_config is not None:
            kwargs["strategy"] = ZeroStrategy(self.zero_config)
        return super().instantiate_trainer(**kwargs)


def _check_sequence_parallel(zero: ZeroConfig | None, trainer: dict) -> None:
    """``zero.sequence_parallel_size`` divides the world of the Trainer's devices and nodes, where both are numbers."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, str) and devices.isdigit():  # (``--trainer.devices 2`` arrives as a string)
        devices = int(devices)
    if zero is None or not isinstance(devices, int) or not isinstance(nodes, int):
        return
    if (devices * nodes) % zero.sequence_parallel_size:
        raise ValueError(
            f"zero.sequence_parallel_size must divide the {devices * nodes} ranks (trainer.devices x"
            f" trainer.num_nodes), got {zero.sequence_parallel_size}"
        )


def _check_checkpoint(ckpt_path: str) -> None:
    """A sharded checkpoint's metadata and file sizes (cheap; loading checks the hashes on every rank).
    Lightning's own names ("last", "best", ...) and single-file checkpoints are Lightning's to resolve."""
    path = Path(ckpt_path)
    if ckpt_path.split(":", 1)[0] in ("last", "best", "hpc", "registry") or path.is_file():
        return
    meta = read_metadata(path)
    check_files(path, meta, checksum=False)


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


def _checkpoint_command(
    args: list[str], *, prog: str, description: str, source: str, output: str, trust: str, run, flags=None, options=None
):
    """consolidate and convert-deepspeed: a checkpoint in, a file out, ``--trust-pickles``; a CheckpointError
    is bad input. ``run(source, output, trust_pickles, **flags, **options)`` returns the line to print;
    ``flags``: more switches, ``options``: more options with a value (name -> help)."""
    parser = Parser(prog=prog, description=description)
    parser.add_argument("source", help=source)
    parser.add_argument("output", help=output)
    parser.add_argument("--trust-pickles", action="store_true", help=trust)
    for name, help_text in (flags or {}).items():
        parser.add_argument(f"--{name}", action="store_true", help=help_text)
    for name, help_text in (options or {}).items():
        parser.add_argument(f"--{name.replace('_', '-')}", default="", help=help_text)
    parsed = parser.parse_args(args)
    try:
        check_not_a_link(Path(parsed.output))  # (before any work: what writes the output refuses a link too)
        switches = {name: getattr(parsed, name) for name in [*(flags or {}), *(options or {})]}
        print(run(parsed.source, parsed.output, parsed.trust_pickles, **switches))
    except CheckpointError as error:
        raise InputError(str(error)) from error


def consolidate_main(args: list[str]) -> None:
    """``lightning-zero consolidate``: parses ``args`` (the arguments after the command's name), writes the export
    and prints its path; a CheckpointError is raised as an InputError."""
    _checkpoint_command(
        args,
        prog="lightning-zero consolidate",
        description="Write the fp32 weights of a sharded checkpoint directory (streamed, parameter by parameter):"
        " a .ckpt loads with MyModule.load_from_checkpoint (hyper-parameters included), a .pt with torch.load and"
        " module.load_state_dict, a .safetensors with safetensors; with --hf a new directory as Hugging Face's"
        " save_pretrained writes it (config.json, sharded safetensors with their index); with --dcp a new"
        " torch.distributed.checkpoint directory, weights and optimizer state, that FSDP2 loads at any world size.",
        source="a checkpoint directory written by the ZeRO strategies",
        output="the output file: .ckpt (a Lightning checkpoint), .pt, or .safetensors; with --hf or --dcp a new"
        " directory",
        trust="unpickle the checkpoint's Lightning state (lightning.pt) without restrictions (weights_only=False),"
        " as checkpoints of older versions may need. Unpickling can run any code: only for a checkpoint you trust.",
        run=_consolidate,
        flags={
            "hf": "export the LightningModule's Hugging Face model for AutoModel*.from_pretrained(OUTPUT)",
            "dcp": "export as torch.distributed.checkpoint, {'model': ..., 'optim': ...} as get_state_dict returns"
            " them, for dcp.load in an FSDP2 job",
        },
        options={
            "strip_prefix": "with --dcp: remove this prefix from every name, e.g. 'model.' when the"
            " LightningModule holds the FSDP2 job's module as self.model"
        },  # fmt: skip
    )


def _consolidate(source: str, output: str, trust: bool, *, hf: bool, dcp: bool, strip_prefix: str) -> str:
    if hf and dcp:
        raise CheckpointError("--hf and --dcp: choose one export")
    if strip_prefix and not dcp:
        raise CheckpointError(f"--strip-prefix {strip_prefix!r}: only with --dcp")
    if dcp:
        return f"wrote {export_dcp(source, output, strip_prefix=strip_prefix, weights_only=not trust)}"
    if hf:
        return f"wrote {export_hugging_face(source, output, weights_only=not trust)}"
    return f"wrote {consolidate(source, output, weights_only=not trust)}"


def convert_deepspeed_main(args: list[str]) -> None:
    """``lightning-zero convert-deepspeed``: parses ``args`` (the arguments after the command's name), converts the
    DeepSpeed checkpoint and prints its summary; a CheckpointError is raised as an InputError."""
    _checkpoint_command(
        args,
        prog="lightning-zero convert-deepspeed",
        description="Convert a DeepSpeed ZeRO stage 1/2/3 checkpoint (engine.save_checkpoint, or Lightning's"
        " DeepSpeedStrategy) into a plain Lightning checkpoint file, which the ZeRO strategies resume from at"
        " any stage and world size: fp32 weights, the optimizer's state where the layout allows, Lightning's"
        " loops and schedulers when DeepSpeedStrategy saved them.",
        source="DeepSpeed's save directory (with 'latest') or one tag directory in it",
        output="the checkpoint file to write, e.g. converted.ckpt",
        trust="unpickle DeepSpeed's files without restrictions, for one that safe loading refuses (it allows"
        " tensors, containers and DeepSpeed's own classes; the error names what it refused). Unpickling can run"
        " any code: only for a checkpoint you trust.",
        run=lambda source, output, trust: convert_deepspeed(source, output, trust_pickles=trust),
    )


OWN_COMMANDS = {
    "consolidate": consolidate_main,
    "convert-deepspeed": convert_deepspeed_main,
    "estimate": estimate_main,
}


def _run(argv: list[str], cli_args: list[str] | None) -> None:
    if argv[:1] and argv[0] in OWN_COMMANDS:
        OWN_COMMANDS[argv[0]](argv[1:])
        return
    if argv[:1] in (["-h"], ["--help"]):
        print(
            "lightning-zero: fit | validate | test | predict (Lightning's CLI, below), estimate, consolidate,"
            " convert-deepspeed\n"
            "  lightning-zero estimate --help           memory per rank for ddp / zero1 / zero2 / zero3\n"
            "  lightning-zero consolidate --help        the weights of a sharded checkpoint, for inference\n"
            "  lightning-zero convert-deepspeed --help  a DeepSpeed ZeRO checkpoint as a Lightning one\n"
            "  --debug (or LIGHTNING_ZERO_DEBUG=1) shows the traceback of an error about bad input\n"
        )
    ZeroCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=cli_args,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


def main(args: list[str] | None = None) -> None:
    """The ``lightning-zero`` console script, or the same in-process with ``main([...])``.

    Runs ``fit | validate | test | predict`` (Lightning's CLI), ``estimate``, ``consolidate`` or
    ``convert-deepspeed`` (see the module's docstring). ``--debug`` anywhere in the arguments (or
    ``LIGHTNING_ZERO_DEBUG=1``) raises bad input with its traceback instead of reporting it in one line.

    Args:
        args: The arguments after the program's name; None reads them from ``sys.argv``.

    Raises:
        SystemExit: With code 2 on bad input (an argument, a config, a checkpoint), after rank 0 printed
            ``lightning-zero <command>: error: ...`` to stderr; with code 0 after a command's ``--help``.
    """
    argv = sys.argv[1:] if args is None else list(args)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV) == "1"
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        if args is None:  # rank 1 re-runs sys.argv: it learns about --debug from the environment
            sys.argv[1:] = argv
            os.environ[DEBUG_ENV] = "1"
    # Lightning 2.6's pytree helper (lightning/pytorch/utilities/_pytree.py) builds a LeafSpec, which torch
    # 2.13 deprecates with a FutureWarning on each rank: nothing a user can act on. Filtered by its message
    # and Lightning's module only.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    command = argv[0] if argv[:1] and argv[0] in (*LIGHTNING_COMMANDS, *OWN_COMMANDS) else None
    try:
        # LightningCLI reads the command line itself when given None; given a list it warns that the two
        # may disagree, which is only meant for calls from Python.
        _run(argv, None if args is None else argv)
    except (InputError, CheckpointError) as error:  # CheckpointError: also from loading one in fit --ckpt_path
        if debug:
            raise
        if rank_zero_only.rank == 0:  # every rank has the same error: rank 0 reports it
            unsafe = isinstance(error, UnsafePickleError) or isinstance(error.__cause__, UnsafePickleError)
            print(_one_line(command, str(error), unsafe), file=sys.stderr)
        raise SystemExit(2) from None


def _one_line(command: str | None, message: str, unsafe_pickle: bool) -> str:
    message = " ".join(message.split())
    if unsafe_pickle and command:  # safe loading refused an object: this command's switch
        message += f"; here: {'--trust-pickles' if command == 'consolidate' else '--weights_only false'}"
    return f"lightning-zero{f' {command}' if command else ''}: error: {message}"


if __name__ == "__main__":
    main()
