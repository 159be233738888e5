"""A random-weight GGUF with another GGUF's metadata, tokenizer and tensor shapes and types.

For a machine the real file cannot reach (the device tool carries 64 MiB; SmolLM2's Q4_1 file
is 98 MB): export the metadata here (a few MB), build the model there.

    python bench/gguf_like.py export SRC.gguf META.gguf     # every key/value and tensor layout
    python bench/gguf_like.py build META.gguf OUT.gguf     # random weights, the same types

The built file has SRC's keys (architecture, sizes, tokenizer, chat template) and one tensor for
each of SRC's, of the same shape and GGML type, filled with seeded random values: N(0, 0.02) for
matrices, 1 for norm weights (1-D F32 tensors), quantized by the `gguf` package. Speed benches
need no trained weights (the bench prompts are token ids and ignore EOS); answers are noise.
The tensor layouts travel in META as three array keys (`like.tensor.names`, `.types`, `.shapes`).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

_SKIP = ("GGUF.", "general.alignment")  # the writer sets these itself
_LAYOUT = "like.tensor."  # the keys export adds: the tensors' names, types and shapes


def _copy(src: str, out: str) -> tuple:
    """(reader of src, a writer for out holding src's keys, src's layout keys' values)."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch)
    layout = {}
    for f in r.fields.values():
        if f.name.startswith(_LAYOUT):
            layout[f.name] = f.contents()
        elif not (f.name.startswith(_SKIP) or f.name == "general.architecture"):
            vtype = f.types[0]
            sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
            w.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    return r, w, layout


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def export(src: str, meta: str) -> None:
    r, w, _ = _copy(src, meta)
    w.add_array(_LAYOUT + "names", [t.name for t in r.tensors])
    w.add_array(_LAYOUT + "types", [int(t.tensor_type) for t in r.tensors])
    # shapes in numpy order (outermost first), joined so one array holds them all
    w.add_array(_LAYOUT + "shapes", [",".join(str(int(d)) for d in reversed(t.shape.tolist()))
                                     for t in r.tensors])
    _finish(w)


def build(meta: str, out: str, seed: int) -> None:
    import gguf
    from gguf.quants import quantize

    _, w, layout = _copy(meta, out)
    rng = np.random.default_rng(seed)
    for name, qtype, shape in zip(layout[_LAYOUT + "names"], layout[_LAYOUT + "types"],
                                  layout[_LAYOUT + "shapes"], strict=True):
        dims = tuple(int(d) for d in shape.split(","))
        qt = gguf.GGMLQuantizationType(int(qtype))
        if len(dims) == 1:
            values = np.ones(dims, np.float32)
        else:
            values = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, values)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, values.astype(np.float16))
        else:
            data = quantize(values, qt)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)
    _finish(w)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("src")
    e.add_argument("meta")
    b = sub.add_parser("build")
    b.add_argument("meta")
    b.add_argument("out")
    b.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.cmd == "export":
        export(a.src, a.meta)
    else:
        build(a.meta, a.out, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
