"""A Hugging Face Llama with grouped-query attention (8 heads, 4 key/value heads), unedited, trained sequence-parallel
under ZeroStrategy through a real Trainer (sequence/hf.py: its attention through Ulysses by transformers' registry,
its inputs and loss per rank from ``causal_lm_inputs``), on padded samples of different lengths (labels -100 on the
pads) under the causal mask: SP=2 on 2 ranks at stage 3 with activation checkpointing, a LoRA fine-tune, right
padding and no padding mask; SP=4 on 4 ranks at stage 2, eager attention, from ``load_pretrained`` weights, right
padding and its mask; 2 replicas x SP=2 at stage 1 with left padding and its mask (which only then changes real
tokens' outputs). Each equals one process on the same global batch (its F.cross_entropy token mean, the same
optimizer) within 1e-5 in loss and weights, its all-to-alls are the ones Ulysses makes, and the model's attention is
its own again after the run, nothing left registered. And the same through Fabric against a plain torch loop."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_zero
from tests.support.compare import relative_error
from tests.support.helpers import COLLECTIVE_TIMEOUT_S, make_trainer, zero_strategy

pytest.importorskip("transformers")
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from lightning_zero.sequence.hf import PREFIX, causal_lm_inputs  # noqa: E402
from tests.support.hf_models import LoRA  # noqa: E402

STEPS, ACCUMULATE, GLOBAL_BATCH, SEQ, VOCAB = 3, 2, 4, 16, 64
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 8, 4, 4, 2


def build(implementation: str = "sdpa", lora: bool = False) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, attn_implementation=implementation,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if lora:
        model.requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj, layer.self_attn.v_proj = LoRA(layer.self_attn.q_proj), LoRA(layer.self_attn.v_proj)
    return model


@functools.cache
def _pretrained() -> dict[str, torch.Tensor]:
    torch.manual_seed(123)
    return build().state_dict()


def _data(left: bool) -> TensorDataset:
    """Samples of 9 to 16 real tokens padded (with 0) on the right (or ``left``), labels -100 on the pads, and the
    padding mask. Under the causal mask right padding changes no real token's output, mask or not; left padding
    does, only with the mask: what it covers on each slice must reach every rank's queries."""
    g = torch.Generator().manual_seed(11)
    n = STEPS * ACCUMULATE * GLOBAL_BATCH
    tokens = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    real = torch.arange(SEQ) < torch.randint(9, SEQ + 1, (n, 1), generator=g)
    real = real.flip(1) if left else real
    return TensorDataset(tokens.masked_fill(~real, 0), tokens.masked_fill(~real, -100), real.long())


class SequenceLlama(pl.LightningModule):
    """Built in ``configure_model``; sequence-parallel where the strategy made the groups, else one process."""

    def __init__(self, implementation="sdpa", lora=False, pretrained=False, mask=True, left=False) -> None:
        super().__init__()
        self.implementation, self.lora, self.pretrained, self.mask = implementation, lora, pretrained, mask
        self.model, self.data, self.losses = None, _data(left), []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.implementation, self.lora)
            if self.pretrained:
                lightning_zero.load_pretrained(self.model, _pretrained())

    def training_step(self, batch, batch_idx):
        x, labels, real = batch
        mask = real if self.mask else None
        sequence = getattr(self.trainer.strategy, "sequence_parallel", None)
        if sequence is None:  # (one process: the token mean over the real targets of the batch)
            logits = self.model(input_ids=x, attention_mask=mask).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        else:
            loss = self.model(**causal_lm_inputs(sequence, x, labels, attention_mask=mask)).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=2e-3, weight_decay=0.1)

    def train_dataloader(self):  # (a sequence-parallel group reads its replica's samples)
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(self.data, shuffle=False, **kwargs)
        return DataLoader(self.data, batch_size=GLOBAL_BATCH // sampler.num_replicas, sampler=sampler)


UNITS = {"activation_checkpointing": "units", "param_persistence_threshold": 0}
# tag: (stage, sequence_parallel_size, ZeroConfig fields, SequenceLlama arguments)
RUNS_AT = {
    2: {"sp2-z3": (3, 2, UNITS, {"lora": True, "mask": False})},
    4: {
        "sp4-z2": (2, 4, {"reduce_bucket_size": 3000}, {"implementation": "eager", "pretrained": True}),
        "dp2xsp2-z1": (1, 2, {}, {"left": True}),
    },
}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for tag, (stage, size, config, options) in RUNS_AT[world].items():
        pl.seed_everything(0)
        module = SequenceLlama(**options)
        trainer = make_trainer(zero_strategy(stage, sequence_parallel_size=size, **config), world, steps=STEPS)
        trainer.fit(module)
        out[tag] = {
            "state": trainer.strategy.gather_module().state_dict(),
            "losses": module.losses,
            "all_to_all": trainer.strategy.traffic.elements["all_to_all"],
            "attention": module.model.config._attn_implementation,  # (after the run: the model's own again)
            "registered": _registered(),
        }
    return out


@functools.cache
def _reference(options: tuple) -> tuple[dict, list[float]]:
    pl.seed_everything(0)
    module = SequenceLlama(**dict(options))
    make_trainer("auto", 1, steps=STEPS).fit(module)
    return {k: v.clone() for k, v in module.state_dict().items()}, module.losses


def _all_to_all_elements(world: int, size: int, checkpointed: bool, lora: bool) -> int:
    """Ulysses' per rank: q and the output (H heads), k and v (H_kv), of each layer's slice, sent forward, back and
    (checkpointed) forward again; LoRA's first layer sends no gradient of k back (its k_proj is frozen, and so is the
    embedding before it: nothing there needs it)."""
    head = GLOBAL_BATCH // (world // size) * (SEQ // size) * HEAD_DIM  # one head's slice
    per_micro_batch = LAYERS * head * (2 * HEADS + 2 * KV_HEADS) * (3 if checkpointed else 2)
    return STEPS * ACCUMULATE * (per_micro_batch - (head * KV_HEADS if lora else 0))


@pytest.mark.parametrize("world", [2, 4])
def test_a_hugging_face_llama_trains_sequence_parallel_as_one_process(ranks, world):
    results = ranks(_worker, world)
    for tag, (_, size, config, options) in RUNS_AT[world].items():
        state, losses = _reference(tuple(sorted(options.items())))
        logged = torch.tensor([result[tag]["losses"] for result in results]).mean(0)  # (a sync_dist mean)
        assert relative_error(logged, torch.tensor(losses)) <= 1e-5, (tag, logged, losses)
        for rank, result in enumerate(results):
            run = result[tag]
            expected = _all_to_all_elements(world, size, "activation_checkpointing" in config, "lora" in options)
            assert run["all_to_all"] == expected, (tag, run["all_to_all"], expected)
            assert run["attention"] == options.get("implementation", "sdpa") and run["registered"] == [], tag
            assert list(run["state"]) == list(state), tag
            for name, value in state.items():
                err = relative_error(run["state"][name], value)
                assert err <= 1e-5, f"{tag} rank {rank}: {name} differs from one process by {err:.1e}"


def _registered() -> list[str]:
    registries = (AttentionInterface, AttentionMaskInterface)
    return [name for registry in registries for name in registry._global_mapping if name.startswith(PREFIX)]


def _fabric_worker(rank: int, world: int) -> dict:
    """Fabric's door (stage 2, SP=2, left padding and its mask): ``fabric.setup`` attaches, teardown detaches."""
    config = lightning_zero.ZeroConfig(stage=2, sequence_parallel_size=world, timeout=COLLECTIVE_TIMEOUT_S)
    fabric = Fabric(strategy=lightning_zero.ZeroFabricStrategy(config), accelerator="cpu", devices=world)
    fabric.launch()
    torch.manual_seed(0)
    model = build()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=2e-3))
    sequence, losses = fabric.strategy.sequence_parallel, []
    for x, labels, real in DataLoader(_data(left=True), batch_size=GLOBAL_BATCH):  # (one replica: every batch)
        loss = model(**causal_lm_inputs(sequence, x, labels, attention_mask=real)).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    inputs = causal_lm_inputs(sequence, x, labels, attention_mask=real)
    if rank == 1:  # positions restarting inside rank 1's slice only (a packed sequence): every rank refuses, none waits
        inputs["position_ids"] = inputs["position_ids"] % 3
    with pytest.raises(ValueError, match="every rank passes its slice's global position_ids"):
        model(**inputs)
    state, attached = fabric.strategy.get_module_state_dict(model), _registered()
    fabric.strategy.teardown()
    return {"state": state, "losses": losses, "attached": attached, "registered": _registered()}


def test_fabric_trains_a_hugging_face_llama_sequence_parallel_as_plain_torch(ranks):
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for x, labels, real in DataLoader(_data(left=True), batch_size=GLOBAL_BATCH):
        logits = model(input_ids=x, attention_mask=real).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    results = ranks(_fabric_worker, 2)
    logged = torch.tensor([result["losses"] for result in results]).mean(0)
    assert relative_error(logged, torch.tensor(losses)) <= 1e-5, (logged, losses)
    for rank, result in enumerate(results):
        assert len(result["attached"]) == 2 and result["registered"] == [], result  # (an attention, a mask function)
        for name, value in model.state_dict().items():
            err = relative_error(result["state"][name], value)
            assert err <= 1e-5, f"fabric rank {rank}: {name} differs from one process by {err:.1e}"
