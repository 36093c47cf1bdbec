"""Tiny Hugging Face models (GPT-2 with its tied head, Llama with GQA and RoPE buffers) as the tests
fine-tune them: built in ``__init__`` or in ``configure_model``, optionally with Hugging Face gradient
checkpointing, optionally as a LoRA fine-tune (the base frozen, low-rank adapters trained)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

VOCAB, SEQ = 64, 12


class LoRA(nn.Module):
    """``base(x) + scale * B(A(x))`` with ``base`` frozen; B starts at zero, so training starts from the base."""

    def __init__(self, base: nn.Module, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        fan_in, fan_out = (
            (base.weight.shape[0], base.weight.shape[1]) if isinstance(base, Conv1D) else base.weight.T.shape
        )
        self.lora_a = nn.Parameter(torch.empty(rank, fan_in))
        self.lora_b = nn.Parameter(torch.zeros(fan_out, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=5**0.5)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def build(family: str, *, lora: bool = False, checkpointing: bool = False) -> nn.Module:
    if family == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        model.requires_grad_(False)
        targets = ("c_attn",) if family == "gpt2" else ("q_proj", "v_proj")
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if name in targets:
                    setattr(module, name, LoRA(child))
    return model


class HFModule(pl.LightningModule):
    """Next-token prediction on fixed data that rank r of W reads as samples r, r + W, ..."""

    def __init__(
        self,
        family: str,
        *,
        lazy: bool = False,
        lora: bool = False,
        checkpointing: bool = False,
        steps: int = 4,
        accumulate: int = 2,
        global_batch: int = 8,
    ) -> None:
        super().__init__()
        self.family, self.lora, self.checkpointing, self.global_batch = family, lora, checkpointing, global_batch
        self.model = None if lazy else build(family, lora=lora, checkpointing=checkpointing)
        n = steps * accumulate * global_batch
        tokens = torch.randint(VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(5))
        self.data = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.family, lora=self.lora, checkpointing=self.checkpointing)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(input_ids=x).logits  # a ModelOutput: the units' outputs are containers too
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(self.data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(self.data, batch_size=self.global_batch // world, sampler=sampler)


def pretrained_state() -> dict:
    """A llama's weights made with seed 123: what the pretrained-loading tests load."""
    torch.manual_seed(123)
    return {k: v.clone() for k, v in build("llama").state_dict().items()}
