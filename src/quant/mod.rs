//! ggml's quantized block formats: Q8_0, the 32-element Q4_0/Q4_1/Q5_0/Q5_1
//! and the 256-element K-quants Q2_K..Q6_K, laid out byte for byte as
//! `ggml-common.h` defines them (spec §5.3).
//!
//! * [`quantize_row`] follows ggml's reference quantizers
//!   (`quantize_row_*_ref`, which is also what `llama-quantize` runs when no
//!   importance matrix is given), operation for operation in f32 with no fused
//!   multiply-adds, so the bytes are identical to llama.cpp's on the same
//!   values. The 32-element types are additionally checked against gguf-py's
//!   numpy quantizers, the K-quants against `llama-quantize` output.
//! * [`dequantize_row`] is the scalar reference decoder, bit-exact with
//!   gguf-py's numpy dequantizers (the fixtures under
//!   `tests/fixtures/quant/` come from `tools/quant/make_fixtures.py`).
//!
//! The per-type code lives in [`legacy`] (32-element blocks) and [`kquants`]
//! (256-element super-blocks); [`search`] holds the scale searches the
//! K-quant reference quantizers share.

pub mod bench;
pub mod dot;
pub mod float;
pub mod kernels;
pub mod kquants;
pub mod legacy;
pub mod matmul;
pub mod policy;
pub mod requantize;
mod search;

use float::{encode_bf16, encode_f16, encode_f32};
use crate::error::{Error, Result};
use crate::gguf::GgmlType;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// Byte offsets of a block's f16 scale fields, which every value of the
/// block is linear in (`d`, and `dmin` / `m` where the type has one); none
/// for the float types.
pub fn scale_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => &[],
    }
}

/// The quantized types (everything but the float types).
pub const QUANT_TYPES: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Encoder and decoder of one block of a quantized type.
#[derive(Clone, Copy)]
pub(crate) struct BlockCodec {
    pub quantize: fn(&[f32], &mut [u8]),
    pub dequantize: fn(&[u8], &mut [f32]),
}

/// The block codec of a quantized type, `None` for the float types.
pub(crate) fn codec(ty: GgmlType) -> Option<BlockCodec> {
    let c = |quantize, dequantize| Some(BlockCodec { quantize, dequantize });
    match ty {
        GgmlType::Q4_0 => c(legacy::quantize_q4_0, legacy::dequantize_q4_0),
        GgmlType::Q4_1 => c(legacy::quantize_q4_1, legacy::dequantize_q4_1),
        GgmlType::Q5_0 => c(legacy::quantize_q5_0, legacy::dequantize_q5_0),
        GgmlType::Q5_1 => c(legacy::quantize_q5_1, legacy::dequantize_q5_1),
        GgmlType::Q8_0 => c(legacy::quantize_q8_0_block, legacy::dequantize_q8_0),
        GgmlType::Q2K => c(kquants::quantize_q2_k, kquants::dequantize_q2_k),
        GgmlType::Q3K => c(kquants::quantize_q3_k, kquants::dequantize_q3_k),
        GgmlType::Q4K => c(kquants::quantize_q4_k, kquants::dequantize_q4_k),
        GgmlType::Q5K => c(kquants::quantize_q5_k, kquants::dequantize_q5_k),
        GgmlType::Q6K => c(kquants::quantize_q6_k, kquants::dequantize_q6_k),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => None,
    }
}

/// Checks that `bytes` holds exactly one row of `n` values of `ty`.
fn check_row(ty: GgmlType, n: usize, bytes: usize) -> Result<()> {
    let want =
        ty.row_bytes(n).ok_or_else(|| Error::arg(format!("row of {n} values is not a whole number of {ty} blocks")))?;
    if bytes != want {
        return Err(Error::arg(format!("{ty} row of {n} values needs {want} bytes, got {bytes}")));
    }
    Ok(())
}

/// Encodes one row of `src` as `ty` into `dst`, which must be exactly
/// `ty.row_bytes(src.len())` long. Works for every [`GgmlType`]: the float
/// types are rounded (f16/bf16 round to nearest even), the quantized ones go
/// through ggml's reference quantizer.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_row(ty, src.len(), dst.len())?;
    match (ty, codec(ty)) {
        (_, Some(c)) => {
            let (bs, bb) = (ty.block_size(), ty.block_bytes());
            for (x, b) in src.chunks_exact(bs).zip(dst.chunks_exact_mut(bb)) {
                (c.quantize)(x, b);
            }
        }
        (GgmlType::F32, None) => encode_f32(src, dst),
        (GgmlType::F16, None) => encode_f16(src, dst),
        (_, None) => encode_bf16(src, dst),
    }
    Ok(())
}

/// Decodes one row of `ty` from `src` into `dst` (any [`GgmlType`]).
///
/// Panics if `src` is not exactly one row of `dst.len()` values: callers pass
/// slices of tensors whose sizes were checked when the file was parsed.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    if let Err(e) = check_row(ty, dst.len(), src.len()) {
        panic!("dequantize_row: {e}");
    }
    match (ty, codec(ty)) {
        (_, Some(c)) => {
            let (bs, bb) = (ty.block_size(), ty.block_bytes());
            for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(bs)) {
                (c.dequantize)(b, y);
            }
        }
        (GgmlType::F32, None) => decode_f32(src, dst),
        (GgmlType::F16, None) => decode_f16(src, dst),
        (_, None) => decode_bf16(src, dst),
    }
}

#[inline(always)]
pub(crate) fn decode_f32(b: &[u8], y: &mut [f32]) {
    for (v, c) in y.iter_mut().zip(b.chunks_exact(4)) {
        *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

#[inline(always)]
pub(crate) fn decode_f16(b: &[u8], y: &mut [f32]) {
    for (v, c) in y.iter_mut().zip(b.chunks_exact(2)) {
        *v = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
    }
}

#[inline(always)]
pub(crate) fn decode_bf16(b: &[u8], y: &mut [f32]) {
    for (v, c) in y.iter_mut().zip(b.chunks_exact(2)) {
        *v = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
    }
}

/// The f16 at byte `off` of `b`, widened (exact).
#[inline]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Stores `x` rounded to f16 (nearest even, as `GGML_FP32_TO_FP16`) at byte `off` of `b`.
#[inline]
pub(crate) fn put_f16(b: &mut [u8], off: usize, x: f32) {
    b[off..off + 2].copy_from_slice(&half::f16::from_f32(x).to_bits().to_le_bytes());
}

/// `x` after the f16 round trip the block header applies to it.
#[inline]
pub(crate) fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}
