//! The decode state of one sequence on the GPU and the recording of one
//! token. Everything a token needs lives in device memory: a scratch buffer
//! holding every activation at a fixed offset ([`ScratchLayout`]), and per
//! layer a state buffer (GDN conv + recurrent state; or attention keys,
//! values, raw indexer keys and block keys). One descriptor set per layer is
//! written at creation; per token the host
//! writes the embedding row, the PLE rows and the RoPE cos/sin tables into a
//! small host-visible buffer, records the whole network (push constants,
//! dispatches, barriers) into one command buffer, submits once and waits on
//! one fence, then reads the logits.
//!
//! Attention caches grow with the context: a state starts with room for
//! [`INITIAL_CAPACITY`] positions and, when a token needs more, doubles it
//! (up to `n_ctx`): new buffers are allocated, the filled caches copied on
//! the GPU, and the descriptor sets written again. Everything is allocated
//! before anything is replaced, so a growth that runs out of memory leaves
//! the state as it was. The scratch regions that scale with the context
//! (block scores, selection, attention weights) sit at the end of the
//! scratch buffer, so every other offset is the same at any capacity.

use super::buffer::{Buffer, Commands};
use super::model::{GpuHyper, GpuMixer, GpuModel};
use super::pipelines::*;
use super::record::{DescriptorPool, Recorder, Timestamps, TokenStats};
use crate::error::{Error, Result};
use crate::model::ops::Rope;
use crate::model::{Config, LayerKind, Model};
use ash::vk;
use gpu_allocator::MemoryLocation;

/// Float offsets of every activation in the scratch buffer.
#[derive(Default, Debug)]
struct ScratchLayout {
    residual: u32,
    ple_rows: u32,
    rope: u32,
    /// One block-key table per attention layer.
    block_rope: u32,
    /// End of the region the host uploads per token.
    input_len: u32,
    xn: u32,
    low: u32,
    mix: u32,
    input: u32,
    inject: u32,
    ple_key: u32,
    ple_value: u32,
    ple_tmp: u32,
    qkv: u32,
    z: u32,
    beta: u32,
    alpha: u32,
    conv_out: u32,
    gdn_out: u32,
    qg: u32,
    k: u32,
    v: u32,
    q: u32,
    iq: u32,
    ik: u32,
    scores: u32,
    sel: u32,
    att_tmp: u32,
    att_out: u32,
    router: u32,
    ids: u32,
    weights: u32,
    exp_h: u32,
    exp_y: u32,
    sh_h: u32,
    sh_y: u32,
    logits: u32,
    total: u32,
}

impl ScratchLayout {
    fn new(cfg: &Config, n_ctx: usize) -> Result<Self> {
        let (h, c) = (cfg.hidden, cfg.hc);
        let n_attn = cfg.layers.iter().filter(|k| **k != LayerKind::Linear).count();
        let (ih, id) = cfg.qsa.as_ref().map_or((0, 0), |q| (q.n_heads, q.head_dim));
        let mut at = 0usize;
        let mut next = |n: usize| {
            let o = at;
            at += n.div_ceil(4) * 4;
            o as u32
        };
        let mut l = ScratchLayout {
            residual: next(c * h),
            ple_rows: next(if cfg.ple.is_some() { h } else { 0 }),
            rope: next(cfg.rope_dims),
            block_rope: next(n_attn * cfg.rope_dims),
            ..Default::default()
        };
        l.input_len = next(0);
        l.xn = next(c * h);
        // Outputs of fused projections are contiguous.
        l.low = next(cfg.hc_rank + c);
        l.inject = l.low + cfg.hc_rank as u32;
        l.mix = next(c * h);
        l.input = next(h);
        l.ple_key = next(c * h);
        l.ple_value = next(h);
        l.ple_tmp = next(c * h);
        let dv = cfg.ssm_v_heads * cfg.ssm_head_dim;
        l.qkv = next(cfg.ssm_conv_dim() + dv + 2 * cfg.ssm_v_heads);
        l.z = l.qkv + cfg.ssm_conv_dim() as u32;
        l.beta = l.z + dv as u32;
        l.alpha = l.beta + cfg.ssm_v_heads as u32;
        l.conv_out = next(cfg.ssm_conv_dim());
        l.gdn_out = next(dv);
        let (nh, kv) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
        l.qg = next(2 * nh + 2 * kv + id + ih * id);
        l.k = l.qg + 2 * nh as u32;
        l.v = l.k + kv as u32;
        l.ik = l.v + kv as u32;
        l.iq = l.ik + id as u32;
        l.q = next(nh);
        l.att_out = next(nh);
        l.router = next(cfg.n_experts);
        // The chosen experts, and the shared one when it runs in the arena.
        let k = cfg.n_experts_used + 1;
        l.ids = next(k);
        l.weights = next(k);
        l.exp_h = next(k * exp_h_stride(cfg) as usize);
        l.exp_y = next(k * h);
        l.sh_h = next(cfg.shared_ff);
        l.sh_y = next(h);
        l.logits = next(cfg.vocab);
        // Last: the regions that scale with the capacity.
        l.scores = next(n_ctx);
        l.sel = next(n_ctx);
        l.att_tmp = next(cfg.n_heads * n_ctx);
        l.total = next(0);
        if at > u32::MAX as usize / 4 {
            return Err(Error::OutOfMemory(format!("GPU scratch of {at} floats is too large; lower n_ctx")));
        }
        Ok(l)
    }
}

/// Floats between consecutive experts' hidden activations: the expert width
/// rounded up to 4, as the down matvec reads its input in vec4s.
fn exp_h_stride(cfg: &Config) -> u32 {
    cfg.expert_ff.div_ceil(4) as u32 * 4
}

/// Float offsets inside an attention layer's state buffer.
#[derive(Clone, Copy, Debug)]
struct AttnLayout {
    keys: u32,
    values: u32,
    raw_keys: u32,
    block_keys: u32,
    total: usize,
}

fn attn_layout(cfg: &Config, n_ctx: usize) -> AttnLayout {
    let kv = cfg.n_kv_heads * cfg.head_dim;
    let id = cfg.qsa.as_ref().map_or(0, |q| q.head_dim);
    let (values, raw_keys) = (n_ctx * kv, 2 * n_ctx * kv);
    let block_keys = raw_keys + n_ctx * id;
    AttnLayout { keys: 0, values: values as u32, raw_keys: raw_keys as u32, block_keys: block_keys as u32, total: block_keys + n_ctx * id }
}

/// Floats of each layer's state buffer.
fn layer_state_len(cfg: &Config, kind: &LayerKind, n_ctx: usize) -> usize {
    match kind {
        LayerKind::Linear => (cfg.ssm_conv - 1) * cfg.ssm_conv_dim() + cfg.ssm_v_heads * cfg.ssm_head_dim * cfg.ssm_head_dim,
        LayerKind::Attention { .. } => attn_layout(cfg, n_ctx).total,
    }
}

/// Positions a new state's attention caches hold before they first grow.
pub const INITIAL_CAPACITY: usize = 1024;

/// A copy of a state's buffers ([`GpuState::save`]), at the capacity it was taken at.
#[derive(Clone, Debug)]
pub struct SavedState {
    capacity: usize,
    buffers: Vec<Vec<u8>>,
}

/// What binds a state's buffers: the pool and its sets (set 0 per layer,
/// then the output mixer's, then the PLE layer's).
struct Bindings {
    sets: Vec<vk::DescriptorSet>,
    _pool: DescriptorPool,
}

impl Bindings {
    fn new(g: &GpuModel, scratch: &Buffer, layer_state: &[&Buffer], n_layers: usize, dummy: &Buffer) -> Result<Bindings> {
        let n_sets = n_layers + 2;
        let pool = DescriptorPool::new(&g.ctx, n_sets as u32, 3 * n_sets as u32)?;
        let state_set = |b: &Buffer| pool.set(g.pipes.state_layout, &[&[scratch.info()], &[b.info()], &[g.params.info()]]);
        let mut sets = Vec::with_capacity(n_sets);
        for b in &layer_state[..n_layers] {
            sets.push(state_set(b)?);
        }
        sets.push(state_set(dummy)?);
        if let Some(ple) = layer_state.get(n_layers) {
            sets.push(state_set(ple)?);
        }
        Ok(Bindings { sets, _pool: pool })
    }
}

pub struct GpuState {
    layout: ScratchLayout,
    attn: AttnLayout,
    /// Per layer, then the PLE history if any: the buffers `reset` zeroes and snapshots copy.
    layer_state: Vec<Buffer>,
    /// Set 0 per layer, then the output mixer's, then the PLE layer's.
    sets: Vec<vk::DescriptorSet>,
    /// Most positions a state may hold.
    n_ctx: usize,
    /// Positions the attention caches hold now (grows up to `n_ctx`).
    capacity: usize,
    stats: TokenStats,
    /// Per-dispatch timestamps when profiling ([`GpuState::enable_timestamps`]).
    timestamps: Option<Timestamps>,
    /// Milliseconds per pipeline of the last token, when profiling.
    stage_ms: Vec<(&'static str, f64)>,
    bindings: Bindings,
    upload: Buffer,
    readback: Buffer,
    scratch: Buffer,
    dummy: Buffer,
    cmds: Commands,
}

impl std::fmt::Debug for GpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuState(n_ctx {}, capacity {})", self.n_ctx, self.capacity)
    }
}

fn gpu(model: &Model) -> &GpuModel {
    model.gpu.as_ref().expect("GPU states belong to models loaded for Vulkan")
}

impl GpuState {
    pub fn new(model: &Model) -> Result<GpuState> {
        let (cfg, g) = (&model.config, gpu(model));
        let ctx = &g.ctx;
        let n_ctx = model.n_ctx;
        // Checked at the largest size the state may grow to, so that a
        // context too long for one binding fails now, not mid-sequence.
        ScratchLayout::new(cfg, n_ctx)?;
        for kind in &cfg.layers {
            let bytes = 4 * layer_state_len(cfg, kind, n_ctx) as u64;
            if bytes > ctx.limits.max_storage_buffer_range as u64 {
                return Err(Error::OutOfMemory(format!(
                    "a layer's GPU state for n_ctx {n_ctx} ({bytes} bytes) exceeds one storage-buffer binding; lower n_ctx"
                )));
            }
        }
        // `FNX_VULKAN_INITIAL_CAPACITY` lowers the start (tests use it to grow often).
        let initial = std::env::var("FNX_VULKAN_INITIAL_CAPACITY").ok().and_then(|v| v.parse::<usize>().ok());
        let capacity = n_ctx.min(initial.unwrap_or(INITIAL_CAPACITY).max(1));
        let layout = ScratchLayout::new(cfg, capacity)?;
        let f = |n: usize| (n * 4) as u64;
        let scratch = Buffer::new(ctx, "GPU scratch", f(layout.total as usize), MemoryLocation::GpuOnly)?;
        let upload = Buffer::new(ctx, "token upload", f(layout.input_len as usize), MemoryLocation::CpuToGpu)?;
        let readback = Buffer::new(ctx, "logits readback", f(cfg.vocab), MemoryLocation::GpuToCpu)?;
        let dummy = Buffer::new(ctx, "no layer state", 16, MemoryLocation::GpuOnly)?;
        let mut layer_state = Vec::with_capacity(cfg.n_layers + 1);
        for kind in &cfg.layers {
            layer_state.push(Buffer::new(ctx, "layer state", f(layer_state_len(cfg, kind, capacity)), MemoryLocation::GpuOnly)?);
        }
        if let Some(p) = &cfg.ple {
            let n = (p.conv_kernel - 1) * p.ngram * cfg.hc * cfg.hidden;
            layer_state.push(Buffer::new(ctx, "PLE conv history", f(n), MemoryLocation::GpuOnly)?);
        }
        let bindings = Bindings::new(g, &scratch, &layer_state.iter().collect::<Vec<_>>(), cfg.n_layers, &dummy)?;
        let cmds = Commands::new(ctx)?;
        let mut s = GpuState {
            layout,
            attn: attn_layout(cfg, capacity),
            layer_state,
            sets: bindings.sets.clone(),
            n_ctx,
            capacity,
            stats: TokenStats::default(),
            timestamps: None,
            stage_ms: Vec::new(),
            bindings,
            upload,
            readback,
            scratch,
            dummy,
            cmds,
        };
        s.reset()?;
        Ok(s)
    }

    /// Positions the attention caches hold now.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Makes room for `positions` positions: the capacity doubles (at least
    /// to `positions`, at most to `n_ctx`). The filled caches are copied when
    /// `keep`. On error nothing has changed.
    fn grow(&mut self, model: &Model, positions: usize, keep: bool) -> Result<()> {
        if positions <= self.capacity {
            return Ok(());
        }
        let capacity = (2 * self.capacity).min(self.n_ctx).max(positions);
        self.set_capacity(model, capacity, keep)
    }

    /// Reallocates the context-sized buffers for `capacity` positions,
    /// copying the first `min(old, new)` positions of every cache when `keep`.
    fn set_capacity(&mut self, model: &Model, capacity: usize, keep: bool) -> Result<()> {
        if capacity == self.capacity {
            return Ok(());
        }
        let (cfg, g) = (&model.config, gpu(model));
        let ctx = &g.ctx;
        let layout = ScratchLayout::new(cfg, capacity)?;
        let attn = attn_layout(cfg, capacity);
        // Allocate everything first: an error here leaves the state intact.
        let scratch = Buffer::new(ctx, "GPU scratch", (layout.total as u64) * 4, MemoryLocation::GpuOnly)?;
        let mut grown = Vec::new();
        for (i, kind) in cfg.layers.iter().enumerate() {
            if matches!(kind, LayerKind::Attention { .. }) {
                let bytes = 4 * layer_state_len(cfg, kind, capacity) as u64;
                grown.push((i, Buffer::new(ctx, "layer state", bytes, MemoryLocation::GpuOnly)?));
            }
        }
        self.cmds.begin()?;
        let d = &ctx.device;
        let kept = self.capacity.min(capacity);
        let (kv, id) = (cfg.n_kv_heads * cfg.head_dim, cfg.qsa.as_ref().map_or(0, |q| q.head_dim));
        for (i, buffer) in &grown {
            // SAFETY: recording; both buffers are live, and every region lies
            // inside both (a cache region holds `capacity` rows of its width).
            unsafe {
                d.cmd_fill_buffer(self.cmds.cmd, buffer.raw, 0, vk::WHOLE_SIZE, 0);
                if keep && kept > 0 {
                    let fill = vk::MemoryBarrier::default()
                        .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                        .dst_access_mask(vk::AccessFlags::TRANSFER_WRITE);
                    d.cmd_pipeline_barrier(
                        self.cmds.cmd,
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
                    d.cmd_copy_buffer(self.cmds.cmd, self.layer_state[*i].raw, buffer.raw, &regions);
                }
            }
        }
        self.cmds.submit()?;
        // Bind the new buffers before replacing anything: on error the state is as it was.
        let bound: Vec<&Buffer> = (0..self.layer_state.len())
            .map(|i| grown.iter().find(|(g, _)| *g == i).map_or(&self.layer_state[i], |(_, b)| b))
            .collect();
        let bindings = Bindings::new(g, &scratch, &bound, cfg.n_layers, &self.dummy)?;
        for (i, buffer) in grown {
            self.layer_state[i] = buffer;
        }
        self.sets = bindings.sets.clone();
        self.bindings = bindings;
        self.scratch = scratch;
        self.layout = layout;
        self.attn = attn;
        self.capacity = capacity;
        Ok(())
    }

    /// GPU work of the last decoded token.
    pub fn stats(&self) -> TokenStats {
        self.stats
    }

    /// Times every dispatch of the following tokens on the GPU (see
    /// [`GpuState::stage_ms`]); an error when the device cannot.
    pub fn enable_timestamps(&mut self) -> Result<()> {
        if self.timestamps.is_none() {
            self.timestamps = Some(Timestamps::new(self.scratch.context_arc())?);
        }
        Ok(())
    }

    /// GPU milliseconds per pipeline (summed over its dispatches) of the last
    /// token, when timestamps are enabled; otherwise empty.
    pub fn stage_ms(&self) -> &[(&'static str, f64)] {
        &self.stage_ms
    }

    /// Zeroes every recurrent state and cache.
    pub fn reset(&mut self) -> Result<()> {
        self.cmds.begin()?;
        for b in &self.layer_state {
            // SAFETY: recording; the buffer is live and the range is whole.
            unsafe { self.scratch.context().device.cmd_fill_buffer(self.cmds.cmd, b.raw, 0, vk::WHOLE_SIZE, 0) };
        }
        self.cmds.submit()
    }

    /// Copies of the state buffers (every layer's state and the PLE history).
    pub fn save(&self) -> Result<SavedState> {
        let buffers = self.layer_state.iter().map(|b| self.cmds.download(b, 0, b.size as usize)).collect::<Result<_>>()?;
        Ok(SavedState { capacity: self.capacity, buffers })
    }

    /// Restores buffers made by [`GpuState::save`] on a state of the same
    /// model, at the capacity they were saved at.
    pub fn restore(&mut self, model: &Model, saved: &SavedState) -> Result<()> {
        self.set_capacity(model, saved.capacity, false)?;
        for (b, bytes) in self.layer_state.iter().zip(&saved.buffers) {
            self.cmds.upload(b, 0, bytes)?;
        }
        Ok(())
    }

    /// Decodes `token` at `pos` and returns its logits. `ple_rows` are the
    /// token's PLE table rows, concatenated ([H]), when the model has PLE.
    pub fn decode(&mut self, model: &Model, token: u32, pos: usize, ple_rows: Option<&[f32]>) -> Result<Vec<f32>> {
        self.grow(model, pos + 1, true)?;
        let (cfg, g) = (&model.config, gpu(model));
        self.write_inputs(model, token, pos, ple_rows);
        self.cmds.begin()?;
        let mut rec = Recorder::new(&g.ctx, &g.pipes, self.cmds.cmd);
        if let Some(t) = &self.timestamps {
            rec.profile_into(t.pool);
        }
        let l = &self.layout;
        let input_bytes = (l.input_len * 4) as u64;
        // SAFETY: recording; regions lie inside both buffers.
        unsafe {
            g.ctx.device.cmd_copy_buffer(rec.cmd, self.upload.raw, self.scratch.raw, &[vk::BufferCopy { src_offset: 0, dst_offset: 0, size: input_bytes }]);
        }
        rec.barrier(vk::PipelineStageFlags::TRANSFER, vk::AccessFlags::TRANSFER_WRITE, vk::PipelineStageFlags::COMPUTE_SHADER);
        self.record_token(&mut rec, cfg, g, pos);
        let logits_bytes = (cfg.vocab * 4) as u64;
        // SAFETY: as above.
        unsafe {
            g.ctx.device.cmd_copy_buffer(
                rec.cmd,
                self.scratch.raw,
                self.readback.raw,
                &[vk::BufferCopy { src_offset: (l.logits * 4) as u64, dst_offset: 0, size: logits_bytes }],
            );
        }
        let mut stats = rec.stats;
        self.cmds.submit()?;
        stats.submits = 1;
        self.stats = stats;
        if let Some(t) = &self.timestamps {
            self.stage_ms = t.read(rec.profiled())?;
        }
        let bytes = &self.readback.mapped()[..logits_bytes as usize];
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
    }

    /// The embedding repeated over the streams, the PLE rows, and the RoPE
    /// tables of this position and of any block it completes.
    fn write_inputs(&mut self, model: &Model, token: u32, pos: usize, ple_rows: Option<&[f32]>) {
        let cfg = &model.config;
        let l = &self.layout;
        let mut v = vec![0f32; l.input_len as usize];
        let h = cfg.hidden;
        model.weights.token_embd.dequantize_row(token as usize, &mut v[..h]);
        for c in 1..cfg.hc {
            v.copy_within(0..h, c * h);
        }
        if let Some(rows) = ple_rows {
            v[l.ple_rows as usize..l.ple_rows as usize + h].copy_from_slice(rows);
        }
        let rope = Rope::new(cfg.rope_dims, cfg.rope_theta);
        let table = |out: &mut [f32], p: usize| {
            // Rotating (1..1, 0..0) yields (cos.., sin..) exactly as the CPU computes them.
            let half = cfg.rope_dims / 2;
            out[..half].fill(1.0);
            out[half..2 * half].fill(0.0);
            rope.apply(out, p);
        };
        table(&mut v[l.rope as usize..l.rope as usize + cfg.rope_dims], pos);
        let attn = cfg.layers.iter().filter_map(|k| match k {
            LayerKind::Attention { compress_ratio } => Some(*compress_ratio),
            LayerKind::Linear => None,
        });
        for (i, ratio) in attn.enumerate() {
            if ratio > 0 && (pos + 1).is_multiple_of(ratio) {
                let at = l.block_rope as usize + i * cfg.rope_dims;
                table(&mut v[at..at + cfg.rope_dims], pos + 1 - ratio);
            }
        }
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.upload.mapped()[..bytes.len()].copy_from_slice(&bytes);
    }

    fn record_token(&self, rec: &mut Recorder, cfg: &Config, g: &GpuModel, pos: usize) {
        let l = &self.layout;
        let mut attn_index = 0;
        for (i, layer) in g.layers.iter().enumerate() {
            let set = self.sets[i];
            if let (Some(p), Some(pc)) = (&layer.ple, &cfg.ple) {
                let mv = |x_off, y_off| MatvecPush { x_off, y_off, ..Default::default() };
                rec.matvec(&p.key, set, mv(l.ple_rows, l.ple_key));
                rec.matvec(&p.value, set, mv(l.ple_rows, l.ple_value));
                let push = PleMixPush {
                    key_off: l.ple_key,
                    value_off: l.ple_value,
                    res_off: l.residual,
                    tmp_off: l.ple_tmp,
                    norm_key: p.norm_key,
                    norm_query: p.norm_query,
                    norm_conv: p.norm_conv,
                    conv: p.conv,
                    h: cfg.hidden as u32,
                    streams: cfg.hc as u32,
                    kernel: pc.conv_kernel as u32,
                    dilation: pc.ngram as u32,
                    eps: cfg.eps,
                };
                rec.dispatch(Pipe::PleMix, &[*self.sets.last().unwrap()], &push, [cfg.hc as u32, 1, 1]);
            }
            self.hyper(rec, cfg, set, &layer.attn_hc);
            match (&layer.mixer, &cfg.layers[i]) {
                (GpuMixer::Gdn(w), _) => self.gdn(rec, cfg, set, w),
                (GpuMixer::Attention(w), LayerKind::Attention { compress_ratio }) => {
                    self.attention(rec, cfg, set, w, *compress_ratio, attn_index, pos);
                    attn_index += 1;
                }
                _ => unreachable!("weights and config agree on layer kinds"),
            }
            self.hyper(rec, cfg, set, &layer.ffn_hc);
            self.moe(rec, cfg, g, set, i);
        }
        let set = self.sets[cfg.n_layers];
        self.hyper(rec, cfg, set, &g.output_hc);
        rec.matvec(&g.output, set, MatvecPush { x_off: l.input, y_off: l.logits, ..Default::default() });
        rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
    }

    /// Hyper-connection pre step: residual -> block input (and injection weights).
    fn hyper(&self, rec: &mut Recorder, cfg: &Config, set: vk::DescriptorSet, hc: &GpuHyper) {
        let l = &self.layout;
        let (h, c) = (cfg.hidden as u32, cfg.hc as u32);
        let norm = HcNormPush { x_off: l.residual, gamma: hc.norm, y_off: l.xn, n: h, eps: cfg.eps };
        rec.dispatch(Pipe::HcNorm, &[set], &norm, [c, 1, 1]);
        // Down rows get silu(v/C), injection rows 2*sigmoid(v/C).
        let down = MatvecPush { x_off: l.xn, y_off: l.low, mode: 1, scale: 1.0 / c as f32, split_row: hc.rank as u32, ..Default::default() };
        rec.matvecs(&hc.down_inject, set, down);
        rec.matvec(&hc.up, set, MatvecPush { x_off: l.low, y_off: l.mix, ..Default::default() });
        let combine = HcCombinePush { mix_off: l.mix, xn_off: l.xn, y_off: l.input, n: h, streams: c };
        rec.dispatch(Pipe::HcCombine, &[set], &combine, rec.threads(Pipe::HcCombine, cfg.hidden));
    }

    /// `X_c += inject_c * (W x)`: the block output written back to the streams.
    fn post(&self, cfg: &Config, x_off: u32) -> MatvecPush {
        let l = &self.layout;
        MatvecPush { x_off, y_off: l.residual, mode: 3, aux_off: l.inject, aux_n: cfg.hc as u32, ..Default::default() }
    }

    fn gdn(&self, rec: &mut Recorder, cfg: &Config, set: vk::DescriptorSet, w: &super::model::GpuGdn) {
        let l = &self.layout;
        rec.matvecs(&w.input, set, MatvecPush { x_off: l.input, y_off: l.qkv, ..Default::default() });
        let dc = cfg.ssm_conv_dim();
        let conv = GdnConvPush { x_off: l.qkv, y_off: l.conv_out, taps: w.conv, dc: dc as u32, kc: cfg.ssm_conv as u32 };
        rec.dispatch(Pipe::GdnConv, &[set], &conv, rec.threads(Pipe::GdnConv, dc));
        let rec_push = GdnRecurrentPush {
            conv_off: l.conv_out,
            z_off: l.z,
            b_off: l.beta,
            a_off: l.alpha,
            y_off: l.gdn_out,
            nk: cfg.ssm_k_heads as u32,
            nv: cfg.ssm_v_heads as u32,
            d: cfg.ssm_head_dim as u32,
            rec_off: ((cfg.ssm_conv - 1) * dc) as u32,
            decay_a: w.decay_a,
            dt_bias: w.dt_bias,
            norm: w.norm,
            gate_silu: (cfg.ssm_gate == crate::model::GateActivation::Silu) as u32,
            eps: cfg.eps,
        };
        rec.dispatch(Pipe::GdnRecurrent, &[set], &rec_push, [cfg.ssm_v_heads as u32, 1, 1]);
        rec.matvec(&w.out, set, self.post(cfg, l.gdn_out));
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        rec: &mut Recorder,
        cfg: &Config,
        set: vk::DescriptorSet,
        w: &super::model::GpuAttention,
        ratio: usize,
        attn_index: usize,
        pos: usize,
    ) {
        let (l, a) = (&self.layout, &self.attn);
        rec.matvecs(&w.input, set, MatvecPush { x_off: l.input, y_off: l.qg, ..Default::default() });
        let (nh, nkv, hd) = (cfg.n_heads as u32, cfg.n_kv_heads as u32, cfg.head_dim as u32);
        let prep = AttnPrepPush {
            qg_off: l.qg,
            k_off: l.k,
            v_off: l.v,
            q_off: l.q,
            q_norm: w.q_norm,
            k_norm: w.k_norm,
            rope: l.rope,
            half_dims: (cfg.rope_dims / 2) as u32,
            hd,
            nh,
            nkv,
            keys_off: a.keys,
            values_off: a.values,
            pos: pos as u32,
            eps: cfg.eps,
        };
        rec.dispatch(Pipe::AttnPrep, &[set], &prep, [nh + nkv, 1, 1]);
        let n_tokens = pos + 1;
        // Dense attention reads every token as the "tail".
        let (mut keep, mut ratio_used, mut tail_start) = (0usize, 1usize, 0usize);
        if let (Some(ix), Some(q)) = (&w.indexer, &cfg.qsa) {
            let n_complete = n_tokens / ratio;
            let index = QsaIndexPush {
                key_off: l.ik,
                query_off: l.iq,
                q_norm: ix.q_norm,
                k_norm: ix.k_norm,
                rope: l.rope,
                block_rope: l.block_rope + (attn_index * cfg.rope_dims) as u32,
                half_dims: (cfg.rope_dims / 2) as u32,
                id: q.head_dim as u32,
                heads: if n_complete > 0 { q.n_heads as u32 } else { 0 },
                ratio: ratio as u32,
                raw_keys: a.raw_keys,
                block_keys: a.block_keys,
                pos: pos as u32,
                block: if n_tokens.is_multiple_of(ratio) { (n_complete - 1) as u32 } else { u32::MAX },
                eps: cfg.eps,
            };
            rec.dispatch(Pipe::QsaIndex, &[set], &index, [1, 1, 1]);
            if n_complete > 0 {
                let n_blocks = n_complete as u32;
                let score = QsaScorePush {
                    query_off: l.iq,
                    block_keys: a.block_keys,
                    score_off: l.scores,
                    n_blocks,
                    heads: q.n_heads as u32,
                    id: q.head_dim as u32,
                    scale: 1.0 / (q.head_dim as f32).sqrt(),
                };
                rec.dispatch(Pipe::QsaScore, &[set], &score, rec.threads(Pipe::QsaScore, n_complete));
                keep = (q.budget / ratio).min(n_complete);
                let topk = QsaTopkPush { score_off: l.scores, sel_off: l.sel, n_blocks, keep: keep as u32 };
                rec.dispatch(Pipe::QsaTopk, &[set], &topk, [1, 1, 1]);
            }
            ratio_used = ratio;
            tail_start = n_complete * ratio;
        }
        let att = AttentionPush {
            q_off: l.q,
            qg_off: l.qg,
            keys_off: a.keys,
            values_off: a.values,
            sel_off: l.sel,
            tmp_off: l.att_tmp,
            tmp_stride: self.capacity as u32,
            y_off: l.att_out,
            keep: keep as u32,
            ratio: ratio_used as u32,
            tail_start: tail_start as u32,
            n_tail: (n_tokens - tail_start) as u32,
            hd,
            nh,
            nkv,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        };
        rec.dispatch(Pipe::Attention, &[set], &att, [nh, 1, 1]);
        rec.matvec(&w.o, set, self.post(cfg, l.att_out));
    }

    fn moe(&self, rec: &mut Recorder, cfg: &Config, g: &GpuModel, set: vk::DescriptorSet, layer: usize) {
        let l = &self.layout;
        let w = &g.layers[layer].moe;
        let (h, f, k) = (cfg.hidden, cfg.expert_ff, cfg.n_experts_used);
        rec.matvec(&w.router, set, MatvecPush { x_off: l.input, y_off: l.router, ..Default::default() });
        let ar = &g.arena;
        let route = MoeRoutePush {
            logits_off: l.router,
            ids_off: l.ids,
            w_off: l.weights,
            n_experts: cfg.n_experts as u32,
            k: k as u32,
            shared_in_arena: ar.shared_in_arena as u32,
            x_off: l.input,
            shared_gate: w.shared_gate,
            h: h as u32,
        };
        rec.dispatch(Pipe::MoeRoute, &[set], &route, [1, 1, 1]);
        let experts = k + ar.shared_in_arena as usize;
        let part = &ar.layers[layer];
        let base = MatvecPush {
            expert_off: l.ids,
            slot_table: w.slot_table,
            slots_per_slab: ar.slots_per_slab as u32,
            slot_bytes: ar.slot_bytes as u32,
            scale: 1.0,
            ..Default::default()
        };
        let f_stride = exp_h_stride(cfg);
        let gate_up =
            MatvecPush { rows: f as u32, x_off: l.input, y_off: l.exp_h, y_stride: f_stride, mode: 4, ..base };
        let sets = [set, ar.set];
        rec.expert_matvec(part.gate_ty, sets, gate_up, &part.gate, experts);
        let down = MatvecPush {
            rows: h as u32,
            x_off: l.exp_h,
            x_stride: f_stride,
            y_off: l.exp_y,
            y_stride: h as u32,
            part_off: part.gate.bytes as u32,
            ..base
        };
        rec.expert_matvec(part.down_ty, sets, down, &part.down, experts);
        if let Some(sh) = &w.shared {
            rec.matvec(&sh.gate_up, set, MatvecPush { x_off: l.input, y_off: l.sh_h, mode: 4, ..Default::default() });
            rec.matvec(&sh.down, set, MatvecPush { x_off: l.sh_h, y_off: l.sh_y, ..Default::default() });
        }
        let combine = MoeCombinePush {
            y_off: l.exp_y,
            w_off: l.weights,
            shared_off: l.sh_y,
            x_off: l.input,
            shared_gate: w.shared_gate,
            res_off: l.residual,
            inject_off: l.inject,
            h: h as u32,
            k: experts as u32,
            streams: cfg.hc as u32,
            shared_separate: w.shared.is_some() as u32,
        };
        rec.dispatch(Pipe::MoeCombine, &[set], &combine, rec.threads(Pipe::MoeCombine, cfg.hidden));
    }
}

/// One layer's state in the CPU's layout: GDN `[conv, recurrent]`, attention
/// `[keys, values, index_keys, block_keys]` (only the `pos` filled positions).
pub type HostLayer = Vec<Vec<f32>>;

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

/// Float ranges of a layer's state buffer, in the CPU layout's order.
fn segments(cfg: &Config, kind: &LayerKind, a: &AttnLayout, pos: usize) -> Vec<std::ops::Range<usize>> {
    match kind {
        LayerKind::Linear => {
            let conv = (cfg.ssm_conv - 1) * cfg.ssm_conv_dim();
            vec![0..conv, conv..layer_state_len(cfg, kind, 0)]
        }
        LayerKind::Attention { compress_ratio } => {
            let kv = cfg.n_kv_heads * cfg.head_dim;
            let id = match (&cfg.qsa, compress_ratio) {
                (Some(q), r) if *r > 0 => q.head_dim,
                _ => 0,
            };
            let blocks = if id > 0 { pos / compress_ratio } else { 0 };
            let at = |o: u32, n: usize| o as usize..o as usize + n;
            vec![at(a.keys, pos * kv), at(a.values, pos * kv), at(a.raw_keys, pos * id), at(a.block_keys, blocks * id)]
        }
    }
}

impl GpuState {
    /// The state buffers in the CPU's layout after `pos` tokens, and the PLE conv history.
    pub fn export(&self, cfg: &Config, pos: usize) -> Result<(Vec<HostLayer>, Option<Vec<f32>>)> {
        let saved = self.save()?.buffers;
        let layers = cfg
            .layers
            .iter()
            .zip(&saved)
            .map(|(kind, bytes)| {
                let all = floats(bytes);
                segments(cfg, kind, &self.attn, pos).into_iter().map(|r| all[r].to_vec()).collect()
            })
            .collect();
        let ple = saved.get(cfg.n_layers).map(|b| floats(b));
        Ok((layers, ple))
    }

    /// Loads state in the CPU's layout (as [`GpuState::export`] returns it).
    pub fn import(&mut self, model: &Model, pos: usize, layers: &[HostLayer], ple: Option<&[f32]>) -> Result<()> {
        let cfg = &model.config;
        // Room for the next token too, as `decode` would make.
        self.grow(model, pos + 1, false)?;
        let mut saved = Vec::with_capacity(self.layer_state.len());
        for ((kind, parts), buffer) in cfg.layers.iter().zip(layers).zip(&self.layer_state) {
            let mut all = vec![0f32; buffer.size as usize / 4];
            for (range, part) in segments(cfg, kind, &self.attn, pos).into_iter().zip(parts) {
                if range.len() != part.len() || range.end > all.len() {
                    return Err(Error::arg("state does not fit this GPU state's layout"));
                }
                all[range].copy_from_slice(part);
            }
            saved.push(all.iter().flat_map(|v| v.to_le_bytes()).collect());
        }
        if let Some(p) = ple {
            saved.push(p.iter().flat_map(|v| v.to_le_bytes()).collect());
        }
        self.restore(model, &SavedState { capacity: self.capacity, buffers: saved })
    }
}
