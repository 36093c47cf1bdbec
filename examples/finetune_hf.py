"""LoRA fine-tuning of a Hugging Face causal LM with ZeRO-3 on N processes (CPU by default).

The model is built in ``configure_model``, so under ``zero3`` no rank ever holds it whole: its
parameters are sharded as they are constructed, pretrained weights (``--pretrained DIR``: a Hugging
Face checkpoint directory, a .safetensors or a .pt file) are read slice by slice into the shards,
and the frozen base is sharded too: each rank keeps (frozen bytes + 16 x trainable bytes) / N.

    python examples/finetune_hf.py                                   # a small Llama from its config
    python examples/finetune_hf.py --pretrained path/to/hf_checkpoint --devices 4 --precision bf16-mixed
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import lightning_zero
from lightning_zero import ZeroConfig, ZeroStrategy
from lightning_zero.resilience.resumable_data import resumable_loader


class LoRA(nn.Module):
    """``base(x) + alpha / rank * B(A(x))``; the base stays frozen, B starts at zero."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=5**0.5)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


class LoRAFineTune(pl.LightningModule):
    def __init__(self, config, pretrained: str | None = None, targets=("q_proj", "v_proj"), lr: float = 5e-3):
        super().__init__()
        self.config, self.pretrained, self.targets, self.lr = config, pretrained, targets, lr
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(self.config)  # sharded as it is built under zero3
        if self.pretrained:
            lightning_zero.load_pretrained(self.model, self.pretrained)  # each rank reads its slices
        self.model.requires_grad_(False)
        for module in list(self.model.modules()):
            for name, child in list(module.named_children()):
                if name in self.targets and isinstance(child, nn.Linear):
                    setattr(module, name, LoRA(child))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def toy_data(vocab: int, seq: int, n: int = 256) -> TensorDataset:
    """A repeating pattern the adapters can learn: next token = (token + 1) mod 17."""
    start = torch.randint(17, (n, 1), generator=torch.Generator().manual_seed(0))
    tokens = (start + torch.arange(seq + 1)) % 17
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", help="Hugging Face checkpoint directory, .safetensors or .pt file")
    parser.add_argument("--config", help="Hugging Face config name or directory (default: a small Llama)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    from transformers import AutoConfig, LlamaConfig

    if args.config or args.pretrained:
        config = AutoConfig.from_pretrained(args.config or args.pretrained)
    else:
        config = LlamaConfig(
            vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
    data = resumable_loader(toy_data(config.vocab_size, 32), batch_size=8)  # resumes mid-epoch exactly
    strategy = ZeroStrategy(ZeroConfig(stage=3, param_persistence_threshold=0), start_method="popen")
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
    )
    module = LoRAFineTune(config, args.pretrained)
    trainer.fit(module, data)
    memory = trainer.strategy.memory_bytes()
    if trainer.is_global_zero:
        frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        print(f"frozen {frozen:,} and trainable {trainable:,} parameters; rank 0 holds", end=" ")
        print(", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in memory.items()))


if __name__ == "__main__":
    main()
