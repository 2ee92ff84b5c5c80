//! The integer dot products with AVX-512: 64 weights per 512-bit register,
//! compiled twice: [`plain`] (AVX512F/BW/VL: `vpmaddubsw` then `vpmaddwd`,
//! as [`super::avx2`]) and [`vnni`] (AVX512-VNNI: `vpdpwssd` multiplies the
//! i16 pairs by the scales and accumulates in one instruction, `vpdpbusd`
//! does u8 x i8 quads straight into i32).
//!
//! Layout: a register always holds 64 consecutive values, so the activation
//! is one plain load. The K-quants store the values of a register in two
//! 32-byte runs (low and high nibbles of the same bytes, or two bit planes of
//! the same bytes): the run is broadcast to both 256-bit halves and shifted
//! by a different amount in each (`vpsrlvw`); the extra bits of Q5_K and Q3_K
//! are added under a byte mask (`vptestmb`). Sub-block scales are spread over
//! the i16 lanes with `vpermw`. The 32-element types take two blocks per
//! register, four blocks per step, so their four f16 scales convert together.

// The AVX-512 intrinsics are stable since Rust 1.89, as are the
// `avx512*` target features the exact kernels already enable: the crate
// needs 1.89 whatever `rust-version` says.
#![allow(clippy::incompatible_msrv)]

use super::act::{Q8Blocks, Q8KBlocks};
use super::{k4_scales, BLOCK_BYTES_K};
use std::arch::x86_64::*;

#[inline(always)]
fn blocks(row: &[u8], bytes: usize, nb: usize) -> usize {
    assert_eq!(row.len(), nb * bytes, "row of {} bytes for {nb} blocks of {bytes}", row.len());
    nb
}

/// 64 bytes at `p`.
#[inline(always)]
unsafe fn load64(p: *const u8) -> __m512i {
    // SAFETY (callers): `p..p + 64` is inside a slice.
    _mm512_loadu_si512(p as *const _)
}

/// The 32 bytes at `p` in both halves.
#[inline(always)]
unsafe fn load32x2(p: *const u8) -> __m512i {
    // SAFETY (callers): `p..p + 32` is inside a slice.
    _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i))
}

/// Activation bytes `x[i..i + 64]`.
#[inline(always)]
unsafe fn load_x(x: &[i8], i: usize) -> __m512i {
    debug_assert!(i + 64 <= x.len());
    // SAFETY (callers): `i + 64 <= x.len()`.
    _mm512_loadu_si512(x.as_ptr().add(i) as *const _)
}

/// i16 lanes: `a` in the low 256 bits, `b` in the high.
#[inline(always)]
unsafe fn halves16(a: i16, b: i16) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi16(a), _mm256_set1_epi16(b))
}

/// Bytes: `a` in the low 256 bits, `b` in the high.
#[inline(always)]
unsafe fn halves8(a: u8, b: u8) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_set1_epi8(a as i8), _mm256_set1_epi8(b as i8))
}

/// `acc` + the u8 x i8 products summed by fours (i32 lanes).
#[inline(always)]
unsafe fn dot4<const VNNI: bool>(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(acc, w, x)
    } else {
        _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)))
    }
}

/// `acc` + the u8 x i8 products, adjacent pairs times the i16 `scale` lanes (i32 lanes).
#[inline(always)]
unsafe fn dot_scaled<const VNNI: bool>(acc: __m512i, w: __m512i, x: __m512i, scale: __m512i) -> __m512i {
    let pairs = _mm512_maddubs_epi16(w, x);
    if VNNI {
        _mm512_dpwssd_epi32(acc, pairs, scale)
    } else {
        _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, scale))
    }
}

/// 256-bit `dot4`, for the last blocks of a row.
#[inline(always)]
unsafe fn dot4_256<const VNNI: bool>(w: __m256i, x: __m256i) -> __m256i {
    if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
    } else {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
    }
}

/// The f16 at `p`.
#[inline(always)]
unsafe fn f16_bits(p: *const u8) -> u64 {
    // SAFETY (callers): `p..p + 2` is inside a slice.
    (p as *const u16).read_unaligned() as u64
}

/// The f16 at `p`, widened, in every lane (see [`super::avx2::f16_splat`]).
#[inline(always)]
unsafe fn f16_splat(p: *const u8) -> __m512 {
    // SAFETY (callers): `p..p + 2` is inside a slice.
    _mm512_cvtph_ps(_mm256_set1_epi16((p as *const i16).read_unaligned()))
}

/// Four f16 (bits in `u64` order) widened.
#[inline(always)]
unsafe fn f16x4(bits: u64) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64))
}

#[inline(always)]
unsafe fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[inline(always)]
unsafe fn hsum128(s: __m128) -> f32 {
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// How a 32-element type's block scales its activation block sum.
#[derive(Clone, Copy, PartialEq)]
enum Offset {
    /// `factor * d_w` (levels are the values minus `factor`).
    Scale(f32),
    /// The block's f16 min `m_w`, stored after `d_w`.
    Min,
}

/// A 32-element type as the loop below sees it (methods, not closures, so
/// that they inline into the `target_feature` entry points).
trait Block32 {
    const BYTES: usize;
    fn offset(vnni: bool) -> Offset;
    /// The 64 levels of the blocks at `p` and `q`.
    unsafe fn levels2(p: *const u8, q: *const u8) -> __m512i;
    /// The 32 levels of the block at `p`.
    unsafe fn levels1(p: *const u8) -> __m256i;
    /// Levels times activations, in i32 lanes of eight values each.
    #[inline(always)]
    unsafe fn dot<const VNNI: bool>(w: __m512i, x: __m512i) -> __m512i {
        dot4::<VNNI>(_mm512_setzero_si512(), w, x)
    }
    #[inline(always)]
    unsafe fn dot1<const VNNI: bool>(w: __m256i, x: __m256i) -> __m256i {
        dot4_256::<VNNI>(w, x)
    }
}

/// The 32-element loop, four blocks per step (the last `nb % 4` one by one),
/// for `N` tokens' activations at once: each step's weights are decoded once
/// and meet every token, each token's sums formed exactly as alone (the
/// single-token kernel is `N = 1`).
#[inline(always)]
unsafe fn legacy<B: Block32, const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    let bytes = B::BYTES;
    let offset = B::offset(VNNI);
    let nb = blocks(row, bytes, a[0].blocks());
    assert!(a.iter().all(|a| a.blocks() == nb), "activations of different lengths");
    let (mut acc0, mut acc1) = ([_mm512_setzero_ps(); N], [_mm512_setzero_ps(); N]);
    let mut off = [_mm_setzero_ps(); N];
    let (lo, hi) = (
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
    );
    let base = row.as_ptr();
    let mut i = 0;
    while i + 4 <= nb {
        // SAFETY: blocks i..i + 4 are inside the row (checked by `blocks`),
        // activation blocks i..i + 4 inside each of `a` (they have `nb` blocks).
        let p = [0, 1, 2, 3].map(|k| base.add((i + k) * bytes));
        let d = f16x4(f16_bits(p[0]) | f16_bits(p[1]) << 16 | f16_bits(p[2]) << 32 | f16_bits(p[3]) << 48);
        let c = match offset {
            Offset::Scale(_) => d,
            Offset::Min => {
                let m = |k: usize| f16_bits(p[k].add(2));
                f16x4(m(0) | m(1) << 16 | m(2) << 32 | m(3) << 48)
            }
        };
        let (w01, w23) = (B::levels2(p[0], p[1]), B::levels2(p[2], p[3]));
        for t in 0..N {
            let s = _mm512_castps128_ps512(_mm_mul_ps(d, _mm_loadu_ps(a[t].d.as_ptr().add(i))));
            off[t] = _mm_fmadd_ps(c, _mm_loadu_ps(a[t].ds.as_ptr().add(i)), off[t]);
            let p01 = B::dot::<VNNI>(w01, load_x(&a[t].qs, 32 * i));
            let p23 = B::dot::<VNNI>(w23, load_x(&a[t].qs, 32 * i + 64));
            acc0[t] = _mm512_fmadd_ps(_mm512_permutexvar_ps(lo, s), _mm512_cvtepi32_ps(p01), acc0[t]);
            acc1[t] = _mm512_fmadd_ps(_mm512_permutexvar_ps(hi, s), _mm512_cvtepi32_ps(p23), acc1[t]);
        }
        i += 4;
    }
    let mut tail = [_mm256_setzero_ps(); N];
    let mut tail_off = [0f32; N];
    while i < nb {
        // SAFETY: as above, one block.
        let p = base.add(i * bytes);
        let d = super::avx2::f16_splat(p);
        let w = B::levels1(p);
        let c = if offset == Offset::Min { super::avx2::f16_splat(p.add(2)) } else { d };
        for t in 0..N {
            let x = _mm256_loadu_si256(a[t].qs.as_ptr().add(32 * i) as *const __m256i);
            let isum = B::dot1::<VNNI>(w, x);
            tail[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[t].d[i])), _mm256_cvtepi32_ps(isum), tail[t]);
            tail_off[t] += _mm256_cvtss_f32(c) * a[t].ds[i];
        }
        i += 1;
    }
    let factor = match offset {
        Offset::Scale(f) => f,
        Offset::Min => 1.0,
    };
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t])) + hsum256(tail[t]) + factor * (hsum128(off[t]) + tail_off[t]);
    }
    out
}

/// The 64 nibbles of two legacy blocks (16 bytes at `p` and `q`): per block
/// low nibbles (values 0..16), then high nibbles (16..32).
#[inline(always)]
unsafe fn nibbles2(p: *const u8, q: *const u8) -> __m512i {
    // SAFETY (callers): `p..p + 16`, `q..q + 16` are inside the row.
    let a = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
    let b = _mm256_broadcastsi128_si256(_mm_loadu_si128(q as *const __m128i));
    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
    let four = 0x0004_0004_0004_0004;
    let shift = _mm512_setr_epi64(0, 0, four, four, 0, 0, four, four);
    _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(15))
}

#[inline(always)]
unsafe fn nibbles1(p: *const u8) -> __m256i {
    // SAFETY (callers): `p..p + 16` is inside the row.
    let q = _mm_loadu_si128(p as *const __m128i);
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), _mm256_set1_epi8(15))
}

/// The fifth-bit masks (`u32` at `p`, bit `j` for value `j`).
#[inline(always)]
unsafe fn qh_bits(p: *const u8) -> u32 {
    // SAFETY (callers): `p..p + 4` is inside the row.
    (p as *const u32).read_unaligned()
}

/// Five-bit levels: nibbles at `p + QS`, fifth bits in the `u32` at `p + QH`.
#[inline(always)]
unsafe fn fives2<const QH: usize, const QS: usize>(p: *const u8, q: *const u8) -> __m512i {
    let bits = qh_bits(p.add(QH)) as u64 | (qh_bits(q.add(QH)) as u64) << 32;
    let v = nibbles2(p.add(QS), q.add(QS));
    _mm512_mask_add_epi8(v, bits, v, _mm512_set1_epi8(16))
}

#[inline(always)]
unsafe fn fives1<const QH: usize, const QS: usize>(p: *const u8) -> __m256i {
    let v = nibbles1(p.add(QS));
    _mm256_mask_add_epi8(v, qh_bits(p.add(QH)), v, _mm256_set1_epi8(16))
}

struct Q4_0;
impl Block32 for Q4_0 {
    const BYTES: usize = 18;
    fn offset(_: bool) -> Offset {
        Offset::Scale(-8.0)
    }
    #[inline(always)]
    unsafe fn levels2(p: *const u8, q: *const u8) -> __m512i {
        nibbles2(p.add(2), q.add(2))
    }
    #[inline(always)]
    unsafe fn levels1(p: *const u8) -> __m256i {
        nibbles1(p.add(2))
    }
}

struct Q4_1;
impl Block32 for Q4_1 {
    const BYTES: usize = 20;
    fn offset(_: bool) -> Offset {
        Offset::Min
    }
    #[inline(always)]
    unsafe fn levels2(p: *const u8, q: *const u8) -> __m512i {
        nibbles2(p.add(4), q.add(4))
    }
    #[inline(always)]
    unsafe fn levels1(p: *const u8) -> __m256i {
        nibbles1(p.add(4))
    }
}

struct Q5_0;
impl Block32 for Q5_0 {
    const BYTES: usize = 22;
    fn offset(_: bool) -> Offset {
        Offset::Scale(-16.0)
    }
    #[inline(always)]
    unsafe fn levels2(p: *const u8, q: *const u8) -> __m512i {
        fives2::<2, 6>(p, q)
    }
    #[inline(always)]
    unsafe fn levels1(p: *const u8) -> __m256i {
        fives1::<2, 6>(p)
    }
}

struct Q5_1;
impl Block32 for Q5_1 {
    const BYTES: usize = 24;
    fn offset(_: bool) -> Offset {
        Offset::Min
    }
    #[inline(always)]
    unsafe fn levels2(p: *const u8, q: *const u8) -> __m512i {
        fives2::<4, 8>(p, q)
    }
    #[inline(always)]
    unsafe fn levels1(p: *const u8) -> __m256i {
        fives1::<4, 8>(p)
    }
}

/// Q8_0 levels are the signed weights: with VNNI they are offset by 128
/// (`w ^ 0x80` is `w + 128` as u8), which the activation sum takes back out;
/// without, the weights' signs move onto the activations (`|w| <= 128`, so
/// `vpmaddubsw` cannot saturate).
struct Q8_0;
impl Block32 for Q8_0 {
    const BYTES: usize = 34;
    fn offset(vnni: bool) -> Offset {
        Offset::Scale(if vnni { -128.0 } else { 0.0 })
    }
    #[inline(always)]
    unsafe fn levels2(p: *const u8, q: *const u8) -> __m512i {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(p.add(2) as *const __m256i)),
            _mm256_loadu_si256(q.add(2) as *const __m256i),
        )
    }
    #[inline(always)]
    unsafe fn levels1(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p.add(2) as *const __m256i)
    }
    #[inline(always)]
    unsafe fn dot<const VNNI: bool>(w: __m512i, x: __m512i) -> __m512i {
        if VNNI {
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(w, _mm512_set1_epi8(-128)), x)
        } else {
            let neg = _mm512_movepi8_mask(w);
            let x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
            let p = _mm512_maddubs_epi16(_mm512_abs_epi8(w), x);
            _mm512_madd_epi16(p, _mm512_set1_epi16(1))
        }
    }
    #[inline(always)]
    unsafe fn dot1<const VNNI: bool>(w: __m256i, x: __m256i) -> __m256i {
        if VNNI {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_xor_si256(w, _mm256_set1_epi8(-128)), x)
        } else {
            let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
        }
    }
}

#[inline(always)]
unsafe fn q4_0<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    legacy::<Q4_0, VNNI, N>(row, a)
}

#[inline(always)]
unsafe fn q4_1<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    legacy::<Q4_1, VNNI, N>(row, a)
}

#[inline(always)]
unsafe fn q5_0<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    legacy::<Q5_0, VNNI, N>(row, a)
}

#[inline(always)]
unsafe fn q5_1<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    legacy::<Q5_1, VNNI, N>(row, a)
}

#[inline(always)]
unsafe fn q8_0<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8Blocks; N]) -> [f32; N] {
    legacy::<Q8_0, VNNI, N>(row, a)
}

/// `[f(0), f(1), f(2), f(3)]`, written out so that `f` inlines into the
/// kernel (as `std::array::from_fn` did not always: a kernel whose
/// intrinsics were left in a closure ran 20x slower).
#[inline(always)]
fn four<T>(mut f: impl FnMut(usize) -> T) -> [T; 4] {
    [f(0), f(1), f(2), f(3)]
}

/// i16 lane permutation for `vpermw`: lane `l` takes scale `first + l / run`.
#[inline(always)]
unsafe fn spread(first: i16, run: usize) -> __m512i {
    let mut idx = [0i16; 32];
    for (l, v) in idx.iter_mut().enumerate() {
        *v = first + (l / run) as i16;
    }
    _mm512_loadu_si512(idx.as_ptr() as *const _)
}

/// The K-quant loop for `N` tokens: `block(p, i, acc, mins)` adds
/// super-block `i` at `p` into each token's sums (decoding its weights once
/// for all of them).
#[inline(always)]
unsafe fn kquant<const N: usize>(
    row: &[u8],
    bytes: usize,
    a: [&Q8KBlocks; N],
    mut block: impl FnMut(*const u8, usize, &mut [__m512; N], &mut [__m256; N]),
) -> [f32; N] {
    let nb = blocks(row, bytes, a[0].blocks());
    assert!(a.iter().all(|a| a.blocks() == nb), "activations of different lengths");
    let (mut acc, mut mins) = ([_mm512_setzero_ps(); N], [_mm256_setzero_ps(); N]);
    for i in 0..nb {
        block(row.as_ptr().add(i * bytes), i, &mut acc, &mut mins);
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = _mm512_reduce_add_ps(acc[t]) - hsum256(mins[t]);
    }
    out
}

/// The 16 i16 `bsums` of super-block `i`.
#[inline(always)]
unsafe fn bsums16(a: &Q8KBlocks, i: usize) -> __m256i {
    // SAFETY (callers): `i < a.blocks()`.
    _mm256_loadu_si256(a.bsums.as_ptr().add(16 * i) as *const __m256i)
}

/// `d_w d_x` and `dmin_w d_x` of super-block `i` from the f16 pair at `p`.
#[inline(always)]
unsafe fn scales2(p: *const u8, a: &Q8KBlocks, i: usize) -> (f32, f32) {
    let dd = _mm_mul_ps(f16x4(f16_bits(p) | f16_bits(p.add(2)) << 16), _mm_set1_ps(a.d[i]));
    (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_movehdup_ps(dd)))
}

/// The sum over a super-block's four registers of 64 values with 16-value
/// sub-blocks: `levels[v]` holds values `64 v..64 v + 64`, `scales` the 16
/// sub-block scales in i16 lanes.
#[inline(always)]
unsafe fn scaled16<const VNNI: bool>(x: &[i8], scales: __m512i, levels: &[__m512i; 4]) -> __m512i {
    let mut sum = _mm512_setzero_si512();
    for (v, &w) in levels.iter().enumerate() {
        let s = _mm512_permutexvar_epi16(spread(4 * v as i16, 8), scales);
        sum = dot_scaled::<VNNI>(sum, w, load_x(x, 64 * v), s);
    }
    sum
}

/// Adds super-block `i` of a type without minima whose levels are the
/// values + `2^SHIFT` (Q3_K, Q6_K: `dw` its f16 scale widened, `scales`
/// its 16 signed sub-block scales) into each token's sum.
#[inline(always)]
unsafe fn offset_block<const VNNI: bool, const N: usize, const SHIFT: i32>(
    a: [&Q8KBlocks; N],
    i: usize,
    dw: __m512,
    scales: __m256i,
    levels: &[__m512i; 4],
    acc: &mut [__m512; N],
) {
    for t in 0..N {
        let x = &a[t].qs[256 * i..256 * i + 256];
        let d = _mm512_mul_ps(dw, _mm512_set1_ps(a[t].d[i]));
        let sum = scaled16::<VNNI>(x, _mm512_castsi256_si512(scales), levels);
        let offset = _mm256_slli_epi32::<SHIFT>(_mm256_madd_epi16(scales, bsums16(a[t], i)));
        let isum = _mm512_sub_epi32(sum, _mm512_zextsi256_si512(offset));
        acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(isum), acc[t]);
    }
}

/// Q2_K with each 2-bit level multiplied by its 4-bit sub-block scale
/// before the dot product: `scale * level` is at most 45, an unsigned byte,
/// so one `vpdpbusd` per 64 values takes the scaled weights straight into
/// the i32 sums (`vpmaddubsw` then `vpdpwssd` with the scales spread by
/// `vpermw` before). The products come from a table per sub-block, `scale *
/// {0, 1, 2, 3}` in a dword (one `vpmulld` per super-block), moved into
/// each 128-bit lane (`vpermd`: a lane is one sub-block) and looked up by
/// `vpshufb`; built once per super-block for every token. Each i32 lane
/// still sums the same four values times the same scale, so the sums are
/// the same integers as before.
#[inline(always)]
unsafe fn q2_k<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let m3 = _mm512_set1_epi8(3);
    let times = _mm512_set1_epi32(0x0302_0100);
    // Register v's 128-bit lane k is sub-block 4 v + k.
    let lanes: [__m512i; 4] = four(|v| {
        let j = 4 * v as i32;
        _mm512_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1, j + 2, j + 2, j + 2, j + 2, j + 3, j + 3, j + 3, j + 3)
    });
    let block = |p: *const u8, i: usize, acc: &mut [__m512; N], mins: &mut [__m256; N]| {
        // SAFETY: `p` is super-block `i` (84 bytes: scales 16, qs 64, d, dmin), checked by `kquant`.
        let sm = _mm_loadu_si128(p as *const __m128i);
        // Dword j: scale_j * (0, 1, 2, 3), bytes (no carries: 3 * 15 < 256).
        let table = _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(sm, _mm_set1_epi8(15))), times);
        let m = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sm), _mm_set1_epi8(15)));
        // Register v: half v / 2 (32 bytes), bit pairs 4 (v % 2) and 4 (v % 2) + 2.
        let q = [load32x2(p.add(16)), load32x2(p.add(48))];
        let shifts = [halves16(0, 2), halves16(4, 6)];
        let weights: [__m512i; 4] = four(|v| {
            let levels = _mm512_and_si512(_mm512_srlv_epi16(q[v / 2], shifts[v % 2]), m3);
            _mm512_shuffle_epi8(_mm512_permutexvar_epi32(lanes[v], table), levels)
        });
        for t in 0..N {
            let x = &a[t].qs[256 * i..256 * i + 256];
            let (d, dmin) = scales2(p.add(80), a[t], i);
            let msum = _mm256_madd_epi16(m, bsums16(a[t], i));
            mins[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(msum), mins[t]);
            let mut isum = _mm512_setzero_si512();
            for (v, &w) in weights.iter().enumerate() {
                isum = dot4::<VNNI>(isum, w, load_x(x, 64 * v));
            }
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(isum), acc[t]);
        }
    };
    kquant(row, BLOCK_BYTES_K[0], a, block)
}

#[inline(always)]
unsafe fn q3_k<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let m3 = _mm512_set1_epi8(3);
    let block = |p: *const u8, i: usize, acc: &mut [__m512; N], _: &mut [__m256; N]| {
        // SAFETY: `p` is super-block `i` (110 bytes: hmask 32, qs 64, scales 12, d), checked by `kquant`.
        let dw = f16_splat(p.add(108));
        let scales = _mm256_cvtepi8_epi16(super::avx2::q3_scales_simd(p.add(96)));
        let hm = load32x2(p);
        let q = [load32x2(p.add(32)), load32x2(p.add(64))];
        let shifts = [halves16(0, 2), halves16(4, 6)];
        let levels: [__m512i; 4] = four(|v| {
            let low = _mm512_and_si512(_mm512_srlv_epi16(q[v / 2], shifts[v % 2]), m3);
            // Values 64 v.. hold high bits 2 v and 2 v + 1 of hmask.
            let high = _mm512_test_epi8_mask(hm, halves8(1 << (2 * v), 1 << (2 * v + 1)));
            _mm512_mask_add_epi8(low, high, low, _mm512_set1_epi8(4))
        });
        // Levels are the values + 4.
        offset_block::<VNNI, N, 2>(a, i, dw, scales, &levels, acc);
    };
    kquant(row, BLOCK_BYTES_K[1], a, block)
}

/// Q4_K / Q5_K: register `c` holds chunk `c` (values `64 c..`: sub-blocks
/// `2 c` and `2 c + 1`), `levels[c]`.
#[inline(always)]
unsafe fn k4<const VNNI: bool, const N: usize>(
    p: *const u8,
    i: usize,
    a: [&Q8KBlocks; N],
    acc: &mut [__m512; N],
    mins: &mut [__m256; N],
    levels: [__m512i; 4],
) {
    // SAFETY (callers): `p` is super-block `i`, whose first 16 bytes are d, dmin, 12 scale bytes.
    let (sc, m) = k4_scales(std::slice::from_raw_parts(p.add(4), 12));
    let sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
    let m = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(m as i64));
    let s: [__m512i; 4] = four(|c| _mm512_permutexvar_epi16(spread(2 * c as i16, 16), sc));
    for t in 0..N {
        let x = &a[t].qs[256 * i..256 * i + 256];
        let (d, dmin) = scales2(p, a[t], i);
        let bs = bsums16(a[t], i);
        let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
        let msum = _mm256_zextsi128_si256(_mm_madd_epi16(pairs, m));
        mins[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(msum), mins[t]);
        let mut isum = _mm512_setzero_si512();
        for c in 0..4 {
            isum = dot_scaled::<VNNI>(isum, levels[c], load_x(x, 64 * c), s[c]);
        }
        acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(isum), acc[t]);
    }
}

#[inline(always)]
unsafe fn q4_k<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let (m4, shift) = (_mm512_set1_epi8(15), halves16(0, 4));
    let block = |p: *const u8, i: usize, acc: &mut [__m512; N], mins: &mut [__m256; N]| {
        // SAFETY: `p` is super-block `i` (144 bytes: d, dmin, scales 12, qs 128), checked by `kquant`.
        let levels = four(|c| _mm512_and_si512(_mm512_srlv_epi16(load32x2(p.add(16 + 32 * c)), shift), m4));
        k4::<VNNI, N>(p, i, a, acc, mins, levels)
    };
    kquant(row, BLOCK_BYTES_K[2], a, block)
}

#[inline(always)]
unsafe fn q5_k<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let (m4, shift) = (_mm512_set1_epi8(15), halves16(0, 4));
    let block = |p: *const u8, i: usize, acc: &mut [__m512; N], mins: &mut [__m256; N]| {
        // SAFETY: `p` is super-block `i` (176 bytes: d, dmin, scales 12, qh 32, qs 128), checked by `kquant`.
        let qh = load32x2(p.add(16));
        let levels = four(|c| {
            let v = _mm512_and_si512(_mm512_srlv_epi16(load32x2(p.add(48 + 32 * c)), shift), m4);
            // Fifth bits: bit 2c of qh for the low nibbles, 2c + 1 for the high.
            let high = _mm512_test_epi8_mask(qh, halves8(1 << (2 * c), 1 << (2 * c + 1)));
            _mm512_mask_add_epi8(v, high, v, _mm512_set1_epi8(16))
        });
        k4::<VNNI, N>(p, i, a, acc, mins, levels)
    };
    kquant(row, BLOCK_BYTES_K[3], a, block)
}

#[inline(always)]
unsafe fn q6_k<const VNNI: bool, const N: usize>(row: &[u8], a: [&Q8KBlocks; N]) -> [f32; N] {
    let (m4, m30) = (_mm512_set1_epi8(15), _mm512_set1_epi8(0x30));
    let (up, down) = (halves16(4, 2), halves16(0, 2));
    let block = |p: *const u8, i: usize, acc: &mut [__m512; N], _: &mut [__m256; N]| {
        // SAFETY: `p` is super-block `i` (210 bytes: ql 128, qh 64, scales 16, d), checked by `kquant`.
        let dw = f16_splat(p.add(208));
        let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
        let levels: [__m512i; 4] = four(|v| {
            // Half h = v / 2: low nibbles of ql[64h..] are values 0..64 of the
            // half, high nibbles 64..128; their top bits are bit pairs 0, 1
            // (values 0..64) and 2, 3 (64..128) of qh[32h..].
            let (h, upper) = (v / 2, v % 2 == 1);
            let ql = load64(p.add(64 * h));
            let qh = load32x2(p.add(128 + 32 * h));
            let (low, high) = if upper {
                (_mm512_srli_epi16::<4>(ql), _mm512_srlv_epi16(qh, down))
            } else {
                (ql, _mm512_sllv_epi16(qh, up))
            };
            _mm512_or_si512(_mm512_and_si512(low, m4), _mm512_and_si512(high, m30))
        });
        // Levels are the values + 32.
        offset_block::<VNNI, N, 5>(a, i, dw, scales, &levels, acc);
    };
    kquant(row, BLOCK_BYTES_K[4], a, block)
}


/// The entry points of one compilation: `$feat` enables the instructions,
/// `$vnni` picks the instructions that use them. Each kernel has a
/// one-token entry point and one for several tokens (`tokens::`).
macro_rules! entry_points {
    ($feat:literal, $vnni:literal) => {
        use super::super::act::{Q8Blocks, Q8KBlocks};
        entry_points!(@fn $feat, $vnni, Q8Blocks: q4_0 q4_1 q5_0 q5_1 q8_0);
        entry_points!(@fn $feat, $vnni, Q8KBlocks: q2_k q3_k q4_k q5_k q6_k);
        /// `N` tokens at once (up to [`TOKENS`](super::super::super::TOKENS)).
        pub mod tokens {
            use super::super::super::act::{Q8Blocks, Q8KBlocks};
            entry_points!(@tokens $feat, $vnni, Q8Blocks: q4_0 q4_1 q5_0 q5_1 q8_0);
            entry_points!(@tokens $feat, $vnni, Q8KBlocks: q2_k q3_k q4_k q5_k q6_k);
        }
    };
    (@fn $feat:literal, $vnni:literal, $act:ident: $($name:ident)*) => {$(
        /// # Safety
        /// The CPU must have the enabled features.
        #[target_feature(enable = $feat)]
        pub unsafe fn $name(row: &[u8], a: &$act) -> f32 {
            // SAFETY: the kernels check the row length against the
            // activation, which holds whole blocks by construction.
            unsafe { super::$name::<$vnni, 1>(row, [a])[0] }
        }
    )*};
    (@tokens $feat:literal, $vnni:literal, $act:ident: $($name:ident)*) => {$(
        /// # Safety
        /// The CPU must have the enabled features.
        #[target_feature(enable = $feat)]
        pub unsafe fn $name<const N: usize>(row: &[u8], a: [&$act; N]) -> [f32; N] {
            // SAFETY: as the one-token entry point (the kernels check every activation's length).
            unsafe { super::super::$name::<$vnni, N>(row, a) }
        }
    )*};
}

/// AVX512F/BW/VL without VNNI.
pub mod plain {
    entry_points!("avx512f,avx512bw,avx512vl,avx2,fma,f16c", false);
}

/// AVX512F/BW/VL with VNNI.
pub mod vnni {
    entry_points!("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c", true);
}
