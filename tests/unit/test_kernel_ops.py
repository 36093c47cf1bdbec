"""The fused ops are torch custom ops (kernels/ops.py, [Note: custom ops]): ``torch.library.opcheck`` passes
for every forward and backward op (schema, fake tensors, autograd registration, AOT dispatch), and
``torch.compile(fullgraph=True)`` traces a block of them, forward and backward, without a graph break and
with the eager results. On the CPU the ops run their references; the registrations are the same on CUDA."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.kernels import launchers, ops
from lightning_zero.kernels.reference import stream_tensor as stream

LZ = torch.ops.lightning_zero


def _cases():
    g = torch.Generator().manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    x, w, b = randn(3, 5, 8, grad=True), randn(8, grad=True), randn(8, grad=True)
    _, mean, rstd = LZ.layer_norm_fwd(x.detach(), w.detach(), b.detach(), 1e-5)
    scores = randn(2, 3, 4, 6, grad=True)
    probs = torch.softmax(scores.detach(), -1)
    return {
        "layer_norm_fwd": (LZ.layer_norm_fwd.default, (x, w, b, 1e-5)),
        "layer_norm_bwd": (LZ.layer_norm_bwd.default, (randn(3, 5, 8), x.detach(), w.detach(), mean, rstd, b.dtype)),
        "bias_gelu_fwd": (LZ.bias_gelu_fwd.default, (x, b, True)),
        "bias_gelu_bwd": (LZ.bias_gelu_bwd.default, (randn(3, 5, 8), x.detach(), b.detach(), False)),
        "softmax_dropout_fwd": (
            LZ.softmax_dropout_fwd.default,
            (scores, randn(2, 1, 1, 6), 0.5, True, 0.25, stream(3, 1)),
        ),
        "softmax_dropout_fwd_no_dropout": (LZ.softmax_dropout_fwd.default, (scores, None, 0.5, False, 0.0, None)),
        "softmax_dropout_bwd": (LZ.softmax_dropout_bwd.default, (randn(2, 3, 4, 6), probs, 0.5, 0.25, stream(3, 1))),
        "bias_dropout_residual_fwd": (
            LZ.bias_dropout_residual_fwd.default,
            (x, b, randn(3, 5, 8, grad=True), 0.1, stream(5, 2)),
        ),
        "dropout_bwd": (LZ.dropout_bwd.default, (randn(3, 5, 8), 0.1, stream(5, 2))),
        "column_sum": (LZ.column_sum.default, (randn(3, 5, 8), torch.float32)),
        "residual_layer_norm_fwd": (
            LZ.residual_layer_norm_fwd.default,
            (x, b, randn(3, 5, 8, grad=True), w, randn(8, grad=True), 0.2, 1e-5, stream(4, 0)),
        ),
        "residual_layer_norm_bwd": (
            LZ.residual_layer_norm_bwd.default,
            (randn(3, 5, 8), randn(3, 5, 8), x.detach(), w.detach(), mean, rstd, 0.2, stream(4, 0), *(b.dtype,) * 2),
        ),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_opcheck(name):
    op, args = _cases()[name]
    torch.library.opcheck(op, args)


def _block(x, w, b, residual, mask):
    h = ops.layer_norm(x, w, b)
    h = ops.bias_gelu(h, b, approximate="tanh")
    scores = (h @ h.transpose(-1, -2)).unsqueeze(1)  # (batch, 1 head, rows, rows)
    probs = ops.softmax_dropout(scores, 0.3, mask=mask, p=0.2, seed=11, offset=4)
    y = (probs.squeeze(1) @ h).contiguous()
    return ops.bias_dropout_residual(y, b, residual, p=0.1, seed=12, offset=5)


def test_compile_traces_the_ops_without_graph_breaks():
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(*s, generator=g).requires_grad_() for s in ((2, 7, 16), (16,), (16,), (2, 7, 16))]
    mask = torch.rand(2, 1, 1, 7, generator=g) > 0.2
    mask[..., 0] = True

    def run(fn):
        xs = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*xs, mask)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        return out.detach(), [t.grad for t in xs]

    torch._dynamo.reset()
    compiled = torch.compile(_block, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    (eager_out, eager_grads), (compiled_out, compiled_grads) = run(_block), run(compiled)
    torch.testing.assert_close(compiled_out, eager_out)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "rows,cols,sms", [(1, 8, 132), (100, 4096, 132), (4096, 64, 132), (2**25, 8, 132), (10**9, 1024, 8)]
)
def test_column_reductions_fill_the_device_and_never_exceed_the_grid(rows, cols, sms):
    chunks, per_chunk = launchers.row_chunks(rows, cols, sms)
    column_blocks = -(-cols // launchers.BLOCK)
    assert 1 <= chunks <= launchers.MAX_GRID_Y and (chunks - 1) * per_chunk < rows <= chunks * per_chunk
    assert chunks * column_blocks >= min(2 * sms, rows * column_blocks)  # 2+ blocks per SM while rows allow


def test_empty_inputs_and_64_bit_seeds():
    x = torch.zeros(0, 8)
    assert ops.layer_norm(x, torch.ones(8), torch.zeros(8)).shape == (0, 8)
    assert ops.bias_dropout_residual(x, torch.zeros(8), x, p=0.5, seed=1).shape == (0, 8)
    y = torch.randn(4, 8)
    high = ops.bias_dropout_residual(y, torch.zeros(8), torch.zeros(4, 8), p=0.5, seed=-(2**63))  # a uint64 seed
    assert high.shape == y.shape


def test_dropout_without_a_seed_traces_and_follows_torch_manual_seed():
    """A call without a seed draws its stream with torch's generator as a tensor (ops._stream): torch.compile
    traces it without a graph break, torch.manual_seed reproduces it, and the next call drops other elements."""
    x, b, r = torch.randn(6, 32), torch.zeros(32), torch.zeros(6, 32)

    def fn(x, b, r):
        return ops.bias_dropout_residual(x, b, r, p=0.5)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.manual_seed(5)
    eager_first, eager_second = fn(x, b, r), fn(x, b, r)
    torch.manual_seed(5)
    compiled_first = compiled(x, b, r)
    assert torch.equal(compiled_first, eager_first)
    assert not torch.equal(eager_first == 0, eager_second == 0)


@pytest.mark.parametrize("kind", [launchers.FWD_ROWS, launchers.BWD_ROWS, launchers.RESIDUAL_BWD_ROWS])
def test_row_teams_are_a_warp_or_their_whole_block(kind):
    """[Note: row teams]: a team of more than a warp reduces over its block, so it must be the block (a team
    of 64 in a 128-thread block would mix two rows); the team covers the row, whatever its length; too wide
    rows get no team."""
    elems, largest = kind
    for cols in range(1, elems * largest + 1):
        team = launchers._row_team(cols, kind)
        blocks, block, teams = launchers._row_grid(1000, team, 132, 2048)
        assert team == 32 or (team == block and team >= 128 and team & (team - 1) == 0), (cols, team, block)
        assert team * elems >= cols and team <= largest and teams == blocks * (block // team)
    assert launchers._row_team(elems * largest + 1, kind) is None


def test_rows_move_in_packs_only_when_whole_and_aligned():
    """The row kernels' ``vec`` flag: 16-byte packs only for rows of whole packs in 16-byte aligned tensors."""
    x = torch.empty(4096, dtype=torch.bfloat16)
    assert launchers._pack(64, x, x[8:]) == 8
    assert launchers._pack(36, x) == 1  # not a multiple of the 8-element pack
    assert launchers._pack(64, x, x[1:]) == 1  # one tensor not 16-byte aligned
    assert launchers._pack(36, x.float()) == 4  # fp32: 4-element packs
