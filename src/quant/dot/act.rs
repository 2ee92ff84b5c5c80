//! The activation vector rounded to 8 bits, once per matrix-vector product.
//!
//! Two layouts, both struct-of-arrays so the kernels load 32 or 64 values of
//! `qs` with one instruction:
//!
//! * [`Q8Blocks`] for the 32-element weight types: one f32 scale per block of
//!   32 and `ds = d * sum(q)` (the block's sum, which the offset `-8`, `-16`,
//!   `-128` or the min `m` of the weight block multiplies);
//! * [`Q8KBlocks`] for the K-quants: one f32 scale per super-block of 256 and
//!   the integer sum of every 16 values (`bsums`), which the K-quants' mins
//!   and offsets multiply.
//!
//! Rounding (the same in both): `d = amax / 127`, `q = round_ties_even(x * 127
//! / amax)` with `amax = max |x|` over the block, so `|x - d q| <= d / 2` (up
//! to a few f32 ulps) and `q` is in `-127..=127`. A block of zeros has `d = 0`.
//! A block holding a NaN gets `d = NaN` (and an infinite one `d = inf` with all
//! `q = 0`), so a non-finite input still poisons the products, as it does on
//! the exact path. The arithmetic is elementwise or exact (max, integer sums),
//! so every ISA produces the same bytes.

use super::super::kernels::Isa;

/// Values per block of [`Q8Blocks`].
pub const QK8: usize = 32;
/// Values per super-block of [`Q8KBlocks`].
pub const QK_K: usize = 256;

/// `x` in blocks of 32: `x[32 b + j] ~ d[b] * qs[32 b + j]`.
#[derive(Clone, Debug, Default)]
pub struct Q8Blocks {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    /// `d[b] * sum(qs[32 b..32 b + 32])`.
    pub ds: Vec<f32>,
}

/// `x` in super-blocks of 256: `x[256 b + j] ~ d[b] * qs[256 b + j]`.
#[derive(Clone, Debug, Default)]
pub struct Q8KBlocks {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    /// `sum(qs[16 k..16 k + 16])` for every 16 values.
    pub bsums: Vec<i16>,
}

impl Q8Blocks {
    /// Quantizes `x` (`x.len()` a multiple of 32).
    pub fn new(isa: Isa, x: &[f32]) -> Q8Blocks {
        assert_eq!(x.len() % QK8, 0, "Q8 activation: length not a multiple of {QK8}");
        let n = x.len() / QK8;
        let mut a = Q8Blocks { qs: vec![0; x.len()], d: vec![0.0; n], ds: vec![0.0; n] };
        match isa {
            // SAFETY: `isa` comes from `Isa::available`, so the CPU has the features.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { q8_avx2(x, &mut a) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Vnni => unsafe { q8_avx512(x, &mut a) },
            _ => q8_generic(x, &mut a),
        }
        a
    }

    /// Number of blocks.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }

    /// The values the quantized vector stands for, `d * q`.
    pub fn dequantize(&self) -> Vec<f32> {
        self.qs.iter().enumerate().map(|(i, &q)| self.d[i / QK8] * q as f32).collect()
    }
}

impl Q8KBlocks {
    /// Quantizes `x` (`x.len()` a multiple of 256).
    pub fn new(isa: Isa, x: &[f32]) -> Q8KBlocks {
        assert_eq!(x.len() % QK_K, 0, "Q8_K activation: length not a multiple of {QK_K}");
        let n = x.len() / QK_K;
        let mut a = Q8KBlocks { qs: vec![0; x.len()], d: vec![0.0; n], bsums: vec![0; x.len() / 16] };
        match isa {
            // SAFETY: `isa` comes from `Isa::available`, so the CPU has the features.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { q8k_avx2(x, &mut a) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Vnni => unsafe { q8k_avx512(x, &mut a) },
            _ => q8k_generic(x, &mut a),
        }
        a
    }

    /// Number of super-blocks.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }

    /// The values the quantized vector stands for, `d * q`.
    pub fn dequantize(&self) -> Vec<f32> {
        self.qs.iter().enumerate().map(|(i, &q)| self.d[i / QK_K] * q as f32).collect()
    }
}

/// Rounds one block to `q`, returns its scale `d`.
#[inline(always)]
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let nan = x.iter().fold(false, |n, v| n | v.is_nan());
    let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        // In -127..=127 (`as` saturates; NaN becomes 0, covered by `d`).
        *q = (v * id).round_ties_even() as i8;
    }
    if nan {
        f32::NAN
    } else {
        amax / 127.0
    }
}

#[inline(always)]
fn q8_generic(x: &[f32], a: &mut Q8Blocks) {
    for (b, (xs, qs)) in x.chunks_exact(QK8).zip(a.qs.chunks_exact_mut(QK8)).enumerate() {
        let d = quantize_block(xs, qs);
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        a.d[b] = d;
        a.ds[b] = d * sum as f32;
    }
}

#[inline(always)]
fn q8k_generic(x: &[f32], a: &mut Q8KBlocks) {
    for (b, (xs, qs)) in x.chunks_exact(QK_K).zip(a.qs.chunks_exact_mut(QK_K)).enumerate() {
        a.d[b] = quantize_block(xs, qs);
        for (s, q16) in a.bsums[16 * b..16 * b + 16].iter_mut().zip(qs.chunks_exact(16)) {
            *s = q16.iter().map(|&q| q as i16).sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn q8_avx2(x: &[f32], a: &mut Q8Blocks) {
    q8_generic(x, a)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn q8_avx512(x: &[f32], a: &mut Q8Blocks) {
    q8_generic(x, a)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn q8k_avx2(x: &[f32], a: &mut Q8KBlocks) {
    q8k_generic(x, a)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn q8k_avx512(x: &[f32], a: &mut Q8KBlocks) {
    q8k_generic(x, a)
}
