//! Encoders from `f32` to the ggml float storage types (the quantized types
//! are in this module's siblings).
//!
//! Each function encodes one contiguous run of values (normally one tensor row)
//! into little-endian bytes laid out exactly as `ggml-common.h` defines them, and
//! each is bit-exact with the reference ggml / gguf-py implementation named in its
//! doc comment, so a file we write is byte-identical to what llama.cpp's converter
//! would produce from the same f32 values.


/// Rounds an `f32` to bf16 bits like ggml's `GGML_FP32_TO_BF16` (and gguf-py's
/// `BF16.quantize_blocks`): round to nearest, ties to even; a NaN keeps its sign
/// and upper payload bits and is forced quiet (bit 6 of the result set).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u as u64 + (0x7fff + ((u >> 16) & 1)) as u64) >> 16) as u16
}

/// The `f32` a bf16 bit pattern stands for (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Writes `src` as little-endian f32 (`dst.len() == 4 * src.len()`).
pub fn encode_f32(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() * 4, "encode_f32: destination size");
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

/// Writes `src` as IEEE half precision, round to nearest even (the `half` crate's
/// conversion, identical to numpy's `astype(float16)` and ggml's `GGML_FP32_TO_FP16`
/// on hardware with F16C); `dst.len() == 2 * src.len()`.
pub fn encode_f16(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() * 2, "encode_f16: destination size");
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&half::f16::from_f32(*x).to_bits().to_le_bytes());
    }
}

/// Writes `src` as bf16 with [`f32_to_bf16`]; `dst.len() == 2 * src.len()`.
pub fn encode_bf16(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() * 2, "encode_bf16: destination size");
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_bf16(*x).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::legacy::quantize_q8_0;

    #[test]
    fn bf16_rounding_and_nan() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        // 1 + 3*2^-8 is halfway with an odd lower neighbour: rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        // A signalling NaN becomes quiet and stays NaN (no rounding into infinity).
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(f32_to_bf16(f32::from_bits(0xffff_ffff)), 0xffff);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_to_f32(0xc000), -2.0);
    }

    #[test]
    fn q8_0_reference() {
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = -63.5; // exactly half: rounds away from zero
        x[2] = 0.5;
        let mut out = [0u8; 34];
        quantize_q8_0(&x, &mut out);
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), half::f16::from_f32(1.0).to_bits());
        assert_eq!(out[2] as i8, 127);
        assert_eq!(out[3] as i8, -64);
        assert_eq!(out[4] as i8, 1);
        let zeros = [0.0f32; 32];
        quantize_q8_0(&zeros, &mut out);
        assert!(out.iter().all(|&b| b == 0));
    }
}
