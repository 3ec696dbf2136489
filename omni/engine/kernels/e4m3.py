"""FP8 (e4m3) values as the W8A8 kernels and their references share them: the dtype and
its range, rows scaled by their own absolute max, rows a kernel quantized attached to
its output, and the W8A8 product's torch reference (a leaf: fp8.py's layers, the norm,
rope and attention kernels and w8a8.py all import it)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x scaled into e4m3's range by its own absolute max: (e4m3 rows, fp32
    scales [rows]), x ~ rows * scales."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ w.T (+ bias) the W8A8 way: x quantized per token, `weight` [N, K] e4m3 with
    fp32 `weight_scale` [N]; the e4m3 products summed in fp32, then both scales applied."""
    shape = x.shape
    xq, xs = quantize_rows(x.reshape(-1, shape[-1]))
    y = (xq.float() @ weight.float().T) * xs[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*shape[:-1], weight.shape[0])


def attach_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Give x [rows, K] its rows already quantized (quantize_rows' bits: a norm kernel that
    wrote them beside x), so the FP8 projection it feeds skips quantizing them."""
    x._omni_fp8_rows = (q, scale)
    return x


def attached_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x's rows in e4m3 with their scales, if a kernel attached them (attach_rows)."""
    return getattr(x, "_omni_fp8_rows", None)
