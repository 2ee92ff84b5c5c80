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

/// `x` in blocks of 32: `x[32 b + j] ~ d[b] * qs[32 b + j]`. The fields
/// are private: the kernels load whole blocks relying on their lengths.
#[derive(Clone, Debug, Default)]
pub struct Q8Blocks {
    pub(super) qs: Vec<i8>,
    pub(super) d: Vec<f32>,
    /// `d[b] * sum(qs[32 b..32 b + 32])`.
    pub(super) ds: Vec<f32>,
}

/// `x` in super-blocks of 256: `x[256 b + j] ~ d[b] * qs[256 b + j]`.
#[derive(Clone, Debug, Default)]
pub struct Q8KBlocks {
    pub(super) qs: Vec<i8>,
    pub(super) d: Vec<f32>,
    /// `sum(qs[16 k..16 k + 16])` for every 16 values.
    pub(super) bsums: Vec<i16>,
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
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => unsafe { q8_avx2(x, &mut a) },
            _ => q8_generic(x, &mut a),
        }
        a
    }

    /// Number of blocks.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }

    /// The levels, the block scales and `d * sum(levels)` per block.
    pub fn parts(&self) -> (&[i8], &[f32], &[f32]) {
        (&self.qs, &self.d, &self.ds)
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
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => unsafe { q8k_avx2(x, &mut a) },
            _ => q8k_generic(x, &mut a),
        }
        a
    }

    /// Number of super-blocks.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }

    /// The levels, the super-block scales and the sums of every 16 levels.
    pub fn parts(&self) -> (&[i8], &[f32], &[i16]) {
        (&self.qs, &self.d, &self.bsums)
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

fn q8_generic(x: &[f32], a: &mut Q8Blocks) {
    for (b, (xs, qs)) in x.chunks_exact(QK8).zip(a.qs.chunks_exact_mut(QK8)).enumerate() {
        let d = quantize_block(xs, qs);
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        a.d[b] = d;
        a.ds[b] = d * sum as f32;
    }
}

fn q8k_generic(x: &[f32], a: &mut Q8KBlocks) {
    for (b, (xs, qs)) in x.chunks_exact(QK_K).zip(a.qs.chunks_exact_mut(QK_K)).enumerate() {
        a.d[b] = quantize_block(xs, qs);
        for (s, q16) in a.bsums[16 * b..16 * b + 16].iter_mut().zip(qs.chunks_exact(16)) {
            *s = q16.iter().map(|&q| q as i16).sum();
        }
    }
}

/// [`quantize_block`] with AVX2 (`x.len()` a multiple of 32): the same
/// operations lane by lane (`vmaxps` with the running maximum second ignores
/// NaN as `f32::max` does; `vroundps` rounds half to even; NaN lanes become
/// 0 as `as i8` makes them), so the same bytes. `sums(k, s)` receives the
/// i32 sum of the levels of every 16 values `16 k..16 k + 16`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn quantize_block_avx2(x: &[f32], q: &mut [i8], mut sums: impl FnMut(usize, i32)) -> f32 {
    use std::arch::x86_64::*;
    assert!(x.len().is_multiple_of(32) && q.len() == x.len());
    let sign = _mm256_set1_ps(-0.0);
    let (mut m, mut nan) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for c in x.chunks_exact(8) {
        // SAFETY: `c` holds 8 floats.
        let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    }
    // The maximum of the lanes (none is NaN; max is exact in any order).
    let m = _mm256_max_ps(m, _mm256_permute2f128_ps::<1>(m, m));
    let m = _mm256_max_ps(m, _mm256_permute_ps::<0x4e>(m));
    let amax = _mm256_cvtss_f32(_mm256_max_ps(m, _mm256_permute_ps::<0xb1>(m)));
    let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
    let level = |c: &[f32]| {
        // SAFETY: `c` holds 8 floats.
        let v = _mm256_mul_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, id);
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
        _mm256_cvtps_epi32(_mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r)))
    };
    let hsum = |v: __m256i| {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0x4e>(s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0xb1>(s)))
    };
    for (k, (c, out)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        let l = [level(&c[..8]), level(&c[8..16]), level(&c[16..24]), level(&c[24..])];
        let (ab, cd) = (_mm256_packs_epi32(l[0], l[1]), _mm256_packs_epi32(l[2], l[3]));
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `out` holds 32 bytes.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, bytes) };
        sums(2 * k, hsum(_mm256_add_epi32(l[0], l[1])));
        sums(2 * k + 1, hsum(_mm256_add_epi32(l[2], l[3])));
    }
    if _mm256_movemask_ps(nan) != 0 {
        f32::NAN
    } else {
        amax / 127.0
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn q8_avx2(x: &[f32], a: &mut Q8Blocks) {
    for (b, (xs, qs)) in x.chunks_exact(QK8).zip(a.qs.chunks_exact_mut(QK8)).enumerate() {
        let mut sum = 0i32;
        let d = quantize_block_avx2(xs, qs, |_, s| sum += s);
        a.d[b] = d;
        a.ds[b] = d * sum as f32;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn q8k_avx2(x: &[f32], a: &mut Q8KBlocks) {
    for (b, (xs, qs)) in x.chunks_exact(QK_K).zip(a.qs.chunks_exact_mut(QK_K)).enumerate() {
        let bsums = &mut a.bsums[16 * b..16 * b + 16];
        a.d[b] = quantize_block_avx2(xs, qs, |k, s| bsums[k] = s as i16);
    }
}
