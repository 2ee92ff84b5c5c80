//! The 32-element block types: Q8_0, and Q4_0, Q4_1, Q5_0, Q5_1, which
//! `llama-quantize` falls back to for rows that are not a whole number of
//! 256-element super-blocks.
//!
//! Each `quantize_*` encodes one block of 32 values like ggml's
//! `quantize_row_*_ref`; each `dequantize_*` decodes one block like ggml's
//! `dequantize_row_*` (equal, bit for bit, to gguf-py's numpy ports), in
//! storage order so the SIMD kernels can inline and vectorize them.

use super::{f16_at, put_f16};

/// Elements per block.
pub const QK: usize = 32;
const HALF: usize = QK / 2;

/// The value of largest magnitude, with its sign (the first one on ties).
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// Packs 32 values of up to 5 bits: low nibbles of `q[j]` and `q[j+16]` share
/// byte `qs[j]`, the fifth bit of `q[i]` is bit `i` of the little-endian `qh`.
fn pack5(q: &[u8; QK], qh: &mut [u8], qs: &mut [u8]) {
    let mut bits = 0u32;
    for j in 0..HALF {
        qs[j] = (q[j] & 0x0F) | ((q[j + HALF] & 0x0F) << 4);
        bits |= ((q[j] as u32 & 0x10) >> 4) << j;
        bits |= ((q[j + HALF] as u32 & 0x10) >> 4) << (j + HALF);
    }
    qh.copy_from_slice(&bits.to_le_bytes());
}

/// Decodes a block of 32 from its levels: `value(j)` gives the levels of
/// values `j` and `j + 16` (which share byte `qs[j]`), `f` maps a level to
/// the weight.
#[inline(always)]
fn decode(y: &mut [f32], value: impl Fn(usize) -> (u8, u8), f: impl Fn(u8) -> f32) {
    let (lo, hi) = y[..QK].split_at_mut(HALF);
    for (j, (a, b)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
        let (q0, q1) = value(j);
        *a = f(q0);
        *b = f(q1);
    }
}

#[inline(always)]
fn nibbles(qs: &[u8], j: usize) -> (u8, u8) {
    (qs[j] & 0x0F, qs[j] >> 4)
}

/// Levels `j` and `j + 16` of a 5-bit block: nibbles plus bits `j`, `j + 16` of `qh`.
#[inline(always)]
fn fives(qh: u32, qs: &[u8], j: usize) -> (u8, u8) {
    let (a, b) = nibbles(qs, j);
    (a | (((qh >> j) << 4) & 0x10) as u8, b | ((qh >> (j + 12)) & 0x10) as u8)
}

/// Q4_0 (18 bytes): `d: f16, qs: u8[16]`; `x = d * (q - 8)`.
pub fn quantize_q4_0(x: &[f32], out: &mut [u8]) {
    let d = signed_absmax(x) / -8.0;
    let id = inverse(d);
    put_f16(out, 0, d);
    for j in 0..HALF {
        let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let q1 = ((x[j + HALF] * id + 8.5) as i8).min(15) as u8;
        out[2 + j] = q0 | (q1 << 4);
    }
}

#[inline(always)]
pub fn dequantize_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    decode(y, |j| nibbles(&b[2..18], j), |q| (q as i32 - 8) as f32 * d);
}

/// Q4_1 (20 bytes): `d, m: f16, qs: u8[16]`; `x = d * q + m`.
pub fn quantize_q4_1(x: &[f32], out: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    put_f16(out, 0, d);
    put_f16(out, 2, min);
    for j in 0..HALF {
        let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let q1 = (((x[j + HALF] - min) * id + 0.5) as i8).min(15) as u8;
        out[4 + j] = q0 | (q1 << 4);
    }
}

#[inline(always)]
pub fn dequantize_q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    decode(y, |j| nibbles(&b[4..20], j), |q| q as f32 * d + m);
}

/// Q5_0 (22 bytes): `d: f16, qh: u8[4], qs: u8[16]`; `x = d * (q - 16)`.
pub fn quantize_q5_0(x: &[f32], out: &mut [u8]) {
    let d = signed_absmax(x) / -16.0;
    let id = inverse(d);
    put_f16(out, 0, d);
    let mut q = [0u8; QK];
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = ((v * id + 16.5) as i8).min(31) as u8;
    }
    let (qh, qs) = out[2..].split_at_mut(4);
    pack5(&q, qh, qs);
}

#[inline(always)]
pub fn dequantize_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    decode(y, |j| fives(qh, &b[6..22], j), |q| (q as i32 - 16) as f32 * d);
}

/// Q5_1 (24 bytes): `d, m: f16, qh: u8[4], qs: u8[16]`; `x = d * q + m`.
pub fn quantize_q5_1(x: &[f32], out: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    put_f16(out, 0, d);
    put_f16(out, 2, min);
    let mut q = [0u8; QK];
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = ((v - min) * id + 0.5) as u8;
    }
    let (qh, qs) = out[4..].split_at_mut(4);
    pack5(&q, qh, qs);
}

#[inline(always)]
pub fn dequantize_q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    decode(y, |j| fives(qh, &b[8..24], j), |q| q as f32 * d + m);
}

/// Q8_0 (34 bytes): `d: f16, qs: i8[32]`; `x = d * q`. `amax = max|x|`,
/// `d = amax / 127`, `q = roundf(x / d)` (halves away from zero).
pub fn quantize_q8_0_block(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    put_f16(out, 0, d);
    for (q, v) in out[2..].iter_mut().zip(x) {
        // f32::round rounds halves away from zero, like C's roundf.
        *q = ((v * id).round() as i8) as u8;
    }
}

#[inline(always)]
pub fn dequantize_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..34]) {
        *v = (q as i8) as f32 * d;
    }
}

/// Quantizes a whole row to Q8_0 (`src.len()` a multiple of 32,
/// `dst.len() == src.len() / 32 * 34`).
pub fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    assert_eq!(src.len() % QK, 0, "quantize_q8_0: length not a multiple of 32");
    assert_eq!(dst.len(), src.len() / QK * 34, "quantize_q8_0: destination size");
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(34)) {
        quantize_q8_0_block(x, b);
    }
}
