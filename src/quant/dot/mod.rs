//! Integer dot products of quantized rows with an 8-bit activation vector:
//! the fast CPU path of [`super::kernels`], the scheme of ggml's CPU backend.
//!
//! # Design
//!
//! The activation vector `x` is rounded to 8 bits once per matrix-vector
//! product ([`act`]): in blocks of 32 with an f32 scale and the block sum
//! ([`Q8Blocks`]) for the 32-element weight types, in super-blocks of 256
//! with one f32 scale and the sums of every 16 values ([`Q8KBlocks`]) for
//! the K-quants. Each weight block then meets its activation block in
//! integers: the weight levels are unsigned bytes (the 4-, 5-, 2-, 3- and
//! 6-bit codes as stored, before their offset), multiplied with the signed
//! activation bytes and summed exactly in i32; the offsets and mins never
//! touch the 256 products, they multiply the activation sums:
//!
//! | type | per block `b` (`isum` = sum of level x activation level) |
//! |---|---|
//! | Q4_0, Q5_0 | `d_w d_x isum - 8 (16) d_w ds` with `ds = d_x sum(q_x)` |
//! | Q4_1, Q5_1 | `d_w d_x isum + m_w ds` |
//! | Q8_0 | `d_w d_x isum` (signed levels) |
//! | Q2_K | `d d_x sum_j sc_j isum_j - dmin d_x sum_j m_j bsum_j` (16 sub-blocks) |
//! | Q3_K | `d d_x sum_j sc_j (isum_j - 4 bsum_j)` (signed 6-bit `sc`) |
//! | Q4_K, Q5_K | `d d_x sum_j sc_j isum_j - dmin d_x sum_j m_j bsum_j` (8 sub-blocks of 32) |
//! | Q6_K | `d d_x sum_j sc_j (isum_j - 32 bsum_j)` (signed 8-bit `sc`) |
//!
//! Only the last line of each block is f32: one multiply-add per block of 32
//! or super-block of 256. The code, one module per instruction set:
//!
//! * [`scalar`]: plain Rust, the test reference (and the kernels of CPUs
//!   without AVX2);
//! * [`avx2`]: `vpmaddubsw` (u8 x i8 -> adjacent pairs in i16; the levels are
//!   small enough that it never saturates) then `vpmaddwd` by the sub-block
//!   scale (i16) into i32 lanes, 32 weights per instruction;
//! * [`avx512`]: the same on 64 weights, with `vpdpbusd` / `vpdpwssd` (the
//!   multiply and the add in one instruction) where the CPU has AVX512-VNNI.
//!
//! The integer sums are exact at every level; the SIMD kernels keep the i32
//! and f32 sums in lanes (reduced once per row), so they differ from the
//! scalar reference only in the order of the f32 additions: both are within
//! `(n_blocks + 16) * 2^-23 * S` of the exact value, `S = sum_i |w_i x'_i|`
//! over the dequantized weights (offsets and mins counted apart) and rounded
//! activations `x'`. The tests check exactly that.
//!
//! # Accuracy
//!
//! The weights are used exactly; the activations are rounded: `x'_i = d q_i`
//! with `d = amax_b / 127` for the block `b` (32 or 256 values) holding `i`,
//! so `|x_i - x'_i| <= amax_b / 254` (plus a few f32 ulps). Hence, against the
//! exact dot product of the dequantized row with `x`,
//!
//! `|fast - exact| <= sum_b (amax_b / 254) sum_{i in b} |w_i|` (+ f32 rounding),
//!
//! at most 0.4% of `sum_i |w_i| max_i |x_i|`. That is the worst case, every
//! rounding error aligned with its weight's sign; the errors are independent
//! and uniform in `[-d/2, d/2]`, so the typical error is `d / sqrt(12)` times
//! `sqrt(sum w_i^2)`. For Gaussian activations (`amax` about 2.2 sigma over
//! 32 values, 2.9 sigma over 256) that is 0.5% (32-element types) to 0.7%
//! (K-quants) of the output's standard deviation, per product (measured
//! 0.5-0.8% over 64 rows of 2560, where the tests require at most 1%);
//! activations with outliers round coarser. The same as llama.cpp,
//! which rounds to the same grid (its Q8_0 activation scale is f16, ours f32).

pub mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod scalar;

pub use act::{Q8Blocks, Q8KBlocks};

use super::kernels::Isa;
use crate::gguf::GgmlType;

/// Bytes of a Q2_K, Q3_K, Q4_K, Q5_K, Q6_K super-block.
pub(crate) const BLOCK_BYTES_K: [usize; 5] = [84, 110, 144, 176, 210];

/// The 6-bit scales and mins of a Q4_K / Q5_K super-block's 12 packed bytes,
/// one per byte (little-endian): `(scales 0..8, mins 0..8)`.
///
/// Scale and min `j < 4` are the low six bits of bytes `j` and `j + 4`; for
/// `j >= 4` the low four bits are the nibbles of byte `j + 4` and the top two
/// the top bits of bytes `j - 4` (scale) and `j` (min).
#[inline(always)]
pub(crate) fn k4_scales(s: &[u8]) -> (u64, u64) {
    let w = |k: usize| u32::from_le_bytes([s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let sc_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let m_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    ((w0 & LOW6) as u64 | (sc_hi as u64) << 32, (w1 & LOW6) as u64 | (m_hi as u64) << 32)
}

/// The 16 signed 6-bit scales of a Q3_K super-block's 12 packed bytes: low
/// four bits from the nibbles of bytes 0..8 (scale `j` in byte `j % 8`, high
/// nibble for `j >= 8`), top two bits from bits `2 (j / 4)` of byte `8 + j % 4`.
#[inline(always)]
pub(crate) fn q3_scales(s: &[u8]) -> [i8; 16] {
    let w = |k: usize| u32::from_le_bytes([s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let words = [
        (w0 & LOW4) | ((w2 & LOW2) << 4),
        (w1 & LOW4) | (((w2 >> 2) & LOW2) << 4),
        ((w0 >> 4) & LOW4) | (((w2 >> 4) & LOW2) << 4),
        ((w1 >> 4) & LOW4) | (((w2 >> 6) & LOW2) << 4),
    ];
    let mut out = [0i8; 16];
    for (o, b) in out.iter_mut().zip(words.iter().flat_map(|w| w.to_le_bytes())) {
        *o = b as i8 - 32;
    }
    out
}

/// The activation layout a weight type's integer kernel takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActKind {
    /// [`Q8Blocks`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
    Q8,
    /// [`Q8KBlocks`]: Q2_K..Q6_K.
    Q8K,
}

impl ActKind {
    /// The layout `ty`'s integer kernel takes; `None` for the float types.
    pub fn of(ty: GgmlType) -> Option<ActKind> {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => Some(ActKind::Q8),
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => Some(ActKind::Q8K),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => None,
        }
    }
}

/// An activation vector rounded for one [`ActKind`].
#[derive(Clone, Debug)]
pub enum Activation {
    Q8(Q8Blocks),
    Q8K(Q8KBlocks),
}

impl Activation {
    /// Rounds `x` for `kind` (its length a multiple of 32 or 256), with the
    /// code of `isa` (every level gives the same bytes).
    pub fn new(isa: Isa, kind: ActKind, x: &[f32]) -> Activation {
        match kind {
            ActKind::Q8 => Activation::Q8(Q8Blocks::new(isa, x)),
            ActKind::Q8K => Activation::Q8K(Q8KBlocks::new(isa, x)),
        }
    }

    pub fn kind(&self) -> ActKind {
        match self {
            Activation::Q8(_) => ActKind::Q8,
            Activation::Q8K(_) => ActKind::Q8K,
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Activation::Q8(a) => a.qs.len(),
            Activation::Q8K(a) => a.qs.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values the rounded vector stands for.
    pub fn dequantize(&self) -> Vec<f32> {
        match self {
            Activation::Q8(a) => a.dequantize(),
            Activation::Q8K(a) => a.dequantize(),
        }
    }
}

/// A row kernel of one type at one level.
#[derive(Clone, Copy)]
enum RowFn {
    Q8(fn(&[u8], &Q8Blocks) -> f32),
    Q8K(fn(&[u8], &Q8KBlocks) -> f32),
}

/// Tokens the multi-token kernels (AVX2, AVX-512) take at once in
/// [`dot_rows_tokens`] (eight measured no better than four with AVX-512).
const TOKENS: usize = 4;

/// A kernel of one type at one level for `N` tokens at once
/// (each token's result the one [`RowFn`] gives it).
#[derive(Clone, Copy)]
enum TokensFn<const N: usize> {
    Q8(GroupFn<Q8Blocks, N>),
    Q8K(GroupFn<Q8KBlocks, N>),
}

/// The table of kernels, one per quantized type: `$wrap!(kernel, activation
/// blocks)` names the kernel of one level as a plain function pointer, a
/// variant of `$kind` ([`RowFn`] or [`TokensFn`]).
macro_rules! kernel_table {
    ($ty:expr, $wrap:ident) => {
        kernel_table!($ty, $wrap, RowFn)
    };
    ($ty:expr, $wrap:ident, $kind:ident) => {
        match $ty {
            GgmlType::Q4_0 => $kind::Q8($wrap!(q4_0, Q8Blocks)),
            GgmlType::Q4_1 => $kind::Q8($wrap!(q4_1, Q8Blocks)),
            GgmlType::Q5_0 => $kind::Q8($wrap!(q5_0, Q8Blocks)),
            GgmlType::Q5_1 => $kind::Q8($wrap!(q5_1, Q8Blocks)),
            GgmlType::Q8_0 => $kind::Q8($wrap!(q8_0, Q8Blocks)),
            GgmlType::Q2K => $kind::Q8K($wrap!(q2_k, Q8KBlocks)),
            GgmlType::Q3K => $kind::Q8K($wrap!(q3_k, Q8KBlocks)),
            GgmlType::Q4K => $kind::Q8K($wrap!(q4_k, Q8KBlocks)),
            GgmlType::Q5K => $kind::Q8K($wrap!(q5_k, Q8KBlocks)),
            GgmlType::Q6K => $kind::Q8K($wrap!(q6_k, Q8KBlocks)),
            other => panic!("{other} has no integer kernel"),
        }
    };
}

/// The integer kernel of quantized type `ty` at level `isa`.
fn row_fn(isa: Isa, ty: GgmlType) -> RowFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2_fns(ty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512_fns::<false>(ty),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512_fns::<true>(ty),
        _ => {
            macro_rules! plain {
                ($f:ident, $a:ty) => {
                    scalar::$f
                };
            }
            kernel_table!(ty, plain)
        }
    }
}

/// The AVX2 kernels as plain function pointers.
#[cfg(target_arch = "x86_64")]
fn avx2_fns(ty: GgmlType) -> RowFn {
    macro_rules! wrap {
        ($f:ident, $a:ty) => {{
            fn f(row: &[u8], a: &$a) -> f32 {
                // SAFETY: only reachable through `dot_rows`, whose callers
                // check that the CPU has `Isa::Avx2` (`Isa::available`).
                unsafe { avx2::$f(row, a) }
            }
            f
        }};
    }
    kernel_table!(ty, wrap)
}

/// The AVX-512 kernels (with VNNI when `VNNI`) as plain function pointers.
#[cfg(target_arch = "x86_64")]
fn avx512_fns<const VNNI: bool>(ty: GgmlType) -> RowFn {
    macro_rules! wrap {
        ($f:ident, $a:ty) => {{
            fn f<const VNNI: bool>(row: &[u8], a: &$a) -> f32 {
                // SAFETY: only reachable through `dot_rows`, whose callers
                // check that the CPU has `Isa::Avx512` / `Isa::Avx512Vnni`.
                unsafe {
                    if VNNI {
                        avx512::vnni::$f(row, a)
                    } else {
                        avx512::plain::$f(row, a)
                    }
                }
            }
            f::<VNNI>
        }};
    }
    kernel_table!(ty, wrap)
}

/// The AVX2 kernels of `N` tokens as plain function pointers.
#[cfg(target_arch = "x86_64")]
fn avx2_tokens_fns<const N: usize>(ty: GgmlType) -> TokensFn<N> {
    macro_rules! wrap {
        ($f:ident, $a:ty) => {{
            fn f<const N: usize>(row: &[u8], a: [&$a; N]) -> [f32; N] {
                // SAFETY: only reachable through `dot_rows_tokens`, which
                // checks that the CPU has `Isa::Avx2`.
                unsafe { avx2::tokens::$f::<N>(row, a) }
            }
            f::<N>
        }};
    }
    kernel_table!(ty, wrap, TokensFn)
}

/// The AVX-512 kernels of `N` tokens (with VNNI when `VNNI`)
/// as plain function pointers.
#[cfg(target_arch = "x86_64")]
fn avx512_tokens_fns<const VNNI: bool, const N: usize>(ty: GgmlType) -> TokensFn<N> {
    macro_rules! wrap {
        ($f:ident, $a:ty) => {{
            fn f<const VNNI: bool, const N: usize>(row: &[u8], a: [&$a; N]) -> [f32; N] {
                // SAFETY: only reachable through `dot_rows_tokens`, which
                // checks that the CPU has `Isa::Avx512` / `Isa::Avx512Vnni`.
                unsafe {
                    if VNNI {
                        avx512::vnni::tokens::$f::<N>(row, a)
                    } else {
                        avx512::plain::tokens::$f::<N>(row, a)
                    }
                }
            }
            f::<VNNI, N>
        }};
    }
    kernel_table!(ty, wrap, TokensFn)
}

/// The `N`-token kernel of `ty` at level `isa`, where the level has them.
#[cfg(target_arch = "x86_64")]
fn tokens_fn<const N: usize>(isa: Isa, ty: GgmlType) -> Option<TokensFn<N>> {
    match isa {
        Isa::Avx2 => Some(avx2_tokens_fns::<N>(ty)),
        Isa::Avx512 => Some(avx512_tokens_fns::<false, N>(ty)),
        Isa::Avx512Vnni => Some(avx512_tokens_fns::<true, N>(ty)),
        _ => None,
    }
}

/// `y[r] = rows[r] · act` for consecutive rows of `ty` (each `act.len()`
/// values), with the integer kernels of `isa`.
///
/// Panics if `ty` is not quantized, `act` is not its layout, the sizes do not
/// match, or (once per call) the CPU lacks `isa`.
pub fn dot_rows(isa: Isa, ty: GgmlType, rows: &[u8], act: &Activation, y: &mut [f32]) {
    assert!(isa.supported(), "this CPU cannot run {}", isa.name());
    let rb = ty.row_bytes(act.len()).unwrap_or_else(|| panic!("{ty} row of {} values", act.len()));
    assert_eq!(rows.len(), rb * y.len(), "{ty}: {} bytes for {} rows", rows.len(), y.len());
    let ahead = prefetch_distance();
    lead_in(rows, ahead);
    match (row_fn(isa, ty), act) {
        (RowFn::Q8(f), Activation::Q8(a)) => {
            for (y, row) in y.iter_mut().zip(rows.chunks_exact(rb)) {
                prefetch(row, ahead);
                *y = f(row, a);
            }
        }
        (RowFn::Q8K(f), Activation::Q8K(a)) => {
            for (y, row) in y.iter_mut().zip(rows.chunks_exact(rb)) {
                prefetch(row, ahead);
                *y = f(row, a);
            }
        }
        _ => panic!("{ty} kernel given a {:?} activation", act.kind()),
    }
}

/// `ys[t * n + r] = rows[r] · acts[t]` for the `n` consecutive rows of `ty`
/// and every token's rounded activation (the rows, a piece of a matrix, stay
/// in L2 while the tokens meet them, a group of tokens' activations in L1),
/// each product the one [`dot_rows`] computes, so the numbers are those of
/// `T` separate matrix-vector products.
/// With AVX2 and AVX-512 the tokens go through each row four at a time
/// ([`TOKENS`]): a block's weights are decoded once for the four
/// (`FNX_CPU_TOKENS=1` turns this off, for measuring it).
///
/// Panics as [`dot_rows`] does, or if the activations differ in length or layout.
pub fn dot_rows_tokens(isa: Isa, ty: GgmlType, rows: &[u8], acts: &[&Activation], ys: &mut [f32]) {
    assert!(isa.supported(), "this CPU cannot run {}", isa.name());
    let Some(first) = acts.first() else { return };
    let rb = ty.row_bytes(first.len()).unwrap_or_else(|| panic!("{ty} row of {} values", first.len()));
    let n = rows.len() / rb;
    assert_eq!(rows.len(), rb * n, "{ty}: {} bytes are not whole rows", rows.len());
    assert_eq!(ys.len(), n * acts.len(), "{ty}: outputs for {} rows of {} tokens", n, acts.len());
    assert!(acts.iter().all(|a| a.len() == first.len() && a.kind() == first.kind()), "{ty}: activations differ");
    let ahead = prefetch_distance();
    match row_fn(isa, ty) {
        RowFn::Q8(f) => {
            let a: Vec<&Q8Blocks> = acts.iter().map(|a| match *a {
                Activation::Q8(a) => a,
                Activation::Q8K(_) => panic!("{ty} kernel given a Q8K activation"),
            }).collect();
            fn q8<const N: usize>(g: TokensFn<N>) -> GroupFn<Q8Blocks, N> {
                match g {
                    TokensFn::Q8(g) => g,
                    TokensFn::Q8K(_) => unreachable!("the kernel tables agree"),
                }
            }
            rows_tokens(rows, rb, ahead, &a, f, groups(isa, ty, q8, q8, q8), ys);
        }
        RowFn::Q8K(f) => {
            let a: Vec<&Q8KBlocks> = acts.iter().map(|a| match *a {
                Activation::Q8K(a) => a,
                Activation::Q8(_) => panic!("{ty} kernel given a Q8 activation"),
            }).collect();
            fn q8k<const N: usize>(g: TokensFn<N>) -> GroupFn<Q8KBlocks, N> {
                match g {
                    TokensFn::Q8K(g) => g,
                    TokensFn::Q8(_) => unreachable!("the kernel tables agree"),
                }
            }
            rows_tokens(rows, rb, ahead, &a, f, groups(isa, ty, q8k, q8k, q8k), ys);
        }
    }
}

/// A kernel of `N` tokens' activations of type `A`.
type GroupFn<A, const N: usize> = fn(&[u8], [&A; N]) -> [f32; N];

/// The kernels of [`TOKENS`], three and two tokens at once of one type and
/// level: a row meets four tokens at a time, the rest (an expert's last
/// pairs) in one group of three or two rather than one by one.
struct Groups<A> {
    four: GroupFn<A, TOKENS>,
    three: GroupFn<A, 3>,
    two: GroupFn<A, 2>,
}

/// The [`Groups`] of `ty` at level `isa`, where the level has them and
/// `FNX_CPU_TOKENS=1` does not turn them off; `pick` takes each table's
/// kernels of the activation type.
#[allow(unused_variables)]
fn groups<A>(
    isa: Isa,
    ty: GgmlType,
    four: fn(TokensFn<TOKENS>) -> GroupFn<A, TOKENS>,
    three: fn(TokensFn<3>) -> GroupFn<A, 3>,
    two: fn(TokensFn<2>) -> GroupFn<A, 2>,
) -> Option<Groups<A>> {
    #[cfg(target_arch = "x86_64")]
    if multi_token() {
        return Some(Groups { four: four(tokens_fn(isa, ty)?), three: three(tokens_fn(isa, ty)?), two: two(tokens_fn(isa, ty)?) });
    }
    None
}

/// Each row of `rb` bytes against every token's activation `a[t]`:
/// `ys[t * n + r]`, by `one`, or by the `groups` of four, then of three or
/// two for the rest, where there are some.
///
/// Tokens outside, rows inside: a group's activations (10 KB for four
/// tokens of 2560 values) stay in L1 while every row of the piece (in L2)
/// meets them. The other order, each row meeting all the tile's tokens,
/// streamed the tile's activations (80 KB) from L2 for every row; this one
/// measured 5-30 % more multiply-adds per second per core (bench-kernels'
/// batch column: Q4_K 36 -> 38.5 G/s, Q6_K 23-26 -> 30 on a Zen 3).
fn rows_tokens<A>(rows: &[u8], rb: usize, ahead: usize, a: &[&A], one: fn(&[u8], &A) -> f32, groups: Option<Groups<A>>, ys: &mut [f32]) {
    let n = rows.len() / rb;
    // Every row for one group of tokens (`k` of them, from `t`), then the next group.
    let mut each_row = |t: usize, k: usize, dot: &dyn Fn(&[u8]) -> [f32; TOKENS]| {
        for (r, row) in rows.chunks_exact(rb).enumerate() {
            if t == 0 {
                prefetch(row, ahead);
            }
            for (j, &y) in dot(row)[..k].iter().enumerate() {
                ys[(t + j) * n + r] = y;
            }
        }
    };
    let mut t = 0;
    if let Some(g) = &groups {
        while t + TOKENS <= a.len() {
            each_row(t, TOKENS, &|row| (g.four)(row, std::array::from_fn(|k| a[t + k])));
            t += TOKENS;
        }
        let pad = |o: &[f32]| std::array::from_fn(|k| o.get(k).copied().unwrap_or(0.0));
        // An expert's last three or two tokens in one group; a last one alone, below.
        match a.len() - t {
            3 => each_row(t, 3, &|row| pad(&(g.three)(row, std::array::from_fn(|k| a[t + k])))),
            2 => each_row(t, 2, &|row| pad(&(g.two)(row, std::array::from_fn(|k| a[t + k])))),
            _ => {}
        }
        if a.len() - t > 1 {
            t = a.len();
        }
    }
    for (t, &at) in a.iter().enumerate().skip(t) {
        each_row(t, 1, &|row| [one(row, at), 0.0, 0.0, 0.0]);
    }
}

/// Whether [`dot_rows_tokens`] takes tokens several at a time where it can:
/// yes unless `FNX_CPU_TOKENS=1`.
#[cfg(target_arch = "x86_64")]
fn multi_token() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FNX_CPU_TOKENS").map_or(true, |v| v != "1"))
}

/// How far ahead of the row it computes [`dot_rows`] asks for the weights,
/// in bytes: [`PREFETCH_BYTES`], or `FNX_PREFETCH_BYTES` (0 = no prefetch).
fn prefetch_distance() -> usize {
    static AHEAD: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *AHEAD.get_or_init(|| std::env::var("FNX_PREFETCH_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(PREFETCH_BYTES))
}

/// The default prefetch distance. Rows read cold from memory (the experts an
/// offloaded decode computes on the host: a few MB per layer, never the same
/// twice in a row) stall each thread at every 4 KiB boundary, where the
/// hardware's stream prefetcher stops; asking a page ahead keeps the reads
/// in flight. On the H200 host (16 threads, `flashnext bench-host-moe`, ten
/// 2 MB experts per layer from the mapped file) it took the host's expert
/// throughput from 38 to 50 GB/s (0 / 2048 / 4096 / 8192 bytes: 37.9 / 46.8
/// / 50.5 / 49.1 GB/s); rows already in cache pay one hint per 64 bytes.
pub const PREFETCH_BYTES: usize = 4096;

/// Asks for the cache lines `ahead` bytes past `row` (as long as the row).
#[inline(always)]
fn prefetch(row: &[u8], ahead: usize) {
    if ahead > 0 {
        prefetch_lines(row.as_ptr().wrapping_add(ahead), row.len());
    }
}

/// Asks for the first `ahead` bytes of `rows` at once (the prefetch of each
/// row covers the bytes `ahead` past it, so a piece of rows starting cold
/// would otherwise meet its first page one miss after another).
#[inline(always)]
fn lead_in(rows: &[u8], ahead: usize) {
    prefetch_lines(rows.as_ptr(), ahead.min(rows.len()));
}

/// Asks for the cache lines of `len` bytes from `start`.
#[inline(always)]
fn prefetch_lines(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..len).step_by(64) {
        // SAFETY: a prefetch is a hint: it never faults, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch(start.wrapping_add(line) as *const i8, std::arch::x86_64::_MM_HINT_T0) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

/// `row · act` for one row of `ty` at level `isa` (see [`dot_rows`]).
pub fn dot_row(isa: Isa, ty: GgmlType, row: &[u8], act: &Activation) -> f32 {
    let mut y = [0f32];
    dot_rows(isa, ty, row, act, &mut y);
    y[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::kquants::scale_min_k4;

    fn bytes(seed: &mut u64, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                (*seed >> 32) as u8
            })
            .collect()
    }

    #[test]
    fn packed_scales_match_the_decoders() {
        let mut seed = 0x1234_5678_9abc_def1;
        for t in 0..2000 {
            let s = if t == 0 { vec![0xff; 12] } else { bytes(&mut seed, 12) };
            let (sc, m) = k4_scales(&s);
            for j in 0..8 {
                assert_eq!(scale_min_k4(&s, j), ((sc >> (8 * j)) as u8, (m >> (8 * j)) as u8), "{s:?} {j}");
            }
            let q3 = q3_scales(&s);
            for (j, &v) in q3.iter().enumerate() {
                let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
                let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
                assert_eq!(v as i32, (low | (high << 4)) as i32 - 32, "{s:?} {j}");
            }
        }
    }
}
