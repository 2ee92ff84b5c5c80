//! A model's weights on the GPU: matrices (split to fit bindings), the
//! expert arena, and one parameter buffer holding every small f32 vector
//! (norm gammas, conv taps, decay constants) and the arena's slot tables.
//! The token embedding and the PLE table stay in the mmap: the host gathers
//! their rows for each token (a few KiB) and uploads them with it.
//!
//! The VRAM budget (`LoadOptions::vram_budget_mb`; without one, nine tenths
//! of the device's memory) is a ceiling: the dense weights, the shared
//! experts and one state at its initial size are resident, and what is left
//! becomes expert slots. When every routed expert fits, all are resident;
//! otherwise the arena is an expert cache ([`super::cache`]) with the same
//! number of slots for every layer, and the misses run on the host's cores.
//! Everything is streamed through [`Stream`] (staging buffers filled in
//! parallel while the GPU copies the previous one).

use super::arena::{arena_layers, expert_bytes, slot_bytes, ExpertArena};
use super::buffer::{Buffer, Stream};
use super::cache::{ExpertCache, Split};
use super::device::{Context, DeviceChoice};
use super::matrix::GpuMatrix;
use super::pipelines::{Pipelines, MAX_ATTN_HEAD_DIM, MAX_GDN_HEAD_DIM, MAX_INDEX_DIM, MAX_EXPERTS, MAX_QSA_KEEP, MAX_TOP_K};
use crate::error::{Error, Result};
use crate::model::backend::{BackendKind, BackendModel, BackendState, ExpertCacheReport, OnModelThreads};
use crate::model::profile::RoutingProfile;
use crate::model::weights::{HyperConnection, Mixer, Weights};
use crate::model::{Config, LayerKind, Model};
use crate::tensor::Tensor;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

/// Small f32 vectors, packed; fields elsewhere hold their offsets.
#[derive(Default)]
struct ParamsBuilder(Vec<f32>);

impl ParamsBuilder {
    fn add(&mut self, v: &[f32]) -> u32 {
        let at = self.0.len() as u32;
        self.0.extend_from_slice(v);
        at
    }
}

pub(crate) struct GpuHyper {
    pub norm: u32,
    /// Down rows then injection rows (absent on the output mixer): [R (+C), C*H]
    pub down_inject: Vec<GpuMatrix>,
    pub rank: usize,
    pub up: GpuMatrix,
}

pub(crate) struct GpuGdn {
    /// The input projections fused: [qkv | z | beta | alpha] rows.
    pub input: Vec<GpuMatrix>,
    pub out: GpuMatrix,
    pub conv: u32,
    pub dt_bias: u32,
    pub decay_a: u32,
    pub norm: u32,
}

pub(crate) struct GpuIndexer {
    pub q_norm: u32,
    pub k_norm: u32,
}

pub(crate) struct GpuAttention {
    /// The input projections fused: [q+gate | k | v | indexer k | indexer q] rows.
    pub input: Vec<GpuMatrix>,
    pub o: GpuMatrix,
    pub q_norm: u32,
    pub k_norm: u32,
    pub indexer: Option<GpuIndexer>,
}

pub(crate) enum GpuMixer {
    Gdn(GpuGdn),
    Attention(GpuAttention),
}

/// A shared expert kept outside the arena (its shape differs from the routed experts').
pub(crate) struct SharedExpert {
    /// Gate rows then up rows: [2*Fs, H]
    pub gate_up: GpuMatrix,
    pub down: GpuMatrix,
}

pub(crate) struct GpuMoe {
    pub router: GpuMatrix,
    /// `None` when the shared expert lives in the arena.
    pub shared: Option<SharedExpert>,
    pub shared_gate: u32,
    /// Params offset of this layer's slot table: [E] or [E + 1]
    pub slot_table: u32,
}

pub(crate) struct GpuPle {
    pub key: GpuMatrix,
    pub value: GpuMatrix,
    pub norm_key: u32,
    pub norm_query: u32,
    pub norm_conv: u32,
    pub conv: u32,
}

pub(crate) struct GpuLayer {
    pub attn_hc: GpuHyper,
    pub ffn_hc: GpuHyper,
    pub mixer: GpuMixer,
    pub moe: GpuMoe,
    pub ple: Option<GpuPle>,
}

/// A model loaded onto a Vulkan device.
pub struct GpuModel {
    pub(crate) layers: Vec<GpuLayer>,
    pub(crate) output_hc: GpuHyper,
    pub(crate) output: GpuMatrix,
    pub(crate) arena: ExpertArena,
    /// Present when not every routed expert fits: the arena is a cache.
    pub(crate) cache: Option<ExpertCache>,
    pub(crate) params: Buffer,
    pub(crate) pipes: Pipelines,
    pub(crate) ctx: Arc<Context>,
    /// How the load went (for reports).
    pub(crate) report: LoadReport,
    /// Whether the model's threads spin through the waits for the GPU of an
    /// offloaded decode (see `ExpertPlacement::spin_wait`).
    pub(crate) spin_wait: bool,
    /// Whether those threads read the next layer's predicted misses ahead
    /// while they wait (see `ExpertPlacement::prefetch`).
    pub(crate) prefetch: bool,
    /// A token's recording is submitted in segments of this many layers
    /// (0: one submission), so the GPU starts while the host records on
    /// (`FNX_VK_SEGMENT_LAYERS`; see `VkPass::segment_after`).
    pub(crate) segment_layers: usize,
}

/// Layers per submitted segment of a token's recording, unless
/// `FNX_VK_SEGMENT_LAYERS` says otherwise (0: the token in one submission).
const SEGMENT_LAYERS: usize = 8;

/// What a load measured.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Bytes streamed to the device and the seconds it took.
    pub uploaded_bytes: u64,
    pub upload_seconds: f64,
    /// Expert slots per layer (all experts when resident).
    pub slots_per_layer: usize,
    /// Whether every routed expert is resident.
    pub resident: bool,
    /// The split the expert cache uses (bandwidths measured at load).
    pub split: Option<Split>,
}

/// How the routed experts are placed, as the load options and budget decide.
#[derive(Clone, Debug, Default)]
pub struct ExpertPlacement {
    /// Slots per layer, when forced (`FNX_EXPERT_CACHE_SLOTS`); `None` = from the budget.
    pub forced_slots: Option<usize>,
    /// Positions one state's caches are sized for (the budget keeps room for one).
    pub state_positions: usize,
    /// Most tokens of a state's passes (its scratch holds that many).
    pub micro_batch: usize,
    /// Positions the budget lets one state grow to (from `state_positions`).
    pub grow_to: usize,
    /// The model's rewind window (part of a state's size).
    pub window: usize,
    /// Fills the expert cache with each layer's most used experts at load.
    pub warm: Option<RoutingProfile>,
    /// Whether the model's threads spin, rather than sleep, while an
    /// offloaded decode waits for the GPU at each layer's router; `None` =
    /// yes, unless the device is the host's CPU (lavapipe).
    pub spin_wait: Option<bool>,
    /// The expert cache's admission count, forced (`None` = from the
    /// speeds measured at load, or 2 with fills in the background).
    pub admission: Option<f32>,
    /// Whether admitted experts are filled in the background (computed on
    /// the host the token they are admitted); `None` = no.
    pub fill: Option<bool>,
    /// Whether the spinning threads of an offloaded decode read the next
    /// layer's predicted misses into the host's caches while they wait;
    /// `None` = no.
    pub prefetch: Option<bool>,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuModel({})", self.ctx.name)
    }
}

/// Shapes the shaders' fixed workgroup sizes can hold.
/// The most blocks a QSA layer keeps (budget / its compression ratio).
fn qsa_keep(cfg: &Config) -> usize {
    let Some(q) = &cfg.qsa else { return 0 };
    cfg.layers
        .iter()
        .filter_map(|k| match k {
            LayerKind::Attention { compress_ratio } if *compress_ratio > 0 => Some(q.budget / compress_ratio),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

fn check_shapes(cfg: &Config) -> Result<()> {
    let limits = [
        ("GDN head dim", cfg.ssm_head_dim, MAX_GDN_HEAD_DIM),
        ("attention head dim", cfg.head_dim, MAX_ATTN_HEAD_DIM),
        ("indexer head dim", cfg.qsa.as_ref().map_or(0, |q| q.head_dim), MAX_INDEX_DIM),
        ("experts per token", cfg.n_experts_used, MAX_TOP_K),
        ("routed experts", cfg.n_experts, MAX_EXPERTS),
        ("QSA blocks kept per query", qsa_keep(cfg), MAX_QSA_KEEP),
    ];
    for (what, have, max) in limits {
        if have > max {
            return Err(Error::Backend(format!("{what} {have} exceeds the Vulkan shaders' limit {max}")));
        }
    }
    if !cfg.ssm_head_dim.is_multiple_of(4) {
        // shaders/gdn_recurrent.comp reads q and k four values at a time.
        return Err(Error::Backend(format!("GDN head dim {} is not a multiple of 4, as the Vulkan delta rule needs", cfg.ssm_head_dim)));
    }
    Ok(())
}

struct Loader<'a> {
    ctx: &'a Arc<Context>,
    pipes: &'a Pipelines,
    stream: &'a mut Stream,
    params: ParamsBuilder,
}

impl Loader<'_> {
    /// A matrix uploaded; on failure the stream is aborted first, so the
    /// matrices already written may be dropped as the error unwinds.
    fn matrix(&mut self, parts: &[&Tensor]) -> Result<GpuMatrix> {
        let m = GpuMatrix::upload(self.ctx, self.pipes, self.stream, parts);
        if m.is_err() {
            self.stream.abort();
        }
        m
    }

    /// Matrices with the same input, fused into one per run of equal type.
    fn fused(&mut self, parts: &[&Tensor]) -> Result<Vec<GpuMatrix>> {
        parts.chunk_by(|a, b| a.ty == b.ty).map(|run| self.matrix(run)).collect()
    }

    fn hyper(&mut self, hc: &HyperConnection) -> Result<GpuHyper> {
        let mut down_inject = vec![&hc.down];
        down_inject.extend(hc.inject.as_ref());
        Ok(GpuHyper {
            norm: self.params.add(&hc.norm),
            down_inject: self.fused(&down_inject)?,
            rank: hc.down.rows(),
            up: self.matrix(&[&hc.up])?,
        })
    }

    fn mixer(&mut self, m: &Mixer) -> Result<GpuMixer> {
        Ok(match m {
            Mixer::Gdn(g) => GpuMixer::Gdn(GpuGdn {
                input: self.fused(&[&g.qkv, &g.z, &g.beta, &g.alpha])?,
                out: self.matrix(&[&g.out])?,
                conv: self.params.add(&g.conv),
                dt_bias: self.params.add(&g.dt_bias),
                decay_a: self.params.add(&g.a),
                norm: self.params.add(&g.norm),
            }),
            Mixer::Attention(a) => {
                let mut input = vec![&a.q, &a.k, &a.v];
                if let Some(ix) = &a.indexer {
                    input.extend([&ix.k_proj, &ix.q_proj]);
                }
                GpuMixer::Attention(GpuAttention {
                    input: self.fused(&input)?,
                    o: self.matrix(&[&a.o])?,
                    q_norm: self.params.add(&a.q_norm),
                    k_norm: self.params.add(&a.k_norm),
                    indexer: a.indexer.as_ref().map(|ix| GpuIndexer {
                        q_norm: self.params.add(&ix.q_norm),
                        k_norm: self.params.add(&ix.k_norm),
                    }),
                })
            }
        })
    }
}

impl GpuModel {
    /// Opens the device and uploads every weight but the embedding and PLE
    /// tables; the routed experts all, or as many as the budget leaves room
    /// for (see the module docs). `host` runs the host's share of the work
    /// (the expert cache's speed measurement) on the model's threads.
    pub fn load(
        cfg: &Config,
        w: &Weights,
        choice: &DeviceChoice,
        placement: &ExpertPlacement,
        host: &OnModelThreads<'_>,
    ) -> Result<GpuModel> {
        check_shapes(cfg)?;
        let ctx = Arc::new(Context::new(choice)?);
        let pipes = Pipelines::new(&ctx, choice.fast_kernels(&ctx), choice.coopmat(&ctx))?;
        let mut stream = Stream::new(&ctx)?;
        let started = std::time::Instant::now();
        let loaded = Self::upload(cfg, w, &ctx, &pipes, &mut stream, placement, host);
        // Every copy ends before anything it writes can be dropped.
        let finished = stream.finish();
        let (layers, output_hc, output, arena, params, mut report) = loaded?;
        finished?;
        report.uploaded_bytes = stream.bytes;
        drop(stream);
        let cache = if report.resident {
            None
        } else {
            let measured = measure_split(cfg, w, &ctx, &arena, host)?;
            report.split = Some(measured);
            let split = Split { forced: placement.admission, background: placement.fill.unwrap_or(false), ..measured };
            let cache = ExpertCache::new(cfg.n_layers, arena.per_layer, cfg.n_experts, split);
            // Every slot filled at load: each layer's most used experts by
            // the routing profile when there is one, else the first ones
            // (with no profile any choice hits as often as another).
            let top: Vec<Vec<u32>> = (0..cfg.n_layers)
                .map(|l| match &placement.warm {
                    Some(profile) => profile.top(l, arena.per_layer),
                    None => (0..arena.per_layer as u32).collect(),
                })
                .collect();
            let slots: Vec<(usize, usize, usize)> =
                top.iter().enumerate().flat_map(|(l, ex)| ex.iter().enumerate().map(move |(s, &e)| (l, s, e as usize))).collect();
            let mut stream = Stream::new(&ctx)?;
            arena.fill(&mut stream, &slots, |l, e| expert_bytes(&w.layers[l].moe, cfg, e))?;
            stream.finish()?;
            report.uploaded_bytes += stream.bytes;
            cache.fill(&top);
            Some(cache)
        };
        report.upload_seconds = started.elapsed().as_secs_f64();
        let spin_wait = placement.spin_wait.unwrap_or(!ctx.on_cpu);
        let prefetch = placement.prefetch.unwrap_or(false);
        let segment_layers = std::env::var("FNX_VK_SEGMENT_LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(SEGMENT_LAYERS);
        Ok(GpuModel { layers, output_hc, output, arena, cache, params, pipes, ctx, report, spin_wait, prefetch, segment_layers })
    }

    #[allow(clippy::type_complexity)]
    fn upload(
        cfg: &Config,
        w: &Weights,
        ctx: &Arc<Context>,
        pipes: &Pipelines,
        stream: &mut Stream,
        placement: &ExpertPlacement,
        _host: &OnModelThreads<'_>,
    ) -> Result<(Vec<GpuLayer>, GpuHyper, GpuMatrix, ExpertArena, Buffer, LoadReport)> {
        let moes: Vec<_> = w.layers.iter().map(|l| &l.moe).collect();
        let (arena_layers, shared_fits) = arena_layers(cfg, &moes)?;
        let slot = slot_bytes(&arena_layers) as u64;
        let (n_layers, e) = (cfg.n_layers as u64, cfg.n_experts as u64);
        let reserve = state_bytes(cfg, placement);
        let room = ctx.room();
        // Everything resident: the dense weights, every expert (the shared
        // ones in the arena when they fit its slots) and one state.
        let dense = dense_bytes(w, false);
        let all = dense + n_layers * (e + shared_fits as u64) * slot + reserve;
        let resident = match placement.forced_slots {
            Some(n) => n >= cfg.n_experts,
            None => all <= room,
        };
        let shared_in_arena = resident && shared_fits;
        let mut up = Loader { ctx, pipes, stream, params: ParamsBuilder::default() };
        let mut layers = Vec::with_capacity(w.layers.len());
        let per_layer_resident = cfg.n_experts + shared_in_arena as usize;
        for (l, layer) in w.layers.iter().enumerate() {
            let moe = &layer.moe;
            let ple = match &layer.ple {
                None => None,
                Some(p) => Some(GpuPle {
                    key: up.matrix(&[&p.key])?,
                    value: up.matrix(&[&p.value])?,
                    norm_key: up.params.add(&p.norm_key),
                    norm_query: up.params.add(&p.norm_query),
                    norm_conv: up.params.add(&p.norm_conv),
                    conv: up.params.add(&p.conv),
                }),
            };
            let shared = if shared_in_arena {
                None
            } else {
                Some(SharedExpert { gate_up: up.matrix(&[&moe.shared_gate_proj, &moe.shared_up])?, down: up.matrix(&[&moe.shared_down])? })
            };
            // Resident: slot = layer * per_layer + expert (the shared one at E).
            let table: Vec<f32> = if resident {
                (0..per_layer_resident).map(|x| f32::from_bits((l * per_layer_resident + x) as u32)).collect()
            } else {
                Vec::new()
            };
            layers.push(GpuLayer {
                attn_hc: up.hyper(&layer.attn_hc)?,
                ffn_hc: up.hyper(&layer.ffn_hc)?,
                mixer: up.mixer(&layer.mixer)?,
                moe: GpuMoe {
                    router: up.matrix(&[&moe.router])?,
                    shared,
                    shared_gate: up.params.add(&moe.shared_gate),
                    slot_table: if resident { up.params.add(&table) } else { super::pipelines::SLOTS_DIRECT },
                },
                ple,
            });
        }
        let output_hc = up.hyper(&w.output_hc)?;
        let output = up.matrix(&[&w.output])?;
        let bytes: Vec<u8> = up.params.0.iter().flat_map(|v| v.to_le_bytes()).collect();
        // Failures from here on abort the stream before anything written is dropped.
        let params = Buffer::new(ctx, "model parameters", bytes.len() as u64, MemoryLocation::GpuOnly).inspect_err(|_| up.stream.abort())?;
        up.stream.write(&params, 0, &bytes)?;
        if ctx.used() + reserve > room {
            up.stream.abort();
            return Err(Error::OutOfMemory(format!(
                "the model's dense weights ({} MiB) and one state ({} MiB) do not fit the VRAM budget of {} MiB",
                ctx.used() >> 20,
                reserve >> 20,
                room >> 20
            )));
        }
        let per_layer = if resident {
            per_layer_resident
        } else {
            let left = room.saturating_sub(ctx.used() + reserve);
            let fits = (left / (n_layers * slot)) as usize;
            placement.forced_slots.unwrap_or(fits).min(cfg.n_experts)
        };
        let arena = ExpertArena::alloc(ctx, pipes, arena_layers, per_layer, shared_in_arena, super::matrix::max_binding_bytes(ctx))
            .inspect_err(|_| up.stream.abort())?;
        if resident {
            arena.fill_all(up.stream, |l, x| expert_bytes(moes[l], cfg, x))?;
        }
        let report = LoadReport { slots_per_layer: per_layer, resident, ..Default::default() };
        Ok((layers, output_hc, output, arena, params, report))
    }

    /// Bytes of device memory in use (weights and every live state).
    pub fn vram_used(&self) -> u64 {
        self.ctx.used()
    }
}

/// Bytes the Vulkan backend needs resident at least: every weight it
/// uploads but the routed experts (the token embedding's and the PLE
/// table's rows are gathered on the host), in the file's encoding.
pub fn dense_weight_bytes(w: &Weights) -> u64 {
    dense_bytes(w, false)
}

/// Bytes of the weights uploaded besides the routed experts (the shared
/// experts too unless `shared_in_arena`).
fn dense_bytes(w: &Weights, shared_in_arena: bool) -> u64 {
    let t = |t: &Tensor| t.bytes().len() as u64;
    let hc = |h: &HyperConnection| t(&h.down) + t(&h.up) + h.inject.as_ref().map_or(0, t);
    let mut n = hc(&w.output_hc) + t(&w.output);
    for l in &w.layers {
        n += hc(&l.attn_hc) + hc(&l.ffn_hc) + t(&l.moe.router);
        if !shared_in_arena {
            n += t(&l.moe.shared_gate_proj) + t(&l.moe.shared_up) + t(&l.moe.shared_down);
        }
        n += match &l.mixer {
            Mixer::Gdn(g) => t(&g.qkv) + t(&g.z) + t(&g.beta) + t(&g.alpha) + t(&g.out),
            Mixer::Attention(a) => {
                t(&a.q) + t(&a.k) + t(&a.v) + t(&a.o) + a.indexer.as_ref().map_or(0, |ix| t(&ix.q_proj) + t(&ix.k_proj))
            }
        };
        n += l.ple.as_ref().map_or(0, |p| t(&p.key) + t(&p.value));
    }
    n
}

/// Device bytes of one state grown from `placement.state_positions` to
/// `placement.grow_to` positions with passes of `placement.micro_batch`
/// tokens (scratch, caches, rings) and of one checkpoint of it (a recurrent plane
/// and the rings per Gated DeltaNet layer, the PLE ring), plus a sixteenth
/// and 1 MiB for the allocator's rounding.
fn state_bytes(cfg: &Config, placement: &ExpertPlacement) -> u64 {
    let positions = placement.state_positions.max(1);
    let grown = placement.grow_to.max(positions);
    let batch = placement.micro_batch.clamp(1, super::state::MAX_BATCH);
    let scratch = super::scratch::ScratchLayout::new(cfg, grown, batch, 1).map_or(0, |l| l.total as u64 * 4);
    let len = |k: &LayerKind, p: usize| 4 * super::caches::layer_len(cfg, k, placement.window, p) as u64;
    // The caches at `grown` positions, and while they grow the attention
    // layers' old ones beside them.
    let old: u64 = if grown > positions { cfg.layers.iter().filter(|k| **k != LayerKind::Linear).map(|k| len(k, positions)).sum() } else { 0 };
    let layers: u64 = cfg.layers.iter().map(|k| len(k, grown)).sum::<u64>() + old;
    let ple = cfg.ple.as_ref().map_or(0, |p| 4 * (crate::cpu::ple::conv_rows(p, placement.window) * cfg.hc * cfg.hidden) as u64);
    let g = super::caches::GdnLayout::new(cfg, placement.window);
    let n_gdn = cfg.layers.iter().filter(|k| **k == LayerKind::Linear).count() as u64;
    let checkpoint = n_gdn * 4 * (g.conv_rows * cfg.ssm_conv_dim() + g.plane) as u64 + ple;
    let n = scratch + layers + ple + checkpoint;
    n + n / 16 + (1 << 20)
}

/// The speeds the expert cache splits misses by: the host computing ten
/// experts of layer 0 from the mapped file, and ten of them repacked and
/// copied into the arena (both the second of two runs).
fn measure_split(
    cfg: &Config,
    w: &Weights,
    ctx: &Arc<Context>,
    arena: &ExpertArena,
    host: &OnModelThreads<'_>,
) -> Result<Split> {
    use crate::cpu::moe::{expert_outputs, Expert};
    let moe = &w.layers[0].moe;
    let n = cfg.n_experts.min(10);
    let experts: Vec<Expert> = (0..n).map(Expert::Routed).collect();
    let bytes: u64 = (0..n).map(|x| { let b = expert_bytes(moe, cfg, x); b.0.iter().map(|p| p.len()).sum::<usize>() + b.1.len() }).sum::<usize>() as u64;
    let x = vec![0.5f32; cfg.hidden];
    let mut host_s = f64::INFINITY;
    for _ in 0..2 {
        let t = std::time::Instant::now();
        host(&mut || {
            std::hint::black_box(expert_outputs(moe, cfg, &x, &experts));
        });
        host_s = host_s.min(t.elapsed().as_secs_f64());
    }
    let mut upload_s = f64::INFINITY;
    if arena.per_layer > 0 {
        let mut stream = Stream::new(ctx)?;
        for _ in 0..2 {
            let t = std::time::Instant::now();
            // One at a time, as a decode step uploads them.
            for x in 0..n {
                arena.write(&mut stream, 0, x % arena.per_layer, &expert_bytes(moe, cfg, x))?;
            }
            stream.finish()?;
            upload_s = upload_s.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(Split {
        host_bytes_per_s: bytes as f64 / host_s.max(1e-9),
        upload_bytes_per_s: if upload_s.is_finite() { bytes as f64 / upload_s.max(1e-9) } else { 0.0 },
        forced: None,
        background: false,
    })
}

/// The Vulkan backend of a model: its weights on the device, shared with every state.
pub struct VulkanBackend(Arc<GpuModel>);

impl VulkanBackend {
    /// Opens the device `choice` names and uploads the weights (see [`GpuModel::load`]).
    pub fn load(
        cfg: &Config,
        w: &Weights,
        choice: &DeviceChoice,
        placement: &ExpertPlacement,
        host: &OnModelThreads<'_>,
    ) -> Result<VulkanBackend> {
        Ok(VulkanBackend(Arc::new(GpuModel::load(cfg, w, choice, placement, host)?)))
    }

    /// What the load measured.
    pub fn report(&self) -> &LoadReport {
        &self.0.report
    }
}

impl BackendModel for VulkanBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vulkan
    }

    fn device_name(&self) -> String {
        self.0.ctx.name.clone()
    }

    fn device_bytes_used(&self) -> u64 {
        self.0.vram_used()
    }

    fn new_state(&self, model: &Model) -> Result<Box<dyn BackendState>> {
        Ok(Box::new(super::state::GpuState::new(&self.0, model, 0)?))
    }

    fn expert_cache(&self) -> Option<ExpertCacheReport> {
        let c = self.0.cache.as_ref()?;
        let s = c.stats();
        // The speeds measured at load (the cache's own split may be a forced admission count).
        let measured = self.0.report.split.unwrap_or(c.split);
        Some(ExpertCacheReport {
            slots_per_layer: c.slots,
            host_bytes_per_s: measured.host_bytes_per_s,
            upload_bytes_per_s: measured.upload_bytes_per_s,
            tokens: s.tokens,
            hits: s.hits,
            misses: s.misses,
            host_experts: s.host_experts,
            uploads: s.uploads,
            fills: s.fills,
            upload_bytes: s.upload_bytes,
            host_seconds: s.host_ns as f64 * 1e-9,
            upload_seconds: s.upload_ns as f64 * 1e-9,
            wait_seconds: s.wait_ns as f64 * 1e-9,
            recorded_seconds: s.recorded_ns as f64 * 1e-9,
            join_seconds: s.join_ns as f64 * 1e-9,
            prefetch_bytes: s.prefetch_bytes,
            predicted: s.predicted,
            predicted_of: s.predicted_of,
        })
    }

    fn reset_expert_cache_counts(&self) {
        if let Some(c) = &self.0.cache {
            c.reset_stats();
        }
    }

    fn routing_profile(&self) -> Option<RoutingProfile> {
        self.0.cache.as_ref().map(|c| RoutingProfile::new(c.profile()))
    }

    fn load_transfer(&self) -> Option<(u64, f64)> {
        Some((self.0.report.uploaded_bytes, self.0.report.upload_seconds))
    }

    fn gpu_kernels(&self) -> Option<crate::quant::kernels::Kernels> {
        use crate::quant::kernels::Kernels;
        Some(if self.0.pipes.fast { Kernels::Fast } else { Kernels::Exact })
    }

    fn gpu_coopmat(&self) -> bool {
        self.0.pipes.mm
    }

    fn empty_dispatch_us(&self) -> Result<Option<f64>> {
        super::record::empty_dispatch_us(&self.0.ctx, &self.0.pipes, 500).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_past_the_shaders_are_refused_with_the_reason() {
        let ok = Config { ssm_head_dim: 128, ..Config::published_one_layer() };
        assert!(check_shapes(&ok).is_ok());
        let odd = Config { ssm_head_dim: 30, ..ok.clone() };
        let e = check_shapes(&odd).unwrap_err().to_string();
        assert!(e.contains("GDN head dim 30 is not a multiple of 4"), "{e}");
        let wide = Config { ssm_head_dim: 256, ..ok };
        let e = check_shapes(&wide).unwrap_err().to_string();
        assert!(e.contains("GDN head dim 256 exceeds"), "{e}");
    }
}
