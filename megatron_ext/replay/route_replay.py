"""Route replay inside any training loop: engine routes installed on a Megatron-Core model the
caller built and runs (RL frameworks' own loops; no ``pretrain``, no dataset), over the entry's
:class:`~megatron_ext.replay.binding.RouteReplayBinding`::

    with RouteReplay(model) as replay:                   # GPTModel / HybridModel, or its VPP chunks
        for step in range(steps):
            for batch in micro_batches:
                replay.set_routes(batch["routes"])      # [B, S, L, K] (or [T, L, K]): engine ids
                loss = model(tokens, positions, None, labels=labels)  ...  backward
            optimizer.step()
            replay.clear()                             # after the step's last backward
    # leaving the block puts Megatron's own RouterReplay back: the model routes natively again

Legend: B samples, S positions, T tokens, L MoE layers, K top-k.
"""

from collections.abc import Hashable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from megatron_ext.common.micro_batch import MicroBatchContext
from megatron_ext.replay.binding import RouteReplayBinding
from megatron_ext.replay.keyed_router_replay import replayed_routers, unwrap_model
from megatron_ext.replay.route_ids import narrow_routes
from megatron_ext.replay.routes import missing_value, pad_routes, route_dtype


class RouteReplay:
    """Engine routes on the MoE routers of a model the caller built (a context manager).

    ``model``: the model on this rank (``GPTModel`` or ``HybridModel``, maybe wrapped), or its
    chunks under virtual pipeline stages. Rows without a route take the router's own top-k.
    ValueError: no MoE router on this rank, or a config where Megatron would bypass replay.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        missing_route_policy: Literal["native"] = "native",
    ) -> None:
        from megatron.core import parallel_state

        #: Context-parallel ranks: packed (THD) routes then follow Megatron's per-document split.
        self.cp_size = parallel_state.get_context_parallel_world_size()
        chunks = [unwrap_model(m) for m in (model if isinstance(model, Sequence) else [model])]
        self.chunks = chunks
        #: The micro-batch each chunk runs: one context for every chunk (a micro-batch has one
        #: key on each), begun by :meth:`set_routes`; recompute in backward reads it.
        self.micro_batches = MicroBatchContext()
        self.bindings: list[RouteReplayBinding | None] = []
        for chunk in chunks:
            self.micro_batches.attach(chunk)
            if not replayed_routers(chunk):
                self.bindings.append(None)  # a chunk of dense layers: nothing to replay
                continue
            self.bindings.append(
                RouteReplayBinding(
                    chunk,
                    "replay",
                    missing_route_policy=missing_route_policy,
                    micro_batches=self.micro_batches,
                )
            )
        bound = [b for b in self.bindings if b is not None]
        if not bound:
            raise ValueError("RouteReplay: no MoE router on this rank's model")
        config = bound[0].config
        self.num_layers, self.topk = bound[0].num_moe_layers, config.moe_router_topk
        self.num_experts = config.num_moe_experts
        self.dtype = route_dtype(self.num_experts, self.topk)
        self.step = 0
        self._positions: dict[int, int] = {}

    def set_routes(
        self,
        routes: Any,
        *,
        model: torch.nn.Module | None = None,
        key: Hashable | None = None,
        src_index: Any = None,
        thd: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> Hashable:
        """Installs one micro-batch's routes on the chunk about to run it; returns its key.

        Args:
            routes: ``[B, S, L, K]`` or one sequence ``[T, L, K]`` (numpy or torch, host or
                device), in the tokens' order: the route sidecar's rows (all-max: missing) or
                any integer ids with -1 for a missing row.
            model: The chunk that runs next (under virtual pipeline stages); None: the first.
            key: Names the micro-batch until :meth:`clear`; default ``(step, index)``.
            src_index: ``[B, S]`` (or ``[S]``): the position each token copies (a self pad),
                -1 for a constant pad (a missing row); None: every token its own.
            thd: The forward runs THD packed sequences (tokens ``[1, B*S]``).
            cu_seqlens: Under context parallelism with ``thd``: the forward's
                ``PackedSeqParams.cu_seqlens_q`` (1-D, every one a multiple of 2*CP); the whole
                micro-batch's routes are given and this rank keeps its share.

        Raises:
            ValueError: Routes of another shape, an id outside ``[0, E)`` or -1, or repeated
                ids in a row (host routes are checked; device routes are not read).
        """
        chunk = 0 if model is None else self._chunk_index(model)
        # The index counted per chunk: a micro-batch has one key on every chunk.
        if key is None:
            key = (self.step, self._positions.get(chunk, 0))
            self._positions[chunk] = key[1] + 1
        routes_BSLK, has_missing = self._narrow(routes, src_index)
        if thd:
            routes_BSLK = routes_BSLK.reshape(1, -1, *routes_BSLK.shape[2:])
        cp_index = self._cp_index(routes_BSLK.shape[1], thd, cu_seqlens)
        self.micro_batches.begin(key)
        binding = self.bindings[chunk]
        if binding is not None:
            device = next(binding.chunks[0].parameters()).device
            binding.install(
                routes_BSLK.to(device, non_blocking=True),
                key,
                has_missing=has_missing,
                cp_index=None if cp_index is None else cp_index.to(device, non_blocking=True),
            )
        return key

    def _cp_index(
        self, total: int, thd: bool, cu_seqlens: torch.Tensor | None
    ) -> torch.Tensor | None:
        """This CP rank's positions of a THD row (Megatron's per-document split), or None."""
        if self.cp_size == 1:
            return None
        if not thd:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens is for packed (thd=True) micro-batches")
            return None  # the binding slices Megatron's per-sequence zigzag itself
        if cu_seqlens is None or cu_seqlens.dim() != 1:
            raise ValueError(
                "under context parallelism, set_routes(thd=True) needs the row's 1-D cu_seqlens "
                "(the forward's PackedSeqParams.cu_seqlens_q): Megatron splits packs per document"
            )
        from megatron.core import parallel_state
        from megatron.core import utils as mcore_utils

        # The split Megatron's get_batch_on_this_cp_rank makes of the tokens (TE's
        # thd_get_partitioned_indices), as the dataset path does. Without thd, the binding
        # follows Megatron's per-sequence zigzag by itself.
        return mcore_utils.tex.thd_get_partitioned_indices(
            cu_seqlens.to(torch.int32),
            total,
            self.cp_size,
            parallel_state.get_context_parallel_rank(),
        )

    def clear(self) -> None:
        """Forgets the step's routes (call after its last backward); keys count from 0 again."""
        for binding in self.bindings:
            if binding is not None:
                binding.clear()
        self.step += 1
        self._positions.clear()

    def remove(self) -> None:
        """Puts Megatron's own ``RouterReplay`` back on every router."""
        for binding in self.bindings:
            if binding is not None:
                binding.remove()
        self.micro_batches.detach()

    def __enter__(self) -> "RouteReplay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _chunk_index(self, model: torch.nn.Module) -> int:
        chunk = unwrap_model(model)
        for i, c in enumerate(self.chunks):
            if c is chunk:
                return i
        raise ValueError("set_routes(model=...): not one of the chunks RouteReplay was built on")

    def _narrow(self, routes: Any, src_index: Any) -> tuple[torch.Tensor, bool | None]:
        """``routes`` as ``[B, S, L, K]`` of the sidecar's dtype, and whether a row is missing
        (None for device routes: never read, their missing mask is built on the device)."""
        on_device = torch.is_tensor(routes) and routes.device.type != "cpu"
        if on_device:
            if src_index is not None:
                raise ValueError("set_routes(src_index=...) takes host routes")
            routes_BSLK = routes if routes.dim() == 4 else routes.unsqueeze(0)
            self._check_shape(routes_BSLK.shape)
            return routes_BSLK, None
        array = routes.numpy() if torch.is_tensor(routes) else np.asarray(routes)
        array = array if array.ndim == 4 else array[None]
        self._check_shape(array.shape)
        narrow = narrow_routes(array, self.num_experts, self.dtype)
        if src_index is not None:  # each pad replays its source's route, as the dataset pads
            index_BS = np.asarray(src_index).reshape(narrow.shape[:2])
            narrow = np.stack([pad_routes(r, i) for r, i in zip(narrow, index_BS, strict=True)])
        marker = missing_value(self.dtype)
        return torch.from_numpy(narrow), bool((narrow == marker).all(-1).any())

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        if len(shape) != 4 or tuple(shape[2:]) != (self.num_layers, self.topk):
            raise ValueError(
                f"routes must be [B, S, {self.num_layers}, {self.topk}] or [T, {self.num_layers}, "
                f"{self.topk}] (the model's MoE layers x top-k), got {list(shape)}"
            )
