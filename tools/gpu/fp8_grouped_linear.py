"""The fp8 expert GEMM of tools/gpu/gpu_check.py: Megatron's TEGroupedMLP linear backend on
``torch._scaled_grouped_mm``, the real fp8 grouped kernel reachable without Transformer Engine.

The kernel takes e4m3 operands with rowwise scales and needs every group's rows to be a multiple
of 16: fed by megatron_ext's aligned dispatcher it runs, fed unaligned groups it fails. The check
compares its output with the bf16 layer's within :data:`FP8_REL_ERR_BOUND`, derived below.
Example: 3 experts holding 16, 0 and 32 rows give ``offs = [16, 16, 48]`` (int32 group ends).
"""

import math

import torch

#: e4m3 has 3 mantissa bits: round-to-nearest has relative error |d| <= u = 2**-4, and for
#: values spread over the binade d is close to uniform on [-u, u], so rms(d) = u / sqrt(3).
#: One GEMM y = sum_k x_k w_k with both operands quantized (rowwise scales keep them in e4m3's
#: normal range): y_hat - y = sum_k x_k w_k (dx_k + dw_k), independent terms, so for zero-mean
#: random data the relative rms error is u * sqrt(2/3) (about 0.051). The expert MLP chains two
#: quantized GEMMs (fc1 -> activation with slope <= ~1.1 -> fc2): fc2 sees fc1's error plus its
#: own, about u * sqrt(2/3) * sqrt(3) = u * sqrt(2) (about 0.088); combining top-k experts with
#: probabilities does not raise a relative error. The bound allows 2x that (finite-sample spread
#: and the bf16 reference's own 2**-9); a broken path (unaligned groups, wrong scales or
#: offsets) gives errors of order 1.
FP8_REL_ERR_BOUND = 2 * math.sqrt(2) * 2**-4  # ~0.177


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
