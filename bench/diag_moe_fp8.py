"""Where the triton MoE runner's block-fp8 experts lose accuracy (a diagnostic; times nothing).

    python bench/diag_moe_fp8.py --out diag.json          # on a CUDA machine

The quant suite's MoE-experts case (conformance.quant_suite.MoEExpertsCase: 4 experts, top-2,
256 x 256, the Qwen3 block-fp8 format) for each compute dtype and each tiling given, at the
token counts given. Per run it reports the relative error against the fp32 reference of
- the output (what the suite checks, tolerance in `tol`);
- the intermediates gate_up_kernel stored (silu(gate) * up per token and slot), captured at
  the launch, against the reference's (so a gap is placed in the first or the second product);
- the routing weights down_kernel was given, against the reference's fp32 softmax top-k;
and torch_native's output error on the same inputs, as the peer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


class _Capture:
    """Stands in for a @triton.jit kernel: launches it and keeps the launch's arguments."""

    def __init__(self, kernel):
        self.kernel, self.args = kernel, None

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.kernel[grid](*args, **kw)
            self.args = args
        return launch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--tokens", default="7,64")
    p.add_argument("--tilings", default="table;16,32,128,4,4;16,64,128,4,4;32,64,128,4,4;"
                   "32,64,128,4,2;32,128,128,8,3;64,64,128,4,3",
                   help="semicolon list of block_m,block_n,block_k,warps,stages; 'table': the "
                   "runner's own choice (block_k is the scale block's for fp8 whatever is given)")
    p.add_argument("--case", default="fp8-block-qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda",
                   help="cpu: a smoke run under TRITON_INTERPRET=1 (fp16 stands in for e4m3)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("skipped: needs CUDA")
        return 0
    from conformance import quant_suite
    from conformance.quant_refs import all_cases
    from core.plan.registry import get_registry
    from plugins.moe.triton import kernels, runner

    case = {c.name: c for c in all_cases()}[a.case]
    native = get_registry().get("moe", "torch_native").load()()
    dev = torch.device(a.device)
    rows = []
    for dname in a.dtypes.split(","):
        dtype = getattr(torch, dname)
        for spec in a.tilings.split(";"):
            tiling = None if spec == "table" else tuple(int(v) for v in spec.split(","))
            if tiling is not None and tiling[0] > runner.FP8_MAX_BLOCK_M:
                # the runner caps fp8 row tiles; lift the cap for this one run
                saved, runner.FP8_MAX_BLOCK_M = runner.FP8_MAX_BLOCK_M, tiling[0]
            else:
                saved = None
            try:
                c = quant_suite.MoEExpertsCase("fp8", case, dev, dtype,
                                               runner.TritonMoE(tiling), a.seed)
                ref_native = quant_suite.MoEExpertsCase("fp8", case, dev, dtype, native, a.seed)
                for m in (int(t) for t in a.tokens.split(",")):
                    x = c.inputs(m)
                    ref_native.inputs(m)  # keep the two generators in step
                    ref, inter_ref = c.reference(x)
                    gu, dn = _Capture(kernels.gate_up_kernel), _Capture(kernels.down_kernel)
                    kernels.gate_up_kernel, kernels.down_kernel = gu, dn
                    try:
                        with torch.no_grad():
                            y = c.moe(x.to(dev))
                            if dev.type == "cuda":
                                torch.cuda.synchronize()
                    finally:
                        kernels.gate_up_kernel, kernels.down_kernel = gu.kernel, dn.kernel
                    with torch.no_grad():
                        y_native = ref_native.moe(x.to(dev))
                    inter = gu.args[2][:m * 2].view(m, 2, -1).cpu()
                    iref = inter_ref.view(m, 2, -1)
                    # slots may come in either order per token: compare each token's best order
                    same = (inter - iref.to(inter.dtype)).float().norm(dim=-1).sum(-1)
                    swap = (inter.flip(1) - iref.to(inter.dtype)).float().norm(dim=-1).sum(-1)
                    inter = torch.where((swap < same)[:, None, None], inter.flip(1), inter)
                    route = dn.args[3][:m * 2].view(m, 2).cpu()
                    scores = torch.softmax(x.float() @ c.moe.gate.weight.float().cpu().t(), -1)
                    top_w, _ = scores.topk(2, -1)
                    top_w = top_w / top_w.sum(-1, keepdim=True)
                    route = torch.where((swap < same)[:, None], route.flip(1), route)
                    row = {"dtype": dname, "tiling": spec, "tokens": m,
                           "tol": quant_suite.TOL[dtype], "out_err": _rel(y, ref),
                           "inter_err": _rel(inter, iref), "route_err": _rel(route, top_w),
                           "native_out_err": _rel(y_native, ref)}
                    # the worst intermediate rows: which token and slot, how many of its values
                    # are off by more than 1e-2 relative to the row's scale
                    d = (inter.float() - iref.float()).reshape(m * 2, -1)
                    rn = iref.float().reshape(m * 2, -1).norm(dim=-1).clamp(min=1e-12)
                    per = d.norm(dim=-1) / rn
                    worst = per.topk(min(4, m * 2)).indices.tolist()
                    row["worst_rows"] = [
                        {"token": r // 2, "slot": r % 2, "rel": per[r].item(),
                         "off": int((d[r].abs() > 1e-2 * rn[r] / d.shape[1] ** 0.5).sum())}
                        for r in worst]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            except Exception as e:  # noqa: BLE001 - a tiling that does not compile is a result
                row = {"dtype": dname, "tiling": spec, "error": f"{type(e).__name__}: {e}"[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
            finally:
                if saved is not None:
                    runner.FP8_MAX_BLOCK_M = saved
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
