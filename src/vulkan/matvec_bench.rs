//! A bandwidth sweep of the matvec pipelines at the real model's shapes, for
//! tuning on a GPU (an ignored test; it checks nothing):
//!
//! ```text
//! cargo test --release --lib matvec_sweep -- --ignored --nocapture
//! ```
//!
//! For every case (dense matrices: GDN qkv 10240 x 2560 in Q8_0 and Q4_K,
//! the LM head 248320 x 2560 in Q6_K and Q8_0, a 320-row matrix; routed
//! experts: gate/up 2 x 640 x 2560 with SwiGLU and down 2560 x 640 for 11
//! experts, in the Q4_K/Q5_0, Q8_0/Q8_0 and Q2_K/Q4_0 mixes) and every
//! tuning of the grid, it prints the GPU time per dispatch (timestamps) and
//! the bandwidth it implies, then each case's best. Each dispatch reads
//! another copy of the weights (another expert), at least 256 MiB in all,
//! so the L2 cache does not serve them. Weights are random bytes (the
//! speed does not depend on them).
//!
//! Each point runs on both kernel families where the device has integer dot
//! products (exact, and fast: 8-bit activations; `FNX_VK_SWEEP_KERNELS=exact`
//! or `fast` for one), and the best is printed per case and family.
//!
//! Environment: `FNX_VK_SWEEP_WG`, `_ROWS`, `_UNROLL`, `_TPR` (comma lists;
//! TPR 0 = the recorder's choice; defaults 64,128,256 / 1,2,4 / 1,2 /
//! 0,4,8,16,32), `FNX_VK_SWEEP_REPS` (dispatches timed per point, default
//! 20), `FNX_VK_SWEEP_SMALL=1` (an eighth of the rows and experts, for a
//! quick run on a CPU driver), `FNX_VK_SWEEP_CASES` (substrings of case
//! names to run); with `FNX_VULKAN_VALIDATION=1` it fails on any validation error.

use super::arena::{ArenaLayer, ExpertArena};
use super::buffer::{Buffer, Commands, Stream};
use super::device::{Context, DeviceChoice};
use super::matrix::{max_binding_bytes, GpuMatrix};
use super::pipelines::{MatvecPush, MatvecTuning, Pipe, Pipelines};
use super::record::{DescriptorPool, Recorder, Timestamps};
use crate::gguf::{GgmlType, TensorInfo};
use crate::tensor::Tensor;
use ash::vk;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

fn list(var: &str, default: &str) -> Vec<u32> {
    let s = std::env::var(var).unwrap_or_else(|_| default.into());
    s.split(',').filter_map(|v| v.trim().parse().ok()).collect()
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.truncate(n);
    out
}

fn random_tensor(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Tensor {
    let bytes = random_bytes(rows * ty.row_bytes(cols).unwrap(), seed);
    let info = TensorInfo { name: format!("sweep.{ty}"), ty, dims: vec![cols, rows], offset: 0, nbytes: bytes.len() };
    Tensor::new(Arc::new(bytes), &info)
}

/// Milliseconds of GPU time of what `record` records (after one untimed run).
fn time(ctx: &Arc<Context>, pipes: &Pipelines, cmds: &Commands, ts: &Timestamps, record: &dyn Fn(&mut Recorder)) -> f64 {
    cmds.begin().unwrap();
    let mut rec = Recorder::new(ctx, pipes, cmds.cmd);
    record(&mut rec);
    cmds.submit().unwrap();
    cmds.begin().unwrap();
    let mut rec = Recorder::new(ctx, pipes, cmds.cmd);
    rec.profile_into(ts.pool);
    record(&mut rec);
    cmds.submit().unwrap();
    ts.read(rec.profiled()).unwrap().iter().sum()
}

/// The GPU idles at low clocks: keeps it busy with `record` for a second
/// before the first point is timed.
fn warm_up(ctx: &Arc<Context>, pipes: &Pipelines, cmds: &Commands, ts: &Timestamps, record: &dyn Fn(&mut Recorder)) {
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_secs_f64() < 1.0 {
        time(ctx, pipes, cmds, ts, record);
    }
}

struct Point {
    case: String,
    line: String,
    gbs: f64,
}

enum Work<'a> {
    Dense(&'a [GpuMatrix]),
    Experts { arena: &'a ExpertArena, layer: ArenaLayer, k: usize, n: usize, down: bool },
}

struct Sweep {
    ctx: Arc<Context>,
    pipes: Vec<Pipelines>,
    tprs: Vec<u32>,
    reps: usize,
    scratch: Buffer,
    params: Buffer,
    _pool: DescriptorPool,
    set: vk::DescriptorSet,
    cmds: Commands,
    ts: Timestamps,
    points: Vec<Point>,
    /// Whether the GPU has been kept busy long enough to leave its idle clocks.
    warmed: std::cell::Cell<bool>,
}

/// Scratch floats: expert ids, then x, hidden and outputs.
const IDS: usize = 0;
const MAX_IDS: usize = 4096;
const X: usize = MAX_IDS;
const H: usize = X + 4096;
const Y: usize = H + 16 * 1024;
const SCRATCH: usize = Y + 248_320;

impl Sweep {
    fn run(&mut self, case: &str, work: Work) {
        for pipes in &self.pipes {
            for &tpr in &self.tprs {
                let reps = self.reps;
                let (pipe, items, bytes) = match &work {
                    Work::Dense(ms) => {
                        (Pipe::matvec(ms[0].ty, false, pipes.fast), ms[0].chunks[0].layout.items, ms[0].device_bytes() as usize)
                    }
                    Work::Experts { layer, k, down, .. } => {
                        let (ty, part) = if *down { (layer.down_ty, layer.down) } else { (layer.gate_ty, layer.gate) };
                        (Pipe::matvec(ty, true, pipes.fast), part.items, k * part.bytes)
                    }
                };
                let case = if pipe.is_fast() { format!("{case} (fast)") } else { case.to_string() };
                let record = |rec: &mut Recorder| {
                    rec.force_tpr = (tpr > 0).then_some(tpr);
                    for r in 0..reps {
                        match &work {
                            Work::Dense(ms) => {
                                let push = MatvecPush { x_off: X as u32, y_off: Y as u32, ..Default::default() };
                                rec.matvec(&ms[r % ms.len()], self.set, push);
                            }
                            Work::Experts { arena, layer, k, n, down } => {
                                let (h, f) = (layer.down.rows, layer.gate.rows / 2);
                                let base = MatvecPush {
                                    expert_off: (IDS + (r * k) % (n - k + 1)) as u32,
                                    slot_table: 0,
                                    slots_per_slab: arena.slots_per_slab as u32,
                                    slot_bytes: arena.slot_bytes as u32,
                                    scale: 1.0,
                                    ..Default::default()
                                };
                                let fs = f.div_ceil(4) as u32 * 4;
                                let sets = [self.set, arena.set];
                                if *down {
                                    let push = MatvecPush {
                                        rows: h as u32,
                                        x_off: H as u32,
                                        x_stride: fs,
                                        y_off: Y as u32,
                                        y_stride: h as u32,
                                        part_off: layer.gate.bytes as u32,
                                        ..base
                                    };
                                    rec.expert_matvec(layer.down_ty, sets, push, &layer.down, *k);
                                } else {
                                    let push = MatvecPush {
                                        rows: f as u32,
                                        x_off: X as u32,
                                        y_off: H as u32,
                                        y_stride: fs,
                                        mode: 4,
                                        ..base
                                    };
                                    rec.expert_matvec(layer.gate_ty, sets, push, &layer.gate, *k);
                                }
                            }
                        }
                    }
                };
                if !self.warmed.get() {
                    warm_up(&self.ctx, pipes, &self.cmds, &self.ts, &record);
                    self.warmed.set(true);
                }
                let ms = time(&self.ctx, pipes, &self.cmds, &self.ts, &record) / reps as f64;
                let t = pipes.tuning[pipe as usize];
                let t = if tpr > 0 { MatvecTuning { tpr: Some(tpr), ..t } } else { t };
                let used_tpr = 1u32 << t.tpr_shift(items);
                let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
                let line = format!(
                    "{case:<36} {:<19} wg {:>4} rows {} unroll {} tpr {:>3}{}  {:>9.1} us  {gbs:>8.1} GB/s",
                    pipe.spec().name,
                    t.wg,
                    t.rows,
                    t.unroll,
                    used_tpr,
                    if tpr == 0 { " (auto)" } else { "       " },
                    ms * 1e3,
                );
                println!("{line}");
                self.points.push(Point { case, line, gbs });
            }
        }
    }
}

#[test]
#[ignore = "a benchmark for tuning on a GPU: run with --ignored --nocapture"]
fn matvec_sweep() {
    let ctx = Arc::new(Context::new(&DeviceChoice::default()).expect("a Vulkan device"));
    let small = std::env::var("FNX_VK_SWEEP_SMALL").is_ok_and(|v| v == "1");
    let div = if small { 8 } else { 1 };
    let only: Vec<String> = std::env::var("FNX_VK_SWEEP_CASES").map_or(Vec::new(), |v| v.split(',').map(String::from).collect());
    let wanted = |name: &str| only.is_empty() || only.iter().any(|o| name.contains(o.as_str()));
    let mut tunings = Vec::new();
    for wg in list("FNX_VK_SWEEP_WG", "64,128,256") {
        for rows in list("FNX_VK_SWEEP_ROWS", "1,2,4") {
            for unroll in list("FNX_VK_SWEEP_UNROLL", "1,2") {
                tunings.push(MatvecTuning { wg, rows, unroll, tpr: None, min_items: 4, fill: 256, tile: 1, share: 8 });
            }
        }
    }
    let kernels = std::env::var("FNX_VK_SWEEP_KERNELS").unwrap_or_else(|_| "exact,fast".into());
    let mut families = Vec::new();
    for k in kernels.split(',').map(str::trim) {
        match k {
            "exact" => families.push(false),
            "fast" if ctx.int_dot.supported => families.push(true),
            "fast" => println!("no integer dot products on {}: the fast kernels are not swept", ctx.name),
            other => panic!("FNX_VK_SWEEP_KERNELS: {other:?} is not exact or fast"),
        }
    }
    let pipes: Vec<Pipelines> =
        families.iter().flat_map(|&fast| tunings.iter().map(move |t| (fast, *t))).map(|(fast, t)| Pipelines::tuned(&ctx, fast, |_| t).unwrap()).collect();
    let scratch = Buffer::new(&ctx, "sweep scratch", (SCRATCH * 4) as u64, MemoryLocation::GpuOnly).unwrap();
    let params = Buffer::new(&ctx, "sweep params", 4 * 4096, MemoryLocation::GpuOnly).unwrap();
    let cmds = Commands::new(&ctx).unwrap();
    // Expert ids 0, 1, 2, ... (consecutive dispatches take consecutive runs of slots); activations small.
    let mut init = vec![0f32; SCRATCH];
    for (i, v) in init.iter_mut().enumerate() {
        *v = if i < MAX_IDS { f32::from_bits(i as u32) } else { ((i % 13) as f32 - 6.0) / 64.0 };
    }
    cmds.upload(&scratch, 0, &init.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let table: Vec<u8> = (0..4096u32).flat_map(|s| s.to_le_bytes()).collect();
    cmds.upload(&params, 0, &table).unwrap();
    let pool = DescriptorPool::new(&ctx, 1, 3).unwrap();
    let set = pool.set(pipes[0].state_layout, &[&[scratch.info()], &[scratch.info()], &[params.info()]]).unwrap();
    let ts = Timestamps::new(&ctx).unwrap();
    let mut sw = Sweep {
        tprs: list("FNX_VK_SWEEP_TPR", "0,4,8,16,32"),
        reps: list("FNX_VK_SWEEP_REPS", "20").first().copied().unwrap_or(20) as usize,
        pipes,
        scratch,
        params,
        _pool: pool,
        set,
        cmds,
        ts,
        points: Vec::new(),
        warmed: std::cell::Cell::new(false),
        ctx: ctx.clone(),
    };
    println!("device {}, subgroup {}, {} tunings, integer dot products {:?}", ctx.name, ctx.subgroup_size, tunings.len(), ctx.int_dot);
    const L2_DEFEAT: usize = 256 << 20;
    let dense = [
        ("gdn qkv 10240x2560", GgmlType::Q8_0, 10240, 2560),
        ("gdn qkv 10240x2560", GgmlType::Q4K, 10240, 2560),
        ("lm_head 248320x2560", GgmlType::Q6K, 248_320, 2560),
        ("lm_head 248320x2560", GgmlType::Q8_0, 248_320, 2560),
        ("hc 320x2560", GgmlType::Q8_0, 320, 2560),
    ];
    for (name, ty, rows, cols) in dense {
        let case = format!("{name} {ty}");
        if !wanted(&case) {
            continue;
        }
        let rows = (rows / div).max(1);
        let one = ty.row_bytes(cols).unwrap() * rows;
        let copies = L2_DEFEAT.div_ceil(one).clamp(1, 64);
        let t = random_tensor(ty, rows, cols, 1);
        let mut stream = Stream::new(&ctx).unwrap();
        let ms: Vec<GpuMatrix> = (0..copies)
            .map(|_| GpuMatrix::upload_split(&ctx, &sw.pipes[0], &mut stream, &[&t], max_binding_bytes(&ctx)).unwrap())
            .collect();
        stream.finish().unwrap();
        sw.run(&case, Work::Dense(&ms));
    }
    let experts = [(GgmlType::Q4K, GgmlType::Q5_0), (GgmlType::Q8_0, GgmlType::Q8_0), (GgmlType::Q2K, GgmlType::Q4_0)];
    for (gate_ty, down_ty) in experts {
        let (h, f, k) = (2560, 640, 11);
        let layer = ArenaLayer::new(gate_ty, down_ty, h, f).unwrap();
        let n = (L2_DEFEAT.div_ceil(layer.gate.bytes + layer.down.bytes) / div).clamp(2 * k, MAX_IDS);
        let gate = random_bytes(2 * f * gate_ty.row_bytes(h).unwrap(), 2);
        let down = random_bytes(h * down_ty.row_bytes(f).unwrap(), 3);
        let case = format!("experts {gate_ty}/{down_ty} x{k}");
        if !wanted(&case) {
            continue;
        }
        let arena = ExpertArena::alloc(&ctx, &sw.pipes[0], vec![layer], n, false, max_binding_bytes(&ctx)).unwrap();
        let mut stream = Stream::new(&ctx).unwrap();
        arena.fill_all(&mut stream, |_, _| (vec![&gate[..]], &down[..])).unwrap();
        stream.finish().unwrap();
        sw.run(&format!("{case} gate/up"), Work::Experts { arena: &arena, layer, k, n, down: false });
        sw.run(&format!("{case} down"), Work::Experts { arena: &arena, layer, k, n, down: true });
    }
    println!("\nbest per case:");
    let mut cases: Vec<&str> = Vec::new();
    for p in &sw.points {
        if !cases.contains(&p.case.as_str()) {
            cases.push(&p.case);
        }
    }
    for case in cases {
        let best = sw.points.iter().filter(|p| p.case == case).max_by(|a, b| a.gbs.total_cmp(&b.gbs)).unwrap();
        println!("{}", best.line);
    }
    let _ = (&sw.scratch, &sw.params);
    assert_eq!(super::device::validation_errors(), 0, "Vulkan validation errors (printed above)");
}

/// The matrix-matrix modules (shaders/mm.comp) on the real model's dense
/// shapes for a pass of 512 tokens, for tuning on a GPU (an ignored test;
/// it checks nothing):
///
/// ```text
/// cargo test --release --lib mm_sweep -- --ignored --nocapture
/// ```
///
/// Prints the GPU time per dispatch and the TFLOP/s it implies. One copy of
/// each matrix (as in a pass, where the tiles of tokens share the rows in the
/// L2 cache). With `FNX_VK_SPIRV_DIR` (src/vulkan/pipelines.rs) it times
/// variants of the modules without a rebuild; `FNX_VK_SWEEP_REPS` as above.
#[test]
#[ignore = "a benchmark for tuning on a GPU: run with --ignored --nocapture"]
fn mm_sweep() {
    const N: usize = 512;
    let ctx = Arc::new(Context::new(&DeviceChoice::default()).expect("a Vulkan device"));
    if !(ctx.int_dot.supported && ctx.coopmat) {
        println!("{}: no cooperative matrices or integer dot products, nothing to time", ctx.name);
        return;
    }
    let pipes = Pipelines::with_mm(&ctx, true, true, MatvecTuning::from_env).unwrap();
    let reps = list("FNX_VK_SWEEP_REPS", "20").first().copied().unwrap_or(20) as usize;
    let cases = [
        ("ssm_out", GgmlType::Q8_0, 2560, 6144),
        ("gdn in", GgmlType::Q8_0, 16480, 2560),
        ("shared gate/up", GgmlType::Q4K, 10240, 2560),
        ("lm_head part", GgmlType::Q6K, 16384, 2560),
    ];
    let (max_cols, max_rows) = (6144, 16480);
    let (x, y) = (0usize, N * max_cols);
    let scratch = Buffer::new(&ctx, "mm sweep scratch", ((y + N * max_rows) * 4) as u64, MemoryLocation::GpuOnly).unwrap();
    let params = Buffer::new(&ctx, "mm sweep params", 4 * 1024, MemoryLocation::GpuOnly).unwrap();
    let cmds = Commands::new(&ctx).unwrap();
    let init: Vec<u8> = (0..y).flat_map(|i| (((i % 13) as f32 - 6.0) / 64.0).to_le_bytes()).collect();
    cmds.upload(&scratch, 0, &init).unwrap();
    let pool = DescriptorPool::new(&ctx, 1, 3).unwrap();
    let set = pool.set(pipes.state_layout, &[&[scratch.info()], &[scratch.info()], &[params.info()]]).unwrap();
    let ts = Timestamps::new(&ctx).unwrap();
    println!("device {}, {N} tokens, {reps} dispatches a point", ctx.name);
    let mut warmed = false;
    for (name, ty, rows, cols) in cases {
        let t = random_tensor(ty, rows, cols, 1);
        let mut stream = Stream::new(&ctx).unwrap();
        let m = GpuMatrix::upload_split(&ctx, &pipes, &mut stream, &[&t], max_binding_bytes(&ctx)).unwrap();
        stream.finish().unwrap();
        let record = |rec: &mut Recorder| {
            for _ in 0..reps {
                let push = MatvecPush { x_off: x as u32, x_stride: cols as u32, y_off: y as u32, y_stride: rows as u32, ..Default::default() };
                rec.matvec_n(&m, set, push, N);
            }
        };
        if !warmed {
            warm_up(&ctx, &pipes, &cmds, &ts, &record);
            warmed = true;
        }
        let ms = time(&ctx, &pipes, &cmds, &ts, &record) / reps as f64;
        let tflops = 2.0 * (rows * cols * N) as f64 / (ms * 1e-3) / 1e12;
        println!("mm {name:<16} {ty:<5} {rows:>6} x {cols:<5} {:>9.1} us  {tflops:>7.1} TFLOP/s", ms * 1e3);
    }
    assert_eq!(super::device::validation_errors(), 0, "Vulkan validation errors (printed above)");
}
