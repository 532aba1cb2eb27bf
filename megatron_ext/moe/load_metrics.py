"""Per-layer expert load: token counts per expert and per EP rank, kept on the device.

The busiest expert (and EP rank) sets the MoE step's pace. Counts are added on the device at every
forward (no host sync), reduced and read only when logged; with a pad mask real tokens are counted
apart, which shows whether pads form a hot spot. One layer, 4 experts on 2 EP ranks, 3 tokens of
top-2, the last token a pad::

    routing_map_TE = [[1,1,0,0], [1,0,1,0], [1,1,0,0]]    pad_mask_T = [0, 0, 1]
    tokens per expert        [3, 2, 1, 0]   per EP rank [5, 1]   max/mean 3/1.5 -> max_vio 1.0
    real tokens per expert   [2, 1, 1, 0]

Shape legend: T tokens, E experts (global), L recorded MoE layers, R EP ranks.
"""

import torch
import torch.distributed as dist

from megatron_ext.common.micro_batch import MicroBatchContext


def load_stats(counts_LE: torch.Tensor, ep_size: int) -> dict[str, torch.Tensor]:
    """``{expert,rank}_{max,mean,max_vio}`` ``[L]`` (``max_vio = (max - mean) / mean``) and
    ``rank_counts_LR``, experts in contiguous blocks of ``E / ep_size`` per EP rank; sync-free."""
    num_layers, num_experts = counts_LE.shape
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over {ep_size} EP ranks")
    counts_LE = counts_LE.double()
    counts_LR = counts_LE.view(num_layers, ep_size, num_experts // ep_size).sum(-1)
    stats: dict[str, torch.Tensor] = {"rank_counts_LR": counts_LR}
    for unit, c in (("expert", counts_LE), ("rank", counts_LR)):
        peak, mean = c.amax(-1), c.mean(-1)
        stats[f"{unit}_max"] = peak
        stats[f"{unit}_mean"] = mean
        # An empty layer (no tokens) is perfectly balanced, not NaN.
        stats[f"{unit}_max_vio"] = torch.where(mean > 0, (peak - mean) / mean.clamp_min(1e-12), 0)
    return stats


def peak_over_mean(stats: dict[str, torch.Tensor], unit: str, prefix: str = "") -> float:
    """Worst layer's ``max / mean`` of ``unit`` (``"rank"``, ``"expert"``) from :func:`load_stats`
    output, for reports; ``prefix`` ``"real_"``: real tokens only.

    NOTE: device-to-host sync (``float``); call it when reporting, not in a step.
    """
    return 1.0 + float(stats[f"{prefix}{unit}_max_vio"].max())


class ExpertLoadMetrics:
    """Accumulates per-layer routing counts on the device; reduce and read with :meth:`summary`.
    ``micro_batches`` None: a context nobody begins (every training-mode forward counts)."""

    def __init__(
        self, num_experts: int, ep_size: int = 1, micro_batches: MicroBatchContext | None = None
    ) -> None:
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split over {ep_size} EP ranks")
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.micro_batches = MicroBatchContext() if micro_batches is None else micro_batches
        self._tokens: dict[int, torch.Tensor] = {}
        self._real_tokens: dict[int, torch.Tensor] = {}

    def counts_pass(self, module: torch.nn.Module) -> bool:
        """Whether this pass of ``module`` (a MoE layer) belongs in the metrics: the forward of a
        training micro-batch, with or without grad, never its recompute nor an evaluation."""
        # A checkpointed forward runs without grad: each micro-batch then counts once under full,
        # selective and MoE recompute, on every virtual pipeline stage.
        context = self.micro_batches
        return module.training and context.training and not context.recomputing

    def record(
        self, layer: int, routing_map_TE: torch.Tensor, pad_mask_T: torch.Tensor | None = None
    ) -> None:
        """Adds one forward's routing of ``layer`` (Megatron's 1-based number), device ops only;
        ``pad_mask_T`` (True = pad, or None) counts real tokens apart."""
        if routing_map_TE.shape[-1] != self.num_experts:
            raise ValueError(
                f"layer {layer}: routing map has {routing_map_TE.shape[-1]} experts, "
                f"expected {self.num_experts}"
            )
        tokens_E = routing_map_TE.sum(0, dtype=torch.long)
        self._tokens[layer] = self._tokens.get(layer, 0) + tokens_E
        if pad_mask_T is not None:
            real_TE = routing_map_TE & ~pad_mask_T.bool().reshape(-1, 1)
            self._real_tokens[layer] = self._real_tokens.get(layer, 0) + real_TE.sum(
                0, dtype=torch.long
            )

    def reset(self) -> None:
        """Forgets everything recorded (call after logging)."""
        self._tokens.clear()
        self._real_tokens.clear()

    @property
    def layers(self) -> list[int]:
        """Layer numbers recorded so far, sorted."""
        return sorted(self._tokens)

    def device_stats(self, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
        """``tokens_LE`` and its :func:`load_stats`, all-reduced across ``group``, on the device;
        with a pad mask on every layer also ``real_tokens_LE`` and its stats (``real_``)."""
        layers = self.layers
        if not layers:
            return {}
        sets = {"": torch.stack([self._tokens[layer] for layer in layers])}
        if all(layer in self._real_tokens for layer in layers):
            sets["real_"] = torch.stack([self._real_tokens[layer] for layer in layers])
        out: dict[str, torch.Tensor] = {}
        for prefix, counts_LE in sets.items():
            if group is not None and dist.get_world_size(group) > 1:
                counts_LE = counts_LE.clone()
                dist.all_reduce(counts_LE, group=group)
            out[f"{prefix}tokens_LE"] = counts_LE
            out.update({prefix + k: v for k, v in load_stats(counts_LE, self.ep_size).items()})
        return out

    def summary(self, group: dist.ProcessGroup | None = None) -> dict[str, float | list[float]]:
        """Reduced, host-side metrics per layer, for a logger: ``layer{n}/expert_max_vio`` etc.

        NOTE: device-to-host sync (one ``tolist``), by design only when metrics are logged.
        """
        stats = self.device_stats(group)
        host = {k: v.tolist() for k, v in stats.items()}  # NOTE: device-to-host sync
        flat: dict[str, float | list[float]] = {}
        for i, layer in enumerate(self.layers):
            for key, values in host.items():
                flat[f"layer{layer}/{key.replace('_LE', '').replace('_LR', '')}"] = values[i]
        return flat
