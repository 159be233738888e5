"""The layer-ops protocol: fused element-wise kernels the shared layers call, as a plugin kind.

A layer-ops plugin registers `register(name, LayerOpsCaps, factory)`; the resolver picks one per
device (the `layer_ops` slot of the plan, `--layer-ops NAME`), and the loader builds it once:

    ops = factory(dtype=torch.dtype, device=torch.device)

Layers receive it at build time (ModelContext.ops) and ask it, once, for each op they run; they
never ask which device or library they are on. Each method returns a callable, or None where this
plugin does not provide that op for this dtype / shape (then the layer runs the reference,
`core.layers.ops_ref.TorchLayerOps`, the built-in `torch` plugin). Every op computes the same math
as the reference (HF rounding: sums in the compute dtype, norms in fp32, cast back before the
weight); `tests/test_layer_ops.py` holds each registered plugin to it.

    rms_norm(weight, eps)       -> f(x [.., N]) -> y                 RMSNorm over the last dim
    add_rms_norm(weight, eps)   -> f(x, residual [T, N]) -> (norm(x + residual), x + residual)
    norm_add_norm(weight1, weight2, eps)
                                -> f(h, residual [T, N]) -> (norm2(s), s), s = residual + norm1(h)
                                   RMSNorm with weight1 on h, the residual add, RMSNorm with
                                   weight2 on the sum (Gemma's post-norm, its residual add and
                                   the next pre-norm); rounded as rms_norm then add_rms_norm
                                   round them: norm1(h) and s in h's dtype
    silu_and_mul()              -> f(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:]   [T, I]
    gelu_and_mul(approximate)   -> f(x [T, 2I]) -> gelu(x[:, :I]) * x[:, I:]   [T, I]
                                   GeGLU (Gemma): torch's gelu with `approximate` "tanh" or
                                   "none" (erf), rounded to x's dtype before the product
    rotary_qk(head_dim)         -> f(qkv, cos, sin, num_q, num_k) -> (q [T, num_q*D], k [T, num_k*D])
                                   rotary on the q and k heads at the front of a fused projection;
                                   cos/sin [T, 1, D] as RotaryEmbedding.cos_sin gives them
    qk_norm_rotary(head_dim, q_weight, k_weight, eps)
                                -> f(qkv, cos, sin, num_q, num_k) -> (q [T, num_q*D], k [T, num_k*D])
                                   Qwen3's RMSNorm over each q head (q_weight [D]) and each k
                                   head (k_weight [D]), then rotary, as rotary_qk returns them
                                   (one kernel for q and k of the batch, where fused)
    rotary_mla(rope_dim, interleaved)
                                -> f(q [T, H, Dr], k [T, Dr], cos, sin) -> (q', k') contiguous
                                   MLA's rotary on the rope part of each q head and on the one
                                   shared k_rope (any strides with a unit last one: views into
                                   the projections); interleaved: the rope pairs are (x0, x1),
                                   (x2, x3), ... and are first taken apart into
                                   [x0, x2, .. | x1, x3, ..] (DeepSeek's layout), as HF does
    linear(weight [N, K], bias [N] | None) -> f(x [M, K]) -> x @ weight.T + bias  [M, N]
                                   a dense layer's product (decode's few rows, where a plugin
                                   streams them faster than the BLAS), for any M; None: F.linear
    store_kv()                  -> f(k, v [T, Hkv, D], loc [T], k_buf, v_buf) -> bool
                                   k_buf[loc] = k, v_buf[loc] = v (cast); False: not taken here
                                   (the pool writes them itself)

A factory may assume its caps were checked (device, dtype, packages) and may import its kernel
library; it must not allocate device memory until an op runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # the planner imports the contract and no torch
    from torch import Tensor

    # the callables the ops return (module docstring)
    TensorFn = Callable[[Tensor], Tensor]  # rms_norm, silu_and_mul, linear: f(x) -> y
    AddNormFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # add_rms_norm, norm_add_norm
    # rotary_qk, qk_norm_rotary: f(qkv, cos, sin, num_q, num_k) -> (q, k)
    QKFn = Callable[[Tensor, Tensor, Tensor, int, int], tuple[Tensor, Tensor]]
    StoreKVFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], bool]  # store_kv
    # rotary_mla: f(q_rope, k_rope, cos, sin) -> (q_rope', k_rope')
    MLARopeFn = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]

OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_qk", "store_kv", "qk_norm_rotary",
       "linear", "rotary_mla", "gelu_and_mul", "norm_add_norm")
# Ops added after the first layer-ops API: a plugin may lack the method altogether; then the
# layers compose them from the plugin's other ops (qk_norm_rotary: rms_norm, then the reference
# rotary; norm_add_norm: rms_norm, then add_rms_norm) or use the reference (linear: F.linear;
# rotary_mla, gelu_and_mul: the reference's torch ops).
OPTIONAL_OPS = ("qk_norm_rotary", "linear", "rotary_mla", "gelu_and_mul", "norm_add_norm")


@runtime_checkable
class LayerOps(Protocol):
    def rms_norm(self, weight: Tensor, eps: float) -> TensorFn | None: ...

    def add_rms_norm(self, weight: Tensor, eps: float) -> AddNormFn | None: ...

    def silu_and_mul(self) -> TensorFn | None: ...

    def rotary_qk(self, head_dim: int) -> QKFn | None: ...

    def store_kv(self) -> StoreKVFn | None: ...

    # optional (OPTIONAL_OPS): qk_norm_rotary(head_dim, q_weight, k_weight, eps),
    # linear(weight, bias), rotary_mla(rope_dim, interleaved), gelu_and_mul(approximate),
    # norm_add_norm(weight1, weight2, eps)


class CompleteLayerOps(Protocol):
    """Layer ops that provide every op, the optional ones included, and never answer None:
    what the layers are built with (a plugin's ops `WithReference`, or the reference,
    core.layers.ops_ref.TorchLayerOps)."""

    def rms_norm(self, weight: Tensor, eps: float) -> TensorFn: ...

    def add_rms_norm(self, weight: Tensor, eps: float) -> AddNormFn: ...

    def norm_add_norm(self, weight1: Tensor, weight2: Tensor, eps: float) -> AddNormFn: ...

    def silu_and_mul(self) -> TensorFn: ...

    def rotary_qk(self, head_dim: int) -> QKFn: ...

    def store_kv(self) -> StoreKVFn: ...

    def linear(self, weight: Tensor, bias: Tensor | None) -> TensorFn: ...

    def qk_norm_rotary(self, head_dim: int, q_weight: Tensor, k_weight: Tensor, eps: float
                       ) -> QKFn: ...

    def rotary_mla(self, rope_dim: int, interleaved: bool) -> MLARopeFn: ...

    def gelu_and_mul(self, approximate: str) -> TensorFn: ...


def qk_norm_rotary(ops: LayerOps, head_dim: int, q_weight: Tensor, k_weight: Tensor, eps: float,
                   norms: LayerOps | None = None) -> QKFn:
    """`ops`' qk_norm_rotary where it provides one for these arguments, else the reference's
    math over the rms_norm of `norms` (default `ops`): a plugin without the fused op keeps its
    norm kernel."""
    from core.layers.ops_ref import compose_qk_norm_rotary

    fn = getattr(ops, "qk_norm_rotary", None)
    got = fn(head_dim, q_weight, k_weight, eps) if fn is not None else None
    if got is not None:
        return got
    norms = ops if norms is None else norms
    return compose_qk_norm_rotary(norms.rms_norm(q_weight, eps), norms.rms_norm(k_weight, eps),
                                  head_dim)


class WithReference:
    """A plugin's ops where it provides them, the reference's elsewhere (never None)."""

    def __init__(self, ops: LayerOps, reference: CompleteLayerOps):
        self.ops, self.reference = ops, reference
        self.name = getattr(ops, "name", type(ops).__name__)

    def _pick(self, op: str, *args: object) -> Callable:
        fn = getattr(self.ops, op, None)
        got = fn(*args) if fn is not None else None
        return got if got is not None else getattr(self.reference, op)(*args)

    def rms_norm(self, weight: Tensor, eps: float) -> TensorFn:
        return self._pick("rms_norm", weight, eps)

    def add_rms_norm(self, weight: Tensor, eps: float) -> AddNormFn:
        return self._pick("add_rms_norm", weight, eps)

    def norm_add_norm(self, weight1: Tensor, weight2: Tensor, eps: float) -> AddNormFn:
        from core.layers.ops_ref import compose_norm_add_norm

        fn = getattr(self.ops, "norm_add_norm", None)
        got = fn(weight1, weight2, eps) if fn is not None else None
        if got is not None:
            return got
        # not fused by the plugin: its two norms where it has them (else the reference's)
        return compose_norm_add_norm(self.rms_norm(weight1, eps), self.add_rms_norm(weight2, eps))

    def silu_and_mul(self) -> TensorFn:
        return self._pick("silu_and_mul")

    def rotary_qk(self, head_dim: int) -> QKFn:
        return self._pick("rotary_qk", head_dim)

    def store_kv(self) -> StoreKVFn:
        return self._pick("store_kv")

    def linear(self, weight: Tensor, bias: Tensor | None) -> TensorFn:
        return self._pick("linear", weight, bias)

    def qk_norm_rotary(self, head_dim: int, q_weight: Tensor, k_weight: Tensor, eps: float
                       ) -> QKFn:
        # not fused by the plugin: its norms where it has them (else the reference's), rotary
        return qk_norm_rotary(self.ops, head_dim, q_weight, k_weight, eps, norms=self)

    def rotary_mla(self, rope_dim: int, interleaved: bool) -> MLARopeFn:
        return self._pick("rotary_mla", rope_dim, interleaved)

    def gelu_and_mul(self, approximate: str) -> TensorFn:
        return self._pick("gelu_and_mul", approximate)
