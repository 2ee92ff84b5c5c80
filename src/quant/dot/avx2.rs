//! The integer dot products with AVX2: 32 weights per 256-bit register.
//!
//! Weight levels are unsigned bytes (`0..=15` for 4 bits, ..., `0..=63` for
//! Q6_K), the activations signed bytes, so `vpmaddubsw` multiplies them and
//! adds adjacent pairs into i16 without saturating (`2 * 63 * 127 < 2^15`);
//! `vpmaddwd` then multiplies the pairs by the sub-block scale (or by 1) and
//! adds them into eight i32 lanes. Q8_0 weights are signed: `vpsignb` moves
//! their signs onto the activations (`|w| <= 128`, `2 * 128 * 127 < 2^15`).
//! The i32 lanes of a (super-)block are converted once and multiplied into
//! eight f32 lane sums by the block's `d_w * d_x`.

use super::act::{Q8Blocks, Q8KBlocks};
use super::{k4_scales, BLOCK_BYTES_K};
use std::arch::x86_64::*;

/// Checks that `row` is `nb` blocks of `bytes` for an activation of `nb`
/// blocks: the loads below rely on it.
#[inline(always)]
fn blocks(row: &[u8], bytes: usize, nb: usize) -> usize {
    assert_eq!(row.len(), nb * bytes, "row of {} bytes for {nb} blocks of {bytes}", row.len());
    nb
}

/// 32 bytes at `p`.
#[inline(always)]
unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY (callers): `p..p + 32` is inside a slice.
    _mm256_loadu_si256(p as *const __m256i)
}

/// 32 activation bytes at `x[i..]`.
#[inline(always)]
unsafe fn load_x(x: &[i8], i: usize) -> __m256i {
    debug_assert!(i + 32 <= x.len());
    // SAFETY (callers): `i + 32 <= x.len()`.
    _mm256_loadu_si256(x.as_ptr().add(i) as *const __m256i)
}

/// The two f16 at `p` (little-endian), widened: lanes 0 and 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x2(p: *const u8) -> __m128 {
    // SAFETY (callers): `p..p + 4` is inside a slice.
    _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()))
}

/// The f16 at `p`, widened, in every lane. (Converting a broadcast keeps
/// every lane live, so the compiler cannot merge the f16 into a register
/// that is still being accumulated: that false dependency chained the
/// iterations of a loop.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_splat(p: *const u8) -> __m256 {
    // SAFETY (callers): `p..p + 2` is inside a slice.
    _mm256_cvtph_ps(_mm_set1_epi16((p as *const i16).read_unaligned()))
}

/// The f16 at `p0`, `p1`, `p2`, `p3`, widened (lanes 0..4).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x4(p: [*const u8; 4]) -> __m128 {
    // SAFETY (callers): each `p[k]..p[k] + 2` is inside a slice.
    let h = |k: usize| (p[k] as *const u16).read_unaligned() as u64;
    _mm_cvtph_ps(_mm_cvtsi64_si128((h(0) | h(1) << 16 | h(2) << 32 | h(3) << 48) as i64))
}

/// The 16 signed scales of a Q3_K super-block's 12 bytes at `p` (see
/// [`super::q3_scales`]), as bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q3_scales_simd(p: *const u8) -> __m128i {
    // SAFETY (callers): `p..p + 12` is inside the row.
    let v = _mm_insert_epi32::<2>(_mm_loadl_epi64(p as *const __m128i), (p.add(8) as *const i32).read_unaligned());
    let m4 = _mm_set1_epi8(15);
    // Low four bits: nibbles of bytes 0..8 (low for scales 0..8, high for 8..16).
    let low = _mm_unpacklo_epi64(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16::<4>(v), m4));
    // Top two bits: bits 2 (j / 4) of byte 8 + j % 4.
    let top = _mm_shuffle_epi8(v, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
    let top = _mm_and_si128(_mm_srlv_epi32(top, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16::<4>(top)), _mm_set1_epi8(32))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum128(s: __m128) -> f32 {
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `sum` of the u8 x i8 products, in eight i32 lanes (adjacent pairs, then quads).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot32(w: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
}

/// The u8 x i8 products, adjacent pairs multiplied by the i16 `scale` lanes, in i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot32_scaled(w: __m256i, x: __m256i, scale: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scale)
}

/// The 32 4-bit levels of a legacy block's 16 bytes at `p`: low nibbles are
/// values 0..16, high nibbles 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles16(p: *const u8) -> __m256i {
    // SAFETY (callers): `p..p + 16` is inside the row.
    let q = _mm_loadu_si128(p as *const __m128i);
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), _mm256_set1_epi8(15))
}

/// 16 where bit `j` of `bits` is set, in byte `j`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, spread), bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// How a 32-element type's block scales its activation block sum: by
/// `factor * d_w`, or (`MIN`) by the f16 min stored after `d_w`.
#[derive(Clone, Copy)]
struct Offset {
    factor: f32,
    min: bool,
}

/// The 32-element loop, four blocks per step, for `N` tokens' activations
/// at once: `levels(p)` gives the block's 32 levels (decoded once for all
/// the tokens), `dot(w, x)` their products with an activation in i32 lanes;
/// a row is `sum d_w d_x isum + offset`, each token's formed exactly as
/// alone (the one-token kernel is `N = 1`).
#[inline(always)]
unsafe fn legacy<const N: usize>(
    row: &[u8],
    bytes: usize,
    a: [&Q8Blocks; N],
    offset: Offset,
    levels: impl Fn(*const u8) -> __m256i,
    dot: impl Fn(__m256i, __m256i) -> __m256i,
) -> [f32; N] {
    let nb = blocks(row, bytes, a[0].blocks());
    assert!(a.iter().all(|a| a.blocks() == nb), "activations of different lengths");
    let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
    let mut off = [_mm_setzero_ps(); N];
    let base = row.as_ptr();
    let lane = |s: __m256, k: i32| _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(k));
    let mut i = 0;
    while i + 4 <= nb {
        // SAFETY: blocks i..i + 4 are inside the row (checked by `blocks`),
        // activation blocks i..i + 4 inside each of `a` (they have `nb` blocks).
        let p = [0, 1, 2, 3].map(|k| base.add((i + k) * bytes));
        let d = f16x4(p);
        let c = if offset.min { f16x4(p.map(|p| p.add(2))) } else { d };
        let mut s = [_mm256_setzero_ps(); N];
        for t in 0..N {
            s[t] = _mm256_castps128_ps256(_mm_mul_ps(d, _mm_loadu_ps(a[t].d.as_ptr().add(i))));
            off[t] = _mm_fmadd_ps(c, _mm_loadu_ps(a[t].ds.as_ptr().add(i)), off[t]);
        }
        for (k, &pk) in p.iter().enumerate() {
            let w = levels(pk);
            for t in 0..N {
                let isum = _mm256_cvtepi32_ps(dot(w, load_x(&a[t].qs, 32 * (i + k))));
                if k % 2 == 0 {
                    acc0[t] = _mm256_fmadd_ps(lane(s[t], k as i32), isum, acc0[t]);
                } else {
                    acc1[t] = _mm256_fmadd_ps(lane(s[t], k as i32), isum, acc1[t]);
                }
            }
        }
        i += 4;
    }
    let mut offs = [0f32; N];
    for t in 0..N {
        offs[t] = hsum128(off[t]);
    }
    while i < nb {
        // SAFETY: as above, one block.
        let p = base.add(i * bytes);
        let d = f16_splat(p);
        let w = levels(p);
        let c = if offset.min { f16_splat(p.add(2)) } else { d };
        for t in 0..N {
            let isum = _mm256_cvtepi32_ps(dot(w, load_x(&a[t].qs, 32 * i)));
            acc0[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[t].d[i])), isum, acc0[t]);
            offs[t] += _mm256_cvtss_f32(c) * a[t].ds[i];
        }
        i += 1;
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = hsum(_mm256_add_ps(acc0[t], acc1[t])) + offset.factor * offs[t];
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn q4_0_n<const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    let offset = Offset { factor: -8.0, min: false };
    // SAFETY: `legacy` checks the row length; a block is 18 bytes (f16 d, 16 bytes of nibbles).
    unsafe { legacy(row, 18, a, offset, |p| nibbles16(p.add(2)), |w, x| dot32(w, x)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn q4_1_n<const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    let offset = Offset { factor: 1.0, min: true };
    // SAFETY: as `q4_0`; a block is 20 bytes (f16 d, m, 16 bytes of nibbles).
    unsafe { legacy(row, 20, a, offset, |p| nibbles16(p.add(4)), |w, x| dot32(w, x)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn q5_0_n<const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    let offset = Offset { factor: -16.0, min: false };
    // SAFETY: as `q4_0`; a block is 22 bytes (f16 d, u32 qh, 16 bytes of nibbles).
    let levels = |p: *const u8| unsafe {
        _mm256_or_si256(nibbles16(p.add(6)), fifth_bits((p.add(2) as *const u32).read_unaligned()))
    };
    unsafe { legacy(row, 22, a, offset, levels, |w, x| dot32(w, x)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn q5_1_n<const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    let offset = Offset { factor: 1.0, min: true };
    // SAFETY: as `q4_0`; a block is 24 bytes (f16 d, m, u32 qh, 16 bytes of nibbles).
    let levels = |p: *const u8| unsafe {
        _mm256_or_si256(nibbles16(p.add(8)), fifth_bits((p.add(4) as *const u32).read_unaligned()))
    };
    unsafe { legacy(row, 24, a, offset, levels, |w, x| dot32(w, x)) }
}

/// Q8_0: the weights' signs move onto the activations (`vpsignb`), so
/// `vpmaddubsw` multiplies `|w| <= 128` by them without saturating.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn q8_0_n<const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    let offset = Offset { factor: 0.0, min: false };
    let dot = |w: __m256i, x: __m256i| dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    // SAFETY: as `q4_0`; a block is 34 bytes (f16 d, 32 i8).
    unsafe { legacy(row, 34, a, offset, |p| load(p.add(2)), dot) }
}

/// `vpshufb` control that repeats i16 lane `k` of each 128-bit half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repeat16(k: i32) -> __m256i {
    _mm256_set1_epi16((((2 * k + 1) << 8) | (2 * k)) as i16)
}

/// `vpshufb` control: i16 lane `k` in the low half, `k + 1` in the high half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn repeat16_pair(k: i32) -> __m256i {
    let lo = _mm_set1_epi16((((2 * k + 1) << 8) | (2 * k)) as i16);
    let hi = _mm_set1_epi16((((2 * k + 3) << 8) | (2 * k + 2)) as i16);
    _mm256_set_m128i(hi, lo)
}

/// The K-quant loop for `N` tokens: `block(p, i, acc, mins)` adds
/// super-block `i` at `p` into each token's two f32 accumulators (products,
/// mins; `d = d_w d_x`, `dmin = dmin_w d_x`), decoding its weights once for
/// all of them; a row is the difference.
#[inline(always)]
unsafe fn kquant<const N: usize>(
    row: &[u8],
    bytes: usize,
    a: [&Q8KBlocks; N],
    mut block: impl FnMut(*const u8, usize, &mut [__m256; N], &mut [__m256; N]),
) -> [f32; N] {
    let nb = blocks(row, bytes, a[0].blocks());
    assert!(a.iter().all(|a| a.blocks() == nb), "activations of different lengths");
    let (mut acc, mut mins) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
    for i in 0..nb {
        block(row.as_ptr().add(i * bytes), i, &mut acc, &mut mins);
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = hsum(acc[t]) - hsum(mins[t]);
    }
    out
}

/// The 16 i16 `bsums` of super-block `i`.
#[inline(always)]
unsafe fn bsums16(a: &Q8KBlocks, i: usize) -> __m256i {
    // SAFETY (callers): `i < a.blocks()`, so `16 i + 16 <= a.bsums.len()`.
    _mm256_loadu_si256(a.bsums.as_ptr().add(16 * i) as *const __m256i)
}

/// 16 bytes as 16 i16 (signed when `SIGNED`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen16<const SIGNED: bool>(b: __m128i) -> __m256i {
    if SIGNED {
        _mm256_cvtepi8_epi16(b)
    } else {
        _mm256_cvtepu8_epi16(b)
    }
}

/// The 16-value sub-block products of a Q2_K / Q3_K / Q6_K super-block
/// with each token's activation `xs[t]`, scaled by `scales` (16 i16):
/// `levels(h, k)` gives the 32 levels of values `128 h + 32 k..128 h + 32 k + 32`
/// (decoded once for every token).
#[inline(always)]
unsafe fn scaled16<const N: usize>(xs: [&[i8]; N], scales: __m256i, mut levels: impl FnMut(usize, usize) -> __m256i) -> [__m256i; N] {
    let mut sum = [_mm256_setzero_si256(); N];
    for h in 0..2 {
        // Scales 8h..8h+8 in both halves.
        let s = if h == 0 {
            _mm256_permute2x128_si256::<0x00>(scales, scales)
        } else {
            _mm256_permute2x128_si256::<0x11>(scales, scales)
        };
        for k in 0..4 {
            let sc = _mm256_shuffle_epi8(s, repeat16_pair(2 * k as i32));
            let w = levels(h, k);
            for t in 0..N {
                sum[t] = _mm256_add_epi32(sum[t], dot32_scaled(w, load_x(xs[t], 128 * h + 32 * k), sc));
            }
        }
    }
    sum
}

/// Each token's activation bytes of super-block `i`.
#[inline(always)]
fn block_x<const N: usize>(a: [&Q8KBlocks; N], i: usize) -> [&[i8]; N] {
    a.map(|a| &a.qs[256 * i..256 * i + 256])
}

/// Adds super-block `i` of a type without minima whose levels are the
/// values + `2^SHIFT` (Q3_K, Q6_K: `dw` its f16 scale widened, `scales` its
/// 16 signed sub-block scales, `sum` each token's scaled level sums) into
/// each token's sum.
#[inline(always)]
unsafe fn offset_block<const N: usize, const SHIFT: i32>(
    a: [&Q8KBlocks; N],
    i: usize,
    dw: __m256,
    scales: __m256i,
    sum: [__m256i; N],
    acc: &mut [__m256; N],
) {
    for t in 0..N {
        let d = _mm256_mul_ps(dw, _mm256_set1_ps(a[t].d[i]));
        let offset = _mm256_slli_epi32::<SHIFT>(_mm256_madd_epi16(scales, bsums16(a[t], i)));
        let isum = _mm256_sub_epi32(sum[t], offset);
        acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum), acc[t]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn q2_k_n<const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let m3 = _mm256_set1_epi8(3);
    let block = |p: *const u8, i: usize, acc: &mut [__m256; N], mins: &mut [__m256; N]| unsafe {
        // SAFETY: `p` is super-block `i` (84 bytes: scales 16, qs 64, d, dmin), checked by `kquant`.
        let dw = f16x2(p.add(80));
        let sm = _mm_loadu_si128(p as *const __m128i);
        let scales = widen16::<false>(_mm_and_si128(sm, _mm_set1_epi8(15)));
        let m = widen16::<false>(_mm_and_si128(_mm_srli_epi16::<4>(sm), _mm_set1_epi8(15)));
        let q = [load(p.add(16)), load(p.add(48))];
        let shifted = |v: __m256i, k: usize| match k {
            0 => v,
            1 => _mm256_srli_epi16::<2>(v),
            2 => _mm256_srli_epi16::<4>(v),
            _ => _mm256_srli_epi16::<6>(v),
        };
        let isum = scaled16(block_x(a, i), scales, |h, k| _mm256_and_si256(shifted(q[h], k), m3));
        for t in 0..N {
            let dd = _mm_mul_ps(dw, _mm_set1_ps(a[t].d[i]));
            let msum = _mm256_madd_epi16(m, bsums16(a[t], i));
            mins[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), _mm256_cvtepi32_ps(msum), mins[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(isum[t]), acc[t]);
        }
    };
    // SAFETY: `kquant` checks the row length and passes super-block pointers inside it.
    unsafe { kquant(row, BLOCK_BYTES_K[0], a, block) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn q3_k_n<const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let m3 = _mm256_set1_epi8(3);
    let block = |p: *const u8, i: usize, acc: &mut [__m256; N], _: &mut [__m256; N]| unsafe {
        // SAFETY: `p` is super-block `i` (110 bytes: hmask 32, qs 64, scales 12, d), checked by `kquant`.
        let dw = f16_splat(p.add(108));
        let scales = widen16::<true>(q3_scales_simd(p.add(96)));
        let hm = load(p);
        let q = [load(p.add(32)), load(p.add(64))];
        let shifted = |v: __m256i, k: usize| match k {
            0 => v,
            1 => _mm256_srli_epi16::<2>(v),
            2 => _mm256_srli_epi16::<4>(v),
            _ => _mm256_srli_epi16::<6>(v),
        };
        let levels = |h: usize, k: usize| {
            let bit = _mm256_set1_epi8((1u8 << (4 * h + k)) as i8);
            let clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
            let high = _mm256_andnot_si256(clear, _mm256_set1_epi8(4));
            _mm256_or_si256(_mm256_and_si256(shifted(q[h], k), m3), high)
        };
        let sum = scaled16(block_x(a, i), scales, levels);
        // Levels are the values + 4.
        offset_block::<N, 2>(a, i, dw, scales, sum, acc);
    };
    // SAFETY: `kquant` checks the row length and passes super-block pointers inside it.
    unsafe { kquant(row, BLOCK_BYTES_K[1], a, block) }
}

/// Q4_K / Q5_K: `levels(c, hi)` gives the 32 levels of values `64 c + 32 hi..`
/// (called in that order: c = 0, 1, 2, 3, low then high).
#[inline(always)]
unsafe fn k4<const N: usize>(
    p: *const u8,
    i: usize,
    a: [&Q8KBlocks; N],
    acc: &mut [__m256; N],
    mins: &mut [__m256; N],
    mut levels: impl FnMut(usize, bool) -> __m256i,
) {
    // SAFETY (callers): `p` is super-block `i`, whose first 16 bytes are d, dmin, 12 scale bytes.
    let dw = f16x2(p);
    let (sc, m) = k4_scales(std::slice::from_raw_parts(p.add(4), 12));
    let sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
    let m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(m as i64));
    let mut isum = [_mm256_setzero_si256(); N];
    for c in 0..4 {
        let (wl, sl) = (levels(c, false), _mm256_shuffle_epi8(sc, repeat16(2 * c as i32)));
        let (wh, sh) = (levels(c, true), _mm256_shuffle_epi8(sc, repeat16(2 * c as i32 + 1)));
        for t in 0..N {
            let x = &a[t].qs[256 * i..256 * i + 256];
            let lo = dot32_scaled(wl, load_x(x, 64 * c), sl);
            let hi = dot32_scaled(wh, load_x(x, 64 * c + 32), sh);
            isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(lo, hi));
        }
    }
    for t in 0..N {
        let dd = _mm_mul_ps(dw, _mm_set1_ps(a[t].d[i]));
        let bs = bsums16(a[t], i);
        let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
        let msum = _mm256_zextsi128_si256(_mm_madd_epi16(pairs, m));
        mins[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), _mm256_cvtepi32_ps(msum), mins[t]);
        acc[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(isum[t]), acc[t]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn q4_k_n<const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let m4 = _mm256_set1_epi8(15);
    let block = |p: *const u8, i: usize, acc: &mut [__m256; N], mins: &mut [__m256; N]| unsafe {
        // SAFETY: `p` is super-block `i` (144 bytes: d, dmin, scales 12, qs 128), checked by `kquant`.
        let mut q = _mm256_setzero_si256();
        k4(p, i, a, acc, mins, |c, hi| {
            if hi {
                _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4)
            } else {
                q = load(p.add(16 + 32 * c));
                _mm256_and_si256(q, m4)
            }
        })
    };
    // SAFETY: `kquant` checks the row length and passes super-block pointers inside it.
    unsafe { kquant(row, BLOCK_BYTES_K[2], a, block) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn q5_k_n<const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let (m4, b4) = (_mm256_set1_epi8(15), _mm256_set1_epi8(16));
    let block = |p: *const u8, i: usize, acc: &mut [__m256; N], mins: &mut [__m256; N]| unsafe {
        // SAFETY: `p` is super-block `i` (176 bytes: d, dmin, scales 12, qh 32, qs 128), checked by `kquant`.
        let mut q = _mm256_setzero_si256();
        // Bit 2c of qh (low nibbles of chunk c) and 2c + 1 (high nibbles), moved down as c advances.
        let mut qh = load(p.add(16));
        k4(p, i, a, acc, mins, |c, hi| {
            if hi {
                let h = _mm256_and_si256(_mm256_slli_epi16::<3>(qh), b4);
                qh = _mm256_srli_epi16::<2>(qh);
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), h)
            } else {
                q = load(p.add(48 + 32 * c));
                _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), b4))
            }
        })
    };
    // SAFETY: `kquant` checks the row length and passes super-block pointers inside it.
    unsafe { kquant(row, BLOCK_BYTES_K[3], a, block) }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub fn q6_k_n<const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let (m4, m30) = (_mm256_set1_epi8(15), _mm256_set1_epi8(0x30));
    let block = |p: *const u8, i: usize, acc: &mut [__m256; N], _: &mut [__m256; N]| unsafe {
        // SAFETY: `p` is super-block `i` (210 bytes: ql 128, qh 64, scales 16, d), checked by `kquant`.
        let dw = f16_splat(p.add(208));
        let scales = widen16::<true>(_mm_loadu_si128(p.add(192) as *const __m128i));
        let levels = |h: usize, k: usize| {
            let ql = load(p.add(64 * h + 32 * (k & 1)));
            let qh = load(p.add(128 + 32 * h));
            let (low, high) = match k {
                0 => (ql, _mm256_slli_epi16::<4>(qh)),
                1 => (ql, _mm256_slli_epi16::<2>(qh)),
                2 => (_mm256_srli_epi16::<4>(ql), qh),
                _ => (_mm256_srli_epi16::<4>(ql), _mm256_srli_epi16::<2>(qh)),
            };
            _mm256_or_si256(_mm256_and_si256(low, m4), _mm256_and_si256(high, m30))
        };
        let sum = scaled16(block_x(a, i), scales, levels);
        // Levels are the values + 32.
        offset_block::<N, 5>(a, i, dw, scales, sum, acc);
    };
    // SAFETY: `kquant` checks the row length and passes super-block pointers inside it.
    unsafe { kquant(row, BLOCK_BYTES_K[4], a, block) }
}


/// The one-token kernels (`N = 1` of the `_n` ones) and the
/// several-token ones (`tokens::`): `name n activation` per type.
macro_rules! entry_points {
    ($($name:ident $n:ident $act:ident),*) => {
        $(
            #[target_feature(enable = "avx2,fma,f16c")]
            pub fn $name(row: &[u8], a: &$act) -> f32 {
                $n::<1>(row, [a])[0]
            }
        )*
        /// `N` tokens at once (up to [`TOKENS`](super::super::TOKENS)).
        pub mod tokens {
            use super::super::act::{Q8Blocks, Q8KBlocks};
            $(
                #[target_feature(enable = "avx2,fma,f16c")]
                pub fn $name<const N: usize>(row: &[u8], a: [&$act; N]) -> [f32; N] {
                    super::$n::<N>(row, a)
                }
            )*
        }
    };
}

entry_points!(
    q4_0 q4_0_n Q8Blocks, q4_1 q4_1_n Q8Blocks, q5_0 q5_0_n Q8Blocks, q5_1 q5_1_n Q8Blocks, q8_0 q8_0_n Q8Blocks,
    q2_k q2_k_n Q8KBlocks, q3_k q3_k_n Q8KBlocks, q4_k q4_k_n Q8KBlocks, q5_k q5_k_n Q8KBlocks, q6_k q6_k_n Q8KBlocks
);
