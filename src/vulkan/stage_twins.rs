//! Stage twins: every compute shader besides the matvec (`twins.rs` has that
//! one) run alone and compared with its CPU twin: the CPU backend's
//! function for the same stage (`src/cpu/`), the very code the CPU decode
//! runs, so each formula exists once.
//!
//! Each test builds random inputs of the real model's sizes (and small or
//! odd ones that leave workgroups partly idle), uploads them to the set-0
//! buffers the shader reads (scratch `s[]`, layer state `st[]`, parameters
//! `prm[]`), records exactly one dispatch through the decode's
//! [`Recorder::dispatch`] with the decode's push-constant struct, runs it
//! under the validation layer (any error fails the test) and compares what
//! it wrote with the CPU's result. Every region the shader must not write
//! is checked to keep its bits, and every buffer region is followed by a
//! guard of NaNs, so a write out of bounds fails too; outputs start as NaN,
//! so an element left unwritten fails. The shader's inputs come from the
//! CPU stages before it, so they are bit-identical.
//!
//! Errors are `max |gpu - cpu| / max |cpu|` over each output (the magnitude
//! of the values); index outputs must be equal. `cargo test --lib
//! stage_twins -- --nocapture` prints every case's error.
//!
//! | shader | CPU twin (`src/cpu/`) | bound |
//! |---|---|---|
//! | `hc_norm` | `hyper::norm` | 4e-6 |
//! | `hc_combine` | `hyper::combine` | 4e-6 |
//! | `ple_mix` | `ple::mix` (residual and conv ring) | 2e-5; untouched ring rows exact |
//! | `gdn_conv` | `gdn::conv` (output and ring; one token and a pass of tokens) | 4e-6; ring exact |
//! | `gdn_recurrent` | `gdn::delta_rule` (output and recurrent planes; one token and a pass of tokens) | 2e-5 |
//! | `gdn_token` | `gdn::conv`, `gdn::delta_rule`, `gdn::gated_norm` (one token; and bit for bit the three stage modules on the same device) | 2e-5; ring exact |
//! | `attn_prep` | `qsa::prep` (queries, key and value caches) | 4e-6; values exact |
//! | `qsa_index` | `qsa::index` (raw and block key caches, queries) | 4e-6; raw keys exact |
//! | `qsa_score` | `qsa::score_blocks` | 1e-5 |
//! | `qsa_topk` | `qsa::top_blocks`, ties included | equal, in order |
//! | `attention` | `qsa::attend`, dense and sparse | 2e-5 |
//! | `moe_route` | `moe::route`, `moe::shared_gate` | ids equal, in order; weights 1e-5 |
//! | `moe_combine` | `moe::combine` + `hyper::post` | 1e-5 |
//! | `act_int8` | none (the matvec's own rounding, `prepare_x`, shares its code): the fast matvecs of a batch reading it equal token by token bit for bit (`twins::batched_matvecs_equal_single_tokens`) | exact |
//! | `moe_group` | none (an order, not a value): every pair once, grouped by expert; the experts' matvecs in that order equal token by token bit for bit (`twins::batched_matvecs_equal_single_tokens`) | exact |
//!
//! Where a CPU block function composes the stages (`gdn::forward`,
//! `qsa::forward`, `ple::forward`), the test checks that it equals the
//! stages run one by one, so the stages compared are the decode's. One context and pipeline table serve every test
//! (tests run in parallel).

mod attention;
mod gdn;
mod hyper;
mod moe;
mod ple;

use super::buffer::{Buffer, Commands};
use super::device::{validation_errors, Context, DeviceChoice};
use super::pipelines::{Pipe, Pipelines, Push};
use super::record::{DescriptorPool, Recorder};
use crate::gguf::{GgmlType, TensorInfo};
use crate::model::config::QsaConfig;
use crate::cpu::ops::Rope;
use crate::model::{Config, GateActivation, LayerKind};
use crate::tensor::Tensor;
use ash::vk;
use gpu_allocator::MemoryLocation;
use std::sync::{Arc, OnceLock};

/// The model's `rms_norm_eps`.
const EPS: f32 = 1e-6;

/// The device, shared by every test of this module.
struct Gpu {
    ctx: Arc<Context>,
    pipes: Pipelines,
}

/// The shared device, or `None` (after printing SKIPPED) when there is none
/// and `FNX_REQUIRE_VULKAN` is not `1`.
fn gpu() -> Option<&'static Gpu> {
    static GPU: OnceLock<Result<Gpu, String>> = OnceLock::new();
    let made = GPU.get_or_init(|| {
        std::env::set_var("FNX_VULKAN_VALIDATION", "1");
        let ctx = Arc::new(Context::new(&DeviceChoice::default()).map_err(|e| e.to_string())?);
        let pipes = Pipelines::new(&ctx, false, false).map_err(|e| e.to_string())?;
        Ok(Gpu { ctx, pipes })
    });
    match made {
        Ok(g) => Some(g),
        Err(e) if std::env::var("FNX_REQUIRE_VULKAN").as_deref() != Ok("1") => {
            println!("SKIPPED: no usable Vulkan device ({e})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Floats after every region: a quiet NaN no shader computes.
const GUARD: usize = 4;
const SENTINEL: f32 = f32::from_bits(0x7fc0_5a5a);

/// A buffer's contents, built region by region (the first at offset 0),
/// each region followed by [`GUARD`] sentinels.
#[derive(Default)]
struct Image(Vec<f32>);

impl Image {
    /// Appends `v`; returns its float offset.
    fn put(&mut self, v: &[f32]) -> u32 {
        let at = self.0.len();
        self.0.extend_from_slice(v);
        self.0.extend([SENTINEL; GUARD]);
        at as u32
    }

    /// An output region of `n` floats, NaN until written.
    fn out(&mut self, n: usize) -> u32 {
        self.put(&vec![SENTINEL; n])
    }
}

/// The three buffers of set 0.
#[derive(Default)]
struct Bufs {
    s: Image,
    st: Image,
    prm: Image,
}

/// Workgroups of a dispatch: a fixed count, or one invocation per item
/// ([`Recorder::threads`], as the decode sizes element-wise stages).
enum Groups {
    Fixed([u32; 3]),
    Threads(usize),
}

/// Float regions `(offset, length)` a dispatch may write.
type Regions<'a> = &'a [(u32, usize)];

/// Scratch and layer state after a dispatch.
struct Out {
    s: Vec<f32>,
    st: Vec<f32>,
}

fn region(v: &[f32], at: u32, n: usize) -> &[f32] {
    &v[at as usize..at as usize + n]
}

impl Out {
    fn s(&self, at: u32, n: usize) -> &[f32] {
        region(&self.s, at, n)
    }
    fn st(&self, at: u32, n: usize) -> &[f32] {
        region(&self.st, at, n)
    }
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Panics when a float outside `written` changed its bits.
fn untouched(what: &str, before: &[f32], after: &[f32], written: Regions) {
    let mut free = vec![true; before.len()];
    for &(at, n) in written {
        free[at as usize..at as usize + n].fill(false);
    }
    if let Some(i) = (0..before.len()).find(|&i| free[i] && before[i].to_bits() != after[i].to_bits()) {
        panic!("{what}: float {i} outside the shader's outputs changed from {} to {}", before[i], after[i]);
    }
}

impl Gpu {
    /// Uploads `b`, records `pipe`'s dispatch alone through the decode's
    /// recorder, runs it, reads scratch and layer state back, and checks the
    /// floats outside `s_written` / `st_written` kept their bits and that the
    /// validation layer reported nothing.
    fn run<P: Push>(&self, pipe: Pipe, push: &P, groups: Groups, b: &Bufs, s_written: Regions, st_written: Regions) -> Out {
        let ctx = &self.ctx;
        let cmds = Commands::new(ctx).unwrap();
        let buffer = |name: &str, img: &Image| {
            let buf = Buffer::new(ctx, name, (img.0.len() * 4) as u64, MemoryLocation::GpuOnly).unwrap();
            if !img.0.is_empty() {
                cmds.upload(&buf, 0, &bytes(&img.0)).unwrap();
            }
            buf
        };
        let (s, st, prm) = (buffer("twin scratch", &b.s), buffer("twin state", &b.st), buffer("twin params", &b.prm));
        let pool = DescriptorPool::new(ctx, 1, 3).unwrap();
        let set = pool.set(self.pipes.state_layout, &[&[s.info()], &[st.info()], &[prm.info()]]).unwrap();
        cmds.begin().unwrap();
        let mut rec = Recorder::new(ctx, &self.pipes, cmds.cmd);
        let groups = match groups {
            Groups::Fixed(g) => g,
            Groups::Threads(n) => rec.threads(pipe, n),
        };
        rec.dispatch(pipe, &[set], push, groups);
        rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
        assert_eq!(rec.stats.dispatches, 1);
        cmds.submit().unwrap();
        let read = |buf: &Buffer, img: &Image| {
            if img.0.is_empty() {
                return Vec::new();
            }
            floats(&cmds.download(buf, 0, img.0.len() * 4).unwrap())
        };
        let out = Out { s: read(&s, &b.s), st: read(&st, &b.st) };
        let name = pipe.spec().name;
        untouched(&format!("{name} scratch"), &b.s.0, &out.s, s_written);
        untouched(&format!("{name} layer state"), &b.st.0, &out.st, st_written);
        assert_eq!(validation_errors(), 0, "Vulkan validation errors (printed above)");
        out
    }
}

/// `max |got - want| / max |want|`, a NaN anywhere counting as infinite.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let diff = got.iter().zip(want).fold(0f32, |m, (a, b)| {
        let d = (a - b).abs();
        if d.is_nan() {
            f32::INFINITY
        } else {
            m.max(d)
        }
    });
    diff / scale
}

/// Asserts `rel_err(got, want) <= bound`; prints and returns the error.
fn check(what: &str, got: &[f32], want: &[f32], bound: f32) -> f32 {
    let e = rel_err(got, want);
    println!("{what}: rel err {e:.2e} (bound {bound:.0e})");
    assert!(e <= bound, "{what}: GPU vs CPU rel err {e:.3e} > {bound:.0e}");
    e
}

/// Asserts `got` and `want` are the same floats, bit for bit.
fn check_exact(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: element {i} is {} on the GPU, {} on the CPU", got[i], want[i]);
    }
    println!("{what}: exact");
}

/// Deterministic pseudo-random numbers (xorshift64*).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values uniform in [-scale, scale).
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }

    /// `n` values of unit RMS (uniform in ±sqrt 3).
    fn unit(&mut self, n: usize) -> Vec<f32> {
        self.vec(n, 3f32.sqrt())
    }

    /// Norm weights with the `1+w` folded in: 1 ± 0.2.
    fn gamma(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| 1.0 + 0.2 * self.uniform()).collect()
    }

    /// An f32 `rows x cols` matrix mapping unit-RMS inputs to unit-RMS outputs.
    fn matrix(&mut self, rows: usize, cols: usize) -> Tensor {
        let v = self.vec(rows * cols, (3.0 / cols as f32).sqrt());
        matrix(rows, cols, &v)
    }
}

/// An f32 tensor of `rows x cols` (row-major) values.
fn matrix(rows: usize, cols: usize, values: &[f32]) -> Tensor {
    assert_eq!(values.len(), rows * cols);
    let b = bytes(values);
    let info = TensorInfo { name: format!("twin.{rows}x{cols}"), ty: GgmlType::F32, dims: vec![cols, rows], offset: 0, nbytes: b.len() };
    Tensor::new(Arc::new(b), &info)
}

fn identity(n: usize) -> Tensor {
    let mut v = vec![0f32; n * n];
    (0..n).for_each(|i| v[i * n + i] = 1.0);
    matrix(n, n, &v)
}

/// The host's cos/sin table of position `pos`, as the decode uploads it.
fn rope_table(rope: &Rope, dims: usize, pos: usize) -> Vec<f32> {
    let mut t = vec![0f32; dims];
    crate::vulkan::blocks::rope_table(rope, dims, pos, &mut t);
    t
}
