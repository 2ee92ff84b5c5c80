//! The Vulkan backend's blocks: each call of the walk records its
//! dispatches into the state's command buffer. The activations live at
//! fixed offsets of the scratch buffer ([`super::scratch`]), one block of
//! them per token of the pass, so the walk's handles are markers: the
//! residual streams at `residual`, a hyper-connection's output at `input`
//! and `inject`, the router's choice at `ids` and `weights`, the expert
//! outputs at `exp_y` and `sh_y`.
//!
//! A pass of `T` tokens (a prompt's micro-batch) records every matrix once
//! for all of them: one dispatch in which each workgroup takes a tile of
//! tokens in turn, reading and writing each token's block, so a matrix's
//! rows come from memory once per tile; with the fast kernels the input is
//! rounded to 8 bits once per token (`act_int8`) rather than by every
//! workgroup. The routed experts are (token, expert) pairs, first grouped
//! by expert (`moe_group`, one small dispatch per layer) so that a tile's
//! pairs mostly share an expert. The Gated DeltaNet's conv and delta rule loop over the
//! tokens inside one dispatch each (a channel, or a head's state, per
//! invocation or workgroup, kept on chip from token to token); the
//! per-token stages between matrices (norms, routing, combines) take a grid
//! dimension per token, one dispatch for the pass. Attention appends every
//! token's key and value in one dispatch; the QSA indexer (each token's raw
//! key, and the block key it completes) runs token after token; then, for
//! runs of tokens whose scores fit the scratch, each token's block scores
//! and its own top-k in one dispatch each (a workgroup row per token, its
//! blocks those complete at its position), and the attention itself for as
//! many tokens as the probability region holds (a workgroup row per token,
//! its keys, blocks and tail from its position). The PLE mix is recorded
//! token after token. Matrices of a pass run the fast kernels' batch modules
//! where the type has them (a weight decoded once for up to 8 tokens or
//! pairs of one expert; `FNX_VK_MATVEC_SHARE`). One token is the same
//! recording as before batches.
//!
//! Where the CPU adds a block's output back into the streams in a separate
//! step, the GPU fuses it into the block's last dispatch: the mixers' out
//! projections (matvec epilogue 3) and `moe_combine`.
//!
//! With the expert cache ([`super::cache`]) a pass of several tokens (a
//! prompt) reads every token's choices back at each layer's router and runs
//! every chosen expert on the GPU: the resident ones from their slots, the
//! others streamed through the layer's slots in rounds (each round's experts
//! repacked into a staging bank on the host while the GPU runs the round
//! before, copied into their slots, and the round's (token, expert) pairs
//! run as entries `start..start + count` of the host's order of the pairs);
//! a token's experts are spread over the rounds and combined once. A
//! single token's MoE splits into segments: the work up to the router is submitted and waited for,
//! and the router's choice and the MoE input are read back
//! (`moe_route`); the cache places each chosen expert; the resident ones
//! (and those uploaded now) run in a second command buffer, submitted at
//! once, while the host computes the rest from the mapped file on its cores
//! (`moe_experts`). The host's share is a job in the pass's scope on the
//! model's threads (started first, the layer's longest work), so this thread
//! meanwhile submits the GPU's share and records the next segment, which
//! combines everything (`moe_combine`) and goes on to the next layer's
//! router: recording is off the token's path. The host's weighted sum is
//! written where that segment's first copy reads it just before it is
//! submitted ([`VkPass::land_host_share`]). With `expert_prefetch`, the
//! threads that spin through a layer's wait for the GPU ([`VkPass::wait_hot`])
//! read ahead the experts the next layer will most likely miss: its router
//! run on the host on this layer's MoE input predicts them, and their bytes
//! go into the host's caches while the GPU computes, so the next host share
//! reads them from there rather than from memory. Background fills ([`super::cache`]) admitted at one
//! layer's MoE are repacked at the next layer's router wait (in the staging
//! bank of their layer's parity) and copied by the next segment of the GPU's
//! experts, after its expert dispatches; the last layer's in one more
//! submission at the end of the step ([`VkPass::end`]).

use super::arena::expert_bytes;
use super::buffer::Buffer;
use super::cache::{Place, Token};
use super::model::{GpuHyper, GpuMixer, GpuModel};
use super::pipelines::*;
use super::record::{Recorder, SplitRegion, TokenStats};
use super::scratch::exp_h_stride;
use super::state::{GpuState, STREAM_BANK};
use crate::cpu::moe::{expert_outputs, Expert};
use crate::cpu::ops::Rope;
use crate::error::{Error, Result};
use crate::model::backend::{Batch, Blocks, LogitsFor, Site};
use crate::model::expert_policy::MAX_UPLOADS;
use crate::model::{Config, GateActivation, LayerKind, Model};
use crate::quant::kernels::with_kernels;
use ash::vk;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// A background fill: (layer, local slot, expert).
type Fill = (usize, usize, usize);

/// Bytes a waiting thread reads ahead between looks at whether the GPU is
/// done (a few microseconds: the wait ends at most that late).
const AHEAD_PIECE: usize = 16 << 10;

/// Reads one byte of every cache line of `bytes` (bringing them into the
/// caches).
fn touch(bytes: &[u8]) {
    std::hint::black_box(bytes.iter().step_by(64).fold(0u8, |a, &b| a ^ b));
}

/// The residual streams, at `residual` of the scratch buffer.
pub(crate) struct Streams;
/// A hyper-connection's output, at `input` and `inject`.
pub(crate) struct Branch;
/// The router's choice, at `ids` and `weights`; with the expert cache also
/// read back to the host.
pub(crate) struct Routes {
    host: Option<HostRoutes>,
}

/// The router's choice and the MoE input, on the host.
struct HostRoutes {
    ids: Vec<u32>,
    weights: Vec<f32>,
    x: Vec<f32>,
}

/// The expert outputs, at `exp_y` (and `sh_y` when the shared expert runs
/// apart), and how many ran on the GPU and whether the host's sum is at `partial`.
pub(crate) struct Experts {
    on_gpu: usize,
    host_sum: bool,
}

/// The host's share of a token's MoE, computing on the model's threads
/// while the pass records on: its weighted sum (`[H]`) and the nanoseconds
/// it took, or why it failed.
struct HostShare {
    done: std::sync::mpsc::Receiver<Result<(Vec<f32>, u64)>>,
    /// When it was handed to the threads.
    started: std::time::Instant,
}

/// One token being recorded. `'scope` is the pass's scope on the model's
/// threads ([`Model::in_place_scope`]), which outlives the pass: the host's
/// share of an offloaded MoE runs there while the pass records on.
pub(crate) struct VkPass<'a, 'scope> {
    state: &'a mut GpuState,
    gpu: &'a GpuModel,
    model: &'scope Model,
    scope: &'a rayon::Scope<'scope>,
    /// The host's share of the last MoE, while it computes.
    host_share: Option<HostShare>,
    cfg: &'a Config,
    rec: Recorder<'a>,
    /// The first token's position.
    pos: usize,
    /// Tokens in the pass (at positions `pos..pos + n`).
    n: usize,
    /// Which of them get logits.
    logits: LogitsFor,
    /// Index among the attention layers, per layer (for its block RoPE table).
    attn_index: Vec<usize>,
    /// The expert cache's hold for this step, when the model has one.
    cache: Option<Token<'a>>,
    /// Segments submitted so far (with the expert cache, or cut from one
    /// token's recording: [`VkPass::submit_segment`]).
    pub submits: u32,
    /// When the last segment was submitted.
    submitted: Option<std::time::Instant>,
    /// Whether to measure how well a layer's MoE input predicts the next
    /// layer's experts (`FNX_MEASURE_PREDICTION=1`; costs a router on the host).
    measure_prediction: bool,
    /// Whether the model's threads spin while the host waits for the GPU at
    /// a router (see [`VkPass::wait_hot`]).
    spin_wait: bool,
    /// Whether the threads read ahead the next layer's predicted misses
    /// while they wait for the GPU (`LoadOptions::expert_prefetch`; only
    /// with `spin_wait`, whose threads are awake to do it).
    prefetch: bool,
    /// The next layer and this layer's MoE input, its router's input for
    /// the prediction (set at a MoE, taken at the next wait).
    read_ahead: Option<(usize, Vec<f32>)>,
    /// Background fills admitted at the last MoE, not yet staged.
    fills: Vec<Fill>,
    /// Fills repacked into staging, to be copied into their slots by the
    /// next segment of the GPU's experts: (layer, local slot, staging slot).
    staged: Vec<(usize, usize, usize)>,
}

/// The host's cos/sin table of position `pos`: `(1.., 0..)` rotated, i.e.
/// `(cos.., sin..)` exactly as the CPU computes them.
pub(crate) fn rope_table(rope: &Rope, dims: usize, pos: usize, out: &mut [f32]) {
    let half = dims / 2;
    out[..half].fill(1.0);
    out[half..2 * half].fill(0.0);
    rope.apply(out, pos);
}

/// Records a global memory barrier into `cmd`.
fn memory_barrier(
    d: &ash::Device,
    cmd: vk::CommandBuffer,
    (src, src_access): (vk::PipelineStageFlags, vk::AccessFlags),
    (dst, dst_access): (vk::PipelineStageFlags, vk::AccessFlags),
) {
    let mb = [vk::MemoryBarrier::default().src_access_mask(src_access).dst_access_mask(dst_access)];
    // SAFETY: `cmd` is recording.
    unsafe { d.cmd_pipeline_barrier(cmd, src, dst, vk::DependencyFlags::empty(), &mb, &[], &[]) };
}

/// Shaders and copies before it, against copies and shaders after it.
const ANY_WORK: vk::PipelineStageFlags = vk::PipelineStageFlags::from_raw(
    vk::PipelineStageFlags::COMPUTE_SHADER.as_raw() | vk::PipelineStageFlags::TRANSFER.as_raw(),
);

/// Ordered after everything before it in the queue (the main segment's
/// results, earlier reads of the slots it rewrites): the start of a segment
/// of the GPU's experts.
fn after_earlier_work(d: &ash::Device, cmd: vk::CommandBuffer) {
    let written = vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE;
    memory_barrier(d, cmd, (ANY_WORK, written), (ANY_WORK, vk::AccessFlags::TRANSFER_WRITE | vk::AccessFlags::SHADER_READ));
}

/// Copies into arena slots, before the shaders that read them.
fn copies_before_shaders(d: &ash::Device, cmd: vk::CommandBuffer) {
    let (transfer, shader) = (vk::PipelineStageFlags::TRANSFER, vk::PipelineStageFlags::COMPUTE_SHADER);
    memory_barrier(d, cmd, (transfer, vk::AccessFlags::TRANSFER_WRITE), (shader, vk::AccessFlags::SHADER_READ));
}

/// The GPU's experts and the host's sum, before the combine.
fn before_combine(d: &ash::Device, cmd: vk::CommandBuffer) {
    let written = vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE;
    let access = vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE;
    memory_barrier(d, cmd, (ANY_WORK, written), (vk::PipelineStageFlags::COMPUTE_SHADER, access));
}

impl<'a, 'scope> VkPass<'a, 'scope> {
    /// Starts recording the batch's tokens: the upload of the host's inputs
    /// (written by the blocks as they are called, read when the command
    /// buffer runs) and, per token, the RoPE tables of its position and of
    /// any block it completes.
    pub fn begin(
        state: &'a mut GpuState,
        gpu: &'a GpuModel,
        model: &'scope Model,
        scope: &'a rayon::Scope<'scope>,
        batch: &Batch,
        mut rec: Recorder<'a>,
        cache: Option<Token<'a>>,
    ) -> Self {
        let cfg = &model.config;
        let (pos, n) = (batch.pos, batch.tokens.len());
        assert!(n <= state.layout.batch as usize && batch.n_logits() <= state.layout.logit_rows as usize, "the scratch fits the pass");
        let l = &state.layout;
        rec.xq = Some((l.xq, l.tok));
        rec.partials = Some(SplitRegion { off: l.split_sums, len: l.split_sums_len, per_entry: l.split_sums_len / l.batch });
        rec.counts = gpu.pipes.split_counters.then_some((l.split_counts, l.split_counts_len));
        let regions = l.upload_regions(n, cfg.hc, cfg.hidden);
        // SAFETY: recording; every region lies inside both buffers.
        unsafe {
            let d = &gpu.ctx.device;
            d.cmd_copy_buffer(rec.cmd, state.upload.raw, state.scratch.raw, &regions);
            // The split matvecs' arrival counters start at zero (each dispatch leaves its own so).
            d.cmd_fill_buffer(rec.cmd, state.scratch.raw, l.split_counts as u64 * 4, l.split_counts_len as u64 * 4, 0);
        }
        rec.barrier(vk::PipelineStageFlags::TRANSFER, vk::AccessFlags::TRANSFER_WRITE, vk::PipelineStageFlags::COMPUTE_SHADER);
        // Each token's RoPE tables: its position's, then the block's it
        // completes in each attention layer (zeros in the others). The
        // embedding and PLE rows are written by the blocks that take them.
        let rope = Rope::new(cfg.rope_dims, cfg.rope_theta);
        let (dims, first) = (cfg.rope_dims, l.rope);
        let mut tables = vec![0f32; (l.input_len - first) as usize];
        let block_rope = (l.block_rope - first) as usize;
        let mut attn_index = vec![0; cfg.n_layers];
        for t in 0..n {
            let pos = pos + t;
            tables.fill(0.0);
            rope_table(&rope, dims, pos, &mut tables[..dims]);
            let mut n_attn = 0;
            for (i, kind) in cfg.layers.iter().enumerate() {
                if let LayerKind::Attention { compress_ratio } = *kind {
                    attn_index[i] = n_attn;
                    if compress_ratio > 0 && (pos + 1).is_multiple_of(compress_ratio) {
                        let at = block_rope + n_attn * dims;
                        rope_table(&rope, dims, pos + 1 - compress_ratio, &mut tables[at..at + dims]);
                    }
                    n_attn += 1;
                }
            }
            let at = state.layout.upload_at(t, first);
            state.write_upload(at, &tables);
        }
        let measure_prediction = cache.is_some() && n == 1 && std::env::var("FNX_MEASURE_PREDICTION").is_ok_and(|v| v == "1");
        let spin_wait = cache.is_some() && gpu.spin_wait;
        let prefetch = spin_wait && n == 1 && gpu.prefetch;
        let logits = batch.logits;
        VkPass {
            state,
            gpu,
            model,
            scope,
            host_share: None,
            cfg,
            rec,
            pos,
            n,
            logits,
            attn_index,
            cache,
            submits: 0,
            submitted: None,
            measure_prediction,
            spin_wait,
            prefetch,
            read_ahead: None,
            fills: Vec::new(),
            staged: Vec::new(),
        }
    }

    /// The token's counts (segments submitted included; the host's time
    /// from `started` to the last submission) and the pipelines it timed.
    pub fn finish(self, started: std::time::Instant) -> (TokenStats, Vec<super::record::Timed>) {
        let mut stats = self.rec.stats;
        stats.submits += self.submits;
        stats.record_ns = self.submitted.map_or(0, |t| t.duration_since(started).as_nanos() as u64);
        (stats, self.rec.profiled().to_vec())
    }

    /// After a failed block: ends the recording and waits for any segment in
    /// flight, so the next step can begin.
    pub fn abandon(mut self) {
        self.cancel_fills();
        if self.state.segments.is_empty() {
            let d = &self.gpu.ctx.device;
            // SAFETY: the main command buffer is recording (every segment begins it again).
            let _ = unsafe { d.end_command_buffer(self.state.cmds.cmd) };
        } else {
            // Segments of the recording are in flight: their buffers are free once the queue has run them.
            let _ = self.state.cmds.drain();
            self.state.reclaim_segments();
        }
        if let Some(o) = self.state.offload.as_mut() {
            let _ = o.wait_experts();
            if let Some(st) = o.stream.as_mut() {
                let _ = st.wait();
            }
        }
    }

    /// Records a copy of `n` floats from `src` at float `from` to `dst` at float `to`.
    fn copy(&self, cmd: vk::CommandBuffer, src: &Buffer, from: u32, dst: &Buffer, to: u32, n: usize) {
        if n == 0 {
            return;
        }
        let region = [vk::BufferCopy { src_offset: from as u64 * 4, dst_offset: to as u64 * 4, size: (n * 4) as u64 }];
        // SAFETY: recording; both buffers are live and the region lies inside both.
        unsafe { self.gpu.ctx.device.cmd_copy_buffer(cmd, src.raw, dst.raw, &region) };
    }

    /// The expert dispatches of `layer` for the first `experts` ids (expert
    /// ids through the slot table, or slots with the cache) and, with
    /// `shared`, the shared expert when it runs apart.
    fn record_experts(&mut self, layer: usize, set: vk::DescriptorSet, experts: usize, shared: bool) {
        let (cfg, gpu) = (self.cfg, self.gpu);
        let l = &self.state.layout;
        let w = &gpu.layers[layer].moe;
        let ar = &gpu.arena;
        if experts > 0 {
            let part = &ar.layers[layer];
            // (token, expert) pairs: each token's ids and activations in its
            // block; a pass's pairs grouped by expert first (the ids are
            // experts here, not the cache's slots: a pass has one token then).
            let grouped = self.n > 1 && w.slot_table != SLOTS_DIRECT;
            if grouped {
                let group = MoeGroupPush {
                    ids_off: l.ids,
                    order_off: l.order,
                    tok_stride: l.tok,
                    k: experts as u32,
                    n: self.n as u32,
                    n_ids: (cfg.n_experts + ar.shared_in_arena as usize) as u32,
                    tiles_off: l.tiles,
                    tile: mm_entries(true),
                };
                self.rec.dispatch(Pipe::MoeGroup, &[set], &group, [1, 1, 1]);
            }
            let (mut gate_up, mut down) = self.expert_pushes(layer, experts, if grouped { l.order } else { 0 }, w.slot_table);
            // The tensor-core tiles take one expert's pairs each (moe_group's table).
            let (tiles_off, max_tiles) = if grouped { (l.tiles, l.max_tiles) } else { (0, 0) };
            (gate_up.tiles_off, down.tiles_off) = (tiles_off, tiles_off);
            let sets = [set, ar.set];
            self.rec.expert_matvec_tiled(part.gate_ty, sets, gate_up, &part.gate, self.n * experts, max_tiles);
            self.rec.expert_matvec_tiled(part.down_ty, sets, down, &part.down, self.n * experts, max_tiles);
        }
        if let Some(sh) = w.shared.as_ref().filter(|_| shared) {
            let (gate_up, down) = (self.batched(l.input, l.sh_h, 4), self.batched(l.sh_h, l.sh_y, 0));
            self.rec.matvec_n(&sh.gate_up, set, gate_up, self.n);
            self.rec.matvec_n(&sh.down, set, down, self.n);
        }
    }

    /// A matvec push for every token of the pass: `x` and `y` (token 0's
    /// offsets) a block apart per token, epilogue `mode`.
    fn batched(&self, x_off: u32, y_off: u32, mode: u32) -> MatvecPush {
        let tok = self.state.layout.tok;
        MatvecPush { x_off, y_off, mode, x_stride: tok, y_stride: tok, ..Default::default() }
    }

    /// Whether the recording is cut after layer `layer`'s last dispatch
    /// (`GpuModel::segment_layers`): one token with every expert resident (a
    /// pass of several may be aborted between layers, which must leave the
    /// state as it was, so it submits once), from the layer whose host
    /// inputs (the PLE rows) are the last the walk writes, every
    /// `segment_layers` layers, not after the last layer.
    fn segment_after(&self, layer: usize) -> bool {
        let every = self.gpu.segment_layers;
        let first = self.cfg.ple.as_ref().map_or(0, |p| p.layer);
        every > 0 && self.n == 1 && self.cache.is_none() && layer >= first && (layer - first).is_multiple_of(every) && layer + 1 < self.cfg.n_layers
    }

    /// Submits what is recorded so far (no fence) and goes on in another
    /// command buffer, so the GPU runs the first layers while the host
    /// records the rest.
    fn submit_segment(&mut self) -> Result<()> {
        self.state.cmds.submit_segment()?;
        self.submits += 1;
        let next = match self.state.spare_cmds.pop() {
            Some(c) => c,
            None => super::buffer::Commands::new(&self.gpu.ctx)?,
        };
        let submitted = std::mem::replace(&mut self.state.cmds, next);
        self.state.segments.push(submitted);
        self.state.cmds.begin()?;
        self.rec.cmd = self.state.cmds.cmd;
        Ok(())
    }

    /// Whether `layer`'s shared expert runs apart beside the router (all
    /// resident: its two dispatches join the router's and the top-k's, which
    /// neither read nor write what it does) rather than after the routed
    /// experts (with the expert cache, in the segment of the GPU's experts).
    fn shared_beside_router(&self, layer: usize) -> bool {
        self.state.offload.is_none() && self.gpu.layers[layer].moe.shared.is_some()
    }

    /// Ends the main segment and submits it; stages the fills admitted at
    /// the last MoE while the GPU runs it; waits (threads kept hot with
    /// `spin_wait`) and begins the next segment. Returns the nanoseconds
    /// waited after the staging.
    fn sync(&mut self) -> Result<u64> {
        self.land_host_share()?;
        self.state.cmds.submit_async()?;
        self.submits += 1;
        self.stage_fills();
        let waited = std::time::Instant::now();
        if self.spin_wait {
            let ahead = self.predicted_misses();
            self.wait_hot(&ahead)?;
        } else {
            self.state.cmds.wait()?;
        }
        let wait_ns = waited.elapsed().as_nanos() as u64;
        self.state.cmds.begin()?;
        self.rec.cmd = self.state.cmds.cmd;
        Ok(wait_ns)
    }

    /// Starts the host's share of `layer`'s MoE (`on_host`: the experts the
    /// host computes and their routing weights, on MoE input `x`) on the
    /// model's threads; [`VkPass::land_host_share`] collects its weighted sum.
    fn spawn_host_share(&mut self, layer: usize, x: Vec<f32>, on_host: Vec<(Expert, f32)>) {
        let model = self.model;
        let (tx, done) = std::sync::mpsc::sync_channel(1);
        self.scope.spawn(move |_| {
            let work = || {
                let computed = std::time::Instant::now();
                let (cfg, h) = (&model.config, model.config.hidden);
                let experts: Vec<Expert> = on_host.iter().map(|e| e.0).collect();
                let moe = &model.weights.layers[layer].moe;
                let ys = with_kernels(model.cpu_kernels, || expert_outputs(moe, cfg, &x, &experts));
                let mut sum = vec![0f32; h];
                for ((_, w), y) in on_host.iter().zip(ys.chunks_exact(h)) {
                    for (s, v) in sum.iter_mut().zip(y) {
                        *s += w * v;
                    }
                }
                (sum, computed.elapsed().as_nanos() as u64)
            };
            let share = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
                .map_err(|p| Error::Internal(format!("the host's experts of layer {layer}: {}", crate::error::panic_message(&*p))));
            // The receiver is gone only when the pass was abandoned.
            let _ = tx.send(share);
        });
        self.host_share = Some(HostShare { done, started: std::time::Instant::now() });
    }

    /// Waits for the host's share of the last MoE, if one is computing, and
    /// writes its sum where the recorded copy reads it (the mapped exchange
    /// buffer, read when the segment runs). Counts the time it computed, the
    /// time this thread recorded meanwhile, and the time it then waited.
    fn land_host_share(&mut self) -> Result<()> {
        let Some(share) = self.host_share.take() else { return Ok(()) };
        let joined = std::time::Instant::now();
        let recorded_ns = (joined - share.started).as_nanos() as u64;
        let received = share.done.recv().map_err(|_| Error::Internal("the host's experts stopped without a result".into()));
        let (sum, compute_ns) = received??;
        let join_ns = joined.elapsed().as_nanos() as u64;
        let k = self.cfg.n_experts_used;
        let up = self.state.offload.as_mut().expect("a host share only with the exchange buffers").up.mapped();
        for (i, v) in sum.iter().enumerate() {
            up[(2 * k + i) * 4..(2 * k + i + 1) * 4].copy_from_slice(&v.to_le_bytes());
        }
        if let Some(t) = self.cache.as_mut() {
            t.timed(compute_ns, 0);
            t.overlapped(recorded_ns, join_ns);
        }
        Ok(())
    }

    /// Waits for the main segment with the model's threads kept busy: one
    /// polls the fence, the others spin until it is signalled, so none has
    /// to be woken for the host's share of the MoE that follows (tens of
    /// microseconds per layer and thread otherwise). It keeps every core the
    /// model has busy while the GPU works: on the H200 host it took the
    /// offloaded decode from 21.1 to 27.8 tok/s at a 4 GB budget (the host's
    /// experts from 23.8 to 18.7 ms per token, the waits from 18.2 to 13.6).
    /// On a contended host (a virtual machine with stolen time) spinning on
    /// every core starved the threads the driver needs: waits of 62-80 ms
    /// per token against 13 asleep (`FNX_SPIN_WAIT=0`, or fewer threads).
    ///
    /// Meanwhile the other threads read `ahead` (the next layer's predicted
    /// misses, [`VkPass::predicted_misses`]) in pieces of [`AHEAD_PIECE`]
    /// bytes until it is read or the fence is signalled, so the host's share
    /// of that layer finds most of its weights in the caches (the host has
    /// hundreds of megabytes of last-level cache; the experts of one layer's
    /// misses are tens) instead of streaming them from memory then.
    fn wait_hot(&mut self, ahead: &[&[u8]]) -> Result<()> {
        let cmds = &self.state.cmds;
        let done = AtomicBool::new(false);
        let pieces: Vec<&[u8]> = ahead.iter().flat_map(|p| p.chunks(AHEAD_PIECE)).collect();
        let (next, read) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let polled = self.model.install(|| {
            rayon::broadcast(|ctx| {
                if ctx.index() != 0 {
                    // The pieces until they run out (nothing to take without a
                    // read-ahead), then only the flag.
                    while !done.load(Ordering::Acquire) {
                        let Some(piece) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) else { break };
                        touch(piece);
                        read.fetch_add(piece.len(), Ordering::Relaxed);
                    }
                    while !done.load(Ordering::Acquire) {
                        std::hint::spin_loop();
                    }
                    return None;
                }
                let r = loop {
                    match cmds.done() {
                        Ok(false) => (0..64).for_each(|_| std::hint::spin_loop()),
                        other => break other.map(|_| ()),
                    }
                };
                done.store(true, Ordering::Release);
                Some(r)
            })
        });
        if let Some(t) = self.cache.as_mut() {
            t.prefetched(read.into_inner() as u64);
        }
        polled.into_iter().flatten().next().expect("thread 0 polled the fence")
    }

    /// The byte ranges of the experts that the next layer's router, run on
    /// the host on this layer's MoE input, picks and the cache does not hold
    /// (its recall is counted as `FNX_MEASURE_PREDICTION`'s); none without a
    /// read-ahead pending.
    fn predicted_misses(&mut self) -> Vec<&'scope [u8]> {
        let Some((layer, x)) = self.read_ahead.take() else { return Vec::new() };
        let ids = self.predict(layer, &x);
        let Some(t) = self.cache.as_ref() else { return Vec::new() };
        let (model, moe) = (self.model, &self.model.weights.layers[layer].moe);
        ids.into_iter()
            .filter(|&e| !t.holds(layer, e))
            .flat_map(|e| {
                let (gate_up, down) = expert_bytes(moe, &model.config, e as usize);
                gate_up.into_iter().chain(std::iter::once(down))
            })
            .collect()
    }

    /// Layer `layer`'s router run on the host on `x` (an earlier layer's MoE
    /// input): the experts it picks, recorded as the cache's prediction of
    /// that layer's choice (whose recall the cache counts).
    fn predict(&mut self, layer: usize, x: &[f32]) -> Vec<u32> {
        let (model, cfg) = (self.model, self.cfg);
        let moe = &model.weights.layers[layer].moe;
        let ids: Vec<u32> = model.install(|| crate::cpu::moe::route(moe, cfg, x)).iter().map(|&(e, _)| e as u32).collect();
        if let Some(t) = self.cache.as_mut() {
            t.predict(layer, ids.clone());
        }
        ids
    }

    /// Repacks the fills admitted at the last MoE (layer `l`) into staging
    /// bank `l mod 2` on the model's threads. The bank's last copies were
    /// those of layer `l - 1`'s fills, recorded in a segment that ended
    /// before the segment this follows: the host never rewrites staging the
    /// GPU may still read.
    fn stage_fills(&mut self) {
        if self.fills.is_empty() {
            return;
        }
        let slot_bytes = self.gpu.arena.slot_bytes;
        let started = std::time::Instant::now();
        let fills = std::mem::take(&mut self.fills);
        let staged: Vec<(usize, usize, usize)> = fills.iter().enumerate().map(|(j, &(layer, slot, _))| {
            assert!(j < MAX_UPLOADS, "at most {MAX_UPLOADS} fills per layer");
            (layer, slot, (layer % 2) * MAX_UPLOADS + j)
        }).collect();
        let o = self.state.offload.as_mut().expect("fills only with a cache");
        let mut regions: Vec<&mut [u8]> = o.fill_staging.mapped().chunks_exact_mut(slot_bytes).collect();
        let jobs = fills.iter().zip(&staged).map(|(&(layer, _, e), &(_, _, at))| (layer, e, std::mem::take(&mut regions[at]))).collect();
        Self::repack_experts(self.model, self.gpu, jobs);
        self.staged.extend(staged);
        if let Some(t) = self.cache.as_mut() {
            t.uploaded((fills.len() * slot_bytes) as u64, started.elapsed().as_nanos() as u64);
        }
    }

    /// Records the copies of the staged fills into `cmd` and a barrier that
    /// orders them before every later read of their slots. (Earlier reads of
    /// a slot ended before the segment's first barrier, and the segment
    /// itself does not read it: a slot being filled serves no hit.)
    fn record_fill_copies(&self, cmd: vk::CommandBuffer) {
        if self.staged.is_empty() {
            return;
        }
        let staging = &self.state.offload.as_ref().expect("fills only with a cache").fill_staging;
        for &(layer, slot, at) in &self.staged {
            self.copy_to_slot(cmd, staging, at, layer, slot);
        }
        copies_before_shaders(&self.gpu.ctx.device, cmd);
    }

    /// The staged fills were submitted: their slots serve hits from now on
    /// (any later read of them comes later in the queue, after the barrier
    /// that follows the copies).
    fn commit_fills(&mut self) {
        let staged = std::mem::take(&mut self.staged);
        if let Some(t) = self.cache.as_mut() {
            for (layer, slot, _) in staged {
                t.commit(layer, slot);
            }
        }
    }

    /// After the walk, with an expert cache: submits the last segment,
    /// stages the last layer's fills while it runs, waits, and copies them
    /// in one more submission (waited for), so that every fill of the step
    /// lands within it. Without a cache, submits and waits.
    pub fn end(&mut self) -> Result<()> {
        let ended = self.end_inner();
        if ended.is_err() {
            self.cancel_fills();
        }
        ended
    }

    /// The fills not copied yet will not happen.
    fn cancel_fills(&mut self) {
        let (fills, staged) = (std::mem::take(&mut self.fills), std::mem::take(&mut self.staged));
        if let Some(t) = self.cache.as_mut() {
            for (layer, slot, _) in fills.into_iter().chain(staged) {
                t.cancel(layer, slot);
            }
        }
    }

    /// Records a copy of staging slot `at` of `staging` into layer `layer`'s local slot `slot`.
    fn copy_to_slot(&self, cmd: vk::CommandBuffer, staging: &Buffer, at: usize, layer: usize, slot: usize) {
        let slot_bytes = self.gpu.arena.slot_bytes;
        let (slab, to) = self.gpu.arena.place(layer, slot);
        let region = [vk::BufferCopy { src_offset: (at * slot_bytes) as u64, dst_offset: to, size: slot_bytes as u64 }];
        // SAFETY: recording; `staging` holds slot `at` and the slot lies in its slab.
        unsafe { self.gpu.ctx.device.cmd_copy_buffer(cmd, staging.raw, slab.raw, &region) };
    }

    /// Repacks each (layer, expert) of `jobs` from the mapped file into its
    /// staging slot, in parallel on the model's threads.
    fn repack_experts(model: &Model, gpu: &GpuModel, jobs: Vec<(usize, usize, &mut [u8])>) {
        let cfg = &model.config;
        model.install(|| {
            use rayon::prelude::*;
            jobs.into_par_iter().for_each(|(layer, e, out)| {
                gpu.arena.repack_into(layer, &expert_bytes(&model.weights.layers[layer].moe, cfg, e), out);
            })
        });
    }

    /// The routed experts' matvec pushes (gate/up with SwiGLU, then down)
    /// of layer `layer`: `kdiv` pairs per token whose ids (through
    /// `slot_table`) are at `ids`, in the order at `order_off` (0: in order).
    fn expert_pushes(&self, layer: usize, kdiv: usize, order_off: u32, slot_table: u32) -> (MatvecPush, MatvecPush) {
        let (cfg, ar, l) = (self.cfg, &self.gpu.arena, &self.state.layout);
        let base = MatvecPush {
            kdiv: kdiv as u32,
            tok_stride: l.tok,
            expert_off: l.ids,
            order_off,
            slot_table,
            slots_per_slab: ar.slots_per_slab as u32,
            slot_bytes: ar.slot_bytes as u32,
            scale: 1.0,
            ..Default::default()
        };
        let (h, f_stride) = (cfg.hidden as u32, exp_h_stride(cfg));
        let gate_up = MatvecPush { rows: cfg.expert_ff as u32, x_off: l.input, y_off: l.exp_h, y_stride: f_stride, mode: 4, ..base };
        let part_off = ar.layers[layer].gate.bytes as u32;
        let down = MatvecPush { rows: h, x_off: l.exp_h, x_stride: f_stride, y_off: l.exp_y, y_stride: h, part_off, ..base };
        (gate_up, down)
    }

    fn end_inner(&mut self) -> Result<()> {
        self.land_host_share()?;
        self.state.cmds.submit_async()?;
        self.submitted = Some(std::time::Instant::now());
        self.stage_fills();
        self.state.cmds.wait()?;
        self.rec.stats.wait_ns = self.submitted.map_or(0, |t| t.elapsed().as_nanos() as u64);
        self.state.reclaim_segments();
        if self.staged.is_empty() {
            return Ok(());
        }
        let o = self.state.offload.as_mut().expect("fills only with a cache");
        o.wait_experts()?;
        o.cmds.begin()?;
        let cmd = o.cmds.cmd;
        self.record_fill_copies(cmd);
        self.state.offload.as_ref().expect("checked above").cmds.submit()?;
        self.submits += 1;
        self.commit_fills();
        Ok(())
    }

    /// A pass of several tokens with the expert cache: every token's choices
    /// go to the host (the walk waits here, as a decode step does).
    fn pass_routes(&mut self) -> Result<Routes> {
        let (k, n) = (self.cfg.n_experts_used, self.n);
        self.rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
        let l = &self.state.layout;
        let st = self.state.offload.as_ref().and_then(|o| o.stream.as_ref()).expect("a pass of several tokens has the stream buffers");
        let regions: Vec<_> = (0..n)
            .map(|t| vk::BufferCopy { src_offset: (l.at(t).ids as u64) * 4, dst_offset: (t * k * 4) as u64, size: (k * 4) as u64 })
            .collect();
        // SAFETY: recording; every region lies inside both buffers.
        unsafe { self.gpu.ctx.device.cmd_copy_buffer(self.rec.cmd, self.state.scratch.raw, st.ids.raw, &regions) };
        let wait_ns = self.sync()?;
        if let Some(t) = self.cache.as_mut() {
            t.timed(0, wait_ns);
        }
        let st = self.state.offload.as_mut().and_then(|o| o.stream.as_mut()).expect("checked above");
        let ids = st.ids.mapped()[..n * k * 4].chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
        Ok(Routes { host: Some(HostRoutes { ids, weights: Vec::new(), x: Vec::new() }) })
    }

    /// A pass of several tokens with the expert cache: every chosen expert
    /// runs on the GPU, the resident ones from their slots and the others
    /// streamed through the layer's slots in rounds ([`super::cache`]'s
    /// plan): a round's experts are repacked into a staging bank on the
    /// host while the GPU runs the round before, copied into their slots,
    /// and the round's pairs run (entries `start..start + count` of the
    /// pairs' order). The shared expert runs with the first round.
    fn stream_experts(&mut self, layer: usize, ids: &[u32]) -> Result<Experts> {
        let (cfg, gpu, set, model) = (self.cfg, self.gpu, self.set(layer), self.model);
        let (k, n) = (cfg.n_experts_used, self.n);
        for t in 0..n {
            model.report_routing(layer, &ids[t * k..(t + 1) * k]);
        }
        let plan = self.cache.as_mut().expect("routes come back only with a cache").stream(layer, ids, STREAM_BANK.min(gpu.arena.per_layer));
        let slot_bytes = gpu.arena.slot_bytes;
        let o = self.state.offload.as_mut().expect("a state of a cached model has the exchange buffers");
        o.wait_experts()?;
        let st = o.stream.as_mut().expect("a pass of several tokens has the stream buffers");
        // Each pair's arena slot, then the order, as float bits, token after token.
        let up = st.plan.mapped();
        let slots = plan.pair_slot.iter().map(|&s| gpu.arena.slot(layer, s as usize));
        for (i, v) in slots.chain(plan.order.iter().copied()).enumerate() {
            up[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        let l = self.state.layout.clone();
        let part = gpu.arena.layers[layer];
        let (gate_up, down) = self.expert_pushes(layer, k, l.order, SLOTS_DIRECT);
        let d = &gpu.ctx.device;
        // A round that fails leaves its slots' contents unknown: they are forgotten.
        let rounds = (|| -> Result<()> {
            for (r, round) in plan.rounds.iter().enumerate() {
                let bank = r % 2;
                let st = self.state.offload.as_mut().and_then(|o| o.stream.as_mut()).expect("checked above");
                // The bank's last copies (two rounds ago) have run.
                if st.pending[bank] {
                    st.cmds[bank].wait()?;
                    st.pending[bank] = false;
                }
                let repacked = std::time::Instant::now();
                let bank_bytes = &mut st.staging.mapped()[bank * STREAM_BANK * slot_bytes..(bank + 1) * STREAM_BANK * slot_bytes];
                let jobs = round.copies.iter().zip(bank_bytes.chunks_exact_mut(slot_bytes)).map(|(&(_, e), out)| (layer, e as usize, out)).collect();
                Self::repack_experts(model, gpu, jobs);
                if let Some(t) = self.cache.as_mut() {
                    t.uploaded((round.copies.len() * slot_bytes) as u64, repacked.elapsed().as_nanos() as u64);
                }
                let st = self.state.offload.as_ref().and_then(|o| o.stream.as_ref()).expect("checked above");
                st.cmds[bank].begin()?;
                let cmd = st.cmds[bank].cmd;
                // After the router's choices and the previous round's reads of the slots this one rewrites.
                after_earlier_work(d, cmd);
                if r == 0 {
                    let (per_tok, plan_buf, scratch) = ((k * 4) as u64, st.plan.raw, self.state.scratch.raw);
                    let regions: Vec<_> = (0..n)
                        .flat_map(|t| {
                            let at = l.at(t);
                            [
                                vk::BufferCopy { src_offset: t as u64 * per_tok, dst_offset: at.ids as u64 * 4, size: per_tok },
                                vk::BufferCopy { src_offset: (n + t) as u64 * per_tok, dst_offset: at.order as u64 * 4, size: per_tok },
                            ]
                        })
                        .collect();
                    // SAFETY: recording; every region lies inside both buffers.
                    unsafe { d.cmd_copy_buffer(cmd, plan_buf, scratch, &regions) };
                }
                for (j, &(s, _)) in round.copies.iter().enumerate() {
                    self.copy_to_slot(cmd, &st.staging, bank * STREAM_BANK + j, layer, s);
                }
                copies_before_shaders(d, cmd);
                self.rec.cmd = cmd;
                let sets = [set, gpu.arena.set];
                self.rec.expert_entries(part.gate_ty, sets, gate_up, &part.gate, round.start, round.count);
                self.rec.expert_entries(part.down_ty, sets, down, &part.down, round.start, round.count);
                if r == 0 {
                    self.record_experts(layer, set, 0, true);
                }
                self.rec.cmd = self.state.cmds.cmd;
                let st = self.state.offload.as_mut().and_then(|o| o.stream.as_mut()).expect("checked above");
                st.cmds[bank].submit_async()?;
                st.pending[bank] = true;
                self.submits += 1;
            }
            Ok(())
        })();
        if let Err(e) = rounds {
            if let Some(t) = self.cache.as_mut() {
                for &(slot, _) in plan.rounds.iter().flat_map(|r| &r.copies) {
                    t.forget(layer, slot);
                }
            }
            return Err(e);
        }
        // The combine reads what the rounds wrote.
        before_combine(d, self.rec.cmd);
        Ok(Experts { on_gpu: k, host_sum: false })
    }

    fn set(&self, layer: usize) -> vk::DescriptorSet {
        self.state.caches.bindings.sets[layer]
    }

    /// Hyper-connection pre step of tokens `first..first + n`: residual ->
    /// block input (and injection weights).
    fn hyper(&mut self, set: vk::DescriptorSet, hc: &GpuHyper, first: usize, n: usize) {
        let cfg = self.cfg;
        let (h, c) = (cfg.hidden as u32, cfg.hc as u32);
        let l = self.state.layout.at(first);
        let tok_stride = l.tok;
        // One token's normalised streams rounded for the down projection's
        // fast kernels by the norm itself (Pipelines::hc_round).
        let rounded = (n == 1 && self.gpu.pipes.hc_round && h.is_multiple_of(32))
            .then(|| hc.down_inject.iter().find_map(|m| self.rec.single_round(m.ty, m.chunks[0].layout.cols)))
            .flatten()
            .unwrap_or(0);
        let norm = HcNormPush { x_off: l.residual, gamma: hc.norm, y_off: l.xn, n: h, eps: cfg.eps, tok_stride, q_off: rounded };
        self.rec.dispatch(Pipe::HcNorm, &[set], &norm, norm.groups(c, n as u32));
        // Down rows get silu(v/C), injection rows 2*sigmoid(v/C).
        let down = MatvecPush { scale: 1.0 / c as f32, split_row: hc.rank as u32, xq_off: rounded, ..self.batched(l.xn, l.low, 1) };
        self.rec.matvecs_n(&hc.down_inject, set, down, n);
        // One token's up projection combines the streams itself (Pipelines::hc_fuse).
        if n == 1 && self.gpu.pipes.hc_fuse && self.rec.fuses_combine(&hc.up, cfg.hc) {
            let up = MatvecPush { aux_off: l.xn, aux_n: c, ..self.batched(l.low, l.input, 5) };
            self.rec.matvec_n(&hc.up, set, up, 1);
            return;
        }
        self.rec.matvec_n(&hc.up, set, self.batched(l.low, l.mix, 0), n);
        let combine = HcCombinePush { mix_off: l.mix, xn_off: l.xn, y_off: l.input, n: h, streams: c, tok_stride };
        let groups = self.rec.threads_n(Pipe::HcCombine, cfg.hidden, n);
        self.rec.dispatch(Pipe::HcCombine, &[set], &combine, groups);
    }

    /// `X_c += inject_c * (W x)` for every token: a block's out projection
    /// written back to the streams.
    fn post(&self, x_off: u32) -> MatvecPush {
        let l = &self.state.layout;
        MatvecPush { aux_off: l.inject, aux_n: self.cfg.hc as u32, ..self.batched(x_off, l.residual, 3) }
    }
}

impl GpuState {
    /// Writes `v` into the upload buffer at float `at`.
    pub(crate) fn write_upload(&mut self, at: usize, v: &[f32]) {
        let bytes = &mut self.upload.mapped()[at * 4..(at + v.len()) * 4];
        // One copy (wide stores into the write-combined mapping: a pass
        // writes megabytes here) where the host's floats are the device's bytes.
        #[cfg(target_endian = "little")]
        // SAFETY: `v`'s floats are plain bytes (no padding), read as `v.len() * 4` of them.
        bytes.copy_from_slice(unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) });
        #[cfg(not(target_endian = "little"))]
        for (b, x) in bytes.chunks_exact_mut(4).zip(v) {
            b.copy_from_slice(&x.to_le_bytes());
        }
    }
}

impl Blocks for VkPass<'_, '_> {
    type Streams = Streams;
    type Branch = Branch;
    type Routes = Routes;
    type Experts = Experts;

    fn embed(&mut self, rows: &[f32]) -> Result<Streams> {
        // The pass's first copy writes each row into every stream.
        let (h, len) = (self.cfg.hidden, self.state.layout.upload_len());
        for (t, row) in rows.chunks_exact(h).take(self.n).enumerate() {
            self.state.write_upload(t * len, row);
        }
        Ok(Streams)
    }

    fn ple(&mut self, layer: usize, rows: &[f32], _x: &mut Streams) -> Result<()> {
        let (cfg, gpu) = (self.cfg, self.gpu);
        let (Some(p), Some(pc)) = (&gpu.layers[layer].ple, &cfg.ple) else { return Ok(()) };
        for (t, row) in rows.chunks_exact(cfg.hidden).take(self.n).enumerate() {
            let at = self.state.layout.upload_at(t, self.state.layout.ple_rows);
            self.state.write_upload(at, row);
        }
        let l = &self.state.layout;
        if self.submits > 0 {
            // The pass's first segment, which uploaded its inputs, has run: these rows go up now.
            let h = cfg.hidden as u64 * 4;
            let regions: Vec<_> = (0..self.n)
                .map(|t| vk::BufferCopy { src_offset: l.upload_at(t, l.ple_rows) as u64 * 4, dst_offset: l.at(t).ple_rows as u64 * 4, size: h })
                .collect();
            // SAFETY: recording; every region lies inside both buffers.
            unsafe { gpu.ctx.device.cmd_copy_buffer(self.rec.cmd, self.state.upload.raw, self.state.scratch.raw, &regions) };
            self.rec.barrier(vk::PipelineStageFlags::TRANSFER, vk::AccessFlags::TRANSFER_WRITE, vk::PipelineStageFlags::COMPUTE_SHADER);
        }
        let (set, ple_set) = (self.set(layer), *self.state.caches.bindings.sets.last().expect("the PLE layer's set"));
        let (key, value) = (self.batched(l.ple_rows, l.ple_key, 0), self.batched(l.ple_rows, l.ple_value, 0));
        self.rec.matvec_n(&p.key, set, key, self.n);
        self.rec.matvec_n(&p.value, set, value, self.n);
        // One dispatch for one token; for a run, the gated values and norms,
        // then the convs (their taps from the run's norms), then the ring rows.
        let rows = crate::cpu::ple::conv_rows(pc, self.state.caches.window) as u32;
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
            rows,
            pos: self.pos as u32,
            eps: cfg.eps,
            phase: 3,
            n: self.n as u32,
            tok_stride: l.tok,
        };
        let (hc, n) = (cfg.hc as u32, self.n as u32);
        if n == 1 {
            self.rec.dispatch(Pipe::PleMix, &[ple_set], &push, [hc, 1, 1]);
        } else {
            for (phase, tokens) in [(0, n), (1, n), (2, n.min(rows))] {
                self.rec.dispatch(Pipe::PleMix, &[ple_set], &PleMixPush { phase, ..push }, [hc, tokens, 1]);
            }
        }
        Ok(())
    }

    fn hyper_pre(&mut self, site: Site, _x: &Streams) -> Result<Branch> {
        let (gpu, layer) = (self.gpu, match site {
            Site::Mixer(l) | Site::Moe(l) => l,
        });
        let hc = match site {
            Site::Mixer(l) => &gpu.layers[l].attn_hc,
            Site::Moe(l) => &gpu.layers[l].ffn_hc,
        };
        self.hyper(self.set(layer), hc, 0, self.n);
        Ok(Branch)
    }

    fn gdn(&mut self, layer: usize, _branch: &Branch, _x: &mut Streams) -> Result<()> {
        let (cfg, gpu, set) = (self.cfg, self.gpu, self.set(layer));
        let GpuMixer::Gdn(w) = &gpu.layers[layer].mixer else { unreachable!("weights and config agree on layer kinds") };
        let l = &self.state.layout;
        let g = self.state.caches.gdn;
        let input = self.batched(l.input, l.qkv, 0);
        self.rec.matvecs_n(&w.input, set, input, self.n);
        let dc = cfg.ssm_conv_dim();
        let (n, tok) = (self.n as u32, l.tok);
        let d = cfg.ssm_head_dim as u32;
        let col_groups = (d * self.gpu.pipes.gdn_lanes).div_ceil(128);
        let gate_silu = (cfg.ssm_gate == GateActivation::Silu) as u32;
        // One token: the conv, the delta rule and the gated norm in one dispatch.
        let counters = (n == 1 && gpu.pipes.gdn_fuse).then(|| self.rec.take_counters("gdn_token", cfg.ssm_v_heads)).flatten();
        if let Some(counts_off) = counters {
            assert!(g.conv_rows >= cfg.ssm_conv, "the conv reads only rows before the token's");
            let push = GdnTokenPush {
                x_off: l.qkv,
                taps: w.conv,
                dc: dc as u32,
                kc: cfg.ssm_conv as u32,
                rows: g.conv_rows as u32,
                b_off: l.beta,
                a_off: l.alpha,
                y_off: l.gdn_out,
                z_off: l.z,
                nk: cfg.ssm_k_heads as u32,
                nv: cfg.ssm_v_heads as u32,
                d,
                planes_off: g.planes,
                planes: g.n_planes as u32,
                pos: self.pos as u32,
                decay_a: w.decay_a,
                dt_bias: w.dt_bias,
                norm: w.norm,
                gate_silu,
                eps: cfg.eps,
                counts_off,
            };
            self.rec.dispatch(Pipe::GdnToken, &[set], &push, [cfg.ssm_v_heads as u32, col_groups, 1]);
            let post = self.post(self.state.layout.gdn_out);
            self.rec.matvec_n(&w.out, set, post, 1);
            return Ok(());
        }
        // Each loops over the pass's tokens: the conv ring and the recurrent
        // state carry from one token to the next.
        let conv = GdnConvPush {
            x_off: l.qkv,
            y_off: l.conv_out,
            taps: w.conv,
            dc: dc as u32,
            kc: cfg.ssm_conv as u32,
            rows: g.conv_rows as u32,
            pos: self.pos as u32,
            n,
            tok_stride: tok,
        };
        let groups = self.rec.threads(Pipe::GdnConv, dc);
        self.rec.dispatch(Pipe::GdnConv, &[set], &conv, groups);
        // The delta rule (a workgroup per 128 / lanes columns of a head,
        // vec4 reads of q and k), then its gated RMSNorm over the pass.
        // (The head dim's limits: check_shapes at load.)
        assert!(l.conv_out.is_multiple_of(4) && tok.is_multiple_of(4), "gdn_recurrent's q and k are read as vec4s");
        let push = GdnRecurrentPush {
            conv_off: l.conv_out,
            b_off: l.beta,
            a_off: l.alpha,
            y_off: l.gdn_out,
            nk: cfg.ssm_k_heads as u32,
            nv: cfg.ssm_v_heads as u32,
            d,
            planes_off: g.planes,
            planes: g.n_planes as u32,
            pos: self.pos as u32,
            n,
            tok_stride: tok,
            decay_a: w.decay_a,
            dt_bias: w.dt_bias,
        };
        self.rec.dispatch(Pipe::GdnRecurrent, &[set], &push, [cfg.ssm_v_heads as u32, col_groups, 1]);
        let norm = GdnNormPush {
            y_off: l.gdn_out,
            z_off: l.z,
            d,
            norm: w.norm,
            gate_silu,
            eps: cfg.eps,
            tok_stride: tok,
        };
        self.rec.dispatch(Pipe::GdnNorm, &[set], &norm, [cfg.ssm_v_heads as u32, n, 1]);
        let post = self.post(self.state.layout.gdn_out);
        self.rec.matvec_n(&w.out, set, post, self.n);
        Ok(())
    }

    fn attention(&mut self, layer: usize, _branch: &Branch, _x: &mut Streams) -> Result<()> {
        let (cfg, gpu, set) = (self.cfg, self.gpu, self.set(layer));
        let (GpuMixer::Attention(w), LayerKind::Attention { compress_ratio: ratio }) = (&gpu.layers[layer].mixer, &cfg.layers[layer])
        else {
            unreachable!("weights and config agree on layer kinds")
        };
        let a = self.state.caches.attn;
        let input = self.batched(self.state.layout.input, self.state.layout.qg, 0);
        self.rec.matvecs_n(&w.input, set, input, self.n);
        let (nh, nkv, hd) = (cfg.n_heads as u32, cfg.n_kv_heads as u32, cfg.head_dim as u32);
        let l0 = self.state.layout.clone();
        // Every token's query, and its key and value appended to the caches.
        let prep = AttnPrepPush {
            qg_off: l0.qg,
            k_off: l0.k,
            v_off: l0.v,
            q_off: l0.q,
            q_norm: w.q_norm,
            k_norm: w.k_norm,
            rope: l0.rope,
            half_dims: (cfg.rope_dims / 2) as u32,
            hd,
            nh,
            nkv,
            keys_off: a.keys,
            values_off: a.values,
            pos: self.pos as u32,
            eps: cfg.eps,
            tok_stride: l0.tok,
        };
        let qsa = w.indexer.as_ref().zip(cfg.qsa.as_ref());
        // The indexer, one workgroup per token: each appends its raw key and
        // completes its block's key (from the pass's raw keys in the scratch,
        // as the later scores read them), then rotates its queries. It and
        // the queries' and caches' stage read and write disjoint regions:
        // one barrier after both.
        let index = qsa.map(|(ix, q)| {
            QsaIndexPush {
                key_off: l0.ik,
                query_off: l0.iq,
                q_norm: ix.q_norm,
                k_norm: ix.k_norm,
                rope: l0.rope,
                block_rope: l0.block_rope + (self.attn_index[layer] * cfg.rope_dims) as u32,
                half_dims: (cfg.rope_dims / 2) as u32,
                id: q.head_dim as u32,
                heads: q.n_heads as u32,
                ratio: *ratio as u32,
                raw_keys: a.raw_keys,
                block_keys: a.block_keys,
                pos: self.pos as u32,
                tok_stride: l0.tok,
                eps: cfg.eps,
            }
        });
        let n = self.n as u32;
        self.rec.independent(|rec| {
            rec.dispatch(Pipe::AttnPrep, &[set], &prep, [nh + nkv, n, 1]);
            if let Some(index) = &index {
                rec.dispatch(Pipe::QsaIndex, &[set], index, [1, n, 1]);
            }
        });
        // Runs of tokens whose block scores and selections fit the scratch:
        // each token's scores and its top-k in one dispatch each for the
        // run, then its attention in dispatches of as many tokens as the
        // probability region holds.
        let rows = l0.score_rows as usize;
        for t0 in (0..self.n).step_by(rows) {
            let run = rows.min(self.n - t0);
            let first = self.pos + t0;
            let (mut keep_max, mut ratio_used) = (0usize, 1usize);
            if let Some((_, q)) = qsa {
                let (first_blocks, last_blocks) = ((first + 1) / ratio, (first + run) / ratio);
                keep_max = q.budget / ratio;
                ratio_used = *ratio;
                if last_blocks > 0 {
                    let per_token = (*ratio as u32, ((first + 1) % ratio) as u32);
                    let score = QsaScorePush {
                        query_off: self.state.layout.at(t0).iq,
                        block_keys: a.block_keys,
                        score_off: l0.scores,
                        n_blocks: first_blocks as u32,
                        heads: q.n_heads as u32,
                        id: q.head_dim as u32,
                        scale: 1.0 / (q.head_dim as f32).sqrt(),
                        ratio: per_token.0,
                        phase: per_token.1,
                        tok_stride: l0.tok,
                        score_stride: l0.score_stride,
                    };
                    let groups = self.rec.groups_n(last_blocks, run);
                    self.rec.dispatch(Pipe::QsaScore, &[set], &score, groups);
                    let topk = QsaTopkPush {
                        score_off: l0.scores,
                        sel_off: l0.sel,
                        n_blocks: first_blocks as u32,
                        keep: keep_max as u32,
                        ratio: per_token.0,
                        phase: per_token.1,
                        score_stride: l0.score_stride,
                        sel_stride: l0.score_stride,
                    };
                    self.rec.dispatch(Pipe::QsaTopk, &[set], &topk, [1, run as u32, 1]);
                }
            }
            // The run's attention, `att_rows` tokens per dispatch, each with
            // its own partials region (a grid row per token, a grid layer
            // per split of its keys); the last split of each (head, token)
            // combines them, or without arrival counters a second dispatch.
            let (att_rows, tmp_stride) = (l0.att_rows as usize, l0.att_stride);
            for a0 in (t0..t0 + run).step_by(att_rows) {
                let chunk = att_rows.min(t0 + run - a0);
                let l = self.state.layout.at(a0);
                // Keys token `t` of the pass attends: its kept blocks and its tail.
                let attended = |t: usize| {
                    let n_tokens = self.pos + t + 1;
                    let complete = if qsa.is_some() { n_tokens / ratio_used } else { 0 };
                    keep_max.min(complete) * ratio_used + n_tokens - complete * ratio_used
                };
                let splits = (a0..a0 + chunk).map(|t| attention_splits(attended(t))).max().unwrap_or(1);
                let counts = self.rec.take_counters("attention", nh as usize * chunk);
                let mut att = AttentionPush {
                    q_off: l.q,
                    qg_off: l.qg,
                    keys_off: a.keys,
                    values_off: a.values,
                    sel_off: l0.sel + ((a0 - t0) as u32) * l0.score_stride,
                    tmp_off: l0.att_tmp,
                    tmp_stride,
                    y_off: l.att_out,
                    keep: keep_max as u32,
                    ratio: ratio_used as u32,
                    n_first: (self.pos + a0 + 1) as u32,
                    qsa: qsa.is_some() as u32,
                    hd,
                    nh,
                    nkv,
                    scale: 1.0 / (cfg.head_dim as f32).sqrt(),
                    tok_stride: l0.tok,
                    sel_stride: l0.score_stride,
                    tmp_tok: nh * tmp_stride,
                    counts_off: counts.unwrap_or(0),
                    combine: 0,
                };
                self.rec.dispatch(Pipe::Attention, &[set], &att, [nh, chunk as u32, splits as u32]);
                if counts.is_none() {
                    att.combine = 1;
                    self.rec.label_next(|| "attention (combine)".to_string(), 0);
                    self.rec.dispatch(Pipe::Attention, &[set], &att, [nh, chunk as u32, 1]);
                }
            }
        }
        let post = self.post(self.state.layout.att_out);
        self.rec.matvec_n(&w.o, set, post, self.n);
        Ok(())
    }

    fn moe_route(&mut self, layer: usize, _branch: &Branch) -> Result<Routes> {
        let (cfg, gpu, set) = (self.cfg, self.gpu, self.set(layer));
        let l = &self.state.layout;
        let w = &gpu.layers[layer].moe;
        let shared = w.shared.as_ref().filter(|_| self.shared_beside_router(layer));
        let (n, router) = (self.n, self.batched(l.input, l.router, 0));
        let (mut sh_gate_up, mut sh_down) = (self.batched(l.input, l.sh_h, 4), self.batched(l.sh_h, l.sh_y, 0));
        // The shared expert's inputs rounded before the groups it runs in.
        if let Some(sh) = shared {
            self.rec.round_for(set, &sh.gate_up, &mut sh_gate_up, n);
        }
        self.rec.independent(|rec| {
            if rec.routes(&w.router, n) {
                rec.router_n(&w.router, set, router.x_off, router.y_off, router.x_stride, n);
            } else {
                rec.matvec_n(&w.router, set, router, n);
            }
            if let Some(sh) = shared {
                rec.matvec_n(&sh.gate_up, set, sh_gate_up, n);
            }
        });
        let route = MoeRoutePush {
            logits_off: l.router,
            ids_off: l.ids,
            w_off: l.weights,
            n_experts: cfg.n_experts as u32,
            k: cfg.n_experts_used as u32,
            shared_in_arena: gpu.arena.shared_in_arena as u32,
            x_off: l.input,
            shared_gate: w.shared_gate,
            h: cfg.hidden as u32,
            tok_stride: l.tok,
        };
        if let Some(sh) = shared {
            self.rec.round_for(set, &sh.down, &mut sh_down, n);
        }
        self.rec.independent(|rec| {
            rec.dispatch(Pipe::MoeRoute, &[set], &route, [1, n as u32, 1]);
            if let Some(sh) = shared {
                rec.matvec_n(&sh.down, set, sh_down, n);
            }
        });
        let Some(o) = self.state.offload.as_ref() else { return Ok(Routes { host: None }) };
        if n > 1 {
            return self.pass_routes();
        }
        // The choice and the input go to the host.
        let (k, h) = (cfg.n_experts_used, cfg.hidden);
        self.rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
        let (cmd, scratch) = (self.rec.cmd, &self.state.scratch);
        self.copy(cmd, scratch, l.ids, &o.down, 0, k);
        self.copy(cmd, scratch, l.weights, &o.down, k as u32, k);
        self.copy(cmd, scratch, l.input, &o.down, 2 * k as u32, h);
        let wait_ns = self.sync()?;
        if let Some(t) = self.cache.as_mut() {
            t.timed(0, wait_ns);
        }
        let o = self.state.offload.as_mut().expect("checked above");
        let v: Vec<f32> = o.down.mapped()[..(2 * k + h) * 4].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        let host = HostRoutes { ids: v[..k].iter().map(|f| f.to_bits()).collect(), weights: v[k..2 * k].to_vec(), x: v[2 * k..].to_vec() };
        // How well the next layer's router on this layer's MoE input would
        // predict the next choice (a measurement; see `cache`). The
        // read-ahead makes the same prediction at the next wait.
        if self.measure_prediction && !self.prefetch && layer + 1 < cfg.n_layers {
            self.predict(layer + 1, &host.x);
        }
        Ok(Routes { host: Some(host) })
    }

    fn moe_experts(&mut self, layer: usize, _branch: &Branch, routes: &Routes) -> Result<Experts> {
        let (cfg, gpu, set) = (self.cfg, self.gpu, self.set(layer));
        let Some(host) = &routes.host else {
            let experts = cfg.n_experts_used + gpu.arena.shared_in_arena as usize;
            let shared = !self.shared_beside_router(layer);
            self.record_experts(layer, set, experts, shared);
            return Ok(Experts { on_gpu: experts, host_sum: false });
        };
        if self.n > 1 {
            return self.stream_experts(layer, &host.ids);
        }
        self.model.report_routing(layer, &host.ids);
        // Where each chosen expert runs.
        let places = self.cache.as_mut().expect("routes come back only with a cache").place(layer, &host.ids);
        let moe = &self.model.weights.layers[layer].moe;
        let (k, h) = (cfg.n_experts_used, cfg.hidden);
        let (mut slots, mut weights, mut uploads) = (Vec::new(), Vec::new(), Vec::new());
        let mut on_host: Vec<(Expert, f32)> = Vec::new();
        for (i, p) in places.iter().enumerate() {
            match *p {
                Place::Hit(s) | Place::Upload(s) => {
                    slots.push(f32::from_bits(gpu.arena.slot(layer, s)));
                    weights.push(host.weights[i]);
                    if let Place::Upload(s) = *p {
                        uploads.push((s, host.ids[i] as usize));
                    }
                }
                Place::Host => on_host.push((Expert::Routed(host.ids[i] as usize), host.weights[i])),
                Place::Fill(s) => {
                    on_host.push((Expert::Routed(host.ids[i] as usize), host.weights[i]));
                    self.fills.push((layer, s, host.ids[i] as usize));
                }
            }
        }
        let on_gpu = slots.len();
        // The host's share first, the longest of the layer's work: from the
        // mapped file on the model's threads (still hot from the wait at the
        // router), while this thread submits the GPU's share and records on
        // to the next router; its sum goes up just before that segment is
        // submitted (`land_host_share`).
        let host_sum = !on_host.is_empty();
        if host_sum {
            self.spawn_host_share(layer, host.x.clone(), on_host);
        }
        if self.prefetch && layer + 1 < cfg.n_layers {
            self.read_ahead = Some((layer + 1, host.x.clone()));
        }
        let slot_bytes = gpu.arena.slot_bytes;
        let o = self.state.offload.as_mut().expect("a state of a cached model has the exchange buffers");
        o.wait_experts()?;
        let up = o.up.mapped();
        for (i, v) in slots.iter().chain(&weights).enumerate() {
            let at = if i < on_gpu { i } else { k + i - on_gpu };
            up[at * 4..at * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        // Experts admitted now: repacked into staging, copied into their slots.
        let repacked = std::time::Instant::now();
        let (staging, scratch) = (o.staging.mapped(), &mut o.repack);
        self.model.install(|| {
            for (j, &(_, e)) in uploads.iter().enumerate() {
                gpu.arena.repack_through(layer, &expert_bytes(moe, cfg, e), scratch, &mut staging[j * slot_bytes..(j + 1) * slot_bytes]);
            }
        });
        if let Some(t) = self.cache.as_mut() {
            t.uploaded((uploads.len() * slot_bytes) as u64, repacked.elapsed().as_nanos() as u64);
        }
        // The GPU's share, submitted now.
        let o = self.state.offload.as_ref().expect("checked above");
        o.cmds.begin()?;
        let cmd = o.cmds.cmd;
        let l = &self.state.layout;
        let d = &gpu.ctx.device;
        // Ordered after the main segment's work (queue order) for the slots and scratch.
        after_earlier_work(d, cmd);
        self.copy(cmd, &o.up, 0, &self.state.scratch, l.ids, on_gpu);
        self.copy(cmd, &o.up, k as u32, &self.state.scratch, l.weights, on_gpu);
        for (j, &(s, _)) in uploads.iter().enumerate() {
            self.copy_to_slot(cmd, &o.staging, j, layer, s);
        }
        copies_before_shaders(d, cmd);
        self.rec.cmd = cmd;
        self.record_experts(layer, set, on_gpu, true);
        // The last MoE's fills after the hits, which they need not delay.
        self.record_fill_copies(cmd);
        self.rec.cmd = self.state.cmds.cmd;
        let o = self.state.offload.as_mut().expect("checked above");
        o.cmds.submit_async()?;
        o.pending = true;
        self.submits += 1;
        self.commit_fills();
        // Where the host's sum goes up.
        if host_sum {
            let (o, l) = (self.state.offload.as_ref().expect("checked above"), &self.state.layout);
            self.copy(self.rec.cmd, &o.up, 2 * k as u32, &self.state.scratch, l.partial, h);
        }
        // The combine reads what both the GPU's segment and the copy wrote.
        before_combine(d, self.rec.cmd);
        Ok(Experts { on_gpu, host_sum })
    }

    fn moe_combine(&mut self, layer: usize, _branch: &Branch, _routes: &Routes, experts: Experts, _x: &mut Streams) -> Result<()> {
        let (cfg, gpu, set) = (self.cfg, self.gpu, self.set(layer));
        let l = &self.state.layout;
        let w = &gpu.layers[layer].moe;
        let combine = MoeCombinePush {
            y_off: l.exp_y,
            w_off: l.weights,
            shared_off: l.sh_y,
            x_off: l.input,
            shared_gate: w.shared_gate,
            res_off: l.residual,
            inject_off: l.inject,
            h: cfg.hidden as u32,
            k: experts.on_gpu as u32,
            streams: cfg.hc as u32,
            shared_separate: w.shared.is_some() as u32,
            partial_off: if experts.host_sum { l.partial } else { NO_PARTIAL },
            tok_stride: l.tok,
        };
        let groups = self.rec.threads_n(Pipe::MoeCombine, cfg.hidden, self.n);
        self.rec.dispatch(Pipe::MoeCombine, &[set], &combine, groups);
        if self.segment_after(layer) {
            self.submit_segment()?;
        }
        Ok(())
    }

    fn head(&mut self, _x: &Streams) -> Result<()> {
        let (cfg, gpu) = (self.cfg, self.gpu);
        let set = self.set(cfg.n_layers);
        // The tokens that get logits: the last, or all.
        let (first, rows) = match self.logits {
            LogitsFor::Last => (self.n - 1, 1),
            LogitsFor::All => (0, self.n),
        };
        self.hyper(set, &gpu.output_hc, first, rows);
        let l = &self.state.layout;
        let head = MatvecPush { x_off: l.at(first).input, y_off: l.logits, x_stride: l.tok, y_stride: cfg.vocab as u32, ..Default::default() };
        self.rec.matvec_n(&gpu.output, set, head, rows);
        self.rec.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::TRANSFER);
        let logits_bytes = (rows * cfg.vocab * 4) as u64;
        // SAFETY: recording; the regions lie inside both buffers.
        unsafe {
            gpu.ctx.device.cmd_copy_buffer(
                self.rec.cmd,
                self.state.scratch.raw,
                self.state.readback().raw,
                &[vk::BufferCopy { src_offset: (l.logits * 4) as u64, dst_offset: 0, size: logits_bytes }],
            );
        }
        Ok(())
    }
}
