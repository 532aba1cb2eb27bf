"""GPU proof of megatron_ext's MoE alignment: a real fp8 grouped GEMM fed by our aligned dispatch.

Run by tools/gpu_check.sh on one GPU (H200: torch 2.11 + CUDA 13, no network, no Transformer
Engine). One Megatron ``AlignedMoELayer`` (all-to-all dispatcher, 8 experts, top-2) runs
forward/backward with fp8 experts built on ``torch._scaled_grouped_mm`` (rowwise e4m3 scales; the
kernel needs 16-row groups), while ``torch.cuda.set_sync_debug_mode("error")`` guards our
alignment (pad + strip). It compares with the bf16 layer and times ours against Megatron's
``--moe-router-padding-for-quantization`` path. ``--cpu-smoke`` runs the same script on CPU with
``torch._grouped_mm`` in place of the fp8 kernel (what CI can check).

Prints one JSON line with the results.
"""

import argparse
import json
import os
import statistics
import time

import torch


class ScaledGroupedFp8Linear(torch.nn.Module):
    """TEGroupedMLP linear backend: e4m3 rowwise-scaled ``torch._scaled_grouped_mm`` forward.

    Backward runs in bf16 through ``torch._grouped_mm`` (the check is about the fp8 forward GEMM
    receiving aligned groups; fp8 wgrad needs the same alignment and is not exercised here).
    """

    def __init__(self, num_gemms, input_size, output_size, /, *, config, init_method, **kwargs):
        super().__init__()
        w = torch.empty(num_gemms, output_size, input_size, dtype=torch.bfloat16)
        for wi in w:
            init_method(wi)
        self.weight = torch.nn.Parameter(w.transpose(1, 2).contiguous().cuda())
        self.config = config
        self.use_fp8 = True

    def forward(self, x, tokens_per_expert):
        offs = torch.tensor(tokens_per_expert, device=x.device).cumsum(0, dtype=torch.int32)
        return _Fp8GroupedMM.apply(x, self.weight, offs, self.use_fp8), None

    def backward_dw(self):
        pass


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, use_fp8):
        ctx.save_for_backward(x, w, offs)
        if not use_fp8:
            return torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs).to(x.dtype)
        fp8 = torch.float8_e4m3fn
        x_scale = x.abs().amax(-1).float().clamp_min(1e-12) / torch.finfo(fp8).max
        w_t = w.transpose(1, 2)  # [G, out, in]
        w_scale = w_t.abs().amax(-1).float().clamp_min(1e-12) / torch.finfo(fp8).max
        xq = (x / x_scale[:, None]).to(fp8)
        wq = (w_t / w_scale[..., None]).to(fp8).transpose(1, 2)  # column-major per group
        return torch._scaled_grouped_mm(
            xq, wq, x_scale, w_scale, offs=offs, out_dtype=torch.bfloat16
        ).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        g = g.contiguous().bfloat16()
        dx = torch._grouped_mm(g, w.bfloat16().transpose(1, 2), offs=offs)
        dw = torch._grouped_mm(x.bfloat16().t(), g, offs=offs)
        return dx.to(x.dtype), dw.to(w.dtype), None, None


def _init_dist(device: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group(
        "nccl" if device == "cuda" else "gloo", rank=0, world_size=1
    )
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _build(aligned: bool, backend, router_padding: bool = False):
    import functools

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    from megatron_ext.config import MoEAlignmentConfig
    from megatron_ext.moe.layer_specs import with_aligned_moe
    from megatron_ext.testing import tiny_moe_config

    cfg = tiny_moe_config(hidden_size=1024, moe_ffn_hidden_size=2048, num_attention_heads=8)
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
    cfg.fp8, cfg.fp8_recipe = (
        "e4m3",
        "tensorwise",
    )  # set after build: no TE to validate it
    cfg.moe_router_padding_for_quantization = router_padding
    return layer.to(torch.cuda.current_device() if torch.cuda.is_available() else "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="run on CPU with _grouped_mm")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cpu":
        from megatron_ext.cpu import enable_cpu_mode

        enable_cpu_mode()
    _init_dist(device)
    backend = ScaledGroupedFp8Linear
    if args.cpu_smoke:
        from megatron_ext.moe.grouped_mm_linear import GroupedMMLinear as backend
    ours = _build(True, backend)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, 1, 1024, generator=g).to(device).requires_grad_()
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}

    # Our alignment path under the sync detector: pad + strip of the dispatcher.
    from megatron_ext.moe import alignment as al

    counts = torch.randint(0, 600, (1, 8), device=device)
    n = int(counts.sum())
    rows = al.static_aligned_rows(n, 8, 16)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    layout = al.plan_aligned_layout(counts, 16, n, rows)
    y = al.strip_layout(al.pad_to_layout(torch.ones(n, 8, device=device), layout), layout)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode(0)
    result["alignment_sync_free"] = bool(y.shape[0] == n)

    out, _ = ours(x)
    out.float().sum().backward()
    bf16 = _build(True, backend)
    bf16.load_state_dict(ours.state_dict())
    bf16.config.fp8 = None
    for m in bf16.modules():
        if hasattr(m, "use_fp8"):
            m.use_fp8 = False
    ref, _ = bf16(x.detach())
    rel = ((out - ref).float().norm() / ref.float().norm()).item()
    result["fp8_vs_bf16_rel_err"] = rel

    def timed(layer) -> float:
        times = []
        for _ in range(args.repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            o, _ = layer(x.detach())
            o.float().sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    result["ms_ours"] = timed(ours)
    try:
        result["ms_router_padding"] = timed(_build(False, backend, router_padding=True))
    except (
        RuntimeError,
        ValueError,
    ) as e:  # report the failure (an unaligned group) instead
        result["router_padding_error"] = repr(e)[:300]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
