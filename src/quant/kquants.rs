//! The K-quants: super-blocks of 256 values in sub-blocks of 16 (Q2_K, Q3_K,
//! Q6_K) or 32 (Q4_K, Q5_K) with quantized per-sub-block scales.
//!
//! `quantize_*` encode one super-block like ggml's `quantize_row_*_K_ref`
//! (what `llama-quantize` runs without an importance matrix); `dequantize_*`
//! decode one like ggml's `dequantize_row_*_K`, in storage order so the SIMD
//! kernels can inline and vectorize them. Byte offsets inside a block are
//! spelled out in each type's doc comment.

use super::search::{make_q3_quants, make_qkx2_quants, make_qx_quants, nearest_int, Qkx2, GROUP_MAX_EPS};
use super::{f16_at, put_f16, round_f16, QK_K};

/// Packs 2-bit levels as Q2_K and Q3_K do: in each half of 128 values, byte
/// `l` of the half's 32 holds values `l`, `l+32`, `l+64`, `l+96` at bit
/// offsets 0, 2, 4, 6.
fn pack2(levels: &[u8; QK_K], qs: &mut [u8]) {
    for (half, out) in levels.chunks_exact(128).zip(qs.chunks_exact_mut(32)) {
        for (l, q) in out.iter_mut().enumerate() {
            *q = half[l] | (half[l + 32] << 2) | (half[l + 64] << 4) | (half[l + 96] << 6);
        }
    }
}

/// The largest of `v` (0 when all are <= 0), as the reference loops compute it.
fn max_positive(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, &s| if s > m { s } else { m })
}

/// Q2_K (84 bytes): `scales: u8[16]` (low nibble scale, high nibble min) at 0,
/// `qs: u8[64]` at 16, `d: f16` at 80, `dmin: f16` at 82;
/// `x = d * sc * q - dmin * m` per sub-block of 16.
pub fn quantize_q2_k(x: &[f32], out: &mut [u8]) {
    const Q4SCALE: f32 = 15.0;
    let p = Qkx2 { nmax: 3, rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: true };
    let mut levels = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let mut w = [0f32; 16];
        for (w, v) in w.iter_mut().zip(xs) {
            *w = v.abs();
        }
        (scales[j], mins[j]) = make_qkx2_quants(&p, xs, &w, &mut levels[16 * j..16 * j + 16]);
    }
    let (max_scale, max_min) = (max_positive(&scales), max_positive(&mins));
    let sc = &mut out[..16];
    sc.fill(0);
    let d = if max_scale > 0.0 {
        let iscale = Q4SCALE / max_scale;
        for (b, s) in sc.iter_mut().zip(&scales) {
            *b = nearest_int(iscale * s) as u8;
        }
        max_scale / Q4SCALE
    } else {
        0.0
    };
    let dmin = if max_min > 0.0 {
        let iscale = Q4SCALE / max_min;
        for (b, m) in sc.iter_mut().zip(&mins) {
            *b |= (nearest_int(iscale * m) << 4) as u8;
        }
        max_min / Q4SCALE
    } else {
        0.0
    };
    put_f16(out, 80, d);
    put_f16(out, 82, dmin);
    let (d, dmin) = (round_f16(d), round_f16(dmin));
    for ((&sc, group), xs) in out[..16].iter().zip(levels.chunks_exact_mut(16)).zip(x.chunks_exact(16)) {
        let dl = d * (sc & 0xF) as f32;
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * (sc >> 4) as f32;
        for (l, &v) in group.iter_mut().zip(xs) {
            *l = nearest_int((v + ml) / dl).clamp(0, 3) as u8;
        }
    }
    pack2(&levels, &mut out[16..80]);
}

#[inline(always)]
pub fn dequantize_q2_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let (sc, qs) = (&b[..16], &b[16..80]);
    for (n, (yh, q)) in y.chunks_exact_mut(128).zip(qs.chunks_exact(32)).enumerate() {
        for (j, y32) in yh.chunks_exact_mut(32).enumerate() {
            for (k, y16) in y32.chunks_exact_mut(16).enumerate() {
                let s = sc[8 * n + 2 * j + k];
                let (dl, ml) = (d * (s & 0xF) as f32, dmin * (s >> 4) as f32);
                for (v, &byte) in y16.iter_mut().zip(&q[16 * k..16 * k + 16]) {
                    *v = dl * ((byte >> (2 * j)) & 3) as f32 - ml;
                }
            }
        }
    }
}

/// The signed 6-bit scale `j` of a Q3_K block's 12 scale bytes: low nibbles
/// in bytes 0..8 (scales 8..16 in the high nibbles), the top two bits in
/// bytes 8..12.
#[inline]
fn q3_scale(s: &[u8], j: usize) -> i32 {
    let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
    let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    (low | (high << 4)) as i32 - 32
}

/// Q3_K (110 bytes): `hmask: u8[32]` at 0 (bit `b` of `hmask[l]` is the high
/// bit of value `32b + l`), `qs: u8[64]` at 32 (low two bits), `scales: u8[12]`
/// at 96 (16 six-bit scales), `d: f16` at 108; `x = d * sc * (q - 4)`.
pub fn quantize_q3_k(x: &[f32], out: &mut [u8]) {
    let mut levels = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut amax, mut max_scale) = (0f32, 0f32);
    for j in 0..16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut levels[16 * j..16 * j + 16]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let s = &mut out[96..108];
    s.fill(0);
    let d = if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, &sc) in scales.iter().enumerate() {
            let l = ((nearest_int(iscale * sc) as i8).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                s[j] = l & 0xF;
            } else {
                s[j - 8] |= (l & 0xF) << 4;
            }
            s[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
        }
        1.0 / iscale
    } else {
        0.0
    };
    put_f16(out, 108, d);
    let d = round_f16(d);
    for j in 0..16 {
        let dl = d * q3_scale(&out[96..108], j) as f32;
        if dl == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            levels[i] = (nearest_int(x[i] / dl).clamp(-4, 3) + 4) as i8;
        }
    }
    let hmask = &mut out[..32];
    hmask.fill(0);
    let mut low = [0u8; QK_K];
    for (i, (&l, lo)) in levels.iter().zip(low.iter_mut()).enumerate() {
        *lo = l as u8;
        if l > 3 {
            hmask[i % 32] |= 1 << (i / 32);
            *lo -= 4;
        }
    }
    pack2(&low, &mut out[32..96]);
}

#[inline(always)]
pub fn dequantize_q3_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 108);
    let (hmask, qs, sc) = (&b[..32], &b[32..96], &b[96..108]);
    for (n, (yh, q)) in y.chunks_exact_mut(128).zip(qs.chunks_exact(32)).enumerate() {
        for (j, y32) in yh.chunks_exact_mut(32).enumerate() {
            let bit = 4 * n + j;
            for (k, y16) in y32.chunks_exact_mut(16).enumerate() {
                let dl = d * q3_scale(sc, 8 * n + 2 * j + k) as f32;
                for (l, v) in y16.iter_mut().enumerate() {
                    let low = ((q[16 * k + l] >> (2 * j)) & 3) as i32;
                    let high = (hmask[16 * k + l] >> bit) & 1;
                    *v = dl * (low - 4 * (1 - high as i32)) as f32;
                }
            }
        }
    }
}

/// Scale and min `j` of the 12 packed bytes of Q4_K / Q5_K (six bits each:
/// `j < 4` in the low bits of bytes `j` and `j+4`; `j >= 4` in byte `j+4`'s
/// nibbles plus the top bits of bytes `j-4` and `j`).
#[inline]
pub(crate) fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The header of Q4_K / Q5_K (`d`, `dmin` at bytes 0 and 2, the packed
/// scales at 4..16) and the levels `0..=nmax` of all 256 values.
fn quantize_scale_min(x: &[f32], p: &Qkx2, out: &mut [u8]) -> [u8; QK_K] {
    let mut levels = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2 = xs.iter().fold(0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut w = [0f32; 32];
        for (w, v) in w.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        (scales[j], mins[j]) = make_qkx2_quants(p, xs, &w, &mut levels[32 * j..32 * j + 32]);
    }
    let (max_scale, max_min) = (max_positive(&scales), max_positive(&mins));
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let s = &mut out[4..16];
    s.fill(0);
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            s[j] = ls;
            s[j + 4] = lm;
        } else {
            s[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            s[j - 4] |= (ls >> 4) << 6;
            s[j] |= (lm >> 4) << 6;
        }
    }
    put_f16(out, 0, max_scale / 63.0);
    put_f16(out, 2, max_min / 63.0);
    let (d, dmin) = (f16_at(out, 0), f16_at(out, 2));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(&out[4..16], j);
        let dl = d * sc as f32;
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * m as f32;
        for i in 32 * j..32 * j + 32 {
            levels[i] = nearest_int((x[i] + ml) / dl).clamp(0, p.nmax) as u8;
        }
    }
    levels
}

/// Decodes a Q4_K / Q5_K block: chunk `c` of 64 values has scale/min pairs
/// `2c` (first 32 values) and `2c + 1` (last 32); `level(c, l)` gives the
/// levels of values `64c + l` and `64c + 32 + l`.
#[inline(always)]
fn dequantize_scale_min(b: &[u8], y: &mut [f32], level: impl Fn(usize, usize) -> (u8, u8)) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for (c, y64) in y.chunks_exact_mut(64).enumerate() {
        let ((s1, m1), (s2, m2)) = (scale_min_k4(&b[4..16], 2 * c), scale_min_k4(&b[4..16], 2 * c + 1));
        let (d1, m1, d2, m2) = (d * s1 as f32, dmin * m1 as f32, d * s2 as f32, dmin * m2 as f32);
        let (lo, hi) = y64.split_at_mut(32);
        for (l, (a, b)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
            let (q1, q2) = level(c, l);
            *a = d1 * q1 as f32 - m1;
            *b = d2 * q2 as f32 - m2;
        }
    }
}

/// Q4_K (144 bytes): `d, dmin: f16` at 0 and 2, `scales: u8[12]` at 4,
/// `qs: u8[128]` at 16; `x = d * sc * q - dmin * m` per sub-block of 32.
pub fn quantize_q4_k(x: &[f32], out: &mut [u8]) {
    let p = Qkx2 { nmax: 15, rmin: -1.0, rdelta: 0.1, nstep: 20, use_mad: false };
    let levels = quantize_scale_min(x, &p, out);
    for (chunk, q) in levels.chunks_exact(64).zip(out[16..144].chunks_exact_mut(32)) {
        for (l, b) in q.iter_mut().enumerate() {
            *b = chunk[l] | (chunk[l + 32] << 4);
        }
    }
}

#[inline(always)]
pub fn dequantize_q4_k(b: &[u8], y: &mut [f32]) {
    let qs = &b[16..144];
    dequantize_scale_min(b, y, |c, l| (qs[32 * c + l] & 0xF, qs[32 * c + l] >> 4));
}

/// Q5_K (176 bytes): as Q4_K with `qh: u8[32]` at 16 and `qs: u8[128]` at
/// 48; value `i` of chunk `c` gets `+16` from bit `2c` (low nibbles) or
/// `2c + 1` (high nibbles) of `qh[i % 32]`.
pub fn quantize_q5_k(x: &[f32], out: &mut [u8]) {
    let p = Qkx2 { nmax: 31, rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: false };
    let levels = quantize_scale_min(x, &p, out);
    let (qh, qs) = out[16..176].split_at_mut(32);
    qh.fill(0);
    for (c, (chunk, q)) in levels.chunks_exact(64).zip(qs.chunks_exact_mut(32)).enumerate() {
        for (l, b) in q.iter_mut().enumerate() {
            let (lo, hi) = (chunk[l], chunk[l + 32]);
            qh[l] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1));
            *b = (lo & 0xF) | ((hi & 0xF) << 4);
        }
    }
}

#[inline(always)]
pub fn dequantize_q5_k(b: &[u8], y: &mut [f32]) {
    let (qh, qs) = (&b[16..48], &b[48..176]);
    dequantize_scale_min(b, y, |c, l| {
        let (q, h) = (qs[32 * c + l], qh[l] >> (2 * c));
        ((q & 0xF) | ((h & 1) << 4), (q >> 4) | ((h & 2) << 3))
    });
}

/// Q6_K (210 bytes): `ql: u8[128]` at 0 (low four bits), `qh: u8[64]` at 128
/// (high two bits), `scales: i8[16]` at 192, `d: f16` at 208;
/// `x = d * sc * (q - 32)` per sub-block of 16. In each half of 128 values,
/// value `r = 32k + l` has its low nibble in `ql[64h + l + 32 (k & 1)]`
/// (high nibble when `k >= 2`) and its top bits at offset `2k` of `qh[32h + l]`.
pub fn quantize_q6_k(x: &[f32], out: &mut [u8]) {
    let mut levels = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let (mut max_abs, mut max_scale) = (0f32, 0f32);
    for j in 0..16 {
        scales[j] = make_qx_quants(32, &x[16 * j..16 * j + 16], &mut levels[16 * j..16 * j + 16]);
        if scales[j].abs() > max_abs {
            max_abs = scales[j].abs();
            max_scale = scales[j];
        }
    }
    if max_abs < GROUP_MAX_EPS {
        out[..210].fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(out, 208, 1.0 / iscale);
    for (b, s) in out[192..208].iter_mut().zip(&scales) {
        *b = nearest_int(iscale * s).min(127) as i8 as u8;
    }
    let d = f16_at(out, 208);
    for j in 0..16 {
        let dl = d * out[192 + j] as i8 as f32;
        if dl == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            levels[i] = (nearest_int(x[i] / dl).clamp(-32, 31) + 32) as i8;
        }
    }
    let (ql, qh) = out[..192].split_at_mut(128);
    for (h, half) in levels.chunks_exact(128).enumerate() {
        let l6 = |r: usize| half[r] as u8;
        for l in 0..32 {
            ql[64 * h + l] = (l6(l) & 0xF) | ((l6(l + 64) & 0xF) << 4);
            ql[64 * h + l + 32] = (l6(l + 32) & 0xF) | ((l6(l + 96) & 0xF) << 4);
            qh[32 * h + l] =
                (l6(l) >> 4) | ((l6(l + 32) >> 4) << 2) | ((l6(l + 64) >> 4) << 4) | ((l6(l + 96) >> 4) << 6);
        }
    }
}

#[inline(always)]
pub fn dequantize_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    for (h, yh) in y.chunks_exact_mut(128).enumerate() {
        let (ql, qh, sc) = (&ql[64 * h..64 * h + 64], &qh[32 * h..32 * h + 32], &sc[8 * h..8 * h + 8]);
        let (y01, y23) = yh.split_at_mut(64);
        let ((y0, y1), (y2, y3)) = (y01.split_at_mut(32), y23.split_at_mut(32));
        for l in 0..32 {
            let is = l / 16;
            let level = |low: u8, shift: u32| ((low & 0xF) | (((qh[l] >> shift) & 3) << 4)) as i32 - 32;
            let w = |k: usize| d * sc[is + 2 * k] as i8 as f32;
            y0[l] = w(0) * level(ql[l], 0) as f32;
            y1[l] = w(1) * level(ql[l + 32], 2) as f32;
            y2[l] = w(2) * level(ql[l] >> 4, 4) as f32;
            y3[l] = w(3) * level(ql[l + 32] >> 4, 6) as f32;
        }
    }
}
