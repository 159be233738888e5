"""Linear layers whose weights are created and applied through a quant-method object.

A quant method (core.contract.quant.QuantMethod) has three duties (gpt-fast style: the model stays
pure, the method swaps weights): `create_weights(layer, ...)` registers parameters on the layer,
`process_weights_after_loading` may repack them once the checkpoint is in, and `apply(layer, x)`
computes the product. Layers call its members as they are (the base class gives each a default).

A Platform may move dense weights to a layout its kernels stream faster once loading is over
(`repack_dense_weights`; the cpu target's oneDNN blocked layout, plugins/hardware/cpu_runtime.py).
Loading leaves weights in the checkpoint's layout, so everything that reads them after loading
(tests, tools) sees plain tensors; only the runner's copy of the model is repacked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from core.contract.quant import Matmul, Packer, QuantMethod  # noqa: F401 - Matmul, Packer: re-exported
from core.engine.distributed import SINGLE


class DenseLinearMethod(QuantMethod):
    """Dense weights in the compute dtype; `F.linear`, or a platform's product over repacked
    weights once `repack` ran. The quant protocol's reference (core.contract.quant): what router gates
    and layers a checkpoint leaves dense use, and what the `unquantized` plugin serves."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype,
                                                device=device), requires_grad=False)
        layer.bias = (nn.Parameter(torch.empty(output_size, dtype=dtype, device=device),
                                   requires_grad=False) if bias else None)
        layer.matmul = None  # a platform's product once the weight is repacked for it

    def repack(self, layer: nn.Module, pack: Packer, matmul: Matmul) -> None:
        """Replace the weight by `pack(weight)` (same shape and dtype; the plain one is dropped,
        so memory does not double) and compute with `matmul`; a no-op where pack gives None."""
        packed = pack(layer.weight)
        if packed is not None:
            layer.weight = nn.Parameter(packed, requires_grad=False)
            layer.matmul = matmul

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.matmul is not None:
            return layer.matmul(x, weight=layer.weight, bias=layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def bind(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """`apply` with the layer's tensors bound (the decode hot path skips module lookups):
        the platform's product, else the layer ops' `linear` where they offer one (a GPU's
        few-row kernel for decode), else F.linear."""
        if layer.matmul is not None:
            return partial(layer.matmul, weight=layer.weight, bias=layer.bias)
        op = getattr(getattr(layer, "ops", None), "linear", None)
        got = op(layer.weight, layer.bias) if op is not None else None
        return got if got is not None else partial(F.linear, weight=layer.weight,
                                                   bias=layer.bias)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor | None:
        return layer.weight.float()

    def create_moe_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                           intermediate_size: int, dtype: torch.dtype,
                           device: torch.device) -> None:
        # w13: gate and up stacked on the output dim; w2: down.
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                    hidden_size, dtype=dtype, device=device),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size,
                                                   dtype=dtype, device=device),
                                       requires_grad=False)


UnquantizedLinearMethod = DenseLinearMethod  # the name layers and tests have used


def tp_narrow(loaded: object, dim: int, start: int, length: int) -> object:
    """The part [start, start + length) along `dim` (0: output rows, 1: inputs) of a checkpoint
    tensor, or of anything that can narrow itself (GGUF blocks); what a tensor-parallel rank
    loads of a weight."""
    if isinstance(loaded, torch.Tensor):
        if loaded.dim() <= dim:
            return loaded  # a scalar or 1-D tensor along no such dim: the whole of it
        return loaded.narrow(dim, start, length)
    narrow = getattr(loaded, "narrow", None)
    if narrow is None:
        raise ValueError(f"{type(loaded).__name__} cannot be split for tensor parallelism")
    return narrow(dim, start, length)


class Linear(nn.Module):
    """y = x W^T (+ b), possibly several HF projections stacked along the output dim.

    `output_sizes` lists the stacked shards (e.g. [q, k, v] or [gate, up]); `shard_names` names
    them so that `weight_loader(param, tensor, shard)` can place an HF tensor at its offset.

    Tensor parallelism (ctx.tp): `parallel="column"` keeps this rank's rows of every shard (an
    even split, or `shard_rows`: (start, length) per shard in the checkpoint's rows, for
    replicated KV heads); `parallel="row"` keeps this rank's inputs (`in_part`, default an
    even split) and sums the ranks' partial outputs with one all-reduce (`reduce=False`
    leaves that to the caller, who reduces once for several); the bias is added by rank 0
    only. Sizes given are the model's; the layer's own are this rank's.
    """

    def __init__(self, input_size: int, output_sizes: int | Sequence[int], bias: bool,
                 ctx, shard_names: Sequence[str] | None = None, parallel: str | None = None,
                 shard_rows: Sequence[tuple[int, int]] | None = None,
                 in_part: tuple[int, int] | None = None, reduce: bool = True):
        super().__init__()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        tp = getattr(ctx, "tp", SINGLE)
        self.tp, self.parallel, self.reduce = tp, parallel, reduce
        self.ops = getattr(ctx, "ops", None)  # the layer ops (their `linear`, where offered)
        self._rows: list[tuple[int, int]] | None = None
        self._in_part: tuple[int, int] | None = None
        if parallel == "column":
            self._rows = list(shard_rows) if shard_rows is not None else [
                tp.split(n, "output size") for n in sizes]
            self._full_sizes = sizes
            sizes = [n for _, n in self._rows]
        elif parallel == "row":
            full_input = input_size
            self._in_part = in_part if in_part is not None else tp.split(input_size,
                                                                         "input size")
            input_size = self._in_part[1]
        elif parallel is not None:
            raise ValueError(f"parallel must be 'column', 'row' or None, not {parallel!r}")
        self.full_input_size = input_size if self._in_part is None else full_input
        self.input_size = input_size
        self.output_sizes = sizes
        self.output_size = sum(sizes)
        self.shard_names = list(shard_names) if shard_names is not None else None
        if self.shard_names is not None and len(self.shard_names) != len(sizes):
            raise ValueError("shard_names and output_sizes differ in length")
        self._build = (bias, ctx.dtype, ctx.device)
        self.epilogue: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.quant_method = ctx.quant_method
        self.quant_method.create_weights(self, input_size, self.output_size, bias, ctx.dtype,
                                         ctx.device)

    def rebuild_with(self, method: QuantMethod) -> None:
        """Drop the parameters and create them again with another quant method (a layer the
        checkpoint leaves dense; core.contract.quant.apply_ignore). Only before loading."""
        for name in [n for n, _ in self.named_parameters(recurse=False)]:
            delattr(self, name)
        self.quant_method = method
        bias, dtype, device = self._build
        method.create_weights(self, self.input_size, self.output_size, bias, dtype, device)

    def shard_slice(self, shard: str | None) -> slice:
        """Rows of the stacked output that one named shard occupies."""
        if shard is None:
            return slice(0, self.output_size)
        if self.shard_names is None or shard not in self.shard_names:
            raise KeyError(f"no shard {shard!r} in this linear ({self.shard_names})")
        i = self.shard_names.index(shard)
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])

    def full_shard_size(self, shard: str | None) -> int:
        """Rows one named shard (None: the whole output) has in the checkpoint, before any
        split over tensor-parallel ranks."""
        if self._rows is None:
            return self.shard_slice(shard).stop - self.shard_slice(shard).start
        if shard is None:
            return sum(self._full_sizes)
        return self._full_sizes[self.shard_names.index(shard)]

    def rank_rows(self, loaded: torch.Tensor, shard: str | None) -> torch.Tensor:
        """This rank's rows of a tensor laid out along dim 0 like one shard's output rows in
        the checkpoint (a column-parallel split: the rows its weight keeps, replicated KV heads
        included); the whole of it for a layer whose output is not split."""
        if self._rows is None or self.tp.size == 1:
            return loaded
        if shard is None and len(self._rows) > 1:
            raise ValueError("rank_rows takes one shard's rows of a stacked linear")
        start, length = self._rows[0 if shard is None else self.shard_names.index(shard)]
        return loaded.narrow(0, start, length)

    def rank_inputs(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a tensor laid out along its last dim like the checkpoint's
        inputs (a row-parallel split: the inputs its weight keeps); the whole of it for a
        layer whose input is not split."""
        if self._in_part is None or self.tp.size == 1:
            return loaded
        return loaded.narrow(-1, *self._in_part)

    def param_shards(self, leaf: str) -> list[str] | None:
        """Every parameter of a stacked linear (weight, bias, a quant method's scales) is
        given once per shard by a checkpoint."""
        return self.shard_names

    def _tp_part(self, param: nn.Parameter, loaded: object, shard: str | None) -> object:
        """This rank's part of a checkpoint tensor (the whole of it without parallelism)."""
        if self.tp.size == 1:  # one rank (possibly in a group): its part is the whole
            return loaded
        if self._rows is not None:
            if shard is None and len(self._rows) > 1:  # a stacked tensor: each shard's rows
                if not isinstance(loaded, torch.Tensor):
                    raise ValueError("a stacked tensor splits over tensor-parallel ranks only "
                                     "as a dense tensor")
                offsets = [sum(self._full_sizes[:i]) for i in range(len(self._rows))]
                return torch.cat([loaded.narrow(0, o + start, n)
                                  for o, (start, n) in zip(offsets, self._rows, strict=True)])
            i = self.shard_names.index(shard) if shard is not None else 0
            start, length = self._rows[i]
            return tp_narrow(loaded, 0, start, length)
        if self._in_part is not None:
            if param is getattr(self, "bias", None):  # added once, by rank 0
                return loaded if self.tp.rank == 0 else torch.zeros_like(loaded)
            return tp_narrow(loaded, 1, *self._in_part)
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: str | None = None) -> None:
        """Copy an HF tensor into `param` (the whole of it, or one shard's part: its rows, or
        what core.contract.quant.mark says the shard owns of a quantized parameter), through the
        quant method's `weight_loader` (its default: that copy; GGUF's reads the file's blocks
        as they are). Under tensor parallelism the tensor is first cut to this rank's part."""
        self.quant_method.weight_loader(self, param, self._tp_part(param, loaded, shard), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        if self.epilogue is not None:
            y = self.epilogue(x, y)
        return self.tp.all_reduce(y) if self._reduces() else y

    def _reduces(self) -> bool:
        return self._in_part is not None and self.reduce and self.tp.active

    def bound(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> y as a plain callable: the quant method's `bind` (partial(apply, layer) unless
        it offers a faster one)."""
        f = self.quant_method.bind(self)
        if self.epilogue is not None:
            f = _with_epilogue(f, self.epilogue)
        if self._reduces():
            reduce = self.tp.all_reduce
            return lambda x: reduce(f(x))
        return f

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}"


def _with_epilogue(f: Callable[[torch.Tensor], torch.Tensor],
                   epilogue: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: epilogue(x, f(x))


def reset_bindings(model: nn.Module) -> None:
    """Drop hot-path bindings made before (they may point at replaced tensors, or miss an
    epilogue set since)."""
    for module in model.modules():
        reset = getattr(module, "reset_bindings", None)
        if reset is not None:
            reset()


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's quant method finish its weights once the checkpoint is loaded (a
    linear's, and a MoE layer's experts')."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant_method.process_weights_after_loading(module)
        experts = getattr(module, "expert_quant_method", None)  # a MoE layer (core.layers.moe)
        if experts is not None:
            experts.process_moe_weights_after_loading(module)
    for module in model.modules():  # layers that keep a processed linear's weight their way
        finish = getattr(module, "finish_loading", None)  # (core.layers.mla: kv_b_proj dense)
        if finish is not None:
            finish()
    reset_bindings(model)


def repack_dense_weights(model: nn.Module, pack: Packer, matmul: Matmul) -> None:
    """Move a loaded model's dense weights to a platform's layout (each linear's quant method's
    `repack`, a no-op for methods without dense weights, and modules offering `repack`: the LM
    head). Call it once loading is over: repacked weights can no longer be loaded into.
    Idempotent when `pack` returns None for a packed weight."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant_method.repack(module, pack, matmul)
        elif hasattr(module, "repack"):  # a module's own weight (core.layers.embedding.LMHead)
            module.repack(pack, matmul)
    reset_bindings(model)
