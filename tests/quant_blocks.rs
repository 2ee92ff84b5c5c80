//! The block formats against ggml: `dequantize_row` must equal gguf-py's
//! numpy dequantizers bit for bit on random blocks, and `quantize_row` must
//! produce the same bytes as ggml's own quantizer (`ggml_quantize_chunk`
//! without an importance matrix, i.e. what `llama-quantize` writes) on rows
//! covering random, outlier, constant, all-zero and tiny values. Fixtures:
//! `tests/fixtures/quant/`, made by `tools/quant/make_fixtures.py`.

use flashnext::gguf::GgmlType;
use flashnext::quant::{dequantize_row, quantize_row, QUANT_TYPES};
use std::path::PathBuf;

fn fixture(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant").join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn block_sizes_match_ggml_common() {
    let want =
        [(32, 18), (32, 20), (32, 22), (32, 24), (32, 34), (256, 84), (256, 110), (256, 144), (256, 176), (256, 210)];
    for (ty, (bs, bb)) in QUANT_TYPES.iter().zip(want) {
        assert_eq!((ty.block_size(), ty.block_bytes()), (bs, bb), "{ty}");
        assert_eq!(ty.row_bytes(2 * bs), Some(2 * bb), "{ty}");
        assert_eq!(ty.row_bytes(bs + 16), None, "{ty}");
    }
}

#[test]
fn dequantize_is_bit_exact_with_gguf_py() {
    for ty in QUANT_TYPES {
        let blocks = fixture(&format!("{ty}.blocks.bin"));
        let want = f32s(&fixture(&format!("{ty}.blocks.f32")));
        let n_blocks = blocks.len() / ty.block_bytes();
        assert!(n_blocks >= 6 && want.len() == n_blocks * ty.block_size(), "{ty}: fixture sizes");
        let mut got = vec![0f32; want.len()];
        dequantize_row(ty, &blocks, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{ty} value {i} (block {}): {g} != {w}", i / ty.block_size());
        }
    }
}

#[test]
fn quantize_matches_ggml_bytes() {
    for ty in QUANT_TYPES {
        let values = f32s(&fixture(&format!("{ty}.values.f32")));
        let want = fixture(&format!("{ty}.quant.bin"));
        let mut got = vec![0u8; want.len()];
        quantize_row(ty, &values, &mut got).unwrap();
        let bb = ty.block_bytes();
        for (b, (g, w)) in got.chunks(bb).zip(want.chunks(bb)).enumerate() {
            assert_eq!(g, w, "{ty} block {b}");
        }
    }
}

#[test]
fn bad_row_sizes_are_errors() {
    let x = vec![0.5f32; 256];
    let mut out = vec![0u8; 144];
    let e = quantize_row(GgmlType::Q4K, &x[..250], &mut out).unwrap_err().to_string();
    assert!(e.contains("not a whole number of Q4_K blocks"), "{e}");
    let e = quantize_row(GgmlType::Q4K, &x, &mut out[..100]).unwrap_err().to_string();
    assert!(e.contains("needs 144 bytes"), "{e}");
    quantize_row(GgmlType::Q4K, &x, &mut out).unwrap();
}

/// Every kernel level this CPU has, on every type, against the exact dot
/// product (in f64) of the dequantized row: within 1e-6 of `sum |w x|`.
#[test]
fn kernels_match_the_dequantized_dot_product() {
    use flashnext::quant::kernels::{dot_row_with, Isa};
    let floats = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    for ty in QUANT_TYPES.iter().chain(&floats).copied() {
        // A 12-wide float row exercises the tail; 512 covers whole super-blocks.
        let lens: &[usize] = if ty.block_size() == 1 { &[12, 48, 520] } else { &[512, 2 * 1024] };
        for &n in lens.iter().filter(|&&n| ty.row_bytes(n).is_some()) {
            let w: Vec<f32> = (0..n).map(|_| rand()).collect();
            let x: Vec<f32> = (0..n).map(|_| 4.0 * rand()).collect();
            let mut row = vec![0u8; ty.row_bytes(n).unwrap()];
            quantize_row(ty, &w, &mut row).unwrap();
            let mut deq = vec![0f32; n];
            dequantize_row(ty, &row, &mut deq);
            let exact: f64 = deq.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let scale: f64 = deq.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            for isa in Isa::available() {
                let got = dot_row_with(isa, ty, &row, &x) as f64;
                assert!(
                    (got - exact).abs() <= 1e-6 * scale,
                    "{ty} n={n} {}: {got} vs {exact} (scale {scale})",
                    isa.name()
                );
            }
        }
    }
}
