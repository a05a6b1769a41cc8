"""Per-token displacement psi = (1 - cos(a, b)) / 2: fused kernel and PyTorch reference together.

``megatron_jreg._C`` (csrc/) holds the CPU and CUDA kernels, registered as the custom ops
``torch.ops.megatron_jreg.token_displacement_{fwd,bwd}`` (with fake implementations, so
``torch.compile`` traces them); :class:`FusedTokenDisplacement` is the autograd op over them and
:func:`token_displacement_reference` the plain-PyTorch psi it is tested against.
:func:`token_displacement` dispatches between the two; :func:`displacement` is a layer's mean.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from megatron_jreg.jreg import EPS, masked_mean

try:
    from megatron_jreg import _C
except ImportError as err:  # a source checkout that was never built; the tests require _C
    _C = None
    _IMPORT_ERROR: Union[ImportError, None] = err
else:
    _IMPORT_ERROR = None

IMPLS = ("auto", "fused", "torch")
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
NUM_STATS = 3  # per token, saved for backward: 1/(|a||b|), c/|a|^2, c/|b|^2

# Read once: torch.compile must not trace a pybind call to decide the dispatch.
_CUDA_BUILT = _C is not None and bool(_C.cuda_built())


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs; float64 stays float64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_displacement_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token psi = (1 - cos(a, b)) / 2 over the last dimension, in plain PyTorch.

    a, b: [..., h] of any float dtype. Returns [...] in fp32 (float64 for float64 input).
    The sums are taken in float64 whatever the inputs (a product of two fp32 values is exact
    there), so psi keeps ~1e-7 relative accuracy down to psi ~ 1e-9 (nearly parallel
    vectors), where fp32 sums lose every digit; autograd keeps float64 copies of a and b.
    This is the reference that the fused kernel is tested against.
    """
    if a.shape != b.shape:
        raise ValueError(f"token_displacement: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    out_dtype = _compute_dtype(torch.promote_types(a.dtype, b.dtype))
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    dot = (a * b).sum(-1)
    aa = (a * a).sum(-1)
    bb = (b * b).sum(-1)
    # Where |a||b| < EPS the cosine is dot / EPS (0 for a zero vector) and is held constant:
    # such a token has no direction to move, so its gradient is 0 (never NaN or 1/EPS).
    product = aa * bb
    degenerate = product < EPS * EPS
    norm_product = torch.sqrt(torch.where(degenerate, torch.ones_like(product), product))
    cos = torch.where(degenerate, (dot / EPS).detach(), dot / norm_product)
    return ((1.0 - cos) * 0.5).to(out_dtype)


@torch.library.custom_op("megatron_jreg::token_displacement_fwd", mutates_args=())
def _fused_forward(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(psi [...], stats [tokens, 3]) from a, b [..., h]."""
    psi, stats = _C.forward(a, b)
    return psi, stats


@_fused_forward.register_fake
def _fused_forward_fake(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    if a.shape != b.shape or a.dtype != b.dtype or a.dim() < 1:
        raise ValueError(
            f"token_displacement: a and b must share shape and dtype, got {tuple(a.shape)} "
            f"{a.dtype} and {tuple(b.shape)} {b.dtype}"
        )
    acc = _compute_dtype(a.dtype)
    tokens = math.prod(a.shape[:-1])
    return a.new_empty(a.shape[:-1], dtype=acc), a.new_empty((tokens, NUM_STATS), dtype=acc)


@torch.library.custom_op("megatron_jreg::token_displacement_bwd", mutates_args=())
def _fused_backward(
    grad_psi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, stats: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(grad_a, grad_b), contiguous, in the inputs' dtype."""
    grad_a, grad_b = _C.backward(grad_psi, a, b, stats)
    return grad_a, grad_b


@_fused_backward.register_fake
def _fused_backward_fake(
    grad_psi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, stats: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(a, memory_format=torch.contiguous_format), torch.empty_like(
        b, memory_format=torch.contiguous_format
    )


# Memory: the fused op saves a and b (which the model keeps alive anyway) and three fp32
# scalars per token, nothing of size [tokens, h]; the reference keeps float64 copies of both
# inputs for backward. Both take the per-token sums in float64, for every input dtype.
class FusedTokenDisplacement(torch.autograd.Function):
    """psi = (1 - cos(a, b)) / 2 per token through the fused kernel; differentiable in a and b.

    Backward: dpsi/da = -(b/(|a||b|) - c a/|a|^2)/2 and symmetrically for b; 0 for a
    degenerate token (|a||b| < EPS, e.g. a zero vector), as in the reference. Both
    gradients are computed in one pass; double backward is not supported.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        psi, stats = torch.ops.megatron_jreg.token_displacement_fwd(a, b)
        ctx.save_for_backward(a, b, stats)
        return psi

    @staticmethod
    def backward(ctx, grad_psi: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        a, b, stats = ctx.saved_tensors
        grad_a, grad_b = torch.ops.megatron_jreg.token_displacement_bwd(
            grad_psi.to(stats.dtype), a, b, stats
        )
        return grad_a, grad_b


def fused_available(device: Union[torch.device, str]) -> bool:
    """True when the fused kernel is built for tensors on ``device``."""
    device_type = torch.device(device).type
    if _C is None:
        return False
    if device_type == "cpu":
        return True
    return device_type == "cuda" and _CUDA_BUILT


def kernel_status(device: Union[torch.device, str]) -> str:
    """Why the fused kernel is not available on ``device`` (for error messages)."""
    if _C is None:
        return f"the extension megatron_jreg._C failed to import ({_IMPORT_ERROR})"
    return f"the extension was built without {torch.device(device).type.upper()} support"


# _C.CUDA_SKIPPED: why the install built no CUDA kernel (setup.py writes it into the build)
_CUDA_SKIPPED = {
    1: "MEGATRON_JREG_NO_CUDA was set at install",
    2: "torch was a CPU build at install",
    3: "nvcc was missing at install",
}


def kernel_build() -> str:
    """What the installed fused kernel was built for, and why CUDA was left out."""
    if _C is None:
        return kernel_status("cpu")
    if _CUDA_BUILT:
        return "the extension was built for CPU and CUDA"
    why = _CUDA_SKIPPED.get(int(getattr(_C, "CUDA_SKIPPED", -1)), "built outside setup.py")
    return f"the extension was built for CPU only ({why})"


def describe_impl(impl: str, device: Union[torch.device, str]) -> Tuple[str, str]:
    """(what ``token_displacement(impl=impl)`` runs for a run's activations on ``device``,
    why): ``fused`` (the CUDA or CPU kernel) or ``torch`` (the reference), for the trainer's
    start-up line. An explicit ``fused`` that is not built raises in ``resolve_impl``."""
    device_type = torch.device(device).type
    if impl == "torch":
        return "torch", "the PyTorch reference, requested with --jreg-impl torch"
    if fused_available(device):
        kernel = "CUDA" if device_type == "cuda" else "C++/OpenMP"
        return "fused", f"the {kernel} kernel, --jreg-impl {impl}"
    return "torch", (f"the PyTorch reference: no fused kernel for {device_type}: {kernel_build()}; "
                     "reinstall with `pip install --no-build-isolation -e .` to build it")


def resolve_impl(a: torch.Tensor, b: torch.Tensor, impl: str = "auto") -> str:
    """The implementation ``token_displacement`` runs for these inputs: "fused" or "torch".

    ``auto`` takes the fused kernel when it is built for the device and the inputs share a
    dtype it takes (fp32, fp16, bf16, fp64); ``fused`` raises where it is not built.
    """
    if impl not in IMPLS:
        raise ValueError(f"token_displacement: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return "torch"
    if impl == "fused":
        if not fused_available(a.device):
            why = kernel_status(a.device)
            raise RuntimeError(
                f"token_displacement: impl='fused' but the fused kernel is not built for "
                f"{a.device.type} tensors: {why}. Reinstall with "
                f"`pip install --no-build-isolation -e .` (a CUDA torch and nvcc for GPUs), "
                f"or use impl='torch' (--jreg-impl torch)"
            )
        return "fused"
    fits = a.dtype == b.dtype and a.dtype in FUSED_DTYPES and a.device == b.device
    return "fused" if fits and fused_available(a.device) else "torch"


def token_displacement(a: torch.Tensor, b: torch.Tensor, impl: str = "auto",
                       mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token psi = (1 - cos(a, b)) / 2 over the last dimension; differentiable in a and b.

    a, b: [..., h], same shape. Returns [...] in fp32 (float64 for float64 input).
    impl: "auto" | "fused" | "torch" (see ``resolve_impl``).
    mask: [...] bool, True = counted. A masked-out token gets psi 0 and exactly zero
    gradient, whatever its hidden states hold (NaN and inf included), on both paths.
    """
    if mask is not None:
        if tuple(mask.shape) != tuple(a.shape[:-1]):
            raise ValueError(
                f"mask shape {tuple(mask.shape)} must equal the token shape {tuple(a.shape[:-1])} "
                "(the hidden states' shape without the last dimension)")
        mask = mask.to(device=a.device, dtype=torch.bool)
    if resolve_impl(a, b, impl) == "fused":
        # the kernel's backward gives exactly 0 to a token whose upstream gradient is 0
        psi = FusedTokenDisplacement.apply(a, b)
    else:
        if mask is not None:  # autograd would give 0 * NaN = NaN: zero the inputs instead
            keep = mask.unsqueeze(-1)
            a = torch.where(keep, a, torch.zeros((), dtype=a.dtype, device=a.device))
            b = torch.where(keep, b, torch.zeros((), dtype=b.dtype, device=b.device))
        psi = token_displacement_reference(a, b)
    if mask is None:
        return psi
    return torch.where(mask, psi, torch.zeros((), dtype=psi.dtype, device=psi.device))


def displacement(h_prev: torch.Tensor, h_next: torch.Tensor, mask: Optional[torch.Tensor] = None,
                 impl: str = "auto") -> torch.Tensor:
    """A layer's Psi: mean psi over the counted tokens, a 0-dim fp32 tensor (differentiable).

    h_prev, h_next: [..., h]; mask: [...] bool, True = counted (None counts every token).
    impl: "auto" | "fused" | "torch" (see ``resolve_impl``). Masked-out tokens never affect
    the value or the gradients, whatever they hold.
    """
    # masked-out tokens give psi 0 and zero gradient even when they hold NaN
    psi = token_displacement(h_prev, h_next, impl=impl, mask=mask)
    return masked_mean(psi, mask)
