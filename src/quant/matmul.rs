//! Matrix products over a batch of tokens: `ys[t][r] = rows[r] · xs[t]`,
//! the prefill twin of [`super::kernels::matvec_batch`].
//!
//! # Weights read once per batch
//!
//! A matrix-vector product streams every weight from memory for one token;
//! prefilling `T` tokens that way reads each weight `T` times. Here the rows
//! of every job are cut into pieces of about [`CHUNK_BYTES`] of weights (as
//! the matrix-vector path cuts them), and a piece meets the tokens in tiles
//! of [`TOKEN_TILE`]: the piece stays in L2 while the tile's tokens meet its
//! rows, four tokens at a time whose activations stay in L1
//! ([`dot::dot_rows_tokens`]), and from one tile to the next, so the weights
//! come from memory once per batch.
//!
//! Every product is the one the matrix-vector path computes: on the integer
//! path each token's activation is rounded once ([`Activation`], the same
//! bytes as one matrix-vector product would round) and meets each row through
//! the same row kernel; on the exact path a row is decoded once per tile and
//! each token's sum is formed in the same blocks, lanes and order as the
//! one-token kernel. Batched and token-by-token results are equal bit for
//! bit, which the tests check.
//!
//! # Scheduling
//!
//! All jobs of a call share one parallel region (the gate and up products of
//! every expert of a MoE layer are one call). When the pieces are too few
//! for the threads (small matrices, e.g. a hyper-connection's), the tokens
//! are split as well, each split reading its piece again: a small matrix is
//! cheap to read twice. A piece computes its tile in its thread's scratch
//! (reused from call to call: fresh buffers of this size cost page faults
//! that showed up at a tenth of a prefill's time) and writes it into the
//! job's `ys`, where the pieces' cells are disjoint.

use super::dot::{self, ActKind, Activation};
use super::kernels::{dot_tokens_exact, Isa, Kernels, CHUNK_BYTES, PAR_MIN_WEIGHTS};
use crate::gguf::GgmlType;
use rayon::prelude::*;

/// Tokens a row meets while it is in L1: 32 activations of a 2560-wide
/// layer are 80 KB rounded (320 KB in f32), which stay in L2 beside the
/// piece of weights.
pub const TOKEN_TILE: usize = 32;

/// The fewest activations rounded in one call worth a parallel region.
const PAR_MIN_ROUNDS: usize = 64;

/// One matrix over a batch: `ys[t * n + r] = rows[r] · xs[t * cols..]`, where
/// `rows` holds `n` consecutive rows of `cols` values of `ty`, `xs` is
/// [T][cols] and `ys` [T][n].
///
/// With `pick`, the job reads only the tokens of `xs` it names, in its
/// order: `ys[i * n + r] = rows[r] · xs[pick[i] * cols..]` (a MoE expert
/// reads the batch's inputs in place, and each token is rounded once for
/// all the experts that read it).
pub struct MatMul<'a> {
    pub ty: GgmlType,
    pub rows: &'a [u8],
    pub cols: usize,
    pub xs: &'a [f32],
    pub pick: Option<&'a [usize]>,
    pub ys: &'a mut [f32],
}

impl MatMul<'_> {
    /// The tokens this job computes.
    fn tokens(&self) -> usize {
        self.pick.map_or(self.xs.len() / self.cols, <[usize]>::len)
    }

    fn n_rows(&self) -> usize {
        self.ys.len().checked_div(self.tokens()).unwrap_or(0)
    }
}

/// Runs `jobs` together with [`Kernels::current`] on the CPU's widest level.
pub fn matmul_batch(jobs: &mut [MatMul<'_>]) {
    matmul_batch_with(Kernels::current(), Isa::detect(), jobs)
}

/// A piece of one job: rows `r0..r0 + nr` for tokens `t0..t0 + nt`.
struct Piece {
    job: usize,
    r0: usize,
    nr: usize,
    t0: usize,
    nt: usize,
}

/// A job without its outputs: type, rows, columns, inputs, picked tokens, number of rows.
type Shape<'a> = (GgmlType, &'a [u8], usize, &'a [f32], Option<&'a [usize]>, usize);

/// The row of `xs` of token `t` of a job picking `pick`.
fn picked(pick: Option<&[usize]>, t: usize) -> usize {
    pick.map_or(t, |p| p[t])
}

/// A job's outputs, written by the pieces in parallel.
struct Outputs {
    ys: *mut f32,
    len: usize,
}

// SAFETY: the pieces of a job write disjoint cells of its outputs (their
// rows x tokens rectangles do not overlap), and the job's `&mut` borrow
// outlives the parallel region.
unsafe impl Sync for Outputs {}

thread_local! {
    /// A thread's piece tile, decoded row and picked inputs, reused between calls.
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// The index among `inputs` of job `j`'s input in layout `kind` (none on
/// the exact path), adding it (with `at`, the job's index, in `firsts`) when
/// no earlier job reads it.
fn jobs_seen(inputs: &mut Vec<(*const f32, usize, ActKind)>, firsts: &mut Vec<usize>, j: &MatMul<'_>, kind: Option<ActKind>, at: usize) -> Option<usize> {
    let key = (j.xs.as_ptr(), j.xs.len(), kind?);
    Some(inputs.iter().position(|k| *k == key).unwrap_or_else(|| {
        inputs.push(key);
        firsts.push(at);
        inputs.len() - 1
    }))
}

/// [`matmul_batch`] with the kernels and level given (panics if the CPU lacks `isa`).
pub fn matmul_batch_with(kernels: Kernels, isa: Isa, jobs: &mut [MatMul<'_>]) {
    assert!(isa.supported(), "this CPU cannot run {}", isa.name());
    // Round each distinct (input, layout) once per token: the distinct ones
    // (the first job reading each) found here, rounded below in parallel.
    let mut inputs: Vec<(*const f32, usize, ActKind)> = Vec::new();
    let mut firsts: Vec<usize> = Vec::new();
    let mut job_act: Vec<Option<usize>> = Vec::with_capacity(jobs.len());
    let mut work = 0usize;
    for j in jobs.iter() {
        assert!(j.cols > 0 && j.xs.len() % j.cols == 0, "{} matmul: {} inputs are not rows of {}", j.ty, j.xs.len(), j.cols);
        let (t, n) = (j.tokens(), j.n_rows());
        assert_eq!(j.ys.len(), t * n, "{} matmul: {} outputs for {t} tokens", j.ty, j.ys.len());
        let rows_of_xs = j.xs.len() / j.cols;
        assert!(j.pick.is_none_or(|p| p.iter().all(|&i| i < rows_of_xs)), "{} matmul: a picked token beyond {rows_of_xs}", j.ty);
        let rb = j.ty.row_bytes(j.cols).expect("row length is a whole number of blocks");
        assert_eq!(j.rows.len(), rb * n, "{} matmul: {} bytes for {n} rows", j.ty, j.rows.len());
        work += j.cols * n * t;
        let kind = ActKind::of(j.ty).filter(|_| kernels == Kernels::Fast && n > 0);
        let index = jobs_seen(&mut inputs, &mut firsts, j, kind, job_act.len());
        job_act.push(index);
    }
    // Every token of every distinct input in one parallel region (a MoE
    // layer's experts each read a few tokens: rounded one expert after
    // another, they kept one thread busy while the others waited). An input
    // read through picks is rounded whole: its tokens are the batch's, each
    // read by several experts.
    let tokens: Vec<(usize, usize)> =
        firsts.iter().enumerate().flat_map(|(i, &j)| (0..jobs[j].xs.len() / jobs[j].cols).map(move |t| (i, t))).collect();
    let kinds: Vec<ActKind> = inputs.iter().map(|k| k.2).collect();
    let round = |&(i, t): &(usize, usize)| {
        let j = &jobs[firsts[i]];
        Activation::new(isa, kinds[i], &j.xs[t * j.cols..(t + 1) * j.cols])
    };
    // (A decoded token's few inputs, a microsecond or two each, are rounded in place.)
    let rounded: Vec<Activation> =
        if tokens.len() >= PAR_MIN_ROUNDS { tokens.par_iter().map(round).collect() } else { tokens.iter().map(round).collect() };
    let mut acts: Vec<Vec<Activation>> = firsts.iter().map(|_| Vec::new()).collect();
    for (&(i, _), a) in tokens.iter().zip(rounded) {
        acts[i].push(a);
    }
    // Per job its tokens' rounded activations, in its order.
    let job_acts: Vec<Vec<&Activation>> = jobs
        .iter()
        .zip(&job_act)
        .map(|(j, a)| a.map_or(Vec::new(), |a| (0..j.tokens()).map(|t| &acts[a][picked(j.pick, t)]).collect()))
        .collect();
    // Pieces of rows, then tokens split where the rows alone give too few.
    let mut spans: Vec<(usize, usize, usize)> = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        let (t, n) = (j.tokens(), j.n_rows());
        if t == 0 || n == 0 {
            continue;
        }
        let rb = j.rows.len() / n;
        let per = CHUNK_BYTES.div_ceil(rb.max(1)).max(1);
        spans.extend((0..n).step_by(per).map(|r0| (i, r0, per.min(n - r0))));
    }
    let want = 4 * rayon::current_num_threads();
    let splits = if spans.len() >= want { 1 } else { want.div_ceil(spans.len().max(1)) };
    let mut pieces: Vec<Piece> = Vec::new();
    for &(job, r0, nr) in &spans {
        let t = jobs[job].tokens();
        let step = t.div_ceil(splits).max(TOKEN_TILE.min(t));
        pieces.extend((0..t).step_by(step).map(|t0| Piece { job, r0, nr, t0, nt: step.min(t - t0) }));
    }
    // The inputs apart from the outputs, which the pieces write through `Outputs`.
    let shapes: Vec<Shape> = jobs.iter().map(|j| (j.ty, j.rows, j.cols, j.xs, j.pick, j.n_rows())).collect();
    let outputs: Vec<Outputs> = jobs.iter_mut().map(|j| Outputs { ys: j.ys.as_mut_ptr(), len: j.ys.len() }).collect();
    let run = |p: &Piece| {
        let (ty, rows, cols, xs, pick, n) = shapes[p.job];
        let rb = rows.len() / n;
        let rows = &rows[p.r0 * rb..(p.r0 + p.nr) * rb];
        SCRATCH.with(|s| {
            let (tile, buf, gathered) = &mut *s.borrow_mut();
            tile.clear();
            tile.resize(p.nt * p.nr, 0.0);
            match job_act[p.job] {
                Some(_) => {
                    for t0 in (0..p.nt).step_by(TOKEN_TILE) {
                        let nt = TOKEN_TILE.min(p.nt - t0);
                        let acts = &job_acts[p.job][p.t0 + t0..p.t0 + t0 + nt];
                        dot::dot_rows_tokens(isa, ty, rows, acts, &mut tile[t0 * p.nr..(t0 + nt) * p.nr]);
                    }
                }
                None => {
                    buf.clear();
                    buf.resize(cols, 0.0);
                    for t0 in (0..p.nt).step_by(TOKEN_TILE) {
                        let nt = TOKEN_TILE.min(p.nt - t0);
                        let xs = match pick {
                            None => &xs[(p.t0 + t0) * cols..(p.t0 + t0 + nt) * cols],
                            Some(pick) => {
                                gathered.clear();
                                for &t in &pick[p.t0 + t0..p.t0 + t0 + nt] {
                                    gathered.extend_from_slice(&xs[t * cols..(t + 1) * cols]);
                                }
                                &gathered[..]
                            }
                        };
                        for (r, row) in rows.chunks_exact(rb).enumerate() {
                            dot_tokens_exact(isa, ty, row, xs, buf, &mut tile[t0 * p.nr + r..], p.nr);
                        }
                    }
                }
            }
            let out = &outputs[p.job];
            for (t, row) in tile.chunks_exact(p.nr).enumerate() {
                let at = (p.t0 + t) * n + p.r0;
                assert!(at + p.nr <= out.len);
                // SAFETY: in bounds (checked); no other piece writes these cells,
                // and nothing reads `ys` until the region ends.
                unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), out.ys.add(at), p.nr) };
            }
        });
    };
    if work < PAR_MIN_WEIGHTS || pieces.len() == 1 {
        pieces.iter().for_each(run);
    } else {
        pieces.par_iter().for_each(run);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::kernels::{matvec_batch_with, MatVec};

    fn values(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Every type, both kernel families, every level: the batch equals `T`
    /// matrix-vector products bit for bit (token counts around the tile and
    /// the groups of four, three and two).
    #[test]
    fn matmul_equals_matvec_token_by_token() {
        let mut seed = 0x9e37_79b9_7f4a_7c15;
        let cols = 512;
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16].into_iter().chain(crate::quant::QUANT_TYPES) {
            for n in [1, 37, 300] {
                let w = values(&mut seed, n * cols);
                let rb = ty.row_bytes(cols).unwrap();
                let mut rows = vec![0u8; n * rb];
                for (src, dst) in w.chunks(cols).zip(rows.chunks_mut(rb)) {
                    crate::quant::quantize_row(ty, src, dst).unwrap();
                }
                for t in [1, 6, 7, 33] {
                    let xs = values(&mut seed, t * cols);
                    for kernels in [Kernels::Exact, Kernels::Fast] {
                        for isa in Isa::available() {
                            let mut got = vec![0f32; t * n];
                            matmul_batch_with(kernels, isa, &mut [MatMul { ty, rows: &rows, cols, xs: &xs, pick: None, ys: &mut got }]);
                            for (x, g) in xs.chunks(cols).zip(got.chunks(n)) {
                                let mut want = vec![0f32; n];
                                matvec_batch_with(kernels, isa, &mut [MatVec { ty, rows: &rows, x, y: &mut want }]);
                                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                                assert_eq!(bits(g), bits(&want), "{ty} n {n} T {t} {kernels:?} {}", isa.name());
                            }
                        }
                    }
                }
            }
        }
    }

    /// A job picking tokens of a shared input (as a MoE's experts do, several
    /// jobs on one input) gives the bits of the same job on those tokens
    /// copied out, on both kernel families and every level.
    #[test]
    fn picked_tokens_equal_a_gathered_input() {
        let mut seed = 0x2545_f491_4f6c_dd1d;
        let cols = 512;
        for ty in [GgmlType::F16, GgmlType::Q4K, GgmlType::Q5_0, GgmlType::Q8_0] {
            let n = 40;
            let w = values(&mut seed, n * cols);
            let rb = ty.row_bytes(cols).unwrap();
            let mut rows = vec![0u8; n * rb];
            for (src, dst) in w.chunks(cols).zip(rows.chunks_mut(rb)) {
                crate::quant::quantize_row(ty, src, dst).unwrap();
            }
            let xs = values(&mut seed, 50 * cols);
            let picks: [Vec<usize>; 3] = [vec![3], (0..50).rev().step_by(3).collect(), (0..45).map(|i| (i * 7) % 50).collect()];
            for kernels in [Kernels::Exact, Kernels::Fast] {
                for isa in Isa::available() {
                    let mut got: Vec<Vec<f32>> = picks.iter().map(|p| vec![f32::NAN; p.len() * n]).collect();
                    let mut jobs: Vec<MatMul> = picks
                        .iter()
                        .zip(got.iter_mut())
                        .map(|(p, ys)| MatMul { ty, rows: &rows, cols, xs: &xs, pick: Some(p), ys })
                        .collect();
                    matmul_batch_with(kernels, isa, &mut jobs);
                    for (p, got) in picks.iter().zip(&got) {
                        let copied: Vec<f32> = p.iter().flat_map(|&t| &xs[t * cols..(t + 1) * cols]).copied().collect();
                        let mut want = vec![0f32; p.len() * n];
                        matmul_batch_with(kernels, isa, &mut [MatMul { ty, rows: &rows, cols, xs: &copied, pick: None, ys: &mut want }]);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(got), bits(&want), "{ty} {} picked {kernels:?} {}", p.len(), isa.name());
                    }
                }
            }
        }
    }
}
