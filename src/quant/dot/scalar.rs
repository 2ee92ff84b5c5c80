//! The integer dot products in plain Rust: the reference the SIMD versions are
//! tested against, and the kernels of CPUs without AVX2.
//!
//! Every function computes, per (sub-)block, an exact integer sum of weight
//! levels times activation levels, then combines the sums with the f32
//! scales in a fixed order: `sum += (d_w * d_x) * isum` per block, offsets and
//! mins in a second sum subtracted at the end (see the module docs of
//! [`super`] for the formulas).

use super::act::{Q8Blocks, Q8KBlocks};
use super::{k4_scales, q3_scales, BLOCK_BYTES_K};
use crate::quant::f16_at;

/// `sum_b (d_w d_x)_b isum_b + off * sum_b c_b ds_b` over 32-blocks, where
/// `block(b)` gives the 32 levels of weight block `b` (element order), its
/// scale `d_w` and the coefficient `c_b` of the activation block sum.
#[inline(always)]
fn legacy(row: &[u8], bytes: usize, a: &Q8Blocks, block: impl Fn(&[u8], &mut [i32; 32]) -> (f32, f32)) -> f32 {
    let (mut sum, mut off) = (0f32, 0f32);
    let mut w = [0i32; 32];
    for (i, b) in row.chunks_exact(bytes).enumerate() {
        let (d, c) = block(b, &mut w);
        let x = &a.qs[32 * i..32 * i + 32];
        let isum: i32 = w.iter().zip(x).map(|(&w, &x)| w * x as i32).sum();
        sum += d * a.d[i] * isum as f32;
        off += c * a.ds[i];
    }
    sum + off
}

/// Levels of a block of 16 packed nibbles: `qs[j] & 15` is value `j`, `qs[j] >> 4` value `j + 16`.
#[inline(always)]
fn nibbles(qs: &[u8], w: &mut [i32; 32]) {
    for j in 0..16 {
        w[j] = (qs[j] & 15) as i32;
        w[j + 16] = (qs[j] >> 4) as i32;
    }
}

/// Adds the fifth bits (bit `j` of the little-endian `qh` is value `j`'s).
#[inline(always)]
fn fifth_bits(qh: &[u8], w: &mut [i32; 32]) {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    for (j, w) in w.iter_mut().enumerate() {
        *w |= (((qh >> j) & 1) << 4) as i32;
    }
}

pub fn q4_0(row: &[u8], a: &Q8Blocks) -> f32 {
    legacy(row, 18, a, |b, w| {
        nibbles(&b[2..18], w);
        let d = f16_at(b, 0);
        (d, -8.0 * d)
    })
}

pub fn q4_1(row: &[u8], a: &Q8Blocks) -> f32 {
    legacy(row, 20, a, |b, w| {
        nibbles(&b[4..20], w);
        (f16_at(b, 0), f16_at(b, 2))
    })
}

pub fn q5_0(row: &[u8], a: &Q8Blocks) -> f32 {
    legacy(row, 22, a, |b, w| {
        nibbles(&b[6..22], w);
        fifth_bits(&b[2..6], w);
        let d = f16_at(b, 0);
        (d, -16.0 * d)
    })
}

pub fn q5_1(row: &[u8], a: &Q8Blocks) -> f32 {
    legacy(row, 24, a, |b, w| {
        nibbles(&b[8..24], w);
        fifth_bits(&b[4..8], w);
        (f16_at(b, 0), f16_at(b, 2))
    })
}

pub fn q8_0(row: &[u8], a: &Q8Blocks) -> f32 {
    legacy(row, 34, a, |b, w| {
        for (w, &q) in w.iter_mut().zip(&b[2..34]) {
            *w = q as i8 as i32;
        }
        (f16_at(b, 0), 0.0)
    })
}

/// The 256 levels of a Q2_K / Q3_K super-block's 2-bit `qs` (64 bytes): in
/// each half of 128 values, byte `l` holds values `l`, `l+32`, `l+64`,
/// `l+96` at bit offsets 0, 2, 4, 6.
#[inline(always)]
fn two_bits(qs: &[u8], w: &mut [i32; 256]) {
    for (n, q) in qs.chunks_exact(32).enumerate() {
        for j in 0..4 {
            for l in 0..32 {
                w[128 * n + 32 * j + l] = ((q[l] >> (2 * j)) & 3) as i32;
            }
        }
    }
}

/// `sum_j scale[j] * sum_{16 values of sub-block j} w x`.
#[inline(always)]
fn scaled16(w: &[i32; 256], x: &[i8], scale: impl Fn(usize) -> i32) -> i32 {
    (0..16).map(|j| scale(j) * (16 * j..16 * j + 16).map(|i| w[i] * x[i] as i32).sum::<i32>()).sum()
}

/// The K-quant loop: `block(b, x, bsums)` returns `(d_w * isum, dmin_w * msum)`
/// as (scale, integer) pairs; the row is `sum (d_w d_x) isum - sum (dmin_w d_x) msum`.
#[inline(always)]
fn kquant(
    row: &[u8],
    bytes: usize,
    a: &Q8KBlocks,
    block: impl Fn(&[u8], &[i8], &[i16]) -> ((f32, i32), (f32, i32)),
) -> f32 {
    let (mut sum, mut mins) = (0f32, 0f32);
    for (i, b) in row.chunks_exact(bytes).enumerate() {
        let ((d, isum), (dmin, msum)) = block(b, &a.qs[256 * i..256 * i + 256], &a.bsums[16 * i..16 * i + 16]);
        sum += d * a.d[i] * isum as f32;
        mins += dmin * a.d[i] * msum as f32;
    }
    sum - mins
}

pub fn q2_k(row: &[u8], a: &Q8KBlocks) -> f32 {
    kquant(row, BLOCK_BYTES_K[0], a, |b, x, bsums| {
        let mut w = [0i32; 256];
        two_bits(&b[16..80], &mut w);
        let sc = &b[..16];
        let isum = scaled16(&w, x, |j| (sc[j] & 15) as i32);
        let msum: i32 = (0..16).map(|j| (sc[j] >> 4) as i32 * bsums[j] as i32).sum();
        ((f16_at(b, 80), isum), (f16_at(b, 82), msum))
    })
}

pub fn q3_k(row: &[u8], a: &Q8KBlocks) -> f32 {
    kquant(row, BLOCK_BYTES_K[1], a, |b, x, bsums| {
        let mut w = [0i32; 256];
        two_bits(&b[32..96], &mut w);
        let hmask = &b[..32];
        for (i, w) in w.iter_mut().enumerate() {
            *w |= (((hmask[i % 32] >> (i / 32)) & 1) << 2) as i32;
        }
        let sc = q3_scales(&b[96..108]);
        // Levels are 0..=7 for the values -4..=3.
        let isum = scaled16(&w, x, |j| sc[j] as i32)
            - 4 * (0..16).map(|j| sc[j] as i32 * bsums[j] as i32).sum::<i32>();
        ((f16_at(b, 108), isum), (0.0, 0))
    })
}

/// Q4_K / Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins.
#[inline(always)]
fn k4(b: &[u8], w: &[i32; 256], x: &[i8], bsums: &[i16]) -> ((f32, i32), (f32, i32)) {
    let (sc, m) = k4_scales(&b[4..16]);
    let (sc, m) = (sc.to_le_bytes(), m.to_le_bytes());
    let mut isum = 0i32;
    let mut msum = 0i32;
    for j in 0..8 {
        isum += sc[j] as i32 * (32 * j..32 * j + 32).map(|i| w[i] * x[i] as i32).sum::<i32>();
        msum += m[j] as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
    }
    ((f16_at(b, 0), isum), (f16_at(b, 2), msum))
}

pub fn q4_k(row: &[u8], a: &Q8KBlocks) -> f32 {
    kquant(row, BLOCK_BYTES_K[2], a, |b, x, bsums| {
        let mut w = [0i32; 256];
        for (c, q) in b[16..144].chunks_exact(32).enumerate() {
            for l in 0..32 {
                w[64 * c + l] = (q[l] & 15) as i32;
                w[64 * c + 32 + l] = (q[l] >> 4) as i32;
            }
        }
        k4(b, &w, x, bsums)
    })
}

pub fn q5_k(row: &[u8], a: &Q8KBlocks) -> f32 {
    kquant(row, BLOCK_BYTES_K[3], a, |b, x, bsums| {
        let mut w = [0i32; 256];
        let qh = &b[16..48];
        for (c, q) in b[48..176].chunks_exact(32).enumerate() {
            for l in 0..32 {
                let h = qh[l] >> (2 * c);
                w[64 * c + l] = ((q[l] & 15) | ((h & 1) << 4)) as i32;
                w[64 * c + 32 + l] = ((q[l] >> 4) | ((h & 2) << 3)) as i32;
            }
        }
        k4(b, &w, x, bsums)
    })
}

pub fn q6_k(row: &[u8], a: &Q8KBlocks) -> f32 {
    kquant(row, BLOCK_BYTES_K[4], a, |b, x, bsums| {
        let mut w = [0i32; 256];
        let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
        for h in 0..2 {
            let (ql, qh) = (&ql[64 * h..64 * h + 64], &qh[32 * h..32 * h + 32]);
            for l in 0..32 {
                let w = &mut w[128 * h..];
                w[l] = ((ql[l] & 15) | ((qh[l] & 3) << 4)) as i32;
                w[32 + l] = ((ql[32 + l] & 15) | (((qh[l] >> 2) & 3) << 4)) as i32;
                w[64 + l] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32;
                w[96 + l] = ((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32;
            }
        }
        // Levels are 0..=63 for the values -32..=31.
        let s = |j: usize| sc[j] as i8 as i32;
        let isum = scaled16(&w, x, s) - 32 * (0..16).map(|j| s(j) * bsums[j] as i32).sum::<i32>();
        ((f16_at(b, 208), isum), (0.0, 0))
    })
}
