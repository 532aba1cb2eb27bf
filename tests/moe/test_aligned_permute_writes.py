"""Tier: pure (torch only). What the aligned permute's forward writes, counted op by op with the
benchmark's op counter (megatron_ext.bench.op_counter): rows of hidden size per ATen call.

The forward never fills a whole buffer: the only zeros it writes are the pad rows (or one
appended zero row), never a ``[P, D]`` or ``[T, D]`` zero buffer under the gather. Each path's
rows written are derived here from the layout's host ints (T tokens, P buffer rows, Q pads):

- small tokens (``x.nbytes <= SMALL_TOKENS_BYTES``): the tokens plus one zero row (``cat``, T + 1
  rows), then the gather (P rows): each pad row written once, from the zero row;
- large tokens: the gather (P rows, pads copy a real row) and ``index_fill_`` of the Q pad rows:
  the pad rows are written twice, Q extra rows instead of a ``T + 1`` copy of the tokens.

Why not one write per row: torch has no gather that writes zeros for some indices. The one that
comes close, ``embedding_bag(mode="sum")`` with an empty bag per pad row, writes each row once,
but it sums each real row onto +0.0 and so turns every -0.0 of the tokens into +0.0 (pinned below);
its ``mode="max"`` keeps the values but runs a slow generic loop on CPU. Megatron's gather copies
the rows bit for bit, and so does this one.
"""

import collections

import pytest
import torch

from megatron_ext.bench.op_counter import OpCounter
from megatron_ext.moe import aligned_permute as ap
from megatron_ext.moe import alignment as al

HIDDEN = 64


class RowWrites(OpCounter):
    """:class:`OpCounter` that also tallies, per ATen op, the ``[*, HIDDEN]`` rows it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = func.overloadpacket.__name__
        alias = func._schema.returns[0].alias_info if func._schema.returns else None
        if alias is not None and not alias.is_write:
            return out  # a view writes nothing
        if name == "index_fill_":  # in place: only the indexed rows are written
            self.rows[name] += args[2].numel()
        elif isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] == HIDDEN:
            self.rows[name] += out.shape[0]
        return out


def _routing(num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Top-2 of 8 experts, seeded."""
    g = torch.Generator().manual_seed(seed)
    top = torch.rand(num_tokens, 8, generator=g).topk(2, dim=1).indices
    return torch.zeros(num_tokens, 8, dtype=torch.bool).scatter_(1, top, True)


@pytest.mark.parametrize("path", ["small", "large"])
def test_permute_forward_writes_pads_without_filling_a_buffer(path, monkeypatch):
    if path == "large":
        monkeypatch.setattr(ap, "SMALL_TOKENS_BYTES", -1)
    num_tokens, align = 37, 16
    routing_map = _routing(num_tokens)
    num_out = int(routing_map.sum())
    num_rows = al.static_aligned_rows(num_out, 8, align)
    layout = ap.plan_aligned_permute(routing_map, align, num_out, num_rows)
    x = torch.randn(num_tokens, HIDDEN)
    writes = RowWrites()
    with torch.no_grad():
        ap.permute_to_layout(x, layout)  # warm: the process-wide zero row is made once
    with torch.no_grad(), writes:
        x_P = ap.permute_to_layout(x, layout)
    pads = layout.num_pads
    assert pads > 0  # the interesting case occurred
    if path == "small":
        assert writes.rows == {"cat": num_tokens + 1, "index_select": num_rows}, writes.rows
    else:
        assert writes.rows == {"index_select": num_rows, "index_fill_": pads}, writes.rows
    fills = {k for k in writes.rows if k in ("fill_", "zero_", "zeros", "new_zeros", "full")}
    assert not fills, fills  # no whole-buffer fill under the gather
    real = layout.token_idx_P < num_tokens
    assert torch.equal(x_P[real], x[layout.token_idx_P[real]])
    assert not x_P[~real].any()  # every pad row is zero


def test_the_single_write_gather_torch_offers_changes_negative_zeros(monkeypatch):
    """Why the large path writes its pad rows twice (alignment.gather_and_zero_pads): the layout's
    gather keeps a token's -0.0, embedding_bag's empty-bag gather of the same rows does not. If a
    torch release keeps it there, a single write becomes possible and this test says so."""
    monkeypatch.setattr(ap, "SMALL_TOKENS_BYTES", -1)
    routing_map = _routing(5)
    num_out = int(routing_map.sum())
    layout = ap.plan_aligned_permute(routing_map, 4, num_out, al.static_aligned_rows(num_out, 8, 4))
    x = torch.randn(5, HIDDEN)
    x[:, 0] = -0.0
    with torch.no_grad():
        x_P = ap.permute_to_layout(x, layout)
    real = layout.token_idx_P < 5
    assert layout.num_pads > 0 and torch.signbit(x_P[real, 0]).all()  # Megatron's bits
    # The same buffer from embedding_bag: one bag per buffer row, empty for a pad row.
    offsets = real.long().cumsum(0) - real.long()
    bags = torch.nn.functional.embedding_bag(layout.token_idx_P[real], x, offsets, mode="sum")
    assert torch.equal(bags, x_P)  # equal values, pads zero ...
    assert not torch.signbit(bags[real, 0]).any(), "embedding_bag keeps -0.0 (gather_and_zero_pads)"
