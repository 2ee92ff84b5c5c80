//! Dot products of stored rows with an f32 vector, for every storage type,
//! with runtime CPU-feature dispatch.
//!
//! # Design: dequantize in registers, accumulate in f32
//!
//! A row is walked one block at a time: the block is decoded by the same
//! (bit-exact) dequantizer as [`super::dequantize_row`] into a small stack
//! buffer that never leaves L1, then multiplied into 32 f32 partial sums.
//! The body is one generic function, instantiated per type and compiled three
//! times: plain (the scalar reference, no fused multiply-add), with
//! `avx2,fma` and with `avx512f,avx512bw,avx512vl`; LLVM vectorizes the
//! storage-order decoders and the accumulation. [`Isa::detect`] picks the
//! widest the CPU has, once.
//!
//! Accuracy: the weights are exactly the dequantized values (no activation
//! quantization, unlike ggml's `vec_dot_*_q8_K`), so the only difference from
//! an exact dot product of the dequantized row is f32 summation order and
//! fused rounding: about 1e-7 of `sum |w_i x_i|` per row, the same as the
//! F32 path. llama.cpp instead rounds the activations to 8 bits per block
//! (Q8_K / Q8_0), which adds ~0.4% relative error per product.

use crate::gguf::GgmlType;
use std::sync::OnceLock;

/// An instruction-set level the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable code, no fused multiply-add: the test reference.
    Scalar,
    Avx2,
    Avx512,
}

impl Isa {
    /// The widest level this CPU supports (cached).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| *Isa::available().last().expect("scalar is always available"))
    }

    /// Every level this CPU can run, narrowest first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                {
                    v.push(Isa::Avx512);
                }
            }
        }
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512 => "avx512",
        }
    }
}

/// A storage type as the kernels see it: `N` values in `BYTES` bytes,
/// decoded by `decode` (float types decode any `y.len() <= N`, for row tails).
trait Unit {
    const N: usize;
    const BYTES: usize;
    fn decode(b: &[u8], y: &mut [f32]);
}

macro_rules! units {
    ($($name:ident = $n:expr, $bytes:expr, $f:path;)*) => {$(
        struct $name;
        impl Unit for $name {
            const N: usize = $n;
            const BYTES: usize = $bytes;
            #[inline(always)]
            fn decode(b: &[u8], y: &mut [f32]) {
                $f(b, y)
            }
        }
    )*};
}

units! {
    F32 = 16, 64, super::decode_f32;
    F16 = 16, 32, super::decode_f16;
    Bf16 = 16, 32, super::decode_bf16;
    Q4_0 = 32, 18, super::legacy::dequantize_q4_0;
    Q4_1 = 32, 20, super::legacy::dequantize_q4_1;
    Q5_0 = 32, 22, super::legacy::dequantize_q5_0;
    Q5_1 = 32, 24, super::legacy::dequantize_q5_1;
    Q8_0 = 32, 34, super::legacy::dequantize_q8_0;
    Q2K = 256, 84, super::kquants::dequantize_q2_k;
    Q3K = 256, 110, super::kquants::dequantize_q3_k;
    Q4K = 256, 144, super::kquants::dequantize_q4_k;
    Q5K = 256, 176, super::kquants::dequantize_q5_k;
    Q6K = 256, 210, super::kquants::dequantize_q6_k;
}

const LANES: usize = 32;

/// `acc += w * x` lane by lane; `FUSED` uses fused multiply-add (only where
/// the CPU has it: elsewhere `mul_add` is a slow library call).
#[inline(always)]
fn madd<const FUSED: bool>(acc: &mut [f32; LANES], w: &[f32], x: &[f32]) {
    let mut wc = w.chunks_exact(LANES);
    let mut xc = x.chunks_exact(LANES);
    for (w, x) in (&mut wc).zip(&mut xc) {
        for k in 0..LANES {
            acc[k] = if FUSED { w[k].mul_add(x[k], acc[k]) } else { acc[k] + w[k] * x[k] };
        }
    }
    for (k, (w, x)) in wc.remainder().iter().zip(xc.remainder()).enumerate() {
        acc[k] = if FUSED { w.mul_add(*x, acc[k]) } else { acc[k] + w * x };
    }
}

#[inline(always)]
fn dot_generic<U: Unit, const FUSED: bool>(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut buf = [0f32; 256];
    let whole = x.len() / U::N;
    for (b, xs) in row.chunks_exact(U::BYTES).zip(x.chunks_exact(U::N)) {
        U::decode(b, &mut buf[..U::N]);
        madd::<FUSED>(&mut acc, &buf[..U::N], xs);
    }
    let tail = &x[whole * U::N..];
    if !tail.is_empty() {
        U::decode(&row[whole * U::BYTES..], &mut buf[..tail.len()]);
        madd::<FUSED>(&mut acc, &buf[..tail.len()], tail);
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2<U: Unit>(row: &[u8], x: &[f32]) -> f32 {
    dot_generic::<U, true>(row, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_avx512<U: Unit>(row: &[u8], x: &[f32]) -> f32 {
    dot_generic::<U, true>(row, x)
}

fn dot_isa<U: Unit>(isa: Isa, row: &[u8], x: &[f32]) -> f32 {
    match isa {
        Isa::Scalar => dot_generic::<U, false>(row, x),
        // SAFETY: `isa` comes from `Isa::available` (checked by `dot_row_with`),
        // so the CPU has every feature these functions are compiled for.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { dot_avx2::<U>(row, x) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { dot_avx512::<U>(row, x) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => dot_generic::<U, false>(row, x),
    }
}

/// `row · x` where `row` holds `x.len()` values of `ty`, at kernel level
/// `isa` (the same code [`matvec_batch`] runs at [`Isa::detect`]). Panics if the CPU lacks `isa` or `row` is
/// not one row of `x.len()` values of `ty`.
pub fn dot_row_with(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    assert!(Isa::available().contains(&isa), "this CPU cannot run {}", isa.name());
    dot_isa_checked(isa, ty, row, x)
}

#[inline]
fn dot_isa_checked(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    assert_eq!(ty.row_bytes(x.len()), Some(row.len()), "{ty} row of {} values", x.len());
    match ty {
        GgmlType::F32 => dot_isa::<F32>(isa, row, x),
        GgmlType::F16 => dot_isa::<F16>(isa, row, x),
        GgmlType::BF16 => dot_isa::<Bf16>(isa, row, x),
        GgmlType::Q4_0 => dot_isa::<Q4_0>(isa, row, x),
        GgmlType::Q4_1 => dot_isa::<Q4_1>(isa, row, x),
        GgmlType::Q5_0 => dot_isa::<Q5_0>(isa, row, x),
        GgmlType::Q5_1 => dot_isa::<Q5_1>(isa, row, x),
        GgmlType::Q8_0 => dot_isa::<Q8_0>(isa, row, x),
        GgmlType::Q2K => dot_isa::<Q2K>(isa, row, x),
        GgmlType::Q3K => dot_isa::<Q3K>(isa, row, x),
        GgmlType::Q4K => dot_isa::<Q4K>(isa, row, x),
        GgmlType::Q5K => dot_isa::<Q5K>(isa, row, x),
        GgmlType::Q6K => dot_isa::<Q6K>(isa, row, x),
    }
}

/// Below this many multiply-adds a matvec runs on the calling thread: rayon's
/// fork-join costs more than it saves.
const PAR_THRESHOLD: usize = 1 << 16;
/// Rows per rayon task: enough bytes per task to amortize scheduling.
const MIN_ROWS_PER_TASK: usize = 16;

/// One matrix-vector product: `y[r] = rows[r] · x`, where `rows` holds
/// `y.len()` consecutive rows of `x.len()` values of `ty`.
pub struct MatVec<'a> {
    pub ty: GgmlType,
    pub rows: &'a [u8],
    pub x: &'a [f32],
    pub y: &'a mut [f32],
}

/// Runs `jobs` together: all their rows are spread over the rayon pool in one
/// parallel region (the routed experts of a layer are one call), on the
/// CPU's widest kernel level.
pub fn matvec_batch(jobs: &mut [MatVec<'_>]) {
    use rayon::prelude::*;
    let work: usize = jobs.iter().map(|j| j.y.len() * j.x.len()).sum();
    let isa = Isa::detect();
    let run = |j: &mut MatVec<'_>| {
        let rb = j.ty.row_bytes(j.x.len()).expect("row length is a whole number of blocks");
        assert_eq!(j.rows.len(), rb * j.y.len(), "{} matvec: {} bytes for {} rows", j.ty, j.rows.len(), j.y.len());
        if work < PAR_THRESHOLD {
            for (y, row) in j.y.iter_mut().zip(j.rows.chunks_exact(rb)) {
                *y = dot_isa_checked(isa, j.ty, row, j.x);
            }
        } else {
            let (ty, x) = (j.ty, j.x);
            j.y.par_iter_mut()
                .zip(j.rows.par_chunks_exact(rb))
                .with_min_len(MIN_ROWS_PER_TASK)
                .for_each(|(y, row)| *y = dot_isa_checked(isa, ty, row, x));
        }
    };
    if work < PAR_THRESHOLD || jobs.len() == 1 {
        jobs.iter_mut().for_each(run);
    } else {
        jobs.par_iter_mut().for_each(run);
    }
}
