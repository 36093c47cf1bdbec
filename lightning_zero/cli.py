"""The ``lightning-zero`` command: Lightning's CLI (fit / validate / test / predict) with the ZeRO
strategies registered, so ``trainer.strategy: zero2`` or a ``ZeroStrategy`` with its ``ZeroConfig``
can be written in the YAML. Any LightningModule and LightningDataModule can be named by class path;
the configs in ``configs/`` train the package's GPT on its synthetic language."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_zero  # noqa: F401  (registers zero1 / zero2)


def main(args: list[str] | None = None) -> None:
    LightningCLI(
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
