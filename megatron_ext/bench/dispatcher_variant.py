"""One dispatcher setting of the ``alignment`` benchmark, timed round by round on its own layer.

A :class:`Variant` is a MoE layer (Megatron's, or megatron_ext's aligned one) and the setting it
runs at: a precision (None: the bf16 path, which needs no alignment) and Megatron's router padding.
A trip (:func:`round_trip`) is the dispatcher's own work, dispatch + combine, around stand-in
experts that copy their rows outside the timed span::

    dispatch_preprocess -> token_dispatch -> dispatch_postprocess   timed
    h * 1.0                                                         stand-in experts, not timed
    combine_preprocess -> token_combine -> combine_postprocess      timed
"""

import contextlib
import resource
import time

import torch

from megatron_ext.bench.op_counter import OpCounter

# precision -> (--fp8-format, --fp8-recipe, --fp4-recipe): the fields Megatron's multiple reads.
PRECISIONS = {"fp8": ("e4m3", "tensorwise", None), "mxfp8": ("e4m3", "mxfp8", None)}
PRECISIONS["nvfp4"] = (None, None, "nvfp4")
DISPATCHERS = ("alltoall", "allgather")


def set_precision(cfg, precision: str | None, layer=None) -> None:
    """Sets Megatron's fp8 / fp4 fields of ``cfg`` for ``precision`` (None: neither); with
    ``layer`` (an ``AlignedMoELayer`` built on ``cfg``), passes the new multiple down to it."""
    fp8, recipe, fp4 = PRECISIONS.get(precision, (None, None, None))
    cfg.fp8, cfg.fp8_recipe = fp8, recipe
    cfg.fp4, cfg.fp4_recipe = ("e2m1", "nvfp4") if fp4 else (None, None)
    # An AlignedMoELayer decides its multiple once, at construction: tell it of the new one.
    if hasattr(layer, "realign"):
        layer.realign()


def round_trip(layer, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, span=None):
    """Dispatch and combine around stand-in experts.

    Returns (rows into the exchange, groups, seconds in the dispatcher, the layer's output).
    ``span``: a context entered around the two dispatcher spans (an :class:`OpCounter`), outside
    their timing.
    """
    d = layer.token_dispatcher
    span = span or contextlib.nullcontext()
    # On a GPU the device is synchronised at each clock read (kernels run asynchronously), so each
    # span holds its own kernels and nothing queued before it.
    sync = torch.cuda.synchronize if x.is_cuda else _no_sync
    with span:
        sync()
        start = time.perf_counter()
        h, p = d.dispatch_preprocess(x, routing_map, probs)
        rows_sent = h.shape[0]
        h, p = d.token_dispatch(h, p)
        h, tokens_per_expert, p = d.dispatch_postprocess(h, p)
        sync()
        dispatched = time.perf_counter()
    # The stand-in experts: a copy, as an expert's output is a fresh tensor. Its cost is the
    # experts' (it grows with the pad rows, as the GEMMs do), not the dispatcher's: not timed.
    h = h * 1.0
    with span:
        sync()
        combine = time.perf_counter()
        h = d.combine_preprocess(h)
        h = d.token_combine(h)
        out = d.combine_postprocess(h)
        sync()
        done = time.perf_counter()
    return rows_sent, tokens_per_expert, (dispatched - start) + (done - combine), out


def _no_sync() -> None:
    """CPU ops finish before they return: nothing to wait for."""


class Variant:
    """One dispatcher setting timed in every round: a layer and the precision it runs at."""

    def __init__(
        self, layer, precision: str | None, router_padding: bool = False, inputs=None
    ) -> None:
        self.layer, self.precision, self.router_padding = layer, precision, router_padding
        self.inputs = inputs  # its own (x, probs, routing_map) instead of the round's
        self.seconds: list[float] = []
        self.faults: list[int] = []
        self.rows_sent, self.groups = 0, []
        self.ops: int | None = None  # ATen ops per trip (OpCounter), from count_ops

    @contextlib.contextmanager
    def _setting(self, x, probs, routing_map):
        """This variant's precision and router padding on its layer, no_grad; yields its inputs
        (its own, or the round's)."""
        cfg = self.layer.config
        set_precision(cfg, self.precision, self.layer)
        cfg.moe_router_padding_for_quantization = self.router_padding
        try:
            with torch.no_grad():
                yield self.inputs if self.inputs is not None else (x, probs, routing_map)
        finally:
            cfg.moe_router_padding_for_quantization = False

    def run(self, x, probs, routing_map, reps: int) -> None:
        """One round: appends the time per trip and the minor page faults per trip."""
        with self._setting(x, probs, routing_map) as (x, probs, routing_map):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            seconds = 0.0
            for _ in range(reps):
                # A fresh map each trip: Megatron's pad_routing_map writes into the one it gets.
                trip_map = routing_map.clone()
                self.rows_sent, self.groups, trip, _ = round_trip(self.layer, x, probs, trip_map)
                seconds += trip
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        self.seconds.append(seconds / reps)
        self.faults.append(faults // reps)

    def count_ops(self, x, probs, routing_map) -> int:
        """One untimed trip under an :class:`OpCounter`: the dispatcher's ATen ops per trip."""
        counter = OpCounter()
        with self._setting(x, probs, routing_map) as (x, probs, routing_map):
            round_trip(self.layer, x, probs, routing_map.clone(), span=counter)
        self.ops = counter.count
        return self.ops


def build_layer(dispatcher: str, hidden: int, aligned: bool, device: str = "cpu"):
    """A seeded MoE layer (local spec, 8 experts) with Megatron's ``dispatcher``, megatron_ext's
    aligned one when ``aligned``, on ``device``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.moe.layer_specs import with_aligned_moe
    from megatron_ext.testing import tiny_moe_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    cfg = tiny_moe_config(
        hidden_size=hidden, num_attention_heads=4, moe_token_dispatcher_type=dispatcher
    )
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    if aligned:
        spec = with_aligned_moe(spec, MoEAlignmentConfig(moe_dispatch_align=True))
    torch.manual_seed(0)
    return spec.submodules.mlp(config=cfg, pg_collection=None, is_mtp_layer=False).to(device)
