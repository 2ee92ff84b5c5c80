//! A GPU state's per-layer buffers and what binds them.
//!
//! One buffer per layer (set 0 binding 1 of that layer's dispatches), then
//! one for the PLE conv history:
//!
//! | buffer | contents (floats) |
//! |---|---|
//! | Gated DeltaNet | conv ring `[Kc-1+W][Dc]` at 0, then `W+1` recurrent planes `[nv][dk][dv]` |
//! | attention | keys, values `[capacity][nkv*hd]`, raw indexer keys, block keys `[capacity][id]` |
//! | PLE | conv ring `[(Kp-1)*G+W][C*H]` |
//!
//! (`W` the model's rewind window; the rings and planes are indexed by
//! position as `model::backend` describes.) Attention caches grow with the
//! context: a state starts with room for [`INITIAL_CAPACITY`] positions and,
//! when a token needs more, doubles it (up to `n_ctx`): new buffers are
//! allocated, the filled caches copied on the GPU, and the descriptor sets
//! written again. Everything is allocated and bound before anything is
//! replaced, so a growth that runs out of memory leaves the state as it was.

use super::buffer::{Buffer, Commands};
use super::model::GpuModel;
use super::record::DescriptorPool;
use crate::cpu::{gdn, ple};
use crate::error::{Error, Result};
use crate::model::{Config, LayerKind};
use ash::vk;
use gpu_allocator::MemoryLocation;

/// Positions a new state's attention caches hold before they first grow.
pub const INITIAL_CAPACITY: usize = 1024;

/// Float offsets inside an attention layer's state buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnLayout {
    pub keys: u32,
    pub values: u32,
    pub raw_keys: u32,
    pub block_keys: u32,
    pub total: usize,
}

impl AttnLayout {
    pub fn new(cfg: &Config, capacity: usize) -> AttnLayout {
        let kv = cfg.n_kv_heads * cfg.head_dim;
        let id = cfg.qsa.as_ref().map_or(0, |q| q.head_dim);
        let (values, raw_keys) = (capacity * kv, 2 * capacity * kv);
        let block_keys = raw_keys + capacity * id;
        AttnLayout { keys: 0, values: values as u32, raw_keys: raw_keys as u32, block_keys: block_keys as u32, total: block_keys + capacity * id }
    }
}

/// Float offsets inside a Gated DeltaNet layer's state buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GdnLayout {
    /// Rows of the conv ring (at offset 0), each `Dc` floats.
    pub conv_rows: usize,
    /// Offset of the first recurrent plane.
    pub planes: u32,
    /// Floats per plane.
    pub plane: usize,
    pub n_planes: usize,
    pub total: usize,
}

impl GdnLayout {
    pub fn new(cfg: &Config, window: usize) -> GdnLayout {
        let conv_rows = gdn::conv_rows(cfg.ssm_conv - 1, window);
        let planes = (conv_rows * cfg.ssm_conv_dim()).div_ceil(4) * 4;
        let plane = gdn::GdnState::plane_len(cfg);
        GdnLayout { conv_rows, planes: planes as u32, plane, n_planes: window + 1, total: planes + (window + 1) * plane }
    }

    /// Offset of the plane holding the state after `n` tokens.
    pub fn plane_at(&self, n: usize) -> u32 {
        self.planes + ((n % self.n_planes) * self.plane) as u32
    }
}

/// Floats of the PLE conv ring.
fn ple_len(cfg: &Config, window: usize) -> usize {
    cfg.ple.as_ref().map_or(0, |p| ple::conv_rows(p, window) * cfg.hc * cfg.hidden)
}

/// Floats of each layer's state buffer at `capacity` positions.
pub(crate) fn layer_len(cfg: &Config, kind: &LayerKind, window: usize, capacity: usize) -> usize {
    match kind {
        LayerKind::Linear => GdnLayout::new(cfg, window).total,
        LayerKind::Attention { .. } => AttnLayout::new(cfg, capacity).total,
    }
}

/// What binds a state's buffers: the pool and its sets (set 0 per layer,
/// then the output mixer's, then the PLE layer's).
pub(crate) struct Bindings {
    pub sets: Vec<vk::DescriptorSet>,
    _pool: DescriptorPool,
}

impl Bindings {
    fn new(g: &GpuModel, scratch: &Buffer, layers: &[&Buffer], n_layers: usize, dummy: &Buffer) -> Result<Bindings> {
        let n_sets = n_layers + 2;
        let pool = DescriptorPool::new(&g.ctx, n_sets as u32, 3 * n_sets as u32)?;
        let state_set = |b: &Buffer| pool.set(g.pipes.state_layout, &[&[scratch.info()], &[b.info()], &[g.params.info()]]);
        let mut sets = Vec::with_capacity(n_sets);
        for b in &layers[..n_layers] {
            sets.push(state_set(b)?);
        }
        sets.push(state_set(dummy)?);
        if let Some(p) = layers.get(n_layers) {
            sets.push(state_set(p)?);
        }
        Ok(Bindings { sets, _pool: pool })
    }
}

/// The per-layer buffers of one state, their layouts and bindings.
pub(crate) struct Caches {
    /// Per layer, then the PLE history if any.
    pub buffers: Vec<Buffer>,
    pub attn: AttnLayout,
    pub gdn: GdnLayout,
    /// Positions the attention caches hold now (grows up to `n_ctx`).
    pub capacity: usize,
    /// The model's rewind window (the rings' and planes' extra positions).
    pub window: usize,
    pub bindings: Bindings,
    /// A 16-byte stand-in for the output mixer's layer buffer.
    dummy: Buffer,
}

impl Caches {
    /// Checks that every buffer fits one binding at the largest `n_ctx`, then
    /// allocates them for `capacity` positions (zeroed by the caller).
    pub fn new(g: &GpuModel, cfg: &Config, window: usize, n_ctx: usize, capacity: usize, scratch: &Buffer) -> Result<Caches> {
        let ctx = &g.ctx;
        for kind in &cfg.layers {
            let bytes = 4 * layer_len(cfg, kind, window, n_ctx) as u64;
            if bytes > ctx.limits.max_storage_buffer_range as u64 {
                return Err(Error::OutOfMemory(format!(
                    "a layer's GPU state for n_ctx {n_ctx} ({bytes} bytes) exceeds one storage-buffer binding; lower n_ctx"
                )));
            }
        }
        let mut buffers = Vec::with_capacity(cfg.n_layers + 1);
        for kind in &cfg.layers {
            buffers.push(Buffer::new(ctx, "layer state", 4 * layer_len(cfg, kind, window, capacity) as u64, MemoryLocation::GpuOnly)?);
        }
        if cfg.ple.is_some() {
            buffers.push(Buffer::new(ctx, "PLE conv history", 4 * ple_len(cfg, window) as u64, MemoryLocation::GpuOnly)?);
        }
        let dummy = Buffer::new(ctx, "no layer state", 16, MemoryLocation::GpuOnly)?;
        let bindings = Bindings::new(g, scratch, &buffers.iter().collect::<Vec<_>>(), cfg.n_layers, &dummy)?;
        Ok(Caches { buffers, attn: AttnLayout::new(cfg, capacity), gdn: GdnLayout::new(cfg, window), capacity, window, bindings, dummy })
    }

    /// Records zero fills of every buffer.
    pub fn record_zero(&self, cmds: &Commands) {
        for b in &self.buffers {
            // SAFETY: recording; the buffer is live and the range is whole.
            unsafe { b.context().device.cmd_fill_buffer(cmds.cmd, b.raw, 0, vk::WHOLE_SIZE, 0) };
        }
    }

    /// Binds `scratch` in place of the state's scratch buffer (on error nothing has changed).
    pub fn rebind(&mut self, g: &GpuModel, cfg: &Config, scratch: &Buffer) -> Result<()> {
        self.bindings = Bindings::new(g, scratch, &self.buffers.iter().collect::<Vec<_>>(), cfg.n_layers, &self.dummy)?;
        Ok(())
    }

    /// Reallocates the attention buffers for `capacity` positions (and binds
    /// `scratch`, allocated by the caller for that capacity), copying the
    /// first `min(old, new)` positions of every cache when `keep`. On error
    /// nothing has changed.
    pub fn set_capacity(&mut self, g: &GpuModel, cfg: &Config, cmds: &Commands, capacity: usize, keep: bool, scratch: &Buffer) -> Result<()> {
        let ctx = &g.ctx;
        let attn = AttnLayout::new(cfg, capacity);
        // Allocate everything first: an error here leaves the state intact.
        let mut grown = Vec::new();
        for (i, kind) in cfg.layers.iter().enumerate() {
            if matches!(kind, LayerKind::Attention { .. }) {
                let bytes = 4 * attn.total as u64;
                grown.push((i, Buffer::new(ctx, "layer state", bytes, MemoryLocation::GpuOnly)?));
            }
        }
        cmds.begin()?;
        let d = &ctx.device;
        let kept = self.capacity.min(capacity);
        let (kv, id) = (cfg.n_kv_heads * cfg.head_dim, cfg.qsa.as_ref().map_or(0, |q| q.head_dim));
        for (i, buffer) in &grown {
            // SAFETY: recording; both buffers are live, and every region lies
            // inside both (a cache region holds `capacity` rows of its width).
            unsafe {
                d.cmd_fill_buffer(cmds.cmd, buffer.raw, 0, vk::WHOLE_SIZE, 0);
                if keep && kept > 0 {
                    let fill = vk::MemoryBarrier::default()
                        .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                        .dst_access_mask(vk::AccessFlags::TRANSFER_WRITE);
                    d.cmd_pipeline_barrier(
                        cmds.cmd,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::DependencyFlags::empty(),
                        &[fill],
                        &[],
                        &[],
                    );
                    let region = |from: u32, to: u32, width: usize| vk::BufferCopy {
                        src_offset: from as u64 * 4,
                        dst_offset: to as u64 * 4,
                        size: (kept * width * 4) as u64,
                    };
                    let (a, b) = (&self.attn, &attn);
                    let regions: Vec<_> = [
                        region(a.keys, b.keys, kv),
                        region(a.values, b.values, kv),
                        region(a.raw_keys, b.raw_keys, id),
                        region(a.block_keys, b.block_keys, id),
                    ]
                    .into_iter()
                    .filter(|r| r.size > 0)
                    .collect();
                    d.cmd_copy_buffer(cmds.cmd, self.buffers[*i].raw, buffer.raw, &regions);
                }
            }
        }
        cmds.submit()?;
        // Bind the new buffers before replacing anything: on error the state is as it was.
        let bound: Vec<&Buffer> = (0..self.buffers.len())
            .map(|i| grown.iter().find(|(g, _)| *g == i).map_or(&self.buffers[i], |(_, b)| b))
            .collect();
        let bindings = Bindings::new(g, scratch, &bound, cfg.n_layers, &self.dummy)?;
        for (i, buffer) in grown {
            self.buffers[i] = buffer;
        }
        self.bindings = bindings;
        self.attn = attn;
        self.capacity = capacity;
        Ok(())
    }
}
