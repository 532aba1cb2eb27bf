"""Binds route buffers to Megatron's ``RouterReplay``: per micro-batch, keyed, recompute-safe.

Megatron 0.19.2 gives each ``TopKRouter`` a ``RouterReplay`` whose targets are a single tensor for
the forward and a FIFO (``pop(0)``) for recompute in backward, set through a process-global list
in construction order. This binding replaces, on the MoE layers of this pipeline stage only, each
router's instance with a :class:`KeyedRouterReplay` (a ``RouterReplay`` subclass, swapped in place
in Megatron's global list) that looks its targets up by ``(micro-batch key, MoE layer)``:

- ``install(routes_BSLK, key)`` before a micro-batch's forward slices the pack's routes for this
  rank (CP zigzag, then SP; :mod:`~megatron_ext.replay.layout`) and stores them per MoE layer,
  keyed by the absolute layer number's MoE ordinal; dense and MTP layers are skipped (MTP routers
  route natively).
- Activation recompute reruns routers during backward, possibly after later micro-batches ran
  their forward (pipeline schedules). A marker on each decoder block's output records, when that
  micro-batch's backward starts, whose key is current; recomputed routers read that key. No FIFO.
- ``native`` missing rows (all-max marker, see :mod:`~megatron_ext.replay.routes`) take the
  router's own top-k: ``where(missing, native_topk, replayed)``, no host sync. The missing mask is
  built once per micro-batch for all layers; a micro-batch the data says has no missing row
  (``install(..., has_missing=False)``, counted on the host by the dataset) skips the mask, the
  native top-k and the ``where``: the router then only gathers, as Megatron's replay does.
- ``record`` mode keeps the forward's top-k per key and layer; :meth:`recorded_routes` gathers
  them back to the data layout ``[B, S, L, K]`` across SP/CP (and PP) ranks.

Example::

    binding = RouteReplayBinding(model_chunks, mode="replay", missing_route_policy="native")
    binding.install(batch["routes"], key=micro_batch_index,   # routes_BSLK, uint8
                    has_missing=has_missing_routes(host_batch))  # host count, no device read
    loss = forward_backward(...)                              # every MoE layer replays routes
    binding.clear()                                           # once per training step
"""

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import make_viewless_tensor

from megatron_ext.replay.layout import (
    assemble_from_ranks,
    moe_layer_numbers,
    moe_layer_numbers_from_hybrid_pattern,
    router_row_positions,
    rows_for_router,
)
from megatron_ext.replay.routes import route_dtype
from megatron_ext.replay.unsupported import check_replay_supported

_TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# Decoder stacks whose output carries the backward key marker (GPTModel's, HybridModel's).
_DECODER_BLOCKS = (TransformerBlock, HybridStack)


class KeyedRouterReplay(RouterReplay):
    """A ``RouterReplay`` whose targets come from a :class:`RouteReplayBinding` by key."""

    def __init__(self, binding: "RouteReplayBinding", moe_ordinal: int, layer_number: int) -> None:
        super().__init__()
        self.binding = binding
        self.moe_ordinal = moe_ordinal
        self.layer_number = layer_number

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: _TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays (or records) this layer's top-k for the current micro-batch key."""
        assert default_compute_topk is not None
        return self.binding.route(self, scores, topk, num_groups, group_topk, default_compute_topk)


class _BackwardKeyMarker(torch.autograd.Function):
    """Identity on the decoder output; its backward announces which micro-batch is in backward.

    Apply through :func:`_mark`: the output is a view, and a non-last pipeline stage's output is
    freed by Megatron's ``deallocate_output_tensor``, which asserts ``out._base is None``."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, binding: "RouteReplayBinding", key: Hashable):
        ctx.binding, ctx.key = binding, key
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.binding.enter_backward(ctx.key)
        return grad, None, None


def _mark(hidden: torch.Tensor, binding: "RouteReplayBinding", key: Hashable) -> torch.Tensor:
    """``hidden`` through :class:`_BackwardKeyMarker`, returned viewless (``_base is None``)."""
    marked = _BackwardKeyMarker.apply(hidden, binding, key)
    # Shares marked's storage; keep_graph keeps the marker's backward on the graph.
    return make_viewless_tensor(marked, requires_grad=True, keep_graph=True)


def _moe_layer_numbers(model: torch.nn.Module) -> list[int]:
    """The decoder's MoE layer numbers: a ``HybridModel`` from its layer pattern (its config's
    ``moe_layer_freq`` does not describe it), a ``GPTModel`` from ``moe_layer_freq``."""
    if isinstance(model, HybridModel):
        return moe_layer_numbers_from_hybrid_pattern(model.hybrid_layer_pattern)
    return moe_layer_numbers(model.config.num_layers, model.config.moe_layer_freq)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # DDP / Float16Module wrappers
        module = module.module
    return module


class RouteReplayBinding:
    """Owns the route state of one model (all its virtual-pipeline chunks on this rank).

    Args:
        model: The model chunk(s) on this rank (``GPTModel`` or ``HybridModel``, possibly
            wrapped).
        mode: ``"replay"`` or ``"record"``.
        missing_route_policy: ``"native"`` (rows with the missing marker take the router's own
            top-k) or ``"balanced"`` (the data already filled them; no native top-k is computed).

    Raises:
        ValueError: The model's config is one where Megatron would bypass replay, or the model
            has no MoE router on any layer.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        mode: Literal["replay", "record"],
        *,
        missing_route_policy: Literal["native", "balanced"] = "native",
    ) -> None:
        if mode not in ("replay", "record"):
            raise ValueError(f"--route-replay-mode must be 'replay' or 'record' here, got {mode!r}")
        chunks = [_unwrap(m) for m in (model if isinstance(model, Sequence) else [model])]
        self.config = chunks[0].config
        check_replay_supported(self.config, f"--route-replay-mode {mode}")
        self.mode = mode
        self.native_missing = missing_route_policy == "native"
        numbers = _moe_layer_numbers(chunks[0])
        self.num_moe_layers = len(numbers)
        self.topk = self.config.moe_router_topk
        ordinal_of = {n: i for i, n in enumerate(numbers)}
        self.replays: list[KeyedRouterReplay] = []
        self._restore: list[tuple[TopKRouter, RouterReplay | None]] = []
        self._hooks = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter) and not module.is_mtp_layer:
                    self._restore.append((module, module.router_replay))
                    self.replays.append(self._swap_in(module, ordinal_of[module.layer_number]))
            for block in (m for m in chunk.modules() if isinstance(m, _DECODER_BLOCKS)):
                self._hooks.append(block.register_forward_hook(self._mark_block_output))
        if not self.replays:
            raise ValueError("--route-replay-mode: this pipeline stage has no MoE router")
        self.stage_ordinals = [r.moe_ordinal for r in self.replays]
        self._stage_range = (min(self.stage_ordinals), max(self.stage_ordinals) + 1)
        self._targets: dict[tuple[Hashable, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._recorded: dict[tuple[Hashable, int], torch.Tensor] = {}
        self._shapes: dict[Hashable, tuple[int, int]] = {}
        self._positions: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._device_positions: dict[tuple[torch.device, int, int], torch.Tensor] = {}
        self._forward_key: Hashable | None = None
        self._backward_key: Hashable | None = None
        #: Called with each replayed layer's indices (training forwards); see ReplayCheck.
        self.on_replay: Callable[..., None] | None = None

    def _swap_in(self, router: TopKRouter, ordinal: int) -> KeyedRouterReplay:
        """Replaces ``router.router_replay`` (and its slot in Megatron's global list)."""
        old = router.router_replay
        new = KeyedRouterReplay(self, ordinal, router.layer_number)  # appended to the global list
        instances = RouterReplay.global_router_replay_instances
        if old is not None and any(inst is old for inst in instances):
            instances.pop()
            instances[next(i for i, inst in enumerate(instances) if inst is old)] = new
        router.router_replay = new
        return new

    def remove(self) -> None:
        """Unbinds: puts each router's previous ``RouterReplay`` back and drops the hooks."""
        instances = RouterReplay.global_router_replay_instances
        for (router, old), new in zip(self._restore, self.replays, strict=True):
            router.router_replay = old
            slot = next((i for i, inst in enumerate(instances) if inst is new), None)
            if slot is not None:
                if old is None:
                    instances.pop(slot)
                else:
                    instances[slot] = old
        for hook in self._hooks:
            hook.remove()
        self.clear()

    # ----- per micro-batch ---------------------------------------------------------------
    def _row_positions(self, batch_size: int, seq_len: int, tp_rank: int, cp_rank: int):
        cache_key = (batch_size, seq_len, tp_rank, cp_rank)
        if cache_key not in self._positions:
            self._positions[cache_key] = router_row_positions(
                batch_size,
                seq_len,
                cp_size=parallel_state.get_context_parallel_world_size(),
                cp_rank=cp_rank,
                tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                tp_rank=tp_rank,
                sequence_parallel=self.config.sequence_parallel,
            )
        return self._positions[cache_key]

    def _my_positions(self, batch_size: int, seq_len: int) -> torch.Tensor:
        return self._row_positions(
            batch_size,
            seq_len,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_context_parallel_rank(),
        )

    def install(
        self, routes_BSLK: torch.Tensor, key: Hashable, *, has_missing: bool | None = None
    ) -> None:
        """Stores a micro-batch's routes for the MoE layers of this stage and makes it current.

        Args:
            routes_BSLK: Routes of the whole micro-batch in the layout the model sees (un-sharded;
                uint8 or uint16 as produced by :mod:`~megatron_ext.replay.routes`), on the model's
                device (move it with the rest of the batch). THD (packed sequences, tokens
                ``[1, B*S]``): the router rows run ``b * S + s``, so pass
                ``routes_BSLK.reshape(1, B * S, L, K)``, not ``[B, S, L, K]``.
            key: Identifies the micro-batch until :meth:`clear` (e.g. its index in the step).
            has_missing: Whether any row of the micro-batch is missing, as the host knows it
                (:func:`~megatron_ext.replay.route_dataset.has_missing_routes` of the batch).
                ``False`` skips the missing mask and, in every router call, the native top-k and
                the ``where`` (a missing row would then index out of range: pass ``False`` only
                from the data's count). ``None``: unknown, the mask is built (on the device, no
                sync). Only the ``native`` policy reads it; ``balanced`` rows are never missing.

        Raises:
            ValueError: Wrong rank, MoE layer count or top-k; ``has_missing`` not a host bool.
        """
        if self.mode != "replay":
            raise ValueError("install() needs --route-replay-mode replay")
        if has_missing is not None and not isinstance(has_missing, (bool, np.bool_)):
            # A device tensor here would be read by `if` below: a device-to-host sync.
            raise ValueError(
                f"install(has_missing=...) takes a host bool or None, got {type(has_missing)}"
            )
        has_missing = None if has_missing is None else bool(has_missing)
        if routes_BSLK.dim() != 4:
            raise ValueError(
                f"routes must be [batch, seq, moe_layers, topk], got {routes_BSLK.shape}"
            )
        batch_size, seq_len, num_layers, topk = routes_BSLK.shape
        if num_layers != self.num_moe_layers or topk != self.topk:
            raise ValueError(
                f"routes have {num_layers} MoE layers x top-{topk}; the model has "
                f"{self.num_moe_layers} MoE layers x top-{self.topk} (--moe-router-topk)"
            )
        positions_N = self._my_positions(batch_size, seq_len)
        device_key = (routes_BSLK.device, batch_size, seq_len)
        if device_key not in self._device_positions:  # one host-to-device copy per shape
            self._device_positions[device_key] = positions_N.to(routes_BSLK.device)
        rows_NLK = rows_for_router(routes_BSLK, self._device_positions[device_key])
        # This stage's layers [lo, hi) as one layer-major copy: every layer's rows (and mask) are
        # then a contiguous slice, made by one kernel per micro-batch instead of one per layer.
        lo, hi = self._stage_range
        rows_LNK = rows_NLK[:, lo:hi].transpose(0, 1).contiguous()
        missing_LN = None
        if self.native_missing and has_missing is not False:
            missing_LN = (rows_LNK == torch.iinfo(rows_LNK.dtype).max).all(-1)
        for ordinal in self.stage_ordinals:
            # Kept narrow (K bytes per token); widened to int64 inside the router call.
            rows_NK = rows_LNK[ordinal - lo]
            missing_N = None if missing_LN is None else missing_LN[ordinal - lo]
            self._targets[(key, ordinal)] = (rows_NK, missing_N)
        self._shapes[key] = (batch_size, seq_len)
        self._forward_key, self._backward_key = key, None

    def begin_record(self, key: Hashable, batch_size: int, seq_len: int) -> None:
        """Makes ``key`` current for a recording forward of a ``[batch_size, seq_len]`` batch.

        THD (tokens ``[1, B*S]``): pass ``batch_size=1, seq_len=B*S``; :meth:`recorded_routes`
        then returns ``[1, B*S, L, K]`` (reshape to ``[B, S, L, K]`` for per-sample routes).
        """
        if self.mode != "record":
            raise ValueError("begin_record() needs --route-replay-mode record")
        self._shapes[key] = (batch_size, seq_len)
        self._forward_key, self._backward_key = key, None

    def enter_backward(self, key: Hashable) -> None:
        """Called by the decoder-output marker: routers now recompute micro-batch ``key``."""
        self._backward_key = key

    def clear(self) -> None:
        """Forgets every micro-batch (call once per training step, after the last backward)."""
        self._targets.clear()
        self._recorded.clear()
        self._shapes.clear()
        self._forward_key = self._backward_key = None

    def _mark_block_output(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        del module, args
        key = self._forward_key
        if key is None or self._backward_key is not None or not torch.is_grad_enabled():
            return output
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return _mark(output, self, key)
        first = output[0] if isinstance(output, tuple) and output else None
        if isinstance(first, torch.Tensor) and first.requires_grad:
            return (_mark(first, self, key), *output[1:])
        return output

    # ----- inside the router ---------------------------------------------------------------
    def route(
        self,
        replay: KeyedRouterReplay,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        default_compute_topk: _TopK,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k of one router call: recorded, or replayed for the current key."""
        in_backward = self._backward_key is not None
        key = self._backward_key if in_backward else self._forward_key
        if key is None:
            raise RuntimeError(
                f"MoE layer {replay.layer_number} routed with no micro-batch installed: call "
                "RouteReplayBinding.install()/begin_record() before the forward"
            )
        if self.mode == "record":
            probs, idx_NK = default_compute_topk(scores, topk, num_groups, group_topk)
            if not in_backward:
                self._recorded[(key, replay.moe_ordinal)] = idx_NK.detach()
            return probs, idx_NK
        target = self._targets.get((key, replay.moe_ordinal))
        if target is None:
            raise RuntimeError(
                f"no routes installed for micro-batch {key!r} at MoE layer {replay.layer_number}"
            )
        rows_NK, missing_N = target
        if rows_NK.shape[0] != scores.shape[0]:
            raise ValueError(
                f"MoE layer {replay.layer_number}: {rows_NK.shape[0]} installed route rows for "
                f"{scores.shape[0]} tokens on this rank (sequence/batch shape mismatch)"
            )
        idx_NK = rows_NK.to(torch.int64)
        if missing_N is not None:  # None: no missing row in this micro-batch (or balanced)
            # Missing rows hold the marker id; where() swaps in the router's choice before gather.
            _, native_NK = default_compute_topk(scores, topk, num_groups, group_topk)
            idx_NK = torch.where(missing_N.unsqueeze(-1), native_NK, idx_NK)
        if self.on_replay is not None and not in_backward and torch.is_grad_enabled():
            # --route-replay-check (replay_check.ReplayCheck): compare with what Megatron uses.
            self.on_replay(
                replay.moe_ordinal,
                scores,
                idx_NK,
                lambda: default_compute_topk(scores, topk, num_groups, group_topk)[1],
            )
        return scores.gather(1, idx_NK), idx_NK

    # ----- record mode output ----------------------------------------------------------------
    def recorded_routes(self, key: Hashable) -> torch.Tensor:
        """The routes the forward of ``key`` chose, in the data layout ``[B, S, L, K]``.

        uint8 or uint16 as :func:`~megatron_ext.replay.routes.route_dtype` picks for the model.
        All-gathers over the TP group (with SP) and the CP group, so every rank of those groups
        returns the same tensor; layers of other pipeline stages are gathered over the PP group.
        NOTE: device-to-host sync (PP gather of Python objects); record mode only, not a hot path.
        """
        np_dtype = route_dtype(self.config.num_moe_experts, self.topk)
        dtype = torch.uint8 if np_dtype == np.uint8 else torch.uint16
        batch_size, seq_len = self._shapes[key]
        missing = torch.iinfo(dtype).max
        rows_NLK = torch.full(
            (batch_size * seq_len // self._ranks_sharing_batch(), self.num_moe_layers, self.topk),
            missing,
            dtype=torch.int64,
        )
        for ordinal in self.stage_ordinals:
            rows_NLK[:, ordinal] = self._recorded[(key, ordinal)].to(rows_NLK.device)
        rows_RNLK, positions_RN = self._gather_rows(rows_NLK, batch_size, seq_len)
        routes_BSLK = assemble_from_ranks(rows_RNLK, positions_RN, batch_size, seq_len)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            stages: list[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
            torch.distributed.all_gather_object(
                stages,
                (self.stage_ordinals, routes_BSLK.cpu()),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
            for ordinals, stage_routes in stages:
                routes_BSLK[:, :, ordinals] = stage_routes[:, :, ordinals].to(routes_BSLK.device)
        return routes_BSLK.to(dtype)

    def _ranks_sharing_batch(self) -> int:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
        return cp * (tp if self.config.sequence_parallel else 1)

    def _gather_rows(self, rows_NLK: torch.Tensor, batch_size: int, seq_len: int):
        """All-gathers router rows over SP (TP group) then CP; returns rows and positions."""
        tp_ranks = [parallel_state.get_tensor_model_parallel_rank()]
        if self.config.sequence_parallel:
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
            gathered = [torch.empty_like(rows_NLK) for _ in range(tp_size)]
            torch.distributed.all_gather(
                gathered, rows_NLK, group=parallel_state.get_tensor_model_parallel_group()
            )
            rows_TNLK, tp_ranks = torch.stack(gathered), list(range(tp_size))
        else:
            rows_TNLK = rows_NLK.unsqueeze(0)
        cp_size = parallel_state.get_context_parallel_world_size()
        if cp_size > 1:
            gathered = [torch.empty_like(rows_TNLK) for _ in range(cp_size)]
            torch.distributed.all_gather(
                gathered, rows_TNLK, group=parallel_state.get_context_parallel_group()
            )
            rows_CTNLK = torch.stack(gathered)
        else:
            rows_CTNLK = rows_TNLK.unsqueeze(0)
        cp_ranks = range(cp_size) if cp_size > 1 else [parallel_state.get_context_parallel_rank()]
        positions_RN = torch.stack(
            [self._row_positions(batch_size, seq_len, t, c) for c in cp_ranks for t in tp_ranks]
        )
        return rows_CTNLK.reshape(-1, *rows_NLK.shape), positions_RN
