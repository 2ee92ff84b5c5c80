#!/usr/bin/env python3
"""Quantization error of flashnext vs ggml on real-shaped random tensors.

For each type, quantizes the same heavy-tailed random matrices (the real
model's expert gate/up 640x2560, expert down 2560x640, GDN qkv 10240x2560)
with `flashnext quantize --tensor-type '.*=TYPE'` and with ggml's own
quantizer (ggml_quantize_chunk, no imatrix: what llama-quantize runs), then
reports RMSE relative to the F32 values (both dequantized by gguf-py) and
whether the bytes are identical. Rows the type's block does not divide use
llama-quantize's fallback type, as both tools do.

  PYTHONPATH=$LLAMA_CPP/gguf-py python3 tools/quant/rmse_vs_llama.py \
      --llama-cpp $LLAMA_CPP --build $LLAMA_CPP/build-cpu --flashnext target/release/flashnext
"""
import argparse
import pathlib
import subprocess
import tempfile

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize

import make_fixtures

TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "Q5_1", "Q5_0", "Q4_1", "Q4_0"]
SHAPES = {"expert_gate.weight": (640, 2560), "expert_down.weight": (2560, 640), "gdn_qkv.weight": (10240, 2560)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=pathlib.Path, required=True)
    ap.add_argument("--build", type=pathlib.Path, required=True)
    ap.add_argument("--flashnext", type=pathlib.Path, required=True)
    args = ap.parse_args()
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        exe = make_fixtures.build_harness(args.llama_cpp, args.build, tmp)
        values = {n: (rng.standard_t(5, size=s) * 0.02).astype(np.float32) for n, s in SHAPES.items()}
        w = GGUFWriter(str(tmp / "in.gguf"), "qwen4exp")
        for n, v in values.items():
            w.add_tensor(n, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        print(f"{'tensor':<20} {'type':<6} {'stored':<6} {'RMSE flashnext':>15} {'RMSE ggml':>10}  bytes")
        for ty in TYPES:
            out = tmp / f"{ty}.gguf"
            subprocess.run([str(args.flashnext), "quantize", str(tmp / "in.gguf"), str(out), "--type", "q8_0",
                            "--tensor-type", f".*={ty}", "-q"], check=True, capture_output=True)
            for t in GGUFReader(str(out)).tensors:
                x = values[t.name]
                stored = t.tensor_type.name
                ours = np.asarray(t.data).view(np.uint8).reshape(-1)
                src = tmp / "x.f32"
                x.tofile(src)
                subprocess.run([str(exe), stored, str(x.shape[1]), str(src), str(tmp / "ref.bin")], check=True)
                ref = np.fromfile(tmp / "ref.bin", dtype=np.uint8)
                rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))

                def rmse(b):
                    d = dequantize(b.reshape(x.shape[0], -1), t.tensor_type).astype(np.float64)
                    return float(np.sqrt(np.mean((d - x) ** 2))) / rms

                same = "identical" if np.array_equal(ours, ref) else "DIFFERENT"
                print(f"{t.name:<20} {ty:<6} {stored:<6} {rmse(ours):>15.5f} {rmse(ref):>10.5f}  {same}")


if __name__ == "__main__":
    main()
