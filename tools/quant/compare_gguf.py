#!/usr/bin/env python3
"""Compares two GGUF files tensor by tensor: same names, shapes, types and bytes?

  PYTHONPATH=$LLAMA_CPP/gguf-py python3 tools/quant/compare_gguf.py a.gguf b.gguf

Prints one line per differing tensor and a summary; exit status 1 if any differ.
Used to check `flashnext quantize` against `llama-quantize` (docs/BENCHMARKS.md).
"""
import sys

import numpy as np
from gguf import GGUFReader


def tensors(path):
    return {t.name: t for t in GGUFReader(path).tensors}


def dims(t):
    """Shape without trailing 1s (llama-quantize writes {H, 1} back as {H})."""
    d = [int(x) for x in t.shape]
    while len(d) > 1 and d[-1] == 1:
        d.pop()
    return d


def main():
    a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
    if a.keys() != b.keys():
        print("different tensor sets:", sorted(a.keys() ^ b.keys()))
        return 1
    type_diff = byte_diff = 0
    for name in a:
        ta, tb = a[name], b[name]
        if ta.tensor_type != tb.tensor_type or dims(ta) != dims(tb):
            type_diff += 1
            print(f"{name}: {ta.tensor_type.name}{dims(ta)} vs {tb.tensor_type.name}{dims(tb)}")
        elif not np.array_equal(np.asarray(ta.data).view(np.uint8).reshape(-1), np.asarray(tb.data).view(np.uint8).reshape(-1)):
            byte_diff += 1
            print(f"{name}: {ta.tensor_type.name}, bytes differ")
    print(f"{len(a)} tensors: {type_diff} with other type/shape, {byte_diff} with other bytes")
    return 1 if type_diff or byte_diff else 0


if __name__ == "__main__":
    sys.exit(main())
