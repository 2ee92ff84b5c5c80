//! Kernel twins: the matvec shaders of every weight type against the CPU's
//! `Tensor::matvec` (the dot product of the exactly dequantized weights with
//! f32 activations), under the validation layer, through the same upload
//! (device layout, split chunks, arena slots) and recorder the decode uses.
//!
//! Covered: all 13 types; rows of one block and of many (32-element types:
//! 32, 96, 640, 2560 columns; K-quants: 256, 768, 2560; float types also 37
//! columns, whose rows are not whole 16-byte items and whose activations
//! past the end are NaN in the scratch); file rows whose byte length is not
//! a multiple of 4 (Q4_0, Q5_0, Q8_0 rows of 96; Q2_K..Q6_K rows of 768;
//! F16/BF16 rows of 37); row counts that are not multiples of a
//! workgroup's rows; every reduction path (row sets of 1 invocation, fewer
//! than a subgroup, one subgroup, several subgroups, the recorder's choice);
//! other workgroup sizes, rows per set and items per pass; matrices split
//! into chunks; the epilogues (store, hyper-connection gates, residual
//! post, SwiGLU); the expert arena with several experts, slots, slabs and
//! per-layer types.
//!
//! The fast kernels (8-bit activations, integer dot products;
//! shaders/weights_int.glsl) run the same cases and are held to the same
//! bound plus the activation rounding's worst case, `sum_b (amax_b / 254)
//! sum_{i in b} |w_i|` over blocks of 32 (measured at most 0.45 of the sum
//! on lavapipe and the H200); one activation read from the wrong block
//! breaks it 37 times over. A NaN activation reaches every row on both.
//!
//! Bound: per output row, |gpu - cpu| <= 4e-6 * sum_i |w_i x_i| (f32
//! summation in another order, and per-block factoring of scales and minima
//! d * sum(q x) - m * sum(x), whose terms are at most a few times
//! sum |w x|); measured at most 0.37 of it on lavapipe (Q4_1 and Q5_1,
//! whose minima cancel most), 0.1 for most types. One wrong weight in a
//! 2560-wide row moves the result by about 1 / 2560 of that sum, 100 times
//! the bound.

use super::arena::{ArenaLayer, ExpertArena};
use super::buffer::{Buffer, Commands, Stream};
use super::device::{validation_errors, Context, DeviceChoice};
use super::layout::PartLayout;
use super::matrix::GpuMatrix;
use super::pipelines::{max_expert_tiles, mm_entries, HcCombinePush, MatvecPush, MatvecTuning, MmExperts, MoeGroupPush, Pipe, Pipelines, XQ_FLOATS};
use super::record::{DescriptorPool, Recorder, SplitRegion};
use crate::gguf::{GgmlType, TensorInfo};
use crate::tensor::Tensor;
use ash::vk;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

/// The float types, then every quantized type.
fn all_types() -> impl Iterator<Item = GgmlType> {
    [GgmlType::F32, GgmlType::F16, GgmlType::BF16].into_iter().chain(crate::quant::QUANT_TYPES)
}

const TOL: f32 = 4e-6;

fn context() -> Option<Arc<Context>> {
    context_with(&DeviceChoice::default())
}

fn context_with(choice: &DeviceChoice) -> Option<Arc<Context>> {
    std::env::set_var("FNX_VULKAN_VALIDATION", "1");
    match Context::new(choice) {
        Ok(c) => Some(Arc::new(c)),
        Err(e) if std::env::var("FNX_REQUIRE_VULKAN").as_deref() != Ok("1") => {
            println!("SKIPPED: no usable Vulkan device ({e})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// xorshift values in [-1, 1], with a row-dependent scale and an occasional
/// outlier so block scales differ.
fn values(n: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut s = 0x2545_f491_4f6c_dd1du64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s % 2001) as f32 / 1000.0 - 1.0
    };
    (0..n)
        .map(|i| {
            let v = next() * (1.0 + (i / cols % 5) as f32 * 0.5);
            if i % 97 == 13 { v * 6.0 } else { v }
        })
        .collect()
}

/// `rows x cols` values stored as `ty` by the reference quantizers.
fn tensor(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Tensor {
    let v = values(rows * cols, cols, seed);
    let rb = ty.row_bytes(cols).unwrap();
    let mut bytes = vec![0u8; rows * rb];
    for (src, dst) in v.chunks(cols).zip(bytes.chunks_mut(rb)) {
        crate::quant::quantize_row(ty, src, dst).unwrap();
    }
    let info = TensorInfo { name: format!("twin.{ty}.{rows}x{cols}"), ty, dims: vec![cols, rows], offset: 0, nbytes: bytes.len() };
    Tensor::new(Arc::new(bytes), &info)
}

/// The CPU's `W x` on the exact kernels (dequantized weights times f32
/// activations, as the exact shaders compute; the CPU's default fast kernels
/// round the activations to 8 bits) and, per row, the scale of the bound:
/// `sum_i |w_i x_i|`, plus, when `fast` (the GPU's fast kernels, quantized
/// types), the activation rounding's worst case over `TOL`:
/// `sum_b (amax_b / 254) sum_{i in b} |w_i|` over blocks `b` of 32 values
/// (shaders/weights_int.glsl), with a relative 1e-5 for the rounding of the
/// scale itself.
fn cpu(w: &Tensor, x: &[f32], fast: bool) -> (Vec<f32>, Vec<f32>) {
    use crate::quant::kernels::{with_kernels, Kernels};
    let mut y = vec![0f32; w.rows()];
    with_kernels(Kernels::Exact, || w.matvec(x, &mut y));
    let fast = fast && w.ty.block_size() > 1;
    let mut row = vec![0f32; w.cols()];
    let abs = (0..w.rows())
        .map(|r| {
            w.dequantize_row(r, &mut row);
            let exact: f32 = row.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
            let rounding: f32 = if fast {
                row.chunks(32)
                    .zip(x.chunks(32))
                    .map(|(wb, xb)| {
                        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                        amax / 254.0 * (1.0 + 1e-5) * wb.iter().map(|v| v.abs()).sum::<f32>()
                    })
                    .sum()
            } else {
                0.0
            };
            exact + rounding / TOL
        })
        .collect();
    (y, abs)
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The largest |got - want| / bound over rows; panics on a non-finite value.
fn worst(what: &str, got: &[f32], want: &[f32], bound: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).zip(bound).fold(0f32, |m, ((g, w), b)| {
        assert!(g.is_finite(), "{what}: non-finite output {g}");
        m.max((g - w).abs() / (b * TOL + 1e-30))
    })
}

/// One dispatch of a matvec twin: the forced TPR (or the recorder's choice) and the epilogue.
#[derive(Clone, Copy, Debug)]
struct Run {
    tpr: Option<u32>,
    mode: u32,
}

const X_OFF: usize = 4;

/// The GPU's outputs of `runs` on `w` (split into chunks of at most
/// `max_bytes`): one scratch region per run. Mode 3 adds into `streams`
/// copies of the output region filled with `init`, weighted by `aux`.
struct Twin<'a> {
    ctx: &'a Arc<Context>,
    pipes: &'a Pipelines,
    /// Dispatches of the last run.
    dispatches: std::cell::Cell<u32>,
    /// Split rows added by their last workgroups (arrival counters), not split_sums.
    counters: bool,
}

const STREAMS: usize = 2;
const AUX: [f32; STREAMS] = [0.5, -1.25];

impl Twin<'_> {
    fn run(&self, w: &Tensor, x: &[f32], runs: &[Run], max_bytes: usize) -> Vec<Vec<f32>> {
        let (ctx, pipes) = (self.ctx, self.pipes);
        let cmds = Commands::new(ctx).unwrap();
        let mut stream = Stream::new(ctx).unwrap();
        let m = GpuMatrix::upload_split(ctx, pipes, &mut stream, &[w], max_bytes).unwrap();
        stream.finish().unwrap();
        let (cols, rows) = (w.cols(), w.rows());
        // [pad | x | NaN pad | aux | per run: STREAMS * rows]
        let x_end = (X_OFF + cols).div_ceil(4) * 4 + 4;
        let aux = x_end;
        let out = aux + 4;
        let region = STREAMS * rows.div_ceil(4) * 4;
        // Split rows' sums (where the pipelines split, Pipelines::matvec_split)
        // after the runs' regions: room for a split of every 256 columns.
        let sums = out + runs.len() * region;
        let sums_len = if pipes.matvec_split > 0 { (2 * rows * cols.div_ceil(256)).div_ceil(4) * 4 } else { 0 };
        // Then the arrival counters, zero.
        let counts = (sums + sums_len, if self.counters { 64 } else { 0 });
        let mut scratch = vec![f32::NAN; counts.0 + counts.1];
        scratch[counts.0..].fill(0.0);
        scratch[X_OFF..X_OFF + cols].copy_from_slice(x);
        scratch[aux..aux + STREAMS].copy_from_slice(&AUX);
        for r in 0..runs.len() {
            for (i, v) in scratch[out + r * region..out + (r + 1) * region].iter_mut().enumerate() {
                *v = (i % 7) as f32 * 0.25 - 0.5;
            }
        }
        let buf = Buffer::new(ctx, "twin scratch", (scratch.len() * 4) as u64, MemoryLocation::GpuOnly).unwrap();
        let dummy = Buffer::new(ctx, "twin dummy", 16, MemoryLocation::GpuOnly).unwrap();
        let pool = DescriptorPool::new(ctx, 1, 3).unwrap();
        let set = pool.set(pipes.state_layout, &[&[buf.info()], &[dummy.info()], &[dummy.info()]]).unwrap();
        cmds.upload(&buf, 0, &bytes(&scratch)).unwrap();
        cmds.begin().unwrap();
        let mut rec = Recorder::new(ctx, pipes, cmds.cmd);
        if sums_len > 0 {
            rec.partials = Some(SplitRegion { off: sums as u32, len: sums_len as u32, per_entry: sums_len as u32 });
        }
        if self.counters {
            rec.counts = Some((counts.0 as u32, counts.1 as u32));
        }
        for (i, run) in runs.iter().enumerate() {
            rec.force_tpr = run.tpr;
            let y_off = (out + i * region) as u32;
            let push = match run.mode {
                0 | 4 => MatvecPush { x_off: X_OFF as u32, y_off, mode: run.mode, ..Default::default() },
                1 => MatvecPush { x_off: X_OFF as u32, y_off, mode: 1, scale: 0.5, split_row: rows as u32 / 3, ..Default::default() },
                _ => MatvecPush {
                    x_off: X_OFF as u32,
                    y_off,
                    mode: 3,
                    aux_off: aux as u32,
                    aux_n: STREAMS as u32,
                    ..Default::default()
                },
            };
            rec.matvec(&m, set, push);
        }
        rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
        self.dispatches.set(rec.stats.dispatches);
        cmds.submit().unwrap();
        let all = f32s(&cmds.download(&buf, 0, scratch.len() * 4).unwrap());
        // Every counter is back to zero for the next dispatch.
        assert!(all[counts.0..].iter().all(|c| c.to_bits() == 0), "{}: arrival counters left set", w.name);
        (0..runs.len()).map(|i| all[out + i * region..out + (i + 1) * region].to_vec()).collect()
    }

    /// Compares every run with the CPU; returns the worst error / bound.
    fn check(&self, w: &Tensor, runs: &[Run], max_bytes: usize) -> f32 {
        let (rows, cols) = (w.rows(), w.cols());
        let x = values(cols, cols, 99 + cols as u64);
        let (want, abs) = cpu(w, &x, self.pipes.fast);
        let got = self.run(w, &x, runs, max_bytes);
        let mut e = 0f32;
        for (run, g) in runs.iter().zip(got) {
            let what = format!("{} {run:?}", w.name);
            let init = |i: usize| (i % 7) as f32 * 0.25 - 0.5;
            match run.mode {
                0 => e = e.max(worst(&what, &g[..rows], &want, &abs)),
                1 => {
                    let split = rows / 3;
                    let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
                    let f: Vec<f32> = want
                        .iter()
                        .enumerate()
                        .map(|(r, &v)| if r < split { 0.5 * v * sig(0.5 * v) } else { 2.0 * sig(0.5 * v) })
                        .collect();
                    // Both gates have slope at most 1.1 * 0.5 in v.
                    let b: Vec<f32> = abs.iter().zip(&f).map(|(a, f)| 0.55 * a + 1e-6 * f.abs() / TOL).collect();
                    e = e.max(worst(&what, &g[..rows], &f, &b));
                }
                3 => {
                    for c in 0..STREAMS {
                        let f: Vec<f32> = want.iter().enumerate().map(|(r, v)| init(c * rows + r) + AUX[c] * v).collect();
                        let b: Vec<f32> = abs.iter().map(|a| AUX[c].abs() * a + 1e-6 / TOL).collect();
                        e = e.max(worst(&what, &g[c * rows..(c + 1) * rows], &f, &b));
                    }
                }
                _ => {
                    // SwiGLU: rows [0, n) are gates, [n, 2n) ups.
                    let n = rows / 2;
                    let (f, b) = swiglu_ref(&want, &abs, n);
                    e = e.max(worst(&what, &g[..n], &f, &b));
                }
            }
        }
        e
    }
}

/// silu(g) * u of gate rows `[0, n)` and up rows `[n, 2n)`, and the bound
/// propagated from the rows' bounds (|silu'| <= 1.1, |silu(g)| <= |g|).
fn swiglu_ref(y: &[f32], abs: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    let silu = |v: f32| v / (1.0 + (-v).exp());
    (0..n)
        .map(|r| {
            let (g, u) = (y[r], y[n + r]);
            let f = silu(g) * u;
            (f, 1.1 * abs[r] * u.abs() + g.abs() * abs[n + r] + 1e-6 * f.abs() / TOL)
        })
        .unzip()
}

fn shapes(ty: GgmlType) -> &'static [usize] {
    match ty.block_size() {
        1 => &[37, 96, 640, 2560],
        32 => &[32, 96, 640, 2560],
        _ => &[256, 768, 2560],
    }
}

#[test]
fn matvec_matches_cpu_for_every_type() {
    let Some(ctx) = context() else { return };
    every_type(&ctx, false);
}

/// The fast kernels (8-bit activations, integer dot products) of every
/// quantized type, on the same shapes, reduction paths and epilogues as
/// the exact ones: within the activation rounding's bound of the exact CPU
/// product (the float types run their exact kernels in the same pipelines).
#[test]
fn fast_matvec_within_the_rounding_bound_for_every_type() {
    let Some(ctx) = context() else { return };
    if !ctx.int_dot.supported {
        println!("SKIPPED: {} has no integer dot products", ctx.name);
        return;
    }
    every_type(&ctx, true);
}

fn every_type(ctx: &Arc<Context>, fast: bool) {
    let pipes = Pipelines::tuned(ctx, fast, |name| MatvecTuning::for_pipeline(name, false)).unwrap();
    let twin = Twin { ctx, pipes: &pipes, dispatches: Default::default(), counters: false };
    let sg = ctx.subgroup_size;
    let mut report = Vec::new();
    for ty in all_types() {
        let mut e = 0f32;
        for &cols in shapes(ty) {
            for rows in [1, 37, 70] {
                let w = tensor(ty, rows, cols, (rows * 31 + cols) as u64);
                let mut runs = vec![Run { tpr: None, mode: 0 }];
                if rows == 37 {
                    // Every reduction path: 1, below, at and above the subgroup size, the whole workgroup.
                    for t in [1, 4, sg, 2 * sg, 128] {
                        runs.push(Run { tpr: Some(t), mode: 0 });
                    }
                    runs.extend([Run { tpr: None, mode: 1 }, Run { tpr: None, mode: 3 }]);
                }
                if rows == 70 {
                    runs.push(Run { tpr: Some(2 * sg), mode: 4 });
                    runs.push(Run { tpr: None, mode: 4 });
                }
                e = e.max(twin.check(&w, &runs, usize::MAX));
            }
        }
        report.push(format!("{ty} {e:.3}"));
        assert!(e <= 1.0, "{ty}: GPU vs CPU error {e} x the bound (fast kernels: {fast})");
    }
    let kind = if fast { "fast" } else { "exact" };
    println!("matvec twin ({kind} kernels), worst error / bound per type: {}", report.join(", "));
    drop(pipes);
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}

/// Rows split into ranges of columns (`Pipelines::matvec_split`: each
/// workgroup sums its range; the last workgroup of each row group adds the
/// ranges and applies the epilogue, or shaders/split_sums.comp does in a
/// dispatch of its own) on every quantized type, both kernel families,
/// every epilogue and a forced row set below and above the subgroup: within
/// the bound of the CPU's product, the two ways bit for bit the same, the
/// counters back to zero after each dispatch.
#[test]
fn split_rows_within_the_bound_for_every_type() {
    let Some(ctx) = context() else { return };
    for fast in [false, true] {
        if fast && !ctx.int_dot.supported {
            continue;
        }
        // Every matrix below the fill splits (here: all), into ranges of 256 columns.
        let mut pipes = Pipelines::tuned(&ctx, fast, |name| MatvecTuning { fill: 1 << 20, ..MatvecTuning::for_pipeline(name, false) }).unwrap();
        pipes.matvec_split = 256;
        let last = Twin { ctx: &ctx, pipes: &pipes, dispatches: Default::default(), counters: true };
        let reduced = Twin { ctx: &ctx, pipes: &pipes, dispatches: Default::default(), counters: false };
        for ty in all_types().filter(|t| t.block_size() > 1) {
            let (rows, cols) = (70, 2560);
            let w = tensor(ty, rows, cols, 17);
            let sg = ctx.subgroup_size;
            let runs = [0, 1, 3, 4].map(|mode| Run { tpr: None, mode }).into_iter().chain([4, 2 * sg].map(|t| Run { tpr: Some(t), mode: 0 }));
            let runs: Vec<Run> = runs.collect();
            let e = last.check(&w, &runs, usize::MAX);
            assert_eq!(last.dispatches.get() as usize, runs.len(), "{ty}: each matvec split, its splits added by its last workgroups");
            assert!(e <= 1.0, "{ty} (fast {fast}): split rows err {e} x the bound");
            let x = values(cols, cols, 99 + cols as u64);
            let (a, b) = (last.run(&w, &x, &runs, usize::MAX), reduced.run(&w, &x, &runs, usize::MAX));
            assert_eq!(reduced.dispatches.get() as usize, 2 * runs.len(), "{ty}: each matvec split, and its sums added by split_sums");
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                same_bits(a, b, &format!("{ty} (fast {fast}) {:?}: splits added by the last workgroups and by split_sums", runs[i]));
            }
        }
    }
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}

#[test]
fn matvec_other_tunings_and_split_matrices() {
    let Some(ctx) = context() else { return };
    for tuning in [
        MatvecTuning { wg: 64, rows: 1, unroll: 1, tpr: None, min_items: 2, fill: 0, tile: 1, share: 1 },
        MatvecTuning { wg: 256, rows: 3, unroll: 3, tpr: None, min_items: 8, fill: 4096, tile: 3, share: 1 },
    ] {
        let pipes = Pipelines::tuned(&ctx, false, |_| tuning).unwrap();
        let twin = Twin { ctx: &ctx, pipes: &pipes, dispatches: Default::default(), counters: false };
        for ty in all_types() {
            let cols = shapes(ty)[1];
            let w = tensor(ty, 101, cols, 5);
            let runs = [Run { tpr: None, mode: 0 }, Run { tpr: Some(ctx.subgroup_size * 2), mode: 3 }];
            // Whole, and split into chunks of about 30 rows.
            let chunk = PartLayout::new(ty, 30, cols).unwrap().bytes;
            for max_bytes in [usize::MAX, chunk] {
                let e = twin.check(&w, &runs, max_bytes);
                assert!(e <= 1.0, "{ty} {tuning:?} chunks of {max_bytes} bytes: error {e} x the bound");
            }
        }
    }
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}


/// The arena's two dispatches (gate/up SwiGLU, then down) for `ids` of one
/// layer, against the CPU, for the given per-layer types.
fn arena_case(ctx: &Arc<Context>, pipes: &Pipelines, types: &[(GgmlType, GgmlType)], h: usize, f: usize) -> f32 {
    let per_layer = 5;
    let experts: Vec<Vec<(Tensor, Tensor)>> = types
        .iter()
        .enumerate()
        .map(|(l, &(gt, dt))| {
            (0..per_layer).map(|x| (tensor(gt, 2 * f, h, (l * 10 + x) as u64), tensor(dt, h, f, (l * 10 + x + 500) as u64))).collect()
        })
        .collect();
    let layers: Vec<_> = types.iter().map(|&(g, d)| ArenaLayer::new(g, d, h, f).unwrap()).collect();
    // Slabs of three slots: several slabs, a layer's experts in two.
    let slot = layers.iter().map(|a| a.gate.bytes + a.down.bytes).max().unwrap();
    let cmds = Commands::new(ctx).unwrap();
    let arena = ExpertArena::alloc(ctx, pipes, layers.clone(), per_layer, false, 3 * slot).unwrap();
    let mut stream = Stream::new(ctx).unwrap();
    let table = arena.fill_all(&mut stream, |l, x| (vec![experts[l][x].0.bytes()], experts[l][x].1.bytes())).unwrap();
    stream.finish().unwrap();
    assert!(arena.slots_per_slab == 3);
    let params = Buffer::new(ctx, "twin params", (table.len() * 4) as u64, MemoryLocation::GpuOnly).unwrap();
    cmds.upload(&params, 0, &table.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let ids = [3u32, 0, 4];
    let k = ids.len();
    let fs = f.div_ceil(4) * 4;
    // [ids | x | h: k * fs | y: k * h]
    let (x_off, h_off) = (4, 4 + h);
    let y_off = h_off + k * fs;
    let x = values(h, h, 7);
    let mut e = 0f32;
    for (l, layer) in layers.iter().enumerate() {
        let mut scratch = vec![f32::NAN; y_off + k * h];
        for (i, id) in ids.iter().enumerate() {
            scratch[i] = f32::from_bits(*id);
        }
        scratch[x_off..x_off + h].copy_from_slice(&x);
        let buf = Buffer::new(ctx, "twin scratch", (scratch.len() * 4) as u64, MemoryLocation::GpuOnly).unwrap();
        let dummy = Buffer::new(ctx, "twin dummy", 16, MemoryLocation::GpuOnly).unwrap();
        let pool = DescriptorPool::new(ctx, 1, 3).unwrap();
        let set = pool.set(pipes.state_layout, &[&[buf.info()], &[dummy.info()], &[params.info()]]).unwrap();
        cmds.upload(&buf, 0, &bytes(&scratch)).unwrap();
        cmds.begin().unwrap();
        let mut rec = Recorder::new(ctx, pipes, cmds.cmd);
        let base = MatvecPush {
            expert_off: 0,
            slot_table: (l * per_layer) as u32,
            slots_per_slab: arena.slots_per_slab as u32,
            slot_bytes: arena.slot_bytes as u32,
            scale: 1.0,
            ..Default::default()
        };
        let gate_up = MatvecPush { rows: f as u32, x_off: x_off as u32, y_off: h_off as u32, y_stride: fs as u32, mode: 4, ..base };
        rec.expert_matvec(layer.gate_ty, [set, arena.set], gate_up, &layer.gate, k);
        let down = MatvecPush {
            rows: h as u32,
            x_off: h_off as u32,
            x_stride: fs as u32,
            y_off: y_off as u32,
            y_stride: h as u32,
            part_off: layer.gate.bytes as u32,
            ..base
        };
        rec.expert_matvec(layer.down_ty, [set, arena.set], down, &layer.down, k);
        rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
        cmds.submit().unwrap();
        let got = f32s(&cmds.download(&buf, 0, scratch.len() * 4).unwrap());
        for (i, &id) in ids.iter().enumerate() {
            let (gate_up, down) = &experts[l][id as usize];
            let what = format!("layer {l} expert {id} ({} / {})", gate_up.ty, down.ty);
            let (y, abs) = cpu(gate_up, &x, pipes.fast);
            let (want_h, bound_h) = swiglu_ref(&y, &abs, f);
            let got_h = &got[h_off + i * fs..h_off + i * fs + f];
            e = e.max(worst(&format!("{what} gate/up"), got_h, &want_h, &bound_h));
            // The down projection of the GPU's hidden activations.
            let (want_y, bound_y) = cpu(down, got_h, pipes.fast);
            e = e.max(worst(&format!("{what} down"), &got[y_off + i * h..y_off + (i + 1) * h], &want_y, &bound_y));
        }
    }
    e
}

#[test]
fn expert_arena_matvecs_match_cpu() {
    let Some(ctx) = context() else { return };
    arena_types(&ctx, false);
}

#[test]
fn fast_expert_arena_matvecs_within_the_rounding_bound() {
    let Some(ctx) = context() else { return };
    if !ctx.int_dot.supported {
        println!("SKIPPED: {} has no integer dot products", ctx.name);
        return;
    }
    arena_types(&ctx, true);
}

fn arena_types(ctx: &Arc<Context>, fast: bool) {
    let ctx = ctx.clone();
    let pipes = Pipelines::tuned(&ctx, fast, |name| MatvecTuning::for_pipeline(name, false)).unwrap();
    let mut report = Vec::new();
    for ty in all_types() {
        let f = if ty.block_size() == 256 { 256 } else { 96 };
        let e = arena_case(&ctx, &pipes, &[(ty, ty)], 512, f);
        report.push(format!("{ty} {e:.3}"));
        assert!(e <= 1.0, "{ty}: arena GPU vs CPU error {e} x the bound");
    }
    // Layers of different types (slots sized by the largest), down rows of 96.
    let mixed = [(GgmlType::Q4K, GgmlType::Q5_0), (GgmlType::Q2K, GgmlType::Q8_0), (GgmlType::Q6K, GgmlType::Q4_1)];
    let e = arena_case(&ctx, &pipes, &mixed, 768, 96);
    report.push(format!("mixed {e:.3}"));
    assert!(e <= 1.0, "mixed layer types: arena GPU vs CPU error {e} x the bound");
    println!("expert arena twin, worst error / bound: {}", report.join(", "));
    drop(pipes);
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}

/// A NaN among the activations makes every output NaN on both kernel
/// families (the fast kernels give its block the scale NaN), so the
/// samplers' refusal of NaN logits sees it.
#[test]
fn a_nan_activation_reaches_every_row() {
    let Some(ctx) = context() else { return };
    for fast in [false, true] {
        if fast && !ctx.int_dot.supported {
            continue;
        }
        let pipes = Pipelines::tuned(&ctx, fast, |name| MatvecTuning::for_pipeline(name, false)).unwrap();
        let twin = Twin { ctx: &ctx, pipes: &pipes, dispatches: Default::default(), counters: false };
        for ty in crate::quant::QUANT_TYPES {
            let cols = shapes(ty)[1];
            let w = tensor(ty, 37, cols, 3);
            let mut x = values(cols, cols, 5);
            x[cols / 2 + 1] = f32::NAN;
            let got = twin.run(&w, &x, &[Run { tpr: None, mode: 0 }], usize::MAX);
            assert!(got[0][..37].iter().all(|v| v.is_nan()), "{ty} (fast kernels: {fast}): {:?}", &got[0][..37]);
        }
    }
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}

/// `per_layer` experts of `ty` (gate/up `2f x h`, down `h x f`) in an arena
/// of one layer, two slabs, every expert resident; their tensors, the
/// layer, the arena and its slot table (a params buffer).
fn one_layer_arena(ctx: &Arc<Context>, pipes: &Pipelines, ty: GgmlType, h: usize, f: usize, per_layer: usize) -> (Vec<(Tensor, Tensor)>, ArenaLayer, ExpertArena, Buffer) {
    let experts: Vec<(Tensor, Tensor)> = (0..per_layer).map(|x| (tensor(ty, 2 * f, h, x as u64), tensor(ty, h, f, x as u64 + 50))).collect();
    let layer = ArenaLayer::new(ty, ty, h, f).unwrap();
    let slot = layer.gate.bytes + layer.down.bytes;
    let arena = ExpertArena::alloc(ctx, pipes, vec![layer], per_layer, false, 2 * slot).unwrap();
    let mut stream = Stream::new(ctx).unwrap();
    let table = arena.fill_all(&mut stream, |_, x| (vec![experts[x].0.bytes()], experts[x].1.bytes())).unwrap();
    stream.finish().unwrap();
    let slots = Buffer::new(ctx, "twin params", (table.len() * 4) as u64, MemoryLocation::GpuOnly).unwrap();
    Commands::new(ctx).unwrap().upload(&slots, 0, &table.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    (experts, layer, arena, slots)
}

/// A scratch of one block of `tok` floats per token for a plain matrix of
/// `cols` columns: its input (seeded by `seed` + the token) at 0, its
/// residual epilogue's stream weights `0.5 + t, -1 - t` at `aux`, and the
/// streams it adds into, `residual`, filled with a pattern.
fn plain_scratch(tokens: usize, tok: usize, cols: usize, aux: usize, residual: std::ops::Range<usize>, seed: u64) -> Vec<f32> {
    let mut scratch = vec![0f32; tokens * tok];
    for (t, b) in scratch.chunks_mut(tok).enumerate() {
        b[..cols].copy_from_slice(&values(cols, cols, seed + t as u64));
        b[aux..aux + STREAMS].copy_from_slice(&[0.5 + t as f32, -1.0 - t as f32]);
        for (i, v) in b[residual.clone()].iter_mut().enumerate() {
            *v = (i % 7) as f32 * 0.25 - 0.5;
        }
    }
    scratch
}

/// A scratch of one block of `tok` floats per token: its chosen experts'
/// ids at 0 and its input, `h` values seeded by `seed` + the token, at `x_off`.
fn expert_scratch(ids: &[[u32; 3]], tok: usize, x_off: usize, h: usize, seed: u64) -> Vec<f32> {
    let mut scratch = vec![0f32; ids.len() * tok];
    for (t, (b, chosen)) in scratch.chunks_mut(tok).zip(ids).enumerate() {
        for (i, id) in chosen.iter().enumerate() {
            b[i] = f32::from_bits(*id);
        }
        b[x_off..x_off + h].copy_from_slice(&values(h, h, seed + t as u64));
    }
    scratch
}

/// Runs `record` into a fresh command buffer over `scratch` (params
/// `params`) and returns the scratch afterwards.
fn run_scratch(ctx: &Arc<Context>, pipes: &Pipelines, scratch: &[f32], params: &Buffer, record: impl FnOnce(&mut Recorder, vk::DescriptorSet)) -> Vec<f32> {
    let cmds = Commands::new(ctx).unwrap();
    let buf = Buffer::new(ctx, "twin scratch", (scratch.len() * 4) as u64, MemoryLocation::GpuOnly).unwrap();
    let dummy = Buffer::new(ctx, "twin dummy", 16, MemoryLocation::GpuOnly).unwrap();
    let pool = DescriptorPool::new(ctx, 1, 3).unwrap();
    let set = pool.set(pipes.state_layout, &[&[buf.info()], &[dummy.info()], &[params.info()]]).unwrap();
    cmds.upload(&buf, 0, &bytes(scratch)).unwrap();
    cmds.begin().unwrap();
    let mut rec = Recorder::new(ctx, pipes, cmds.cmd);
    record(&mut rec, set);
    rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
    cmds.submit().unwrap();
    f32s(&cmds.download(&buf, 0, scratch.len() * 4).unwrap())
}

/// The bits of every token block of `scratch` (`tok` floats each) before
/// float `xq`, where the region of activations rounded once starts.
fn before_rounded(scratch: &[f32], tok: usize, xq: usize) -> Vec<u32> {
    scratch.chunks(tok).flat_map(|b| b[..xq].iter().map(|v| v.to_bits())).collect()
}

/// One token's hyper-connection up projection with the combine as its
/// epilogue (mode 5: rows walked stream-interleaved, `Pipelines::hc_fuse`)
/// writes what the up projection (mode 0) and then hc_combine write, bit for
/// bit (a pass runs the two, a token the one: tests/prefill.rs holds them
/// equal): every type, both kernel families, row sets of two invocations to
/// twice the subgroup, hiddens that leave a workgroup's last rows past the end.
#[test]
fn hc_up_with_its_combine_equals_up_then_combine() {
    let Some(ctx) = context() else { return };
    let sg = ctx.subgroup_size;
    let params = Buffer::new(&ctx, "twin params", 16, MemoryLocation::GpuOnly).unwrap();
    let mut fused_runs = 0;
    for fast in [false, true] {
        if fast && !ctx.int_dot.supported {
            continue;
        }
        let pipes = Pipelines::tuned(&ctx, fast, |name| MatvecTuning::for_pipeline(name, false)).unwrap();
        for ty in all_types() {
            // 320: the real model's rank.
            let cols = if ty.block_size() == 256 { 256 } else { 320 };
            for (c, h) in [(4, 96), (4, 100), (2, 70)] {
                let w = tensor(ty, c * h, cols, (c * h + cols) as u64);
                let mut stream = Stream::new(&ctx).unwrap();
                let m = GpuMatrix::upload_split(&ctx, &pipes, &mut stream, &[&w], usize::MAX).unwrap();
                stream.finish().unwrap();
                // [x | xn: C x H | mix: C x H | y, up then combine | y, fused]
                let xn = cols.div_ceil(4) * 4;
                let (mix, y0) = (xn + c * h, xn + 2 * c * h);
                let y5 = y0 + h;
                let mut scratch = vec![f32::NAN; y5 + h];
                scratch[..cols].copy_from_slice(&values(cols, cols, 5));
                scratch[xn..xn + c * h].copy_from_slice(&values(c * h, h, 6));
                for tpr in [None, Some(2), Some(4), Some(sg), Some(2 * sg)] {
                    let mut fused = false;
                    let out = run_scratch(&ctx, &pipes, &scratch, &params, |rec, set| {
                        rec.force_tpr = tpr;
                        fused = rec.fuses_combine(&m, c);
                        rec.matvec(&m, set, MatvecPush { x_off: 0, y_off: mix as u32, ..Default::default() });
                        let (n, streams) = (h as u32, c as u32);
                        let combine = HcCombinePush { mix_off: mix as u32, xn_off: xn as u32, y_off: y0 as u32, n, streams, tok_stride: 0 };
                        rec.dispatch(Pipe::HcCombine, &[set], &combine, rec.threads_n(Pipe::HcCombine, h, 1));
                        if fused {
                            let up = MatvecPush { x_off: 0, y_off: y5 as u32, mode: 5, aux_off: xn as u32, aux_n: streams, ..Default::default() };
                            rec.matvec(&m, set, up);
                        }
                    });
                    let what = format!("{ty} fast {fast} C={c} H={h} tpr {tpr:?}");
                    assert!(out[y0..y5].iter().all(|v| v.is_finite()), "{what}: up then combine wrote every value");
                    if fused {
                        same_bits(&out[y5..y5 + h], &out[y0..y5], &format!("{what}: fused"));
                        fused_runs += 1;
                    }
                }
            }
        }
    }
    // Most cases fuse (those that do not: row sets too wide for whole groups of C rows).
    assert!(fused_runs >= 40, "{fused_runs} fused runs");
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}

/// Panics unless `a` and `b` are equal bit for bit, naming how many values
/// differ and the first few (index, both values) rather than printing both.
#[track_caller]
fn same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let differ: Vec<usize> = (0..a.len()).filter(|&i| a[i].to_bits() != b[i].to_bits()).collect();
    let first: Vec<String> = differ.iter().take(8).map(|&i| format!("[{i}] {:e} vs {:e}", a[i], b[i])).collect();
    assert!(differ.is_empty(), "{what}: {} of {} values differ, first {}", differ.len(), a.len(), first.join(", "));
}

/// A batch (a prompt's micro-batch: a workgroup takes a tile of tokens in
/// turn, each token's activations a block apart; the routed experts as
/// (token, expert) pairs)
/// computes every token's rows bit for bit as that token alone, on both
/// kernel families: the residual epilogue with each token's injection
/// weights, SwiGLU, and experts chosen differently per token.
#[test]
fn batched_matvecs_equal_single_tokens() {
    let Some(ctx) = context() else { return };
    // Plain matrices: more tokens than a workgroup's tile, the last tile part full.
    const T: usize = 11;
    // Experts: (token, expert) pairs.
    const TE: usize = 6;
    // Fast kernels: the batch modules, entries sharing weight decodes (share)
    // in groups of the tile (8 of 8, 4 of 4, 3 of 8: groups across a tile's end).
    // Split rows (the last three: rows of 1536 columns in splits of 256, the
    // splits added by each row group's last workgroup, or by split_sums.comp,
    // for the batch and each token).
    let cases = [(false, 8, 1, false), (true, 8, 8, false), (false, 3, 1, false), (true, 4, 8, false), (true, 8, 3, false)];
    let split_cases = [(false, 3, 1, true), (true, 8, 3, true)];
    for (fast, tile, share, split, counters) in cases.map(|(f, t, s, p)| (f, t, s, p, false)).into_iter().chain(split_cases.map(|(f, t, s, p)| (f, t, s, p, true))).chain([(true, 8, 3, true, false)]) {
        if fast && !ctx.int_dot.supported {
            continue;
        }
        let mut pipes = Pipelines::tuned(&ctx, fast, |name| MatvecTuning { tile, share, ..MatvecTuning::for_pipeline(name, false) }).unwrap();
        pipes.matvec_split = if split { 256 } else { 0 };
        let params = Buffer::new(&ctx, "twin params", 16, MemoryLocation::GpuOnly).unwrap();
        for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
            let (rows, cols) = (300, if split { 1536 } else { 512 });
            let w = tensor(ty, rows, cols, 11);
            let cmds = Commands::new(&ctx).unwrap();
            let mut stream = Stream::new(&ctx).unwrap();
            let m = GpuMatrix::upload_split(&ctx, &pipes, &mut stream, &[&w], usize::MAX).unwrap();
            stream.finish().unwrap();
            drop(cmds);
            // Token block: [x | aux | y (mode 3: STREAMS * rows) | y (mode 0)].
            let (aux, y3) = (cols, cols + 4);
            let y0 = y3 + STREAMS * rows;
            // Then the region of the activations rounded once (fast kernels).
            let xq = (y0 + rows).div_ceil(4) * 4;
            let tok = (xq + XQ_FLOATS).div_ceil(64) * 64;
            let mut scratch = plain_scratch(T, tok, cols, aux, y3..y0, 40);
            // The split sums after the token blocks (six splits of each
            // token's rows), then the arrival counters, zero.
            let sums = (scratch.len() as u32, (6 * T * rows) as u32);
            scratch.resize(scratch.len() + sums.1 as usize, f32::NAN);
            let region = split.then_some(SplitRegion { off: sums.0, len: sums.1, per_entry: sums.1 });
            let counts = (counters && split).then_some((scratch.len() as u32, 1024u32));
            scratch.resize(scratch.len() + 1024, 0.0);
            let push = |t: usize, mode: u32, y: usize| {
                let b = (t * tok) as u32;
                let aux_n = if mode == 3 { STREAMS as u32 } else { 0 };
                MatvecPush { x_off: b, y_off: b + y as u32, mode, aux_off: b + aux as u32, aux_n, x_stride: tok as u32, y_stride: tok as u32, ..Default::default() }
            };
            let batched = run_scratch(&ctx, &pipes, &scratch, &params, |rec, set| {
                (rec.xq, rec.partials, rec.counts) = (Some((xq as u32, tok as u32)), region, counts);
                rec.matvec_n(&m, set, push(0, 3, y3), T);
                rec.matvec_n(&m, set, push(0, 0, y0), T);
                // Each matrix: its rounding (fast kernels), itself, its splits' sums (without counters).
                let quant = ty != GgmlType::F32;
                let sums = split && quant && !counters;
                assert_eq!(rec.stats.dispatches as usize, 2 * (1 + usize::from(fast && quant) + usize::from(sums)), "{ty}: the dispatches");
            });
            let mut single = run_scratch(&ctx, &pipes, &scratch, &params, |rec, set| {
                (rec.partials, rec.counts) = (region, counts);
                for t in 0..T {
                    rec.matvec(&m, set, push(t, 3, y3));
                    rec.matvec(&m, set, push(t, 0, y0));
                }
            });
            // The fast kernels of a batch read activations rounded once (and
            // only they): the region is written exactly when they ran.
            let rounded = (0..T).all(|t| batched[t * tok + xq..t * tok + xq + XQ_FLOATS].iter().any(|v| v.to_bits() != 0));
            assert_eq!(rounded, fast && ty != GgmlType::F32, "{ty} (fast {fast}): activations rounded once per token");
            // Token by token with each token's input rounded once first
            // (`FNX_VK_ROUND_ONCE_COLS`): the same bits as rounded by each
            // workgroup, the region written by the fast kernels only.
            pipes.round_once_cols = 32;
            let once = run_scratch(&ctx, &pipes, &scratch, &params, |rec, set| {
                (rec.xq, rec.partials, rec.counts) = (Some((xq as u32, tok as u32)), region, counts);
                for t in 0..T {
                    rec.matvec(&m, set, push(t, 3, y3));
                    rec.matvec(&m, set, push(t, 0, y0));
                }
            });
            pipes.round_once_cols = 0;
            // (A token alone uses the region of the block its pass starts with.)
            let rounded_once = once[xq..xq + XQ_FLOATS].iter().any(|v| v.to_bits() != 0);
            assert_eq!(rounded_once, fast && ty != GgmlType::F32, "{ty} (fast {fast}): one token's activations rounded once");
            let blocks = T * tok;
            assert_eq!(before_rounded(&once[..blocks], tok, xq), before_rounded(&single[..blocks], tok, xq), "{ty} (fast {fast}): tokens rounded once, one by one");
            for t in 0..T {
                single[t * tok + xq..t * tok + xq + XQ_FLOATS].copy_from_slice(&batched[t * tok + xq..t * tok + xq + XQ_FLOATS]);
            }
            // (The split sums' region holds each run's own partial sums.)
            same_bits(&batched[..blocks], &single[..blocks], &format!("{ty} (fast {fast}, tile {tile}, share {share}, split {split}, counters {counters}): a batch of {T} tokens"));
            // The counters are back to zero after every dispatch.
            assert!([&batched, &single, &once].iter().all(|b| b[b.len() - 1024..].iter().all(|c| c.to_bits() == 0)), "{ty}: arrival counters left set");
            let (want, abs) = cpu(&w, &single[..cols], fast);
            assert!(worst(&format!("{ty} token 0"), &single[y0..y0 + rows], &want, &abs) <= 1.0);
        }
        // Experts: per token its own ids, pairs (token, expert) in one dispatch.
        let (h, f, per_layer) = (512, 96, 5);
        let ty = GgmlType::Q8_0;
        let (experts, layer, arena, slots) = one_layer_arena(&ctx, &pipes, ty, h, f, per_layer);
        // Three distinct experts per token, each expert chosen by several tokens.
        let ids: Vec<[u32; 3]> = (0..TE as u32).map(|t| [0, 3, 6].map(|j| (2 * t + j) % per_layer as u32)).collect();
        let (k, fs) = (3usize, f.div_ceil(4) * 4);
        // Token block: [ids | x | hidden: k * fs | y: k * h | order: k].
        let (x_off, h_off) = (4, 4 + h);
        let y_off = h_off + k * fs;
        let order_off = y_off + k * h;
        let xq = (order_off + k).div_ceil(4) * 4;
        let tok = (xq + XQ_FLOATS).div_ceil(64) * 64;
        let mut scratch = expert_scratch(&ids, tok, x_off, h, 60);
        // moe_group's tile table after the token blocks (tiles of up to 4 pairs).
        let (tiles_off, tile) = (scratch.len(), 4usize);
        scratch.resize(tiles_off + (1 + 2 * max_expert_tiles(TE * k, per_layer, tile)).div_ceil(tok) * tok, 0.0);
        let base = MatvecPush { slot_table: 0, slots_per_slab: arena.slots_per_slab as u32, slot_bytes: arena.slot_bytes as u32, scale: 1.0, ..Default::default() };
        // Token by token (kdiv 0), a batch of pairs in order, or grouped by expert first.
        let record = |rec: &mut Recorder, set: vk::DescriptorSet, t: usize, n: usize, kdiv: u32, grouped: bool| {
            rec.xq = Some((xq as u32, tok as u32));
            let b = (t * tok) as u32;
            let order = if grouped { b + order_off as u32 } else { 0 };
            if grouped {
                let (ids_off, tok_stride, k, n, n_ids) = (b, tok as u32, kdiv, n as u32, per_layer as u32);
                let group = MoeGroupPush { ids_off, order_off: order, tok_stride, k, n, n_ids, tiles_off: tiles_off as u32, tile: tile as u32 };
                rec.dispatch(Pipe::MoeGroup, &[set], &group, [1, 1, 1]);
            }
            let base = MatvecPush { expert_off: b, kdiv, tok_stride: tok as u32, order_off: order, ..base };
            let gate_up = MatvecPush { rows: f as u32, x_off: b + x_off as u32, y_off: b + h_off as u32, y_stride: fs as u32, mode: 4, ..base };
            rec.expert_matvec(layer.gate_ty, [set, arena.set], gate_up, &layer.gate, n * k);
            let down = MatvecPush {
                rows: h as u32,
                x_off: b + h_off as u32,
                x_stride: fs as u32,
                y_off: b + y_off as u32,
                y_stride: h as u32,
                part_off: layer.gate.bytes as u32,
                ..base
            };
            rec.expert_matvec(layer.down_ty, [set, arena.set], down, &layer.down, n * k);
        };
        let single = run_scratch(&ctx, &pipes, &scratch, &slots, |rec, set| (0..TE).for_each(|t| record(rec, set, t, 1, 0, false)));
        // Equal outside the rounded activations' regions (written by batches only).
        let bits = |v: &[f32]| before_rounded(v, tok, xq);
        let batched = run_scratch(&ctx, &pipes, &scratch, &slots, |rec, set| record(rec, set, 0, TE, k as u32, false));
        assert_eq!(bits(&batched), bits(&single), "experts (fast {fast}): a batch of {TE} tokens");
        let rounded = (0..TE).all(|t| batched[t * tok + xq..t * tok + xq + XQ_FLOATS].iter().any(|v| v.to_bits() != 0));
        assert_eq!(rounded, fast, "experts (fast {fast}): activations rounded once per token");
        let mut grouped = run_scratch(&ctx, &pipes, &scratch, &slots, |rec, set| record(rec, set, 0, TE, k as u32, true));
        // The order: every pair once, grouped by expert.
        let order: Vec<usize> = (0..TE * k).map(|i| grouped[(i / k) * tok + order_off + i % k].to_bits() as usize).collect();
        let mut seen = order.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..TE * k).collect::<Vec<_>>(), "moe_group: not a permutation of the pairs");
        let experts_in_order: Vec<u32> = order.iter().map(|&p| ids[p / k][p % k]).collect();
        assert!(experts_in_order.is_sorted(), "moe_group: pairs not grouped by expert: {experts_in_order:?}");
        // The tiles: each expert's run of the order in tiles of `tile`, the experts in order.
        let mut want = vec![];
        let mut first = 0;
        for run in experts_in_order.chunk_by(|a, b| a == b) {
            want.extend((0..run.len()).step_by(tile).map(|i| (first + i, tile.min(run.len() - i))));
            first += run.len();
        }
        let table = |i: usize| grouped[tiles_off + i].to_bits() as usize;
        let got: Vec<(usize, usize)> = (0..table(0)).map(|i| (table(1 + 2 * i), table(2 + 2 * i))).collect();
        assert_eq!(got, want, "moe_group: the tiles of one expert each");
        grouped[tiles_off..].fill(0.0);
        for t in 0..TE {
            grouped[t * tok + order_off..t * tok + order_off + k].fill(0.0);
        }
        assert_eq!(bits(&grouped), bits(&single), "experts (fast {fast}, tile {tile}, share {share}): a batch of {TE} tokens grouped by expert");
        // Token 2's second expert against the CPU.
        let b = 2 * tok;
        let (y, abs) = cpu(&experts[2].0, &scratch[b + x_off..b + x_off + h], fast);
        let (want_h, bound_h) = swiglu_ref(&y, &abs, f);
        assert!(worst("token 2 expert 2 gate/up", &batched[b + h_off + fs..b + h_off + fs + f], &want_h, &bound_h) <= 1.0);
    }
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}

/// The CPU's exact `W x` and, per row, the bound of the matrix-matrix
/// modules (shaders/mm.comp) over [`TOL`]: each weight and activation
/// rounded to f16 once, relative 2^-11 each in the normal range (so a
/// product within `(2^-10 + 2^-22) |w x|`), and within 2^-25 absolute below
/// it (f16 subnormals: `2^-24 (|w| + |x|)` covers both), the products summed
/// in f32 (the exact kernels' `TOL`).
fn cpu_f16(w: &Tensor, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (y, abs) = cpu(w, x, false);
    let mut row = vec![0f32; w.cols()];
    let bound = (0..w.rows())
        .map(|r| {
            w.dequantize_row(r, &mut row);
            let wx: f32 = row.iter().zip(x).map(|(a, b)| (a * b).abs()).sum();
            let sub: f32 = row.iter().zip(x).map(|(a, b)| a.abs() + b.abs()).sum();
            abs[r] + ((2f32.powi(-10) + 2f32.powi(-22)) * wx + 2f32.powi(-24) * sub) / TOL
        })
        .collect();
    (y, bound)
}

/// The matrix-matrix modules (cooperative matrices: f16 weights and
/// activations, f32 sums) of every quantized type for a pass of 45 tokens
/// (a partial tile of 128 entries, whose blocks of 16 past the third are skipped) and
/// 300 rows (a partial tile of 64) of 512 values (4 steps of 128), every
/// epilogue (store, hyper-connection gates, residual write-back into two
/// streams, SwiGLU), and the routed experts' 135 pairs grouped by expert
/// (tiles of 32 that span several experts run each one's rows in turn),
/// against the CPU's exact product per token within [`cpu_f16`]'s bound. Where the device has no cooperative matrices
/// (lavapipe) it says so and checks nothing.
#[test]
fn mm_within_the_f16_bound() {
    let Some(ctx) = context_with(&DeviceChoice { coopmat: Some(true), ..Default::default() }) else { return };
    if !(ctx.int_dot.supported && ctx.coopmat) {
        println!("SKIPPED: {} has no cooperative matrices (VK_NV_cooperative_matrix)", ctx.name);
        return;
    }
    let mut pipes = Pipelines::with_mm(&ctx, true, true, |name| MatvecTuning::for_pipeline(name, false)).unwrap();
    // Every matrix on the modules, whatever the default selection by size.
    (pipes.mm_rows, pipes.mm_experts) = (0, MmExperts::All);
    let params = Buffer::new(&ctx, "twin params", 16, MemoryLocation::GpuOnly).unwrap();
    const T: usize = 45;
    let (rows, split) = (300, 100);
    let mut seen = 0.0f32;
    // Rows of 512 values whole, then rows of 1536 in three splits of 512
    // (split_sums adds them and applies the epilogues).
    let shapes = [(512, 1), (1536, 3)];
    for ((cols, splits), ty) in shapes.into_iter().flat_map(|c| crate::quant::QUANT_TYPES.into_iter().filter(|&t| Pipe::mm(t, false).is_some()).map(move |t| (c, t))) {
        let w = tensor(ty, rows, cols, 21);
        let w2 = tensor(ty, rows, cols, 22);
        let mut stream = Stream::new(&ctx).unwrap();
        let m = GpuMatrix::upload_split(&ctx, &pipes, &mut stream, &[&w], usize::MAX).unwrap();
        let m2 = GpuMatrix::upload_split(&ctx, &pipes, &mut stream, &[&w2], usize::MAX).unwrap();
        stream.finish().unwrap();
        // Token block: [x | aux | y mode 3 (STREAMS * rows) | y mode 0 | y mode 1 | y SwiGLU (rows / 2)].
        let (aux, y3) = (cols, cols + 4);
        let (y0, y1) = (y3 + STREAMS * rows, y3 + (STREAMS + 1) * rows);
        let y4 = y1 + rows;
        let tok = (y4 + rows / 2).div_ceil(64) * 64;
        let mut scratch = plain_scratch(T, tok, cols, aux, y3..y0, 70);
        // The split sums after the token blocks: each matrix's splits x tokens x rows.
        let partial = SplitRegion { off: scratch.len() as u32, len: (4 * splits * T * rows) as u32, per_entry: (4 * splits * rows) as u32 };
        scratch.resize(scratch.len() + partial.len as usize, f32::NAN);
        let push = |mode: u32, y: usize| {
            let aux_n = if mode == 3 { STREAMS as u32 } else { 0 };
            MatvecPush { y_off: y as u32, mode, aux_off: aux as u32, aux_n, x_stride: tok as u32, y_stride: tok as u32, scale: 0.75, split_row: split as u32, ..Default::default() }
        };
        // Splits as many as the rows allow.
        pipes.mm_split = if splits > 1 { usize::MAX / 2 } else { 0 };
        let out = run_scratch(&ctx, &pipes, &scratch, &params, |rec, set| {
            rec.partials = Some(partial);
            rec.independent(|rec| {
                rec.matvec_n(&m, set, push(3, y3), T);
                rec.matvec_n(&m, set, push(0, y0), T);
                rec.matvec_n(&m, set, push(1, y1), T);
                rec.matvec_n(&m2, set, push(4, y4), T);
            });
            // With splits, the four reductions after them.
            let n = if splits > 1 { 8 } else { 4 };
            assert_eq!((rec.stats.dispatches, rec.stats.mm), (n, 4), "{ty} ({cols} columns): one matrix-matrix dispatch each");
        });
        let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
        for t in 0..T {
            let b = &out[t * tok..(t + 1) * tok];
            let (want, bound) = cpu_f16(&w, &scratch[t * tok..t * tok + cols]);
            let what = |m: &str| format!("{ty} ({cols} columns in {splits}) token {t} mode {m}");
            seen = seen.max(worst(&what("0"), &b[y0..y0 + rows], &want, &bound));
            let init = &scratch[t * tok + y3..t * tok + y0];
            let a = [0.5 + t as f32, -1.0 - t as f32];
            let want3: Vec<f32> = (0..STREAMS * rows).map(|i| init[i] + a[i / rows] * want[i % rows]).collect();
            let bound3: Vec<f32> = (0..STREAMS * rows).map(|i| a[i / rows].abs() * bound[i % rows] + 1e-6 * want3[i].abs() / TOL).collect();
            seen = seen.max(worst(&what("3"), &b[y3..y0], &want3, &bound3));
            let want1: Vec<f32> = (0..rows).map(|r| if r < split { 0.75 * want[r] * sig(0.75 * want[r]) } else { 2.0 * sig(0.75 * want[r]) }).collect();
            let bound1: Vec<f32> = (0..rows).map(|r| 1.1 * 0.75 * bound[r] + 1e-6 * want1[r].abs() / TOL).collect();
            seen = seen.max(worst(&what("1"), &b[y1..y1 + rows], &want1, &bound1));
            let (g, gb) = cpu_f16(&w2, &scratch[t * tok..t * tok + cols]);
            let (want4, bound4) = swiglu_ref(&g, &gb, rows / 2);
            seen = seen.max(worst(&what("4"), &b[y4..y4 + rows / 2], &want4, &bound4));
        }
    }
    // Routed experts: (token, expert) pairs grouped by expert, gate/up (SwiGLU) then down.
    // Down rows of 256 (the K-quants' blocks; two steps).
    let (h, f, per_layer, k) = (512, 256, 5, 3);
    for ty in [GgmlType::Q4K, GgmlType::Q8_0] {
        let (experts, layer, arena, slots) = one_layer_arena(&ctx, &pipes, ty, h, f, per_layer);
        let ids: Vec<[u32; 3]> = (0..T as u32).map(|t| [0, 1, 3].map(|j| (2 * t + j + t / 7) % per_layer as u32)).collect();
        // Token block: [ids | x | hidden: k * f | y: k * h | order: k].
        let (x_off, h_off) = (4, 4 + h);
        let y_off = h_off + k * f;
        let order_off = y_off + k * h;
        let tok = (order_off + k).div_ceil(64) * 64;
        let mut scratch = expert_scratch(&ids, tok, x_off, h, 90);
        // moe_group's tiles of one expert each after the token blocks.
        let tiles_off = scratch.len();
        let max_tiles = max_expert_tiles(T * k, per_layer, mm_entries(true) as usize);
        scratch.resize(tiles_off + 1 + 2 * max_tiles, 0.0);
        // The tiles of mm_entries consecutive pairs (several experts' runs in turn), then one expert's each.
        for tiled in [false, true] {
            let out = run_scratch(&ctx, &pipes, &scratch, &slots, |rec, set| {
                let tiles = if tiled { tiles_off as u32 } else { 0 };
                let (order, tok_stride, n, n_ids) = (order_off as u32, tok as u32, T as u32, per_layer as u32);
                let group = MoeGroupPush { ids_off: 0, order_off: order, tok_stride, k: k as u32, n, n_ids, tiles_off: tiles, tile: mm_entries(true) };
                rec.dispatch(Pipe::MoeGroup, &[set], &group, [1, 1, 1]);
                let base = MatvecPush {
                    slot_table: 0,
                    slots_per_slab: arena.slots_per_slab as u32,
                    slot_bytes: arena.slot_bytes as u32,
                    scale: 1.0,
                    kdiv: k as u32,
                    tok_stride: tok as u32,
                    order_off: order_off as u32,
                    tiles_off: tiles,
                    ..Default::default()
                };
                let gate_up = MatvecPush { rows: f as u32, x_off: x_off as u32, y_off: h_off as u32, y_stride: f as u32, mode: 4, ..base };
                rec.expert_matvec_tiled(layer.gate_ty, [set, arena.set], gate_up, &layer.gate, T * k, max_tiles as u32);
                let down = MatvecPush { rows: h as u32, x_off: h_off as u32, x_stride: f as u32, y_off: y_off as u32, y_stride: h as u32, part_off: layer.gate.bytes as u32, ..base };
                rec.expert_matvec_tiled(layer.down_ty, [set, arena.set], down, &layer.down, T * k, max_tiles as u32);
                assert_eq!((rec.stats.dispatches, rec.stats.mm), (3, 2), "{ty}: the experts' parts on the matrix-matrix modules");
            });
            for (t, chosen) in ids.iter().enumerate() {
                let b = t * tok;
                for (j, &e) in chosen.iter().enumerate() {
                    let (g, gb) = cpu_f16(&experts[e as usize].0, &scratch[b + x_off..b + x_off + h]);
                    let (want_h, bound_h) = swiglu_ref(&g, &gb, f);
                    let got_h = &out[b + h_off + j * f..b + h_off + (j + 1) * f];
                    seen = seen.max(worst(&format!("{ty} token {t} expert {e} gate/up"), got_h, &want_h, &bound_h));
                    // The down part on the GPU's own hidden values.
                    let (want, bound) = cpu_f16(&experts[e as usize].1, got_h);
                    let what = format!("{ty} (tiles of one expert {tiled}) token {t} expert {e} down");
                    seen = seen.max(worst(&what, &out[b + y_off + j * h..b + y_off + (j + 1) * h], &want, &bound));
                }
            }
        }
    }
    println!("matrix-matrix modules: worst error {seen:.3} of the bound");
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}

/// shaders/router.comp: a pass's logits (the batch module, tiles of 16
/// tokens by 16 experts) equal each token's alone (the plain module) bit
/// for bit, and the CPU's F32 sums within float rounding; shapes whose rows
/// and tokens do not fill the tiles and whose rows end mid-item, the
/// activations past the row NaN (read as zero).
#[test]
fn router_passes_equal_single_tokens_and_the_cpu() {
    let Some(ctx) = context() else { return };
    let pipes = Pipelines::tuned(&ctx, false, |name| MatvecTuning::for_pipeline(name, false)).unwrap();
    for (rows, cols, n) in [(40, 130, 37), (256, 2560, 19), (5, 3, 1)] {
        let w = tensor(GgmlType::F32, rows, cols, 11 + rows as u64);
        let cmds = Commands::new(&ctx).unwrap();
        let mut stream = Stream::new(&ctx).unwrap();
        let m = GpuMatrix::upload_split(&ctx, &pipes, &mut stream, &[&w], usize::MAX).unwrap();
        stream.finish().unwrap();
        // Token t: its input at t * tok (NaN past `cols`), then its logits
        // of the pass at y_pass, of its own dispatch at y_alone.
        let tok = (cols.div_ceil(4) * 4 + 2 * rows.div_ceil(4) * 4 + 8) as u32;
        let (y_pass, y_alone) = (cols.div_ceil(4) * 4 + 4, cols.div_ceil(4) * 4 + 4 + rows.div_ceil(4) * 4);
        let x = values(n * cols, cols, 5 + n as u64);
        let mut scratch = vec![f32::NAN; n * tok as usize];
        for t in 0..n {
            scratch[t * tok as usize..][..cols].copy_from_slice(&x[t * cols..(t + 1) * cols]);
        }
        let buf = Buffer::new(&ctx, "router twin scratch", (scratch.len() * 4) as u64, MemoryLocation::GpuOnly).unwrap();
        let dummy = Buffer::new(&ctx, "twin dummy", 16, MemoryLocation::GpuOnly).unwrap();
        let pool = DescriptorPool::new(&ctx, 1, 3).unwrap();
        let set = pool.set(pipes.state_layout, &[&[buf.info()], &[dummy.info()], &[dummy.info()]]).unwrap();
        cmds.upload(&buf, 0, &bytes(&scratch)).unwrap();
        cmds.begin().unwrap();
        let mut rec = Recorder::new(&ctx, &pipes, cmds.cmd);
        assert!(Recorder::router_takes(&m));
        rec.router_n(&m, set, 0, y_pass as u32, tok, n);
        for t in 0..n as u32 {
            rec.router_n(&m, set, t * tok, t * tok + y_alone as u32, tok, 1);
        }
        rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
        cmds.submit().unwrap();
        let all = f32s(&cmds.download(&buf, 0, scratch.len() * 4).unwrap());
        let mut worst_err = 0f32;
        for t in 0..n {
            let at = t * tok as usize;
            let (pass, alone) = (&all[at + y_pass..][..rows], &all[at + y_alone..][..rows]);
            let differ: Vec<_> = (0..rows).filter(|&e| pass[e].to_bits() != alone[e].to_bits()).collect();
            assert!(differ.is_empty(), "{rows}x{cols}, token {t} of {n}: the pass's logits differ from the token's alone at experts {differ:?}");
            let (want, abs) = cpu(&w, &x[t * cols..(t + 1) * cols], false);
            worst_err = worst_err.max(worst(&format!("router {rows}x{cols} token {t}"), alone, &want, &abs));
        }
        println!("router {rows}x{cols}, {n} tokens: a pass equals its tokens bit for bit; worst error {worst_err:.3} of the bound");
    }
    assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
}
