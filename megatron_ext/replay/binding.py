"""Binds route buffers to Megatron's ``RouterReplay``: per micro-batch, keyed, recompute-safe.

Megatron 0.19.2's ``RouterReplay`` holds one target tensor for the forward and a FIFO (``pop(0)``)
for recompute in backward, which pipeline schedules break. Here each router of this stage looks its
targets up by ``(micro-batch key, MoE layer)`` (docs/replay.md, "How the binding works")::

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
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from megatron_ext.common.device_copy import host_to_device
from megatron_ext.common.micro_batch import MicroBatchContext, decoder_blocks
from megatron_ext.common.token_positions import router_row_positions
from megatron_ext.replay.keyed_router_replay import (
    KeyedRouterReplay,
    TopKFunction,
    model_moe_layer_numbers,
    replayed_routers,
    swap_in,
    unwrap_model,
)
from megatron_ext.replay.layout import stage_rows_layer_major
from megatron_ext.replay.recorded_rows import gather_recorded_routes
from megatron_ext.replay.unsupported import check_replay_supported


class RouteReplayBinding:
    """Owns the route state of one model chunk (or of several whose MoE layers are contiguous).

    Args:
        model: The model chunk(s) on this rank (``GPTModel`` or ``HybridModel``, maybe wrapped).
        mode: ``"replay"`` or ``"record"``.
        missing_route_policy: ``"native"`` (missing rows take the router's own top-k) or
            ``"balanced"`` (the data filled them).
        micro_batches: The run's micro-batch context, begun by the forward step (None: the
            binding keeps its own, begun by :meth:`install` / :meth:`begin_record`).
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        mode: Literal["replay", "record"],
        *,
        missing_route_policy: Literal["native", "balanced"] = "native",
        micro_batches: MicroBatchContext | None = None,
    ) -> None:
        if mode not in ("replay", "record"):
            raise ValueError(f"--route-replay-mode must be 'replay' or 'record' here, got {mode!r}")
        chunks = [unwrap_model(m) for m in (model if isinstance(model, Sequence) else [model])]
        #: The model chunks this binding replays into (unwrapped).
        self.chunks = chunks
        self.config = chunks[0].config
        check_replay_supported(self.config, f"--route-replay-mode {mode}")
        self.mode = mode
        self.native_missing = missing_route_policy == "native"
        numbers = model_moe_layer_numbers(chunks[0])
        self.num_moe_layers = len(numbers)
        self.topk = self.config.moe_router_topk
        ordinal_of = {n: i for i, n in enumerate(numbers)}
        self.replays: list[KeyedRouterReplay] = []
        self._restore: list[tuple[TopKRouter, RouterReplay | None]] = []
        self._hooks = []
        self._owns_context = micro_batches is None
        self.micro_batches = MicroBatchContext() if micro_batches is None else micro_batches
        for chunk in chunks:
            # Dense and MTP layers route natively; each MoE router's instance is swapped in place
            # in Megatron's process-global list (construction order).
            for module in replayed_routers(chunk):
                self._restore.append((module, module.router_replay))
                self.replays.append(swap_in(module, self, ordinal_of[module.layer_number]))
            self.micro_batches.attach(chunk)
            for block in decoder_blocks(chunk):
                self._hooks.append(
                    block.register_forward_pre_hook(self._check_block_input, with_kwargs=True)
                )
        if not self.replays:
            raise ValueError("--route-replay-mode: this pipeline stage has no MoE router")
        self.stage_ordinals = [r.moe_ordinal for r in self.replays]
        self._stage_range = (min(self.stage_ordinals), max(self.stage_ordinals) + 1)
        #: Per micro-batch key: the stage's rows [L_stage, N, K] (narrow), the missing mask and
        #: the balanced fill's mask (the replay check's), or None.
        self._targets: dict[Hashable, tuple[torch.Tensor, Any, Any]] = {}
        self._wide: tuple[torch.Tensor, torch.Tensor] | None = None
        self._recorded: dict[tuple[Hashable, int], torch.Tensor] = {}
        self._shapes: dict[Hashable, tuple[int, int]] = {}
        #: Per recorded key under CP: the packed row's host cu_seqlens (the per-document split).
        self._cu_seqlens: dict[Hashable, torch.Tensor] = {}
        self._positions: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._device_positions: dict[tuple[Any, ...], torch.Tensor] = {}
        #: MoE ordinals that routed in the forward begun at ``_routed_serial`` (the context's
        #: serial): one routing again is the next micro-batch's forward, which nobody installed
        #: (it must not replay these).
        self._routed: set[int] = set()
        self._routed_serial = -1
        #: Called with each replayed layer's indices in every forward (not recompute); see
        #: replay_check.ReplayCheck.
        self.on_replay: Callable[..., None] | None = None

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
        if self._owns_context:
            self.micro_batches.detach()
        self.clear()

    # ----- per micro-batch ---------------------------------------------------------------
    def _row_positions(
        self, batch_size: int, seq_len: int, tp_rank: int, cp_rank: int, cp_size: int | None = None
    ) -> torch.Tensor:
        """Router rows' positions of a ``[batch_size, seq_len]`` micro-batch split by the zigzag
        (``cp_size`` None: the run's CP size; 1: a sequence CP already split, SP only)."""
        cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
        cache_key = (batch_size, seq_len, tp_rank, cp_rank if cp_size > 1 else -1)
        if cache_key not in self._positions:
            self._positions[cache_key] = router_row_positions(
                batch_size,
                seq_len,
                cp_size=cp_size,
                cp_rank=cp_rank if cp_size > 1 else 0,
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

    def _device_rows(
        self, like: torch.Tensor, batch_size: int, seq_len: int, cp_index: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's router rows' positions on ``like``'s device: the zigzag's, cached per
        shape; or, given a packed row's CP index, that index sliced for SP (one small gather)."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        if cp_index is None:
            local = (batch_size, seq_len, tp_rank, parallel_state.get_context_parallel_rank())
        else:  # the CP rank's tokens, in its order: SP splits that local sequence
            local = (1, cp_index.numel(), tp_rank, 0, 1)
        device_key = (like.device, *local)
        if device_key not in self._device_positions:  # one host-to-device copy per shape
            # Pinned and asynchronous: a blocking copy would wait for the stream (a sync on the
            # first micro-batch of every new shape).
            self._device_positions[device_key] = host_to_device(self._row_positions(*local), like)
        positions_N = self._device_positions[device_key]
        if cp_index is None:
            return positions_N
        return cp_index.to(torch.int64).index_select(0, positions_N)

    def install(
        self,
        routes_BSLK: torch.Tensor,
        key: Hashable,
        *,
        has_missing: bool | None = None,
        filled_BSL: torch.Tensor | None = None,
        cp_index: torch.Tensor | None = None,
    ) -> None:
        """Stores a micro-batch's routes for the MoE layers of this stage and makes it current.

        Args:
            routes_BSLK: Routes of the whole micro-batch as the model sees it (un-sharded, uint8
                or uint16), on the model's device. THD (tokens ``[1, B*S]``): router rows run
                ``b * S + s``, so pass ``routes_BSLK.reshape(1, B * S, L, K)``.
            key: Identifies the micro-batch until :meth:`clear` (e.g. its index in the step).
            has_missing: Whether any row is missing, as the host knows it (``has_missing_routes``);
                ``False`` skips the mask, the native top-k and the ``where``; None: unknown.
            filled_BSL: ``balanced`` only, optional: the rows the data filled
                (``sample["route_filled"]``), for the replay check; not read for routing.
            cp_index: THD under CP: the positions of the ``[1, B*S]`` row this rank holds (the
                index Megatron's per-document split used); None: the per-sequence zigzag.

        Raises:
            ValueError: Wrong rank, MoE layer count or top-k; ``has_missing`` not a host bool.
        """
        has_missing = self._checked_install(routes_BSLK, has_missing, filled_BSL, cp_index)
        batch_size, seq_len = routes_BSLK.shape[:2]
        position_N = self._device_rows(routes_BSLK, batch_size, seq_len, cp_index)
        # This stage's layers [lo, hi) in one gather, layer-major: every layer's rows (and mask)
        # are then a contiguous slice, made by one kernel per micro-batch instead of one per layer.
        lo, hi = self._stage_range
        rows_LNK = stage_rows_layer_major(routes_BSLK, position_N, lo, hi)
        missing_LN = filled_LN = None
        # has_missing False comes only from the data's count: a missing row would then index out
        # of range. The mask is built once per micro-batch for all layers, on the device (no
        # sync); the balanced policy's rows are never missing.
        if self.native_missing and has_missing is not False:
            missing_LN = (rows_LNK == torch.iinfo(rows_LNK.dtype).max).all(-1)
        if filled_BSL is not None:
            filled_LN = stage_rows_layer_major(filled_BSL.unsqueeze(-1), position_N, lo, hi)[..., 0]
        # Kept narrow (K bytes per token per layer); widened to int64 once per pass (_wide_rows).
        self._targets[key] = (rows_LNK, missing_LN, filled_LN)
        self._shapes[key] = (batch_size, seq_len)
        self._make_current(key)

    def _checked_install(
        self,
        routes_BSLK: torch.Tensor,
        has_missing: Any,
        filled_BSL: torch.Tensor | None,
        cp_index: torch.Tensor | None,
    ) -> bool | None:
        """Refuses what :meth:`install` cannot replay; returns ``has_missing`` as a host bool."""
        if self.mode != "replay":
            raise ValueError("install() needs --route-replay-mode replay")
        if has_missing is not None and not isinstance(has_missing, (bool, np.bool_)):
            # A device tensor here would be read by `if` in install: a device-to-host sync.
            raise ValueError(
                f"install(has_missing=...) takes a host bool or None, got {type(has_missing)}"
            )
        if routes_BSLK.dim() != 4:
            raise ValueError(
                f"routes must be [batch, seq, moe_layers, topk], got {routes_BSLK.shape}"
            )
        batch_size, seq_len, num_layers, topk = routes_BSLK.shape
        if filled_BSL is not None and filled_BSL.shape != routes_BSLK.shape[:3]:
            raise ValueError(f"filled_BSL is {filled_BSL.shape}, the routes {routes_BSLK.shape}")
        if num_layers != self.num_moe_layers or topk != self.topk:
            raise ValueError(
                f"routes have {num_layers} MoE layers x top-{topk}; the model has "
                f"{self.num_moe_layers} MoE layers x top-{self.topk} (--moe-router-topk)"
            )
        if cp_index is not None and (batch_size != 1 or seq_len % cp_index.numel()):
            raise ValueError(
                f"cp_index ({cp_index.numel()} positions) splits a THD row [1, B*S]: routes are "
                f"[{batch_size}, {seq_len}]"
            )
        return None if has_missing is None else bool(has_missing)

    def begin_record(
        self, key: Hashable, batch_size: int, seq_len: int, cu_seqlens: torch.Tensor | None = None
    ) -> None:
        """Makes ``key`` current for a recording forward of a ``[batch_size, seq_len]`` batch (THD:
        ``batch_size=1, seq_len=B*S``). ``cu_seqlens``: under CP, the THD row's host boundaries
        (each rank's rows are put back by the per-document split, else the zigzag's)."""
        if self.mode != "record":
            raise ValueError("begin_record() needs --route-replay-mode record")
        self._shapes[key] = (batch_size, seq_len)
        if cu_seqlens is not None:
            self._cu_seqlens[key] = cu_seqlens
        self._make_current(key)

    def _make_current(self, key: Hashable) -> None:
        """Begins ``key`` on the binding's own context, or checks the run's context runs it."""
        if self._owns_context:
            self.micro_batches.begin(key)
        elif self.micro_batches.forward_key != key:
            raise ValueError(
                f"routes given for micro-batch {key!r}, but the forward step began "
                f"{self.micro_batches.forward_key!r} (MicroBatchContext.begin comes first)"
            )

    def clear(self) -> None:
        """Forgets every micro-batch (call once per training step, after the last backward)."""
        self._targets.clear()
        self._wide = None
        self._recorded.clear()
        self._shapes.clear()
        self._cu_seqlens.clear()
        self._routed, self._routed_serial = set(), -1

    def device_bytes(self) -> tuple[int, int]:
        """``(installed, row index)``: bytes the installed micro-batches hold on the device (the
        stage's narrow rows and any missing masks; freed by :meth:`clear`) and bytes of the row
        indices cached once per (device, B, S) for the binding's lifetime."""
        installed = sum(t.nbytes for kept in self._targets.values() for t in kept if t is not None)
        return installed, sum(t.nbytes for t in self._device_positions.values())

    def _check_block_input(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A decoder's input ``[S, B, H]`` must have the batch the routes were installed for."""
        # [B, S, L, K] routes under a THD forward ([1, B*S] tokens) would otherwise replay each
        # row's route at another token, with no error (the row counts agree).
        del module
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        key = self.micro_batches.forward_key
        if key not in self._shapes or not isinstance(hidden, torch.Tensor):
            return None  # nothing installed for it, or a later pipeline stage's input
        batch_size, seq_len = self._shapes[key]
        if hidden.dim() == 3 and hidden.shape[1] != batch_size:
            raise ValueError(
                f"routes of micro-batch {key!r} were given for a [{batch_size}, {seq_len}] "
                f"batch, but the decoder runs a batch of {hidden.shape[1]} (THD packs run [1, B*S] "
                f"tokens: pass routes_BSLK.reshape(1, B * S, L, K) / begin_record(key, 1, B * S))"
            )
        return None

    # ----- inside the router ---------------------------------------------------------------
    def route(
        self,
        replay: KeyedRouterReplay,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        default_compute_topk: TopKFunction,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k of one router call: recorded, or replayed for the current key."""
        in_backward = self.micro_batches.recomputing
        key = self.micro_batches.key
        if key not in self._shapes:
            raise RuntimeError(
                f"MoE layer {replay.layer_number} routed with no micro-batch installed: call "
                "RouteReplayBinding.install()/begin_record() before the forward"
            )
        # Activation recompute reruns routers in backward, possibly after later micro-batches'
        # forwards: the context says which micro-batch this call belongs to. No FIFO.
        if not in_backward:
            self._note_routed(replay, key)
        if self.mode == "record":
            probs, idx_NK = default_compute_topk(scores, topk, num_groups, group_topk)
            if not in_backward:
                self._recorded[(key, replay.moe_ordinal)] = idx_NK.detach()
            return probs, idx_NK
        target = self._targets.get(key)
        if target is None:
            raise RuntimeError(
                f"no routes installed for micro-batch {key!r} at MoE layer {replay.layer_number}"
            )
        rows_LNK, missing_LN, filled_LN = target
        if rows_LNK.shape[1] != scores.shape[0]:
            raise ValueError(
                f"MoE layer {replay.layer_number}: {rows_LNK.shape[1]} installed route rows for "
                f"{scores.shape[0]} tokens on this rank (sequence/batch shape mismatch)"
            )
        layer = replay.moe_ordinal - self._stage_range[0]
        idx_NK = self._wide_rows(rows_LNK)[layer]
        missing_N = None if missing_LN is None else missing_LN[layer]
        if missing_N is not None:  # None: no missing row in this micro-batch (or balanced)
            # Missing rows hold the marker id; where() swaps in the router's choice before gather.
            _, native_NK = default_compute_topk(scores, topk, num_groups, group_topk)
            idx_NK = torch.where(missing_N.unsqueeze(-1), native_NK, idx_NK)
        if self.on_replay is not None and not in_backward:
            # --route-replay-check (replay_check.ReplayCheck): compare with what Megatron uses.
            # Every forward, with or without grad (a checkpointed forward runs without), never
            # a recompute: each micro-batch's rows once. Balanced rows: the data's filled mask.
            if not self.native_missing and filled_LN is not None:
                missing_N = filled_LN[layer]
            self.on_replay(
                key,
                scores,
                idx_NK,
                missing_N,
                lambda: default_compute_topk(scores, topk, num_groups, group_topk)[1],
            )
        return scores.gather(1, idx_NK), idx_NK

    def _note_routed(self, replay: KeyedRouterReplay, key: Hashable) -> None:
        """Every forward routes each layer once per install/begin_record: a second time is the
        next micro-batch's forward, which nobody installed."""
        if self._routed_serial != self.micro_batches.serial:
            self._routed, self._routed_serial = set(), self.micro_batches.serial
        elif replay.moe_ordinal in self._routed:
            raise RuntimeError(
                f"MoE layer {replay.layer_number} routed micro-batch {key!r} a second time: "
                "call RouteReplayBinding.install()/begin_record() before every forward (it "
                "would replay, or record over, the previous micro-batch's routes)"
            )
        self._routed.add(replay.moe_ordinal)

    def _wide_rows(self, rows_LNK: torch.Tensor) -> torch.Tensor:
        """``rows_LNK`` as int64 (the gather's index type), widened once per pass over the stage."""
        # The first router of a forward (or of a recompute) widens every layer in one kernel; the
        # next routers slice it, so a layer's replay is a gather, as Megatron's. Only the last
        # pass's copy is cached: routers that saved their slice for backward keep their own
        # micro-batch's copy alive, as they would per layer.
        cached = self._wide
        if cached is None or cached[0] is not rows_LNK:
            cached = self._wide = (rows_LNK, rows_LNK.to(torch.int64))
        return cached[1]

    # ----- record mode output ----------------------------------------------------------------
    def recorded_routes(self, key: Hashable) -> torch.Tensor:
        """The routes the forward of ``key`` chose, in the data layout ``[B, S, L, K]`` (uint8 or
        uint16), the same on every rank of the TP (with SP), CP and PP groups.

        NOTE: device-to-host sync (PP gather of Python objects); record mode only, not a hot path.
        """
        batch_size, seq_len = self._shapes[key]
        recorded = {ordinal: self._recorded[(key, ordinal)] for ordinal in self.stage_ordinals}
        row_positions = self._row_positions
        cu_seqlens = self._cu_seqlens.get(key)
        if cu_seqlens is not None:  # a packed row under CP: split per document, not the zigzag

            def row_positions(b: int, s: int, tp_rank: int, cp_rank: int) -> torch.Tensor:
                return router_row_positions(
                    b,
                    s,
                    cp_size=parallel_state.get_context_parallel_world_size(),
                    cp_rank=cp_rank,
                    tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                    tp_rank=tp_rank,
                    sequence_parallel=self.config.sequence_parallel,
                    cu_seqlens=cu_seqlens,
                )

        return gather_recorded_routes(
            recorded,
            batch_size,
            seq_len,
            num_layers=self.num_moe_layers,
            topk=self.topk,
            num_experts=self.config.num_moe_experts,
            sequence_parallel=self.config.sequence_parallel,
            row_positions=row_positions,
        )
