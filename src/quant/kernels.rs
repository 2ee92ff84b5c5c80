//! Matrix-vector products of stored rows with an f32 vector, for every
//! storage type, with runtime CPU-feature dispatch, and their scheduling on
//! the rayon pool ([`matvec_batch`]).
//!
//! Two kernel families ([`Kernels`]):
//!
//! * **fast** (the default for the quantized types on x86-64 with AVX2):
//!   the activation vector is rounded to 8 bits once per product and each
//!   block is an integer dot product, ggml's scheme; see [`super::dot`] for
//!   the design and its accuracy (at most `amax / 254` per activation, 0.4%
//!   of `sum |w| max |x|` in the worst case, about 0.5-0.8% of the output's
//!   spread typically);
//! * **exact** (always for F32/F16/BF16, and for the quantized types when
//!   asked): the weights are dequantized bit-exactly and multiplied with the
//!   f32 activations, below.
//!
//! `FNX_CPU_KERNELS=exact|fast` sets the process default (read once); Rust
//! code picks per call with [`matvec_batch_with`], per scope with
//! [`with_kernels`], and per model with `LoadOptions::cpu_kernels`.
//!
//! # Exact kernels: dequantize in registers, accumulate in f32
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
//! Accuracy: the weights are exactly the dequantized values and the
//! activations are not rounded, so the only difference from an exact dot
//! product of the dequantized row is f32 summation order and fused rounding:
//! about 1e-7 of `sum |w_i x_i|` per row, the same as the F32 path.
//!
//! # Scheduling
//!
//! [`matvec_batch`] runs all its jobs (e.g. gate and up of the ten routed
//! experts) in one parallel region: the rows of every job are cut into
//! chunks of about [`CHUNK_BYTES`] of weights, and rayon spreads the chunks
//! of all jobs over its threads. The fast path rounds each distinct input
//! vector once (jobs whose `x` is the same slice share it).
//!
//! [`glu_batch`] runs gated units (one token's experts: gate and up, the
//! gate step, down) in one region rather than two: workers claim runs of
//! consecutive chunks from one counter, a unit's down rows wait only for
//! that unit's gate and up, so the threads never all meet in between and
//! each streams long stretches of memory.

use super::dot::{self, ActKind, Activation};
use crate::gguf::GgmlType;
use std::sync::OnceLock;

/// An instruction-set level the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable code, no fused multiply-add: the test reference.
    Scalar,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX-512 F, BW and VL (and AVX2, FMA, F16C).
    Avx512,
    /// [`Isa::Avx512`] with AVX512-VNNI (the exact kernels run as `Avx512`).
    Avx512Vnni,
}

impl Isa {
    /// The widest level this CPU supports, or the narrower one
    /// `FNX_CPU_ISA` names (`scalar`, `avx2+fma`, `avx512`, `avx512+vnni`;
    /// for measuring a narrower level's kernels on a wider CPU: a level the
    /// CPU lacks, or an unknown name, is ignored). Cached.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let widest = *Isa::available().last().expect("scalar is always available");
            let asked = std::env::var("FNX_CPU_ISA").ok().and_then(|v| Isa::parse(v.trim()));
            asked.filter(|i| Isa::available().contains(i)).unwrap_or(widest)
        })
    }

    /// Every level this CPU can run, narrowest first.
    pub fn available() -> Vec<Isa> {
        static AVAILABLE: OnceLock<Vec<Isa>> = OnceLock::new();
        AVAILABLE
            .get_or_init(|| {
                let mut v = vec![Isa::Scalar];
                #[cfg(target_arch = "x86_64")]
                {
                    if is_x86_feature_detected!("avx2")
                        && is_x86_feature_detected!("fma")
                        && is_x86_feature_detected!("f16c")
                    {
                        v.push(Isa::Avx2);
                        if is_x86_feature_detected!("avx512f")
                            && is_x86_feature_detected!("avx512bw")
                            && is_x86_feature_detected!("avx512vl")
                        {
                            v.push(Isa::Avx512);
                            if is_x86_feature_detected!("avx512vnni") {
                                v.push(Isa::Avx512Vnni);
                            }
                        }
                    }
                }
                v
            })
            .clone()
    }

    /// Whether this CPU can run `self`.
    pub fn supported(self) -> bool {
        static MASK: OnceLock<u32> = OnceLock::new();
        *MASK.get_or_init(|| Isa::available().iter().fold(0, |m, &i| m | 1 << i as u32)) & (1 << self as u32) != 0
    }

    /// The level called `name` (as [`Isa::name`] spells it).
    pub fn parse(name: &str) -> Option<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni].into_iter().find(|i| i.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512+vnni",
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
        Isa::Avx512 | Isa::Avx512Vnni => unsafe { dot_avx512::<U>(row, x) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => dot_generic::<U, false>(row, x),
    }
}

/// `ys[t * stride] = row · xs[t]` for every token `t` of `xs` ([T][cols]):
/// the row is decoded once into `buf` (`cols` floats) and each token's sum
/// is then formed exactly as [`dot_generic`] forms it (same blocks, same
/// lanes, same order), so the results are those of `T` separate products.
#[inline(always)]
fn dot_tokens_generic<U: Unit, const FUSED: bool>(row: &[u8], xs: &[f32], buf: &mut [f32], ys: &mut [f32], stride: usize) {
    let cols = buf.len();
    let whole = cols / U::N;
    for (b, w) in row.chunks_exact(U::BYTES).zip(buf.chunks_exact_mut(U::N)) {
        U::decode(b, w);
    }
    if whole * U::N < cols {
        U::decode(&row[whole * U::BYTES..], &mut buf[whole * U::N..]);
    }
    for (t, x) in xs.chunks_exact(cols).enumerate() {
        let mut acc = [0f32; LANES];
        for (w, xb) in buf.chunks_exact(U::N).zip(x.chunks_exact(U::N)) {
            madd::<FUSED>(&mut acc, w, xb);
        }
        if whole * U::N < cols {
            madd::<FUSED>(&mut acc, &buf[whole * U::N..], &x[whole * U::N..]);
        }
        ys[t * stride] = acc.iter().sum();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_tokens_avx2<U: Unit>(row: &[u8], xs: &[f32], buf: &mut [f32], ys: &mut [f32], stride: usize) {
    dot_tokens_generic::<U, true>(row, xs, buf, ys, stride)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_tokens_avx512<U: Unit>(row: &[u8], xs: &[f32], buf: &mut [f32], ys: &mut [f32], stride: usize) {
    dot_tokens_generic::<U, true>(row, xs, buf, ys, stride)
}

fn dot_tokens_isa<U: Unit>(isa: Isa, row: &[u8], xs: &[f32], buf: &mut [f32], ys: &mut [f32], stride: usize) {
    match isa {
        Isa::Scalar => dot_tokens_generic::<U, false>(row, xs, buf, ys, stride),
        // SAFETY: `isa` comes from `Isa::available` (checked by the callers of
        // `dot_tokens_exact`), so the CPU has every feature these are compiled for.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { dot_tokens_avx2::<U>(row, xs, buf, ys, stride) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni => unsafe { dot_tokens_avx512::<U>(row, xs, buf, ys, stride) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => dot_tokens_generic::<U, false>(row, xs, buf, ys, stride),
    }
}

/// The exact kernel of `ty` over many tokens: `ys[t * stride] = row · xs[t]`
/// (`xs`: [T][buf.len()]), bit for bit what [`dot_row_with`] gives token by
/// token, with the row decoded once. `isa` must be supported (unchecked).
pub(crate) fn dot_tokens_exact(isa: Isa, ty: GgmlType, row: &[u8], xs: &[f32], buf: &mut [f32], ys: &mut [f32], stride: usize) {
    debug_assert_eq!(ty.row_bytes(buf.len()), Some(row.len()));
    match ty {
        GgmlType::F32 => dot_tokens_isa::<F32>(isa, row, xs, buf, ys, stride),
        GgmlType::F16 => dot_tokens_isa::<F16>(isa, row, xs, buf, ys, stride),
        GgmlType::BF16 => dot_tokens_isa::<Bf16>(isa, row, xs, buf, ys, stride),
        GgmlType::Q4_0 => dot_tokens_isa::<Q4_0>(isa, row, xs, buf, ys, stride),
        GgmlType::Q4_1 => dot_tokens_isa::<Q4_1>(isa, row, xs, buf, ys, stride),
        GgmlType::Q5_0 => dot_tokens_isa::<Q5_0>(isa, row, xs, buf, ys, stride),
        GgmlType::Q5_1 => dot_tokens_isa::<Q5_1>(isa, row, xs, buf, ys, stride),
        GgmlType::Q8_0 => dot_tokens_isa::<Q8_0>(isa, row, xs, buf, ys, stride),
        GgmlType::Q2K => dot_tokens_isa::<Q2K>(isa, row, xs, buf, ys, stride),
        GgmlType::Q3K => dot_tokens_isa::<Q3K>(isa, row, xs, buf, ys, stride),
        GgmlType::Q4K => dot_tokens_isa::<Q4K>(isa, row, xs, buf, ys, stride),
        GgmlType::Q5K => dot_tokens_isa::<Q5K>(isa, row, xs, buf, ys, stride),
        GgmlType::Q6K => dot_tokens_isa::<Q6K>(isa, row, xs, buf, ys, stride),
    }
}

/// `row · x` where `row` holds `x.len()` values of `ty`, at kernel level
/// `isa` (the same code [`matvec_batch`] runs at [`Isa::detect`]). Panics if the CPU lacks `isa` or `row` is
/// not one row of `x.len()` values of `ty`.
pub fn dot_row_with(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    assert!(isa.supported(), "this CPU cannot run {}", isa.name());
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

/// Which kernels the quantized types use (F32/F16/BF16 always run exact).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernels {
    /// Dequantize bit-exactly, multiply with the f32 activations.
    Exact,
    /// Integer dot products against 8-bit activations ([`super::dot`]).
    Fast,
}

thread_local! {
    static KERNELS: std::cell::Cell<Option<Kernels>> = const { std::cell::Cell::new(None) };
}

impl Kernels {
    /// `"exact"` or `"fast"`.
    pub fn parse(s: &str) -> Option<Kernels> {
        match s.trim().to_ascii_lowercase().as_str() {
            "exact" => Some(Kernels::Exact),
            "fast" => Some(Kernels::Fast),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernels::Exact => "exact",
            Kernels::Fast => "fast",
        }
    }

    /// The process default: `FNX_CPU_KERNELS=exact|fast`, read once; when
    /// unset (or unknown, which is reported on stderr), fast on CPUs with
    /// SIMD integer kernels (AVX2 and up) and exact elsewhere, where the
    /// plain-Rust integer reference is no faster than decoding to f32.
    pub fn from_env() -> Kernels {
        static DEFAULT: OnceLock<Kernels> = OnceLock::new();
        *DEFAULT.get_or_init(|| {
            let default = if Isa::detect() == Isa::Scalar { Kernels::Exact } else { Kernels::Fast };
            match std::env::var("FNX_CPU_KERNELS") {
                Ok(v) if !v.is_empty() => Kernels::parse(&v).unwrap_or_else(|| {
                    eprintln!("flashnext: FNX_CPU_KERNELS={v:?} is not exact or fast; using {}", default.name());
                    default
                }),
                _ => default,
            }
        })
    }

    /// What [`matvec_batch`] uses on this thread: the innermost
    /// [`with_kernels`], else [`Kernels::from_env`].
    pub fn current() -> Kernels {
        KERNELS.with(|k| k.get()).unwrap_or_else(Kernels::from_env)
    }
}

/// Runs `f` with [`matvec_batch`] calls made on this thread using `kernels`
/// (calls from other threads, e.g. inside a rayon job started by `f`, are
/// not affected).
pub fn with_kernels<R>(kernels: Kernels, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Kernels>);
    impl Drop for Restore {
        fn drop(&mut self) {
            KERNELS.with(|k| k.set(self.0));
        }
    }
    let _restore = Restore(KERNELS.with(|k| k.replace(Some(kernels))));
    f()
}

/// Weight bytes per unit of parallel work: large enough that rayon's
/// per-task cost (well under a microsecond) is small next to streaming it
/// (about 8 us at 8 GB/s per core), small enough that 16 threads get about
/// 15 chunks each of a top-10 expert batch (20 x 0.9 MB) and share its tail
/// evenly. Batches of at most one chunk run on the calling thread.
pub const CHUNK_BYTES: usize = 64 << 10;

/// Batches of fewer multiply-adds than this also run on the calling thread:
/// waking the pool costs more than it saves (and tiny models never start it).
pub(crate) const PAR_MIN_WEIGHTS: usize = 1 << 16;

/// One matrix-vector product: `y[r] = rows[r] · x`, where `rows` holds
/// `y.len()` consecutive rows of `x.len()` values of `ty`.
pub struct MatVec<'a> {
    pub ty: GgmlType,
    pub rows: &'a [u8],
    pub x: &'a [f32],
    pub y: &'a mut [f32],
}

/// Runs `jobs` together with [`Kernels::current`] on the CPU's widest
/// level: all their rows are spread over the rayon pool in one parallel
/// region (the routed experts of a layer are one call).
pub fn matvec_batch(jobs: &mut [MatVec<'_>]) {
    matvec_batch_with(Kernels::current(), Isa::detect(), jobs)
}

/// A piece of one job: consecutive rows and their outputs.
struct Chunk<'a> {
    ty: GgmlType,
    rows: &'a [u8],
    x: &'a [f32],
    act: Option<&'a Activation>,
    y: &'a mut [f32],
}

impl Chunk<'_> {
    fn run(&mut self, isa: Isa) {
        run_rows(isa, self.ty, self.rows, self.x, self.act, self.y);
    }
}

/// `y[r] = rows[r] · x`: against `act` (the rounding of `x`) with the integer
/// kernels, else with the exact ones.
fn run_rows(isa: Isa, ty: GgmlType, rows: &[u8], x: &[f32], act: Option<&Activation>, y: &mut [f32]) {
    match act {
        Some(act) => dot::dot_rows(isa, ty, rows, act, y),
        None => {
            let rb = rows.len() / y.len().max(1);
            for (y, row) in y.iter_mut().zip(rows.chunks_exact(rb)) {
                *y = dot_isa_checked(isa, ty, row, x);
            }
        }
    }
}

/// [`matvec_batch`] with the kernels and level given (panics if the CPU
/// lacks `isa`).
pub fn matvec_batch_with(kernels: Kernels, isa: Isa, jobs: &mut [MatVec<'_>]) {
    use rayon::prelude::*;
    assert!(isa.supported(), "this CPU cannot run {}", isa.name());
    // Round each distinct (input, layout) once.
    let mut inputs: Vec<(*const f32, usize, ActKind)> = Vec::new();
    let mut acts: Vec<Activation> = Vec::new();
    let mut job_act: Vec<Option<usize>> = Vec::with_capacity(jobs.len());
    let (mut total, mut weights) = (0usize, 0usize);
    for j in jobs.iter() {
        let rb = j.ty.row_bytes(j.x.len()).expect("row length is a whole number of blocks");
        assert_eq!(j.rows.len(), rb * j.y.len(), "{} matvec: {} bytes for {} rows", j.ty, j.rows.len(), j.y.len());
        total += j.rows.len();
        weights += j.x.len() * j.y.len();
        let kind = ActKind::of(j.ty).filter(|_| kernels == Kernels::Fast && !j.y.is_empty());
        job_act.push(kind.map(|kind| {
            let key = (j.x.as_ptr(), j.x.len(), kind);
            inputs.iter().position(|k| *k == key).unwrap_or_else(|| {
                inputs.push(key);
                acts.push(Activation::new(isa, kind, j.x));
                acts.len() - 1
            })
        }));
    }
    let mut chunks: Vec<Chunk<'_>> = Vec::new();
    for (j, a) in jobs.iter_mut().zip(job_act) {
        if j.y.is_empty() {
            continue;
        }
        let rb = j.rows.len() / j.y.len();
        let per = CHUNK_BYTES.div_ceil(rb.max(1)).max(1);
        let act = a.map(|a| &acts[a]);
        for (rows, y) in j.rows.chunks(per * rb).zip(j.y.chunks_mut(per)) {
            chunks.push(Chunk { ty: j.ty, rows, x: j.x, act, y });
        }
    }
    if total <= CHUNK_BYTES || weights < PAR_MIN_WEIGHTS || chunks.len() == 1 {
        chunks.iter_mut().for_each(|c| c.run(isa));
    } else {
        chunks.par_iter_mut().for_each(|c| c.run(isa));
    }
}

/// Consecutive rows of one matrix: their type and bytes.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub ty: GgmlType,
    pub bytes: &'a [u8],
}

/// A gated unit (an expert) for [`glu_batch`]: `gate` and `up`, `ff` rows
/// each over the shared input, then `down` over the `ff` values the gate
/// step leaves.
#[derive(Clone, Copy)]
pub struct Glu<'a> {
    pub gate: Rows<'a>,
    pub up: Rows<'a>,
    pub down: Rows<'a>,
}

/// `ys[g] = down_g · glu(gate_g · x, up_g · x)` for every unit `g` (`ys`:
/// [units][H]), where `glu(gate, up)` leaves its result in `gate`, with
/// [`Kernels::current`] on the CPU's widest level.
pub fn glu_batch(units: &[Glu<'_>], x: &[f32], glu: impl Fn(&mut [f32], &[f32]) + Sync, ys: &mut [f32]) {
    glu_batch_with(Kernels::current(), Isa::detect(), units, x, glu, ys)
}

/// A task of [`glu_batch_with`]: rows `rows` of unit `unit`'s gate or up
/// (`first`) or down product, their outputs at float `out` of the unit
/// buffer or of `ys`.
struct GluTask<'a> {
    unit: usize,
    first: bool,
    ty: GgmlType,
    rows: &'a [u8],
    out: usize,
    n: usize,
}

/// A pointer the workers of [`glu_batch_with`] share; each writes disjoint
/// ranges, ordered by the units' counters.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: see `glu_batch_with`: writers touch disjoint ranges, and readers
// read a unit's range only after its counter's release/acquire.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// [`glu_batch`] with the kernels and level given (panics if the CPU lacks
/// `isa`).
///
/// One parallel region instead of two: the gate and up rows of every unit
/// are cut into chunks of about [`GLU_CHUNK_BYTES`], then every unit's down rows,
/// and the pool's threads take them in that order from one counter.
/// The thread that finishes a unit's last gate or up chunk applies `glu` and
/// rounds the result for the down kernels; a thread that takes a down chunk
/// of a unit not yet finished waits for it (every gate and up chunk has been
/// taken by then, and the units finish in order, so waits are short). So the
/// threads never all meet between the two products, and the ones done early
/// start on the down rows while the last gate and up chunks run. A worker
/// claims a run of consecutive chunks (half its share of what is left), so
/// it streams a long stretch of memory before it jumps; the chunks are
/// small ([`GLU_CHUNK_BYTES`]) so that the last runs even out the end.
///
/// Measured on an H100 machine's 16-core host (`bench-host-moe`, ten 2 MB
/// Q2_K/Q4_0 experts per layer from the mapped file, the same call): 54-57
/// GB/s with two regions of rayon-split 64 KB chunks, 70-74 GB/s this way
/// (5 experts: 49 -> 56-59; 20: 61-68 -> 75-79); chunks of 8, 16, 32 and 64
/// KB: 57, 70-74, 72 and 70 GB/s. Every row is the same kernel call on the
/// same rounded input as [`matvec_batch`] would make, so the numbers are
/// equal.
pub fn glu_batch_with(kernels: Kernels, isa: Isa, units: &[Glu<'_>], x: &[f32], glu: impl Fn(&mut [f32], &[f32]) + Sync, ys: &mut [f32]) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    assert!(isa.supported(), "this CPU cannot run {}", isa.name());
    if units.is_empty() {
        return;
    }
    let h = ys.len() / units.len();
    assert_eq!(ys.len(), h * units.len(), "outputs for {} units", units.len());
    let rows_of = |r: &Rows<'_>, cols: usize| {
        let rb = r.ty.row_bytes(cols).expect("row length is a whole number of blocks");
        assert_eq!(r.bytes.len() % rb, 0, "{}: {} bytes are not rows of {cols}", r.ty, r.bytes.len());
        r.bytes.len() / rb
    };
    // Per unit its width, and where its [gate | up] lie in the unit buffer.
    let ffs: Vec<usize> = units.iter().map(|u| rows_of(&u.gate, x.len())).collect();
    let base: Vec<usize> = ffs.iter().scan(0, |at, &ff| Some(std::mem::replace(at, *at + 2 * ff))).collect();
    for (u, &ff) in units.iter().zip(&ffs) {
        assert_eq!(rows_of(&u.up, x.len()), ff, "up and gate differ in rows");
        assert_eq!(rows_of(&u.down, ff), h, "down rows");
    }
    let mut buf = vec![0f32; base.last().map_or(0, |b| b + 2 * ffs[ffs.len() - 1])];
    let fast = |ty: GgmlType| ActKind::of(ty).filter(|_| kernels == Kernels::Fast);
    let mut acts: Vec<(ActKind, Activation)> = Vec::new();
    for u in units {
        for ty in [u.gate.ty, u.up.ty] {
            if let Some(kind) = fast(ty).filter(|k| !acts.iter().any(|(a, _)| a == k)) {
                acts.push((kind, Activation::new(isa, kind, x)));
            }
        }
    }
    let act_of = |ty: GgmlType| fast(ty).and_then(|k| acts.iter().find(|(a, _)| *a == k).map(|(_, act)| act));
    // Rows of `r` (over `cols` values) in chunks, their outputs from float `out` on.
    fn cut<'a>(tasks: &mut Vec<GluTask<'a>>, unit: usize, first: bool, r: Rows<'a>, cols: usize, out: usize) {
        let rb = r.ty.row_bytes(cols).expect("checked above");
        let per = glu_chunk_bytes().div_ceil(rb).max(1);
        for (i, rows) in r.bytes.chunks(per * rb).enumerate() {
            tasks.push(GluTask { unit, first, ty: r.ty, rows, out: out + i * per, n: rows.len() / rb });
        }
    }
    let mut tasks = Vec::new();
    for (g, u) in units.iter().enumerate() {
        cut(&mut tasks, g, true, u.gate, x.len(), base[g]);
        cut(&mut tasks, g, true, u.up, x.len(), base[g] + ffs[g]);
    }
    let firsts = tasks.len();
    for (g, u) in units.iter().enumerate() {
        cut(&mut tasks, g, false, u.down, ffs[g], g * h);
    }
    let mut left: Vec<AtomicUsize> = units.iter().map(|_| AtomicUsize::new(0)).collect();
    for t in &tasks[..firsts] {
        *left[t.unit].get_mut() += 1;
    }
    // Per unit, once its glu is applied: the rounding of its hidden values
    // (None on the exact kernels).
    let ready: Vec<OnceLock<Option<Activation>>> = units.iter().map(|_| OnceLock::new()).collect();
    let failed = AtomicBool::new(false);
    let next = AtomicUsize::new(0);
    let threads = rayon::current_num_threads().min(tasks.len()).max(1);
    // Guided claims: a worker takes a run of consecutive chunks, half its
    // share of what is left (so the first runs stream a long stretch of
    // memory and the last ones, a chunk each, even out the end).
    let claim = || {
        let mut at = next.load(Ordering::Relaxed);
        loop {
            let left = tasks.len().checked_sub(at).filter(|&l| l > 0)?;
            let take = (left / (2 * threads)).max(1);
            match next.compare_exchange_weak(at, at + take, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(at..at + take),
                Err(now) => at = now,
            }
        }
    };
    let (hid, out) = (Shared(buf.as_mut_ptr()), Shared(ys.as_mut_ptr()));
    let run = |t: &GluTask<'_>| -> bool {
        let (hid, out) = (hid, out);
        let (ff, at) = (ffs[t.unit], base[t.unit]);
        if t.first {
            // SAFETY: the chunks' output ranges are disjoint and inside
            // `buf`, which outlives the region; nothing reads them before
            // the unit's counter reaches zero.
            let y = unsafe { std::slice::from_raw_parts_mut(hid.0.add(t.out), t.n) };
            run_rows(isa, t.ty, t.rows, x, act_of(t.ty), y);
            if left[t.unit].fetch_sub(1, Ordering::AcqRel) == 1 {
                // SAFETY: every gate and up chunk of the unit is done
                // (acquired above); the down chunks read it only after `ready`.
                let both = unsafe { std::slice::from_raw_parts_mut(hid.0.add(at), 2 * ff) };
                let (gate, up) = both.split_at_mut(ff);
                glu(gate, up);
                let _ = ready[t.unit].set(fast(units[t.unit].down.ty).map(|k| Activation::new(isa, k, gate)));
            }
        } else {
            // Every gate and up chunk was claimed before this one, and each
            // worker runs its claims in order, so the unit finishes.
            let act = loop {
                if let Some(a) = ready[t.unit].get() {
                    break a.as_ref();
                }
                if failed.load(Ordering::Acquire) {
                    return false;
                }
                std::hint::spin_loop();
            };
            // SAFETY: the unit's hidden values are final (`ready`), the
            // output ranges of the down chunks disjoint and inside `ys`.
            let (hidden, y) = unsafe { (std::slice::from_raw_parts(hid.0.add(at), ff), std::slice::from_raw_parts_mut(out.0.add(t.out), t.n)) };
            run_rows(isa, t.ty, t.rows, hidden, act, y);
        }
        true
    };
    let work = || {
        // A worker that panics wakes the ones waiting for its unit.
        struct Guard<'a>(&'a AtomicBool);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.store(true, Ordering::Release);
                }
            }
        }
        let _guard = Guard(&failed);
        while let Some(r) = claim() {
            if !tasks[r].iter().all(&run) {
                return;
            }
        }
    };
    let weights: usize = ffs.iter().map(|ff| ff * (2 * x.len() + h)).sum();
    if threads <= 1 || weights < PAR_MIN_WEIGHTS {
        work();
    } else {
        rayon::scope(|s| {
            for _ in 1..threads {
                s.spawn(|_| work());
            }
            work();
        });
    }
}

/// The chunk size of [`glu_batch_with`]: [`GLU_CHUNK_BYTES`], or
/// `FNX_GLU_CHUNK_BYTES` (for measuring it).
fn glu_chunk_bytes() -> usize {
    static BYTES: OnceLock<usize> = OnceLock::new();
    *BYTES.get_or_init(|| std::env::var("FNX_GLU_CHUNK_BYTES").ok().and_then(|v| v.parse().ok()).filter(|&b| b > 0).unwrap_or(GLU_CHUNK_BYTES))
}

/// The unit of [`glu_batch_with`]'s claims: small, since a claim is a run of
/// consecutive chunks (8 KB measured slower: a claim's pieces each pay a
/// call and a lead-in prefetch).
pub const GLU_CHUNK_BYTES: usize = 16 << 10;
