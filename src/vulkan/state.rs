//! The decode state of one sequence on the GPU: the scratch buffer
//! ([`super::scratch`]), the per-layer caches ([`super::caches`]), a small
//! host-visible buffer the host writes each token's inputs into (embedding
//! row, PLE rows, RoPE cos/sin tables), and its command buffers.
//!
//! Per pass (one token decoding, up to a micro-batch of a prompt) the walk
//! (`model::forward`) records the whole network through [`super::blocks`];
//! one token's recording goes to the GPU in segments of layers as the walk
//! records on (each segment's command buffer a spare until the last
//! submission's fence), a pass of several tokens in one submission; the
//! state waits on one fence and reads the logits back. A failure before
//! the first submission changes nothing; one after it (a lost device)
//! loses the state. The
//! scratch holds one token at first and grows to the largest pass asked of
//! it (see [`super::scratch`]).

use super::buffer::{Buffer, Commands};
use super::device::Context;
use super::caches::{Caches, INITIAL_CAPACITY};
use super::model::GpuModel;
use super::record::{Recorder, Timestamps, TokenStats};
use super::scratch::ScratchLayout;
use crate::error::{Error, Result};
use crate::model::backend::{Batch, BackendState, Checkpoint, HostState, PassStats};
use crate::model::Model;
use gpu_allocator::MemoryLocation;
use std::sync::Arc;

pub struct GpuState {
    pub(crate) gpu: Arc<GpuModel>,
    pub(crate) layout: ScratchLayout,
    pub(crate) caches: Caches,
    /// Most positions a state may hold.
    n_ctx: usize,
    /// Most tokens one pass takes: the model's micro-batch up to
    /// [`MAX_BATCH`] (one with an expert cache of no slots, which has none to
    /// stream through). The scratch grows to a pass's size when one needs it.
    max_batch: usize,
    stats: TokenStats,
    /// Per-dispatch timestamps when profiling ([`BackendState::enable_profiling`]).
    timestamps: Option<Timestamps>,
    /// Milliseconds per pipeline of the last token, when profiling.
    stage_ms: Vec<(&'static str, f64)>,
    dispatch_ms: Vec<crate::model::backend::DispatchTime>,
    pub(crate) upload: Buffer,
    readback: Buffer,
    pub(crate) scratch: Buffer,
    pub(crate) cmds: Commands,
    /// Command buffers of a token's segments submitted before its last
    /// (`cmds`), until the last one's fence has signalled; then spares.
    pub(crate) segments: Vec<Commands>,
    pub(crate) spare_cmds: Vec<Commands>,
    /// With the expert cache: the per-layer exchange with the host.
    pub(crate) offload: Option<Offload>,
}

/// What a state needs to run layers whose experts are partly on the host.
impl Offload {
    /// Waits for the segment of the GPU's experts in flight, if any.
    pub fn wait_experts(&mut self) -> Result<()> {
        if self.pending {
            self.cmds.wait()?;
            self.pending = false;
        }
        Ok(())
    }
}

/// Staging slots for background fills: two banks of the most one layer admits.
const FILL_STAGING: usize = 2 * crate::model::expert_policy::MAX_UPLOADS;

/// Experts one staging bank of a streamed pass holds (each bank is a round's
/// copies at most; two banks: 128 MiB of host memory at the real model's
/// 2 MiB experts).
pub(crate) const STREAM_BANK: usize = 32;

/// A pass of several tokens with the expert cache: the exchange with the
/// host (allocated at the state's first such pass).
pub(crate) struct StreamBuffers {
    /// Read back after the router: every token's choices [T][k].
    pub ids: Buffer,
    /// Written by the host: each pair's local slot [T][k], then the order of
    /// the pairs [T][k].
    pub plan: Buffer,
    /// Two banks of [`STREAM_BANK`] experts in the arena's layout, in cached
    /// host memory (the GPU's copies pull them across the bus).
    pub staging: Buffer,
    /// A submission per bank, and whether it is in flight.
    pub cmds: [Commands; 2],
    pub pending: [bool; 2],
}

impl StreamBuffers {
    fn new(ctx: &Arc<Context>, pairs: usize, slot_bytes: usize) -> Result<StreamBuffers> {
        Ok(StreamBuffers {
            ids: Buffer::new(ctx, "streamed pass choices", (pairs * 4) as u64, MemoryLocation::GpuToCpu)?,
            plan: Buffer::new(ctx, "streamed pass plan", (2 * pairs * 4) as u64, MemoryLocation::CpuToGpu)?,
            staging: Buffer::new(ctx, "streamed expert staging", (2 * STREAM_BANK * slot_bytes) as u64, MemoryLocation::GpuToCpu)?,
            cmds: [Commands::new(ctx)?, Commands::new(ctx)?],
            pending: [false; 2],
        })
    }

    /// Waits for both banks' submissions.
    pub fn wait(&mut self) -> Result<()> {
        for (c, p) in self.cmds.iter().zip(self.pending.iter_mut()) {
            if *p {
                c.wait()?;
                *p = false;
            }
        }
        Ok(())
    }
}

pub(crate) struct Offload {
    /// The expert dispatches of a layer, submitted while the host computes its share.
    pub cmds: Commands,
    /// Whether `cmds` holds a submission not yet waited for.
    pub pending: bool,
    /// Read back after the router: ids [k], weights [k], the MoE input [H].
    pub down: Buffer,
    /// Written by the host: slots [k], weights [k], the host's sum [H].
    pub up: Buffer,
    /// Experts to upload into the arena now, in its layout: [k][slot bytes].
    pub staging: Buffer,
    /// Background fills, in the arena's layout, in cached host memory (the
    /// host repacks at memory speed; the GPU's copies pull them across the
    /// bus): two banks, one per layer parity, so a bank is rewritten only
    /// after its copies ran: [2][MAX_UPLOADS][slot bytes].
    pub fill_staging: Buffer,
    /// Cached host memory an upload is repacked in before it is copied into `staging`.
    pub repack: Vec<u8>,
    /// Passes of several tokens (prompts): see [`StreamBuffers`].
    pub stream: Option<StreamBuffers>,
}

impl std::fmt::Debug for GpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuState(n_ctx {}, capacity {})", self.n_ctx, self.caches.capacity)
    }
}

/// An error of work already submitted: the state's buffers may be half written.
pub(crate) fn lost(what: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| Error::StateLost(format!("{what} failed on the GPU ({e})"))
}

impl GpuState {
    /// An empty state at `capacity` positions (0 = the initial capacity).
    pub fn new(gpu: &Arc<GpuModel>, model: &Model, capacity: usize) -> Result<GpuState> {
        let cfg = &model.config;
        let ctx = &gpu.ctx;
        let n_ctx = model.n_ctx;
        // Checked at the largest size the state may grow to, so that a
        // context too long for one binding fails now, not mid-sequence.
        ScratchLayout::new(cfg, n_ctx, 1, 1)?;
        // `FNX_VULKAN_INITIAL_CAPACITY` lowers the start (tests use it to grow often).
        let initial = std::env::var("FNX_VULKAN_INITIAL_CAPACITY").ok().and_then(|v| v.parse::<usize>().ok());
        let capacity = if capacity > 0 { capacity } else { n_ctx.min(initial.unwrap_or(INITIAL_CAPACITY).max(1)) };
        let layout = ScratchLayout::new(cfg, capacity, 1, 1)?;
        let f = |n: usize| (n * 4) as u64;
        let scratch = Buffer::new(ctx, "GPU scratch", f(layout.total as usize), MemoryLocation::GpuOnly)?;
        let upload = Buffer::new(ctx, "token upload", f(layout.upload_len()), MemoryLocation::CpuToGpu)?;
        let readback = Buffer::new(ctx, "logits readback", f(cfg.vocab), MemoryLocation::GpuToCpu)?;
        let caches = Caches::new(gpu, cfg, model.rewind_window, n_ctx, capacity, &scratch)?;
        let cmds = Commands::new(ctx)?;
        let offload = match &gpu.cache {
            None => None,
            Some(_) => {
                let (k, h) = (cfg.n_experts_used, cfg.hidden);
                Some(Offload {
                    cmds: Commands::new(ctx)?,
                    pending: false,
                    down: Buffer::new(ctx, "expert routing readback", f(2 * k + h), MemoryLocation::GpuToCpu)?,
                    up: Buffer::new(ctx, "expert placement upload", f(2 * k + h), MemoryLocation::CpuToGpu)?,
                    staging: Buffer::new(ctx, "expert upload staging", (k * gpu.arena.slot_bytes) as u64, super::buffer::STAGING)?,
                    fill_staging: Buffer::new(ctx, "expert fill staging", (FILL_STAGING * gpu.arena.slot_bytes) as u64, MemoryLocation::GpuToCpu)?,
                    repack: Vec::new(),
                    stream: None,
                })
            }
        };
        cmds.begin()?;
        caches.record_zero(&cmds);
        cmds.submit()?;
        Ok(GpuState {
            gpu: gpu.clone(),
            layout,
            caches,
            n_ctx,
            // With the expert cache a pass streams experts through the slots (none: token by token).
            max_batch: if gpu.cache.is_some() && gpu.arena.per_layer == 0 { 1 } else { model.micro_batch.clamp(1, MAX_BATCH) },
            stats: TokenStats::default(),
            timestamps: None,
            stage_ms: Vec::new(),
            dispatch_ms: Vec::new(),
            upload,
            readback,
            scratch,
            cmds,
            segments: Vec::new(),
            spare_cmds: Vec::new(),
            offload,
        })
    }

    /// After the fence of a token's last submission (or a drain): the
    /// segments' command buffers are free again.
    pub(crate) fn reclaim_segments(&mut self) {
        self.spare_cmds.append(&mut self.segments);
    }

    /// Makes room for `positions` positions: the capacity doubles (at least
    /// to `positions`, at most to `n_ctx`). The filled caches are copied when
    /// `keep`. On error nothing has changed.
    pub(crate) fn grow(&mut self, model: &Model, positions: usize, keep: bool) -> Result<()> {
        let (batch, rows) = (self.layout.batch as usize, self.layout.logit_rows as usize);
        self.fit(model, positions, batch, rows, keep)
    }

    /// Makes room for `positions` positions (as [`GpuState::grow`]) and for
    /// passes of `batch` tokens of which `logit_rows` get logits (the
    /// scratch, upload and readback buffers are reallocated when a pass needs
    /// more than they hold; they never shrink). On error nothing has changed.
    pub(crate) fn fit(&mut self, model: &Model, positions: usize, batch: usize, logit_rows: usize, keep: bool) -> Result<()> {
        let grow_ctx = positions > self.caches.capacity;
        let grow_batch = batch > self.layout.batch as usize || logit_rows > self.layout.logit_rows as usize;
        if !grow_ctx && !grow_batch {
            return Ok(());
        }
        let capacity = if grow_ctx { (2 * self.caches.capacity).min(self.n_ctx).max(positions) } else { self.caches.capacity };
        let cfg = &model.config;
        let batch = batch.max(self.layout.batch as usize);
        let layout = ScratchLayout::new(cfg, capacity, batch, logit_rows.max(self.layout.logit_rows as usize))?;
        let ctx = self.gpu.ctx.clone();
        let ctx = &ctx;
        let bytes = (layout.total as u64) * 4;
        // The scratch holds nothing between passes: under a VRAM budget its
        // old allocation makes room for the new one when both do not fit
        // (and comes back if anything after fails).
        let mut freed = None;
        let scratch = match Buffer::new(ctx, "GPU scratch", bytes, MemoryLocation::GpuOnly) {
            Err(Error::OutOfMemory(_)) if ctx.budget() > 0 => {
                let placeholder = Buffer::new(ctx, "GPU scratch", 16, MemoryLocation::GpuOnly)?;
                freed = Some(std::mem::replace(&mut self.scratch, placeholder).size);
                Buffer::new(ctx, "GPU scratch", bytes, MemoryLocation::GpuOnly)
            }
            other => other,
        };
        let rest = scratch.and_then(|scratch| {
            let buffers = if grow_batch {
                let upload = Buffer::new(ctx, "token upload", (layout.upload_len() * layout.batch as usize) as u64 * 4, MemoryLocation::CpuToGpu)?;
                let bytes = (layout.logit_rows as usize * cfg.vocab * 4) as u64;
                Some((upload, Buffer::new(ctx, "logits readback", bytes, MemoryLocation::GpuToCpu)?))
            } else {
                None
            };
            // With the expert cache, passes of several tokens stream experts.
            let stream = match &self.offload {
                Some(_) if grow_batch && layout.batch > 1 => {
                    Some(StreamBuffers::new(ctx, layout.batch as usize * cfg.n_experts_used, self.gpu.arena.slot_bytes)?)
                }
                _ => None,
            };
            if grow_ctx {
                self.caches.set_capacity(&self.gpu, cfg, &self.cmds, capacity, keep, &scratch)?;
            } else {
                self.caches.rebind(&self.gpu, cfg, &scratch)?;
            }
            Ok((scratch, buffers, stream))
        });
        let (scratch, buffers, stream) = match rest {
            Ok(r) => r,
            Err(e) => {
                if let Some(size) = freed {
                    self.scratch = Buffer::new(ctx, "GPU scratch", size, MemoryLocation::GpuOnly).map_err(lost("restoring the scratch"))?;
                    self.caches.rebind(&self.gpu, cfg, &self.scratch)?;
                }
                return Err(e);
            }
        };
        if let Some((upload, readback)) = buffers {
            self.upload = upload;
            self.readback = readback;
        }
        if let (Some(st), Some(o)) = (stream, self.offload.as_mut()) {
            o.stream = Some(st);
        }
        self.scratch = scratch;
        self.layout = layout;
        Ok(())
    }


}

/// Most tokens of one pass: the scratch holds every token's activations
/// (about 0.6 MB per token at the real shapes).
pub(crate) const MAX_BATCH: usize = 512;

impl BackendState for GpuState {
    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn forward(&mut self, model: &Model, batch: &Batch) -> Result<Vec<f32>> {
        let n = batch.tokens.len();
        if n == 0 || n > self.max_batch {
            return Err(Error::arg(format!("a Vulkan pass takes 1 to {} tokens, not {n}", self.max_batch)));
        }
        self.fit(model, batch.pos + n, n, batch.n_logits(), true)?;
        let gpu = self.gpu.clone();
        // Steps of states sharing an expert cache take turns.
        let cache = gpu.cache.as_ref().map(|c| c.token());
        self.cmds.begin()?;
        let mut rec = Recorder::new(&gpu.ctx, &gpu.pipes, self.cmds.cmd);
        if let Some(t) = &self.timestamps {
            rec.profile_into(t.pool);
        }
        // The pass's scope on the model's threads: an offloaded MoE's host
        // share computes there while the pass records on.
        let started = std::time::Instant::now();
        let (mut stats, profiled) = model.in_place_scope(|scope| {
            let mut pass = super::blocks::VkPass::begin(self, &gpu, model, scope, batch, rec, cache);
            let walked = crate::model::forward::forward(model, batch, &mut pass);
            // A pass that submitted part of its work has changed the state.
            let submitted = pass.submits > 0;
            if let Err(e) = walked {
                pass.abandon();
                return Err(if submitted { Error::StateLost(format!("a decode step failed part way: {e}")) } else { e });
            }
            // The last segment (and, with an expert cache, the last layer's fills).
            pass.end().map_err(lost("a decode step"))?;
            Ok(pass.finish(started))
        })?;
        stats.submits += 1;
        if let Some(o) = self.offload.as_mut() {
            o.wait_experts().map_err(lost("a decode step's expert work"))?;
            if let Some(st) = o.stream.as_mut() {
                st.wait().map_err(lost("a pass's streamed experts"))?;
            }
        }
        self.stats = stats;
        if let Some(t) = &self.timestamps {
            let ms = t.read(&profiled)?;
            self.stage_ms = super::record::per_pipeline(&profiled, &ms);
            self.dispatch_ms = super::record::per_label(&profiled, &ms);
        }
        let bytes = &self.readback.mapped()[..batch.n_logits() * model.config.vocab * 4];
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
    }

    fn reset(&mut self) -> Result<()> {
        self.cmds.begin()?;
        self.caches.record_zero(&self.cmds);
        self.cmds.submit()
    }

    fn rewind(&mut self, _model: &Model, _to: usize) -> Result<()> {
        // The caches are indexed by position, the rings and planes too.
        Ok(())
    }

    fn checkpoint(&self, model: &Model, pos: usize) -> Result<Checkpoint> {
        self.save_recurrent(model, pos)
    }

    fn rollback(&mut self, model: &Model, checkpoint: &Checkpoint) -> Result<()> {
        self.restore_recurrent(model, checkpoint)
    }

    fn try_clone(&self, model: &Model) -> Result<Box<dyn BackendState>> {
        Ok(Box::new(self.copy(model)?))
    }

    fn export(&self, model: &Model, pos: usize) -> Result<HostState> {
        self.download(model, pos)
    }

    fn import(&mut self, model: &Model, pos: usize, host: HostState) -> Result<()> {
        self.upload_host(model, pos, host)
    }

    fn pass_stats(&self) -> Option<PassStats> {
        let s = self.stats;
        Some(PassStats {
            dispatches: s.dispatches,
            barriers: s.barriers,
            submits: s.submits,
            weight_bytes: s.weight_bytes,
            record_ns: s.record_ns,
            wait_ns: s.wait_ns,
        })
    }

    fn enable_profiling(&mut self) -> Result<()> {
        if self.offload.is_some() {
            return Err(Error::arg("profiling: per-stage GPU times are not kept while experts run on the host too"));
        }
        if self.timestamps.is_none() {
            self.timestamps = Some(Timestamps::new(&self.gpu.ctx)?);
        }
        Ok(())
    }

    fn stage_ms(&self) -> Vec<(&'static str, f64)> {
        self.stage_ms.clone()
    }

    fn dispatch_ms(&self) -> Vec<crate::model::backend::DispatchTime> {
        self.dispatch_ms.clone()
    }

    fn capacity(&self) -> usize {
        self.caches.capacity
    }
}

impl GpuState {
    /// The readback buffer the head copies the logits into.
    pub(crate) fn readback(&self) -> &Buffer {
        &self.readback
    }
}
