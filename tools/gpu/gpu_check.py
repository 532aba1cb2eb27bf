"""GPU proof of megatron_ext's MoE alignment: a real fp8 grouped GEMM fed by our aligned dispatch.

Run by tools/gpu_check.sh on one GPU (H200: torch 2.11 + CUDA 13, no network, no Transformer
Engine). One Megatron ``AlignedMoELayer`` (all-to-all dispatcher, 8 experts, top-2) runs
forward/backward with fp8 experts built on ``torch._scaled_grouped_mm`` (rowwise e4m3 scales; the
kernel needs 16-row groups), while ``torch.cuda.set_sync_debug_mode("error")`` guards our
alignment (pad + strip). It compares with the bf16 layer and times ours against Megatron's
``--moe-router-padding-for-quantization`` path. ``--cpu-smoke`` runs the same script on CPU with
``torch._grouped_mm`` in place of the fp8 kernel (what CI can check).

Prints one JSON line with the results and exits non-zero when a check fails:

- ``aligned_guarded_calls``: how often the dispatcher's pad and strip, inside the real layer's
  forward, and their backward, ran under ``set_sync_debug_mode("error")`` (a sync there raises,
  failing the run); each must be > 0. On CPU the pad/strip forwards run under megatron_ext's
  host-sync detector instead, and the backward spans are only counted.
- ``aligned_groups_ok``: every group the expert GEMM receives (fc1's input) is a multiple of the
  alignment, and the groups cover its rows.
- ``allgather_guarded_calls``, ``allgather_groups_ok``: the same checks on an all-gather layer
  with the same weights, whose pad plans from Megatron's host counts (the groups' starts copied
  to the device pinned and asynchronously: no stream sync); ``allgather_matches_alltoall``: its
  output is the all-to-all layer's (relative error <= 1e-3; 0.0 when bitwise equal).
- ``fp8_vs_bf16_ok``: the fp8 layer's output is within ``FP8_REL_ERR_BOUND`` of the bf16 layer's
  (relative Frobenius error), a bound derived from e4m3's precision in fp8_grouped_linear.py. On CPU both run the
  same fp32 math (the aligned path beside Megatron's unaligned one): 0.0 there.
- ``ours_over_router_padding`` (with ``_min_max``): forward + backward of ours over Megatron's
  router padding, interleaved round by round for ``rounds`` rounds, the median of the per-round
  paired ratios; ``ms_ours`` / ``ms_router_padding`` are each one's median. Not part of ``ok``.
- ``replay`` (``replay_ok``): route replay on this device: our binding's ``install()`` makes no
  host sync (``install_host_syncs`` empty; under sync debug mode "error" on a GPU), a forward
  of the perturbed model replays every recorded route exactly (``replayed_exactly``) where its
  own routing differs (``native_routes_differ``), and the ``replay`` benchmark's
  paired ratios (median, min, max) to native routing and to Megatron's RouterReplay, timed on
  this device. ``replay_ok`` joins ``ok`` in the exit code; an error is ``replay_error``.
- ``alignment``: the ``alignment`` benchmark's EP=1 rows measured on this device (the
  dispatcher's cost figures: ours/unaligned dispatch + combine for fp8/mxfp8/nvfp4 at 48 and
  8192 tokens, both dispatchers, with the control, floor and no-pad columns), one dict per row; an error there is
  reported as ``alignment_error``. Not part of ``ok``. The checks are printed on a line of their
  own before the table is measured; the last line is always the whole result.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
from device_measurements import alignment_table, replay_checks  # beside this script
from fp8_grouped_linear import FP8_REL_ERR_BOUND, ScaledGroupedFp8Linear

HIDDEN = 1024


class _ModeOnBackward(torch.autograd.Function):
    """Identity whose backward sets the CUDA sync debug mode (guards a span of the backward).

    Placed after pad's output it runs just before pad's backward ("error" on); placed before
    pad's input it runs just after it (off again). Same around strip.
    """

    @staticmethod
    def forward(ctx, x, mode, guard):
        ctx.mode, ctx.guard = mode, guard
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.guard.set_mode(ctx.mode)
        return g, None, None


class SyncGuard:
    """Runs the aligner's pad/strip (forward and backward) under sync-debug "error" on CUDA.

    On CPU (``--cpu-smoke``) the forwards run under megatron_ext's host-sync detector and the
    backward spans are only counted (CPU has no sync debug mode).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.calls = {"pad": 0, "strip": 0, "backward": 0, "groups_checked": 0}
        self.groups_aligned = True
        self._orig: dict = {}
        self._hooks: list = []

    def set_mode(self, mode: str | int) -> None:
        if mode == "error":
            self.calls["backward"] += 1
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode(mode)

    @contextlib.contextmanager
    def _forward_guard(self):
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
        else:
            from megatron_ext.testing import record_host_syncs

            with record_host_syncs() as syncs:
                yield
            # host_counts sizing reads counts Megatron already holds on the host (CPU tensor:
            # no device sync on a GPU); anything else is a real sync.
            real = [
                s
                for s in syncs
                if "aligned_rows_from_host_counts" not in s and "read_host_counts" not in s
            ]
            assert not real, f"host syncs in the aligned pad/strip: {real}"

    def _wrap(self, name: str, fn):
        def guarded(*args, **kwargs):
            args = tuple(
                _ModeOnBackward.apply(a, 0, self) if torch.is_tensor(a) and a.requires_grad else a
                for a in args
            )
            with self._forward_guard():
                out = fn(*args, **kwargs)
            self.calls[name] += 1
            outs = out if isinstance(out, tuple) else (out,)
            outs = tuple(
                _ModeOnBackward.apply(o, "error", self)
                if torch.is_tensor(o) and o.requires_grad
                else o
                for o in outs
            )
            return outs if isinstance(out, tuple) else outs[0]

        return guarded

    def install(self, aligner) -> None:
        self._aligner = aligner
        for name in ("pad", "strip"):
            self._orig[name] = getattr(aligner, name)
            setattr(aligner, name, self._wrap(name, self._orig[name]))

    def watch_groups(self, linear) -> None:
        """Checks the group sizes the expert GEMM itself receives (``linear``'s forward input):
        each a multiple of the alignment, together the rows it is given."""

        def check(module, args) -> None:
            x, sizes = args[0], [int(n) for n in args[1]]
            align = self._aligner.align
            self.calls["groups_checked"] += 1
            self.groups_aligned &= all(n % align == 0 for n in sizes) and sum(sizes) == x.shape[0]

        self._hooks.append(linear.register_forward_pre_hook(check))

    def uninstall(self) -> None:
        for name, fn in self._orig.items():
            setattr(self._aligner, name, fn)
        for hook in self._hooks:
            hook.remove()
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode(0)

    def summary(self) -> dict[str, int]:
        return dict(self.calls)


def _init_dist(device: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group(
        "nccl" if device == "cuda" else "gloo", rank=0, world_size=1
    )
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _build(aligned: bool, backend, router_padding: bool = False, dispatcher: str = "alltoall"):
    import functools

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    from megatron_ext.moe.layer_specs import with_aligned_moe
    from megatron_ext.testing import tiny_moe_config
    from megatron_ext.training.feature_configs import MoEAlignmentConfig

    cfg = tiny_moe_config(
        hidden_size=HIDDEN,
        moe_ffn_hidden_size=2 * HIDDEN,
        num_attention_heads=8,
        moe_token_dispatcher_type=dispatcher,
    )
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    moe = spec.submodules.mlp
    experts = functools.partial(
        TEGroupedMLP,
        submodules=GroupedMLPSubmodules(linear_fc1=backend, linear_fc2=backend),
    )
    sub = moe.keywords["submodules"]
    import dataclasses

    spec.submodules.mlp = functools.partial(
        moe.func, submodules=dataclasses.replace(sub, experts=experts)
    )
    if aligned:
        spec = with_aligned_moe(spec, MoEAlignmentConfig(moe_dispatch_align=True))
    torch.manual_seed(0)
    layer = spec.submodules.mlp(config=cfg, pg_collection=None, is_mtp_layer=False)
    layer.set_layer_number(1)
    cfg.fp8, cfg.fp8_recipe = "e4m3", "tensorwise"  # set after build: no TE to validate it
    cfg.moe_router_padding_for_quantization = router_padding
    if aligned:
        layer.realign()  # the multiple is decided at construction: pass fp8's down
    return layer.to(torch.cuda.current_device() if torch.cuda.is_available() else "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="run on CPU with _grouped_mm")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--skip-alignment-table",
        action="store_true",
        help="skip the dispatcher timing table (the alignment benchmark's EP=1 rows)",
    )
    args = parser.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    global HIDDEN
    if args.cpu_smoke:  # small sizes: a CI-speed run of the same code path
        HIDDEN, args.tokens, args.repeats = 64, min(args.tokens, 256), min(args.repeats, 2)
    if device == "cpu":
        from megatron_ext.cpu.model_stack import enable_cpu_mode

        enable_cpu_mode()
    _init_dist(device)
    backend = ScaledGroupedFp8Linear
    if args.cpu_smoke:
        from megatron_ext.moe.grouped_mm_linear import GroupedMMLinear as backend
    ours = _build(True, backend)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, 1, HIDDEN, generator=g).to(device).requires_grad_()
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}

    # The dispatcher's pad/strip inside the real layer's forward and backward, guarded.
    guard = SyncGuard(device)
    guard.install(ours.token_dispatcher.aligner)
    guard.watch_groups(ours.experts.linear_fc1)
    out, _ = ours(x)
    out.float().sum().backward()
    guard.uninstall()
    result["aligned_guarded_calls"] = guard.summary()
    result["aligned_groups_ok"] = guard.groups_aligned
    # The all-gather dispatcher plans from Megatron's host counts: the groups' starts reach the
    # device pinned and asynchronously. Same weights and routing, so the same output.
    allgather = _build(True, backend, dispatcher="allgather")
    guard = SyncGuard(device)
    guard.install(allgather.token_dispatcher.aligner)
    guard.watch_groups(allgather.experts.linear_fc1)
    out_ag, _ = allgather(x.detach().requires_grad_())
    out_ag.float().sum().backward()
    guard.uninstall()
    result["allgather_guarded_calls"] = guard.summary()
    result["allgather_groups_ok"] = guard.groups_aligned
    diff = (out_ag.detach().float() - out.detach().float()).norm() / out.detach().float().norm()
    result["allgather_vs_alltoall_rel_err"] = diff.item()  # 0.0 when bitwise equal
    result["allgather_matches_alltoall"] = bool(diff.item() <= 1e-3)
    bf16 = _build(True, backend)
    bf16.load_state_dict(ours.state_dict())
    bf16.config.fp8 = None
    bf16.realign()  # the multiple is decided at construction: pass bf16's (0) down
    for m in bf16.modules():
        if hasattr(m, "use_fp8"):
            m.use_fp8 = False
    ref, _ = bf16(x.detach())
    out, ref = out.detach().float(), ref.detach().float()
    rel = ((out - ref).norm() / ref.norm()).item()
    result["fp8_vs_bf16_rel_err"] = rel
    result["fp8_rel_err_bound"] = FP8_REL_ERR_BOUND
    result["fp8_vs_bf16_ok"] = bool(float(ref.norm()) > 0 and rel <= FP8_REL_ERR_BOUND)

    def trip(layer) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        o, _ = layer(x.detach())
        o.float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    # Ours beside Megatron's router padding, interleaved round by round (the order alternating):
    # the figure is the median of the per-round paired ratios, with their min and max.
    padded = _build(False, backend, router_padding=True)
    try:
        trip(padded)  # warm-up; an unaligned group raises here (reported instead)
    except (RuntimeError, ValueError) as e:
        result["router_padding_error"] = repr(e)[:300]
        padded = None
    trip(ours)
    times: dict[str, list[float]] = {"ours": [], "router_padding": []}
    for r in range(args.repeats):
        variants = [("ours", ours), ("router_padding", padded)]
        for name, layer in variants[:: 1 if r % 2 else -1]:
            if layer is not None:
                times[name].append(trip(layer))
    result["rounds"] = args.repeats
    result["ms_ours"] = 1e3 * statistics.median(times["ours"])
    if padded is not None:
        ratios = [a / b for a, b in zip(times["ours"], times["router_padding"], strict=True)]
        result["ms_router_padding"] = 1e3 * statistics.median(times["router_padding"])
        result["ours_over_router_padding"] = statistics.median(ratios)
        result["ours_over_router_padding_min_max"] = [min(ratios), max(ratios)]
    guarded = all(
        result[f"{name}_guarded_calls"][k] > 0
        for name in ("aligned", "allgather")
        for k in ("pad", "strip", "backward", "groups_checked")
    )
    result["ok"] = bool(
        guarded
        and result["aligned_groups_ok"]
        and result["allgather_groups_ok"]
        and result["allgather_matches_alltoall"]
        and result["fp8_vs_bf16_ok"]
    )
    # The alignment checks first, on a line of their own: a later section that fails or outruns
    # the shell script's timeout must not take them with it. The last line is the whole result.
    print(json.dumps(result), flush=True)
    try:
        result["replay"] = replay_checks(device, args.cpu_smoke)
    except Exception as e:  # the checks above are printed: device time is scarce
        result["replay_error"] = repr(e)[:500]
    result["replay_ok"] = bool(result.get("replay", {}).get("ok"))
    if not args.skip_alignment_table:
        try:
            result["alignment"] = alignment_table(device, args.cpu_smoke)
        except Exception as e:  # likewise
            result["alignment_error"] = repr(e)[:500]
    print(json.dumps(result))
    if not (result["ok"] and result["replay_ok"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
