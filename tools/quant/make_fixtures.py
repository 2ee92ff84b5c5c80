#!/usr/bin/env python3
"""Reference fixtures for the ggml block formats (tests/quant_blocks.rs).

For each of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K writes
under tests/fixtures/quant/:

  <TYPE>.blocks.bin   random blocks (random bytes, f16 scale fields finite)
  <TYPE>.blocks.f32   those blocks dequantized by gguf-py (ggml's numpy port)
  <TYPE>.values.f32   test rows of f32 (random, outliers, zeros, constants, ...)
  <TYPE>.quant.bin    the rows quantized by ggml itself (ggml_quantize_chunk
                      with no importance matrix, as llama-quantize runs it)

Usage (numpy; gguf-py from a llama.cpp tree; a CPU build of that tree):
  PYTHONPATH=$LLAMA_CPP/gguf-py python3 tools/quant/make_fixtures.py \
      --llama-cpp $LLAMA_CPP --build $LLAMA_CPP/build-cpu --out tests/fixtures/quant
For the 32-element types the ggml bytes are also checked against gguf-py's
numpy quantizers here.
"""
import argparse
import pathlib
import subprocess
import tempfile

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of the f16 fields (d, dmin) in each block.
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}
LEGACY_BLOCKS = 24
K_BLOCKS = 6


def random_blocks(rng, name, n):
    bs, bb = GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, size=(n, bb), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        # Scales of either sign over a wide range, always finite.
        f = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1, n)).astype(np.float16)
        raw[:, off:off + 2] = f.view(np.uint8).reshape(n, 2)
    raw[0, :] = 0  # an all-zero block
    return raw


def test_values(rng, block, n_blocks):
    """Rows of `block` values covering the shapes quantizers branch on."""
    rows = [rng.standard_normal(block) * 0.02]
    rows.append(np.zeros(block))
    rows.append(np.full(block, 0.75))
    rows.append(-np.abs(rng.standard_normal(block)))
    rows.append(np.abs(rng.standard_normal(block)) + 1.0)
    spike = np.zeros(block)
    spike[block // 3] = -3.0
    rows.append(spike)
    out = rng.standard_normal(block) * 0.01
    out[::37] *= 100.0
    rows.append(out)
    rows.append(rng.standard_normal(block) * 1e-20)
    rows.append(rng.uniform(-1, 1, block) * 10.0 ** rng.uniform(-3, 3, block))
    rows.append(np.round(rng.standard_normal(block) * 4) / 8)
    while len(rows) < n_blocks:
        rows.append(rng.standard_normal(block) * rng.uniform(0.001, 2.0))
    return np.concatenate(rows[:n_blocks]).astype(np.float32)


def build_harness(llama_cpp, build, workdir):
    exe = workdir / "ggml_quantize_ref"
    src = pathlib.Path(__file__).with_name("ggml_quantize_ref.c")
    lib = build / "bin"
    subprocess.run(
        ["cc", "-O1", str(src), "-I", str(llama_cpp / "ggml/include"), "-L", str(lib), "-lggml-base",
         f"-Wl,-rpath,{lib}", "-o", str(exe)],
        check=True,
    )
    return exe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=pathlib.Path, required=True)
    ap.add_argument("--build", type=pathlib.Path, required=True)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("tests/fixtures/quant"))
    ap.add_argument("--seed", type=int, default=20261202)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        exe = build_harness(args.llama_cpp, args.build, tmp)
        for name in TYPES:
            qt = T[name]
            bs, bb = GGML_QUANT_SIZES[qt]
            n = K_BLOCKS if bs == 256 else LEGACY_BLOCKS
            blocks = random_blocks(rng, name, n)
            deq = dequantize(blocks.reshape(-1), qt).astype(np.float32)
            assert np.isfinite(deq).all()
            blocks.tofile(args.out / f"{name}.blocks.bin")
            deq.tofile(args.out / f"{name}.blocks.f32")

            values = test_values(rng, bs, n)
            values.tofile(args.out / f"{name}.values.f32")
            qbin = args.out / f"{name}.quant.bin"
            subprocess.run([str(exe), name, str(bs), str(args.out / f"{name}.values.f32"), str(qbin)], check=True)
            ggml = np.fromfile(qbin, dtype=np.uint8)
            assert ggml.size == n * bb, (name, ggml.size)
            if bs == 32:
                numpy_bytes = quantize(values.reshape(n, bs), qt).reshape(-1)
                same = np.array_equal(numpy_bytes, ggml)
                print(f"{name}: gguf-py quantizer {'matches' if same else 'DIFFERS FROM'} ggml")
            print(f"{name}: {n} blocks")


if __name__ == "__main__":
    main()
