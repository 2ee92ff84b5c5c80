//! The kernel benchmark (`flashnext bench-kernels`): GB/s of weights streamed
//! by the matrix-vector kernels of each quantized type on the real model's
//! shapes, next to this machine's read bandwidth measured in the same run.
//!
//! * Bandwidth: every thread sums its share of a 1 GiB buffer (far above any
//!   last-level cache), the median of several passes.
//! * Kernels: one [`matvec_batch`] call per iteration, the median over
//!   iterations; GB/s counts the weight bytes the call reads. The experts are
//!   ten distinct experts drawn from a stack of 64 (so the working set
//!   exceeds the cache), computed together as the MoE does. A type whose
//!   block does not divide a row length is replaced by the type
//!   `llama-quantize` falls back to (e.g. Q4_K -> Q5_0 on the 640-wide
//!   expert down projection), and the row says so.
//! * Weights are valid blocks (a few quantized random rows, tiled): the
//!   kernels' speed does not depend on the values.
//! * Both kernel families ([`Kernels`]): the integer ("fast") path, the
//!   default, and the exact f32-decode path, side by side.
//! * Per core: one thread, a 256 KiB matrix of 2560-wide rows (in L2) and a
//!   fresh activation per call (so the 8-bit rounding is counted): what one
//!   core computes when memory is not the limit. A machine streams its
//!   bandwidth `B` with `n` cores only if this is at least `B / n`.

use super::kernels::{matvec_batch_with, Isa, Kernels, MatVec};
use super::matmul::{matmul_batch_with, MatMul};
use super::policy::fallback_type;
use super::{quantize_row, QUANT_TYPES};
use crate::error::Result;
use crate::gguf::GgmlType;
use rayon::prelude::*;
use std::fmt;
use std::time::{Duration, Instant};

/// What [`run_kernels`] measures.
#[derive(Clone, Debug)]
pub struct KernelBenchOptions {
    pub types: Vec<GgmlType>,
    /// The kernel families to time (exact, fast or both).
    pub kernels: Vec<Kernels>,
    /// Seconds spent timing each (type, shape) pair.
    pub seconds: f64,
    /// Fraction of the lm_head's 248320 rows to use (1.0 = all; less on small machines).
    pub lm_head_fraction: f64,
    /// Only the single-thread in-cache table (no bandwidth, no model shapes).
    pub per_core_only: bool,
    /// Kernel level (`None` = the widest this CPU has).
    pub isa: Option<Isa>,
}

impl Default for KernelBenchOptions {
    fn default() -> Self {
        KernelBenchOptions {
            types: QUANT_TYPES.to_vec(),
            kernels: vec![Kernels::Exact, Kernels::Fast],
            seconds: 1.0,
            lm_head_fraction: 1.0,
            per_core_only: false,
            isa: None,
        }
    }
}

impl KernelBenchOptions {
    fn isa(&self) -> Isa {
        self.isa.unwrap_or_else(Isa::detect)
    }
}

/// One matrix shape of the real model (`rows x cols`, `count` products per call).
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub name: &'static str,
    pub rows: usize,
    pub cols: usize,
    /// Matrices multiplied together per call (the routed experts).
    pub count: usize,
    /// Matrices the `count` are drawn from.
    pub pool: usize,
}

/// Qwen3.8-Flash-Next's shapes (hidden 2560, expert width 640, top-10), and
/// the matrix-vector shape of llama.cpp's `test-backend-ops perf -o MUL_MAT`
/// (m=4096, k=14336, n=1) for a side-by-side comparison.
pub const SHAPES: [Shape; 5] = [
    Shape { name: "expert gate/up 640x2560 top-10", rows: 640, cols: 2560, count: 10, pool: 64 },
    Shape { name: "expert down 2560x640 top-10", rows: 2560, cols: 640, count: 10, pool: 64 },
    Shape { name: "GDN qkv 10240x2560", rows: 10240, cols: 2560, count: 1, pool: 1 },
    Shape { name: "lm_head 248320x2560", rows: 248320, cols: 2560, count: 1, pool: 1 },
    Shape { name: "test-backend-ops 4096x14336", rows: 4096, cols: 14336, count: 1, pool: 1 },
];

/// One measured (type, shape) pair.
#[derive(Clone, Debug)]
pub struct KernelResult {
    /// The requested type.
    pub ty: GgmlType,
    /// The type actually benchmarked (the fallback when `ty` does not fit the rows).
    pub stored: GgmlType,
    pub shape: Shape,
    pub rows: usize,
    /// Weight bytes read per call.
    pub bytes: usize,
    pub kernels: Kernels,
    pub seconds_per_call: f64,
}

/// One type's single-thread, in-cache throughput.
#[derive(Clone, Debug)]
pub struct CoreResult {
    pub ty: GgmlType,
    pub kernels: Kernels,
    /// Weight bytes per second, 10^9.
    pub gbps: f64,
    /// Weights per second, 10^9.
    pub gweights: f64,
    /// Multiply-adds per second, 10^9, over a batch of [`BATCH_TOKENS`]
    /// tokens (`quant::matmul`, the prefill path): on the 2560-wide rows,
    /// and on 640-wide ones (the experts' down projections) where the type's
    /// blocks fit them.
    pub batch_gmacs: f64,
    pub batch_gmacs_short: Option<f64>,
}

/// Tokens of the per-core batch measurement: one tile of `quant::matmul`.
pub const BATCH_TOKENS: usize = super::matmul::TOKEN_TILE;

impl KernelResult {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds_per_call / 1e9
    }
}

#[derive(Clone, Debug)]
pub struct KernelReport {
    pub isa: Isa,
    pub threads: usize,
    /// Read bandwidth of this machine, GB/s (10^9 bytes).
    pub bandwidth_gbps: f64,
    pub results: Vec<KernelResult>,
    pub per_core: Vec<CoreResult>,
}

/// Median seconds of `f` over repeated calls for about `seconds` (at least 3 calls).
fn time_median(seconds: f64, mut f: impl FnMut()) -> f64 {
    f();
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || start.elapsed() < Duration::from_secs_f64(seconds) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Read bandwidth in GB/s: all threads summing a 1 GiB buffer.
pub fn read_bandwidth(seconds: f64) -> f64 {
    let n = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64).into_par_iter().map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
    let mut sink = 0u64;
    let t = time_median(seconds, || {
        sink ^= buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
            .reduce(|| 0, u64::wrapping_add);
    });
    std::hint::black_box(sink);
    (n * 8) as f64 / t / 1e9
}

/// `rows` rows of `cols` values of `ty`: 16 quantized pseudo-random rows, tiled.
fn weights(ty: GgmlType, rows: usize, cols: usize) -> Result<Vec<u8>> {
    let rb = ty.row_bytes(cols).expect("fallback_type picked a fitting type");
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut distinct = vec![0u8; 16 * rb];
    for row in distinct.chunks_exact_mut(rb) {
        let x: Vec<f32> = (0..cols)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.05
            })
            .collect();
        quantize_row(ty, &x, row)?;
    }
    let mut w = vec![0u8; rows * rb];
    w.par_chunks_mut(16 * rb).for_each(|c| c.copy_from_slice(&distinct[..c.len()]));
    Ok(w)
}

fn activation(cols: usize) -> Vec<f32> {
    (0..cols).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect()
}

fn bench_one(ty: GgmlType, shape: Shape, rows: usize, opts: &KernelBenchOptions) -> Result<Vec<KernelResult>> {
    let stored = fallback_type(ty, shape.cols);
    let rb = stored.row_bytes(shape.cols).expect("fallback_type picked a fitting type");
    let matrix = rows * rb;
    let w = weights(stored, rows * shape.pool, shape.cols)?;
    let x = activation(shape.cols);
    let mut y = vec![0f32; rows * shape.count];
    let mut out = Vec::new();
    for &kernels in &opts.kernels {
        let mut pick = 0usize;
        let seconds_per_call = time_median(opts.seconds, || {
            let mut jobs: Vec<MatVec<'_>> = y
                .chunks_exact_mut(rows)
                .enumerate()
                .map(|(k, y)| {
                    // Distinct experts, a different set each call.
                    let e = (pick + k * 7) % shape.pool;
                    MatVec { ty: stored, rows: &w[e * matrix..(e + 1) * matrix], x: &x, y }
                })
                .collect();
            matvec_batch_with(kernels, opts.isa(), &mut jobs);
            pick += 11;
        });
        std::hint::black_box(&y);
        out.push(KernelResult { ty, stored, shape, rows, bytes: matrix * shape.count, kernels, seconds_per_call });
    }
    Ok(out)
}

/// Single-thread throughput of `ty` on a 256 KiB matrix of 2560-wide rows,
/// one token and a batch.
fn bench_core(ty: GgmlType, kernels: Kernels, opts: &KernelBenchOptions) -> Result<CoreResult> {
    const COLS: usize = 2560;
    let rb = ty.row_bytes(COLS).expect("every type fits 2560-wide rows");
    let rows = ((256 << 10) / rb).max(1);
    let w = weights(ty, rows, COLS)?;
    let x = activation(COLS);
    let mut y = vec![0f32; rows];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| crate::error::Error::arg(format!("one-thread pool: {e}")))?;
    let t = pool.install(|| {
        time_median(opts.seconds, || {
            matvec_batch_with(kernels, opts.isa(), &mut [MatVec { ty, rows: &w, x: &x, y: &mut y }])
        })
    });
    std::hint::black_box(&y);
    let batch = |cols: usize| -> Result<f64> {
        let rows = ((256 << 10) / ty.row_bytes(cols).expect("checked by the caller")).max(1);
        let w = weights(ty, rows, cols)?;
        let xs: Vec<f32> = (0..BATCH_TOKENS).flat_map(|_| activation(cols)).collect();
        let mut ys = vec![0f32; rows * BATCH_TOKENS];
        let t = pool.install(|| {
            time_median(opts.seconds, || {
                matmul_batch_with(kernels, opts.isa(), &mut [MatMul { ty, rows: &w, cols, xs: &xs, pick: None, ys: &mut ys }])
            })
        });
        std::hint::black_box(&ys);
        Ok((rows * cols * BATCH_TOKENS) as f64 / t / 1e9)
    };
    let batch_gmacs = batch(COLS)?;
    let batch_gmacs_short = if ty.row_bytes(640).is_some() { Some(batch(640)?) } else { None };
    Ok(CoreResult { ty, kernels, gbps: w.len() as f64 / t / 1e9, gweights: (rows * COLS) as f64 / t / 1e9, batch_gmacs, batch_gmacs_short })
}

/// Measures the read bandwidth, then every requested type on every shape.
pub fn run_kernels(opts: &KernelBenchOptions) -> Result<KernelReport> {
    let bandwidth_gbps = if opts.per_core_only { f64::NAN } else { read_bandwidth(opts.seconds) };
    let mut results = Vec::new();
    for shape in SHAPES.into_iter().filter(|_| !opts.per_core_only) {
        let rows = if shape.pool == 1 && shape.rows > 100_000 {
            ((shape.rows as f64 * opts.lm_head_fraction) as usize).max(1)
        } else {
            shape.rows
        };
        for &ty in &opts.types {
            results.extend(bench_one(ty, shape, rows, opts)?);
        }
    }
    let mut per_core = Vec::new();
    for &ty in &opts.types {
        for &kernels in &opts.kernels {
            per_core.push(bench_core(ty, kernels, opts)?);
        }
    }
    Ok(KernelReport { isa: opts.isa(), threads: rayon::current_num_threads(), bandwidth_gbps, results, per_core })
}

impl fmt::Display for KernelReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.results.is_empty() {
            writeln!(f, "kernels: {}", self.isa.name())?;
        } else {
            writeln!(
                f,
                "read bandwidth: {:.1} GB/s ({} threads, kernels: {})",
                self.bandwidth_gbps,
                self.threads,
                self.isa.name()
            )?;
        }
        // One line per (shape, type), a column group per kernel family.
        let families: Vec<Kernels> = self.results.iter().map(|r| r.kernels).chain(self.per_core.iter().map(|r| r.kernels)).fold(Vec::new(), |mut v, k| {
            if !v.contains(&k) {
                v.push(k);
            }
            v
        });
        if !self.results.is_empty() {
            write!(f, "{:<32} {:<6} {:<6} {:>8}", "shape", "type", "stored", "MB/call")?;
            for k in &families {
                write!(f, " {:>9} {:>7} {:>5}", format!("{} ms", k.name()), "GB/s", "% bw")?;
            }
            writeln!(f)?;
        }
        for group in self.results.chunk_by(|a, b| a.shape.name == b.shape.name && a.ty == b.ty) {
            let r = &group[0];
            write!(f, "{:<32} {:<6} {:<6} {:>8.2}", r.shape.name, r.ty.name(), r.stored.name(), r.bytes as f64 / 1e6)?;
            for r in group {
                write!(
                    f,
                    " {:>9.3} {:>7.1} {:>4.0}%",
                    r.seconds_per_call * 1e3,
                    r.gbps(),
                    100.0 * r.gbps() / self.bandwidth_gbps
                )?;
            }
            writeln!(f)?;
        }
        if !self.per_core.is_empty() {
            writeln!(
                f,
                "per core (1 thread, 256 KiB of 2560-wide rows in cache; one token, and {BATCH_TOKENS} tokens in G multiply-adds/s on 2560- and 640-wide rows):"
            )?;
            write!(f, "{:<6}", "type")?;
            for k in &families {
                write!(f, " {:>12} {:>11} {:>11} {:>10}", format!("{} GB/s", k.name()), "G weights/s", "batch 2560", "batch 640")?;
            }
            writeln!(f)?;
            for group in self.per_core.chunk_by(|a, b| a.ty == b.ty) {
                write!(f, "{:<6}", group[0].ty.name())?;
                for r in group {
                    let short = r.batch_gmacs_short.map_or("-".to_string(), |g| format!("{g:.1}"));
                    write!(f, " {:>12.1} {:>11.1} {:>11.1} {:>10}", r.gbps, r.gweights, r.batch_gmacs, short)?;
                }
                writeln!(f)?;
            }
        }
        Ok(())
    }
}
