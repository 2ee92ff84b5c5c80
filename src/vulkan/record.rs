//! Recording one token: every dispatch goes through [`Recorder::dispatch`],
//! which checks the pipeline table (descriptor sets, push-constant size,
//! workgroup count limits), binds, pushes, dispatches and puts a
//! compute-to-compute barrier after it; the counts are the token's stats.
//!
//! Dispatches that do not depend on each other run together: inside
//! [`Recorder::independent`] no barrier follows a dispatch, one follows the
//! group. The caller vouches that no dispatch of the group reads or writes
//! what another writes: the chunks and type-split parts of one projection
//! (disjoint output rows of one input), and the shared expert beside the
//! router and its top-k (`blocks.rs`).
//!
//! A plain matrix of few rows and long ones splits its rows into ranges of
//! columns: a pass on the matrix-matrix modules ([`Pipelines::mm_split`]),
//! and on the matvec modules a token and a pass alike
//! ([`Pipelines::matvec_split`]). Each workgroup sums its range into the
//! [`Recorder::partials`] region and the splits' reduction
//! (shaders/split_sums.comp, the epilogue with it) waits until the
//! outermost group's barrier: the reductions of a group run together after
//! it, then one more barrier. On the matvec modules the last workgroup of
//! each row group's splits adds them instead, in the same dispatch (an
//! arrival counter per row group in the [`Recorder::counts`] region, zero
//! between dispatches): the same sums in the same order, with no dispatch
//! or barrier of its own. Each split matrix of a group takes its own part
//! of the regions; where one is full, the group waits (a barrier, the
//! reductions queued so far, a barrier), so whether and how a matrix splits
//! never depends on what else the group holds.

use super::device::{err, Context};
use super::layout::PartLayout;
use super::matrix::GpuMatrix;
use super::pipelines::{ActInt8Push, MatvecPush, MatvecTuning, Pipe, Pipelines, Push, RouterPush, RouterUse, Sets, FAST_MAX_COLS, MM_COLS, MM_ROWS, MM_SPLIT_STEPS, mm_entries};
use crate::error::Result;
use crate::gguf::GgmlType;
use ash::vk;
use std::sync::Arc;

/// GPU work of one decoded token.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct TokenStats {
    pub dispatches: u32,
    pub barriers: u32,
    pub submits: u32,
    /// Bytes of weights the token's dispatches read (each matrix once).
    pub weight_bytes: u64,
    /// Dispatches on the matrix-matrix modules (shaders/mm.comp).
    pub mm: u32,
    /// Host nanoseconds from the start of the step to its last submission.
    pub record_ns: u64,
    /// Nanoseconds then waited for the GPU.
    pub wait_ns: u64,
}

pub(crate) struct Recorder<'a> {
    ctx: &'a Context,
    pipes: &'a Pipelines,
    pub cmd: vk::CommandBuffer,
    pub stats: TokenStats,
    /// When profiling: the query pool and what each timestamp after the first timed.
    timestamps: Option<(vk::QueryPool, Vec<Timed>)>,
    /// When profiling: the label and weight bytes of the next dispatch (set by the matvecs).
    next_label: Option<(String, u64)>,
    /// Invocations per matvec row set for every matvec (tests), instead of the tuning's choice.
    pub force_tpr: Option<u32>,
    /// Inside [`Recorder::independent`]: no barrier after each dispatch.
    grouped: bool,
    /// Token 0's region for activations rounded once (the scratch's `xq`:
    /// by `act_int8` in a pass of several tokens, or by their producer) and
    /// the floats between tokens. The fast matvecs then copy a token's
    /// rounded activations instead of rounding them in every workgroup.
    pub xq: Option<(u32, u32)>,
    /// The scratch region for split rows' partial sums (the scratch's
    /// `split_sums`); `None`, no matrix splits its rows.
    pub partials: Option<SplitRegion>,
    /// Floats of `partials` taken since the last barrier (or, while
    /// reductions wait in `reduce`, since they were last run).
    partial_used: u32,
    /// The scratch region of the split matvecs' arrival counters (offset,
    /// count; zero between dispatches: each dispatch's last arrivals reset
    /// theirs, and a pass's upload zeroes the region); `None`: the matvecs'
    /// splits are added by split_sums.comp.
    pub counts: Option<(u32, u32)>,
    /// Counters of `counts` taken since the last barrier.
    counts_used: u32,
    /// The reductions of split matrices recorded since the last barrier
    /// (state set, push, grid, label), dispatched after the outermost group.
    reduce: Vec<(vk::DescriptorSet, MatvecPush, [u32; 3], String)>,
}

/// Floats of the partial sums of a split matrix: `splits` x `entries` x its
/// rows (SwiGLU: gate and up rows), in whole vec4s.
fn split_floats(push: &MatvecPush, splits: usize, entries: usize) -> usize {
    let per_entry = if push.mode == 4 { 2 * push.rows as usize } else { push.rows as usize };
    (splits * entries * per_entry).div_ceil(4) * 4
}

/// The scratch region for the partial sums of split rows: `len` floats at
/// `off`, `per_entry` of them for each entry a pass may hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SplitRegion {
    pub off: u32,
    pub len: u32,
    pub per_entry: u32,
}

/// One timed dispatch: its pipeline, what it computed (a matrix's name
/// without its layer, `experts gate/up`, or the pipeline's name) and the
/// weight bytes it read.
#[derive(Clone, Debug)]
pub(crate) struct Timed {
    pub pipe: Pipe,
    pub label: String,
    pub bytes: u64,
}

/// A matrix's name without its layer and suffix: `blk.3.ssm_out.weight` ->
/// `ssm_out` (fused parts joined by `+`).
fn role(name: &str) -> String {
    let part = |p: &str| {
        let p = p.strip_suffix(".weight").unwrap_or(p);
        match p.strip_prefix("blk.").and_then(|rest| rest.split_once('.')) {
            Some((layer, rest)) if layer.bytes().all(|b| b.is_ascii_digit()) => rest.to_string(),
            _ => p.to_string(),
        }
    };
    name.split('+').map(part).collect::<Vec<_>>().join("+")
}

/// Timestamps one pass may write when profiling (one per dispatch, plus the start; later dispatches go untimed).
pub(crate) const MAX_TIMESTAMPS: u32 = 65536;

/// `n` workgroups along x; beyond the device limit the rest go to z (the
/// shaders index workgroup = x + z * num_x).
fn grid(ctx: &Context, n: usize, y: u32) -> [u32; 3] {
    let max_x = ctx.limits.max_compute_work_group_count[0].min(65535) as usize;
    [n.min(max_x).max(1) as u32, y, n.div_ceil(max_x).max(1) as u32]
}

impl<'a> Recorder<'a> {
    pub fn new(ctx: &'a Context, pipes: &'a Pipelines, cmd: vk::CommandBuffer) -> Self {
        Recorder {
            ctx,
            pipes,
            cmd,
            stats: TokenStats::default(),
            timestamps: None,
            next_label: None,
            force_tpr: None,
            grouped: false,
            xq: None,
            partials: None,
            partial_used: 0,
            counts: None,
            counts_used: 0,
            reduce: Vec::new(),
        }
    }

    /// Writes a timestamp after every dispatch into `pool` (reset here), for
    /// [`Recorder::profiled`] to name afterwards.
    pub fn profile_into(&mut self, pool: vk::QueryPool) {
        let d = &self.ctx.device;
        // SAFETY: recording; the pool holds MAX_TIMESTAMPS queries.
        unsafe {
            d.cmd_reset_query_pool(self.cmd, pool, 0, MAX_TIMESTAMPS);
            d.cmd_write_timestamp(self.cmd, vk::PipelineStageFlags::COMPUTE_SHADER, pool, 0);
        }
        self.timestamps = Some((pool, Vec::new()));
    }

    /// The dispatches timed, in order (empty when not profiling).
    pub fn profiled(&self) -> &[Timed] {
        self.timestamps.as_ref().map_or(&[], |(_, p)| p)
    }

    /// Labels the next dispatch when profiling (`name` is computed only then).
    pub fn label_next(&mut self, name: impl FnOnce() -> String, bytes: u64) {
        if self.timestamps.is_some() {
            self.next_label = Some((name(), bytes));
        }
    }

    pub fn dispatch<P: Push>(&mut self, pipe: Pipe, sets: &[vk::DescriptorSet], push: &P, groups: [u32; 3]) {
        let spec = pipe.spec();
        assert_eq!(sets.len(), spec.sets.count(), "{}: descriptor sets", spec.name);
        assert_eq!(std::mem::size_of::<P>(), spec.push_size, "{}: push-constant block size", spec.name);
        let max = self.ctx.limits.max_compute_work_group_count;
        assert!(groups.iter().zip(max).all(|(g, m)| *g >= 1 && *g <= m), "{}: workgroup count {groups:?}", spec.name);
        let (layout, pipeline) = (self.pipes.layouts[pipe as usize], self.pipes.pipelines[pipe as usize]);
        let d = &self.ctx.device;
        // SAFETY: the command buffer is recording; sets and push size match the layout (checked above).
        unsafe {
            d.cmd_bind_pipeline(self.cmd, vk::PipelineBindPoint::COMPUTE, pipeline);
            d.cmd_bind_descriptor_sets(self.cmd, vk::PipelineBindPoint::COMPUTE, layout, 0, sets, &[]);
            d.cmd_push_constants(self.cmd, layout, vk::ShaderStageFlags::COMPUTE, 0, push.bytes());
            d.cmd_dispatch(self.cmd, groups[0], groups[1], groups[2]);
        }
        let label = self.next_label.take();
        if let Some((pool, timed)) = self.timestamps.as_mut().filter(|(_, t)| (t.len() as u32) < MAX_TIMESTAMPS - 1) {
            let (label, bytes) = label.unwrap_or_else(|| (spec.name.to_string(), 0));
            timed.push(Timed { pipe, label, bytes });
            // SAFETY: recording; the query index is below MAX_TIMESTAMPS.
            unsafe {
                d.cmd_write_timestamp(self.cmd, vk::PipelineStageFlags::COMPUTE_SHADER, *pool, timed.len() as u32)
            };
        }
        self.stats.dispatches += 1;
        self.stats.mm += u32::from(pipe.is_mm());
        if !self.grouped {
            self.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::COMPUTE_SHADER);
        }
    }

    /// Records `f`'s dispatches with no barrier between them and one after
    /// them all (nested groups join the outer one). None of them may read or
    /// write what another of them writes.
    pub fn independent<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let outer = std::mem::replace(&mut self.grouped, true);
        let r = f(self);
        self.grouped = outer;
        if !outer {
            self.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::COMPUTE_SHADER);
            self.reduce_splits();
        }
        r
    }

    /// The reductions of the split matrices recorded since the last barrier
    /// (each its own part of the partial region and its own outputs), then a
    /// barrier.
    fn reduce_splits(&mut self) {
        if self.reduce.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.reduce);
        let outer = std::mem::replace(&mut self.grouped, true);
        for (set, push, groups, label) in pending {
            self.label_next(|| label, 0);
            self.dispatch(Pipe::SplitSums, &[set], &push, groups);
        }
        self.grouped = outer;
        self.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::COMPUTE_SHADER);
    }

    /// The parts of the regions of a split matrix: `floats` of the partial
    /// region for its sums and `counters` arrival counters (0: none), after
    /// those the group's earlier split matrices took; where they leave too
    /// little room, the group waits for them first (a barrier, the queued
    /// reductions, a barrier: every counter is zero again once the
    /// dispatches before it are done, and every partial sum read).
    fn take_split(&mut self, name: &str, floats: usize, counters: usize) -> (u32, u32) {
        let region = self.partials.filter(|_| floats > 0).unwrap_or(SplitRegion { off: 0, len: 0, per_entry: 0 });
        let (c_off, c_len) = self.counts.unwrap_or((0, 0));
        assert!(floats <= region.len as usize && counters <= c_len as usize, "{name}: the splits fit the regions");
        if self.partial_used as usize + floats > region.len as usize || self.counts_used as usize + counters > c_len as usize {
            self.barrier(vk::PipelineStageFlags::COMPUTE_SHADER, vk::AccessFlags::SHADER_WRITE, vk::PipelineStageFlags::COMPUTE_SHADER);
            self.reduce_splits();
        }
        let at = (region.off + self.partial_used, if counters > 0 { c_off + self.counts_used } else { 0 });
        self.partial_used += floats as u32;
        self.counts_used += counters as u32;
        at
    }

    /// `n` arrival counters for a dispatch whose workgroups count themselves
    /// in, the last of a group then finishing its work (zero before the
    /// dispatch, which leaves them zero), after those the dispatches since
    /// the last barrier took; `None` where the counters are off or the
    /// region is too small.
    pub fn take_counters(&mut self, name: &str, n: usize) -> Option<u32> {
        let (_, len) = self.counts?;
        (n <= len as usize).then(|| self.take_split(name, 0, n).1)
    }

    /// Queues the reduction of a split matrix's `splits` x `entries` partial
    /// sums (`push` as its dispatch has it, but for `partial_off`, set here:
    /// [`Recorder::take_split`]) for after the outermost group's barrier.
    fn queue_sums(&mut self, set: vk::DescriptorSet, name: &str, push: &mut MatvecPush, splits: usize, entries: usize) {
        push.partial_off = self.take_split(name, split_floats(push, splits, entries), 0).0;
        let groups = [(push.rows as usize).div_ceil(Pipe::SplitSums.spec().workgroup as usize) as u32, entries as u32, 1];
        self.reduce.push((set, *push, groups, format!("{} (split sums)", role(name))));
    }

    /// Whether rows of `cols` run the fast kernels (when the pipelines have them).
    fn fast(&self, cols: usize) -> bool {
        self.pipes.fast && cols <= FAST_MAX_COLS
    }

    /// One workgroup per `n` items of `pipe`'s workgroup size.
    pub fn threads(&self, pipe: Pipe, n: usize) -> [u32; 3] {
        self.threads_n(pipe, n, 1)
    }

    /// [`Recorder::threads`] for each of `tokens` tokens (grid y).
    pub fn threads_n(&self, pipe: Pipe, n: usize, tokens: usize) -> [u32; 3] {
        grid(self.ctx, n.div_ceil(pipe.spec().workgroup as usize), tokens as u32)
    }

    /// `n` workgroups (past the grid's width, in layers of it: grid z) for
    /// each of `tokens` tokens (grid y).
    pub fn groups_n(&self, n: usize, tokens: usize) -> [u32; 3] {
        grid(self.ctx, n, tokens as u32)
    }

    /// A pipeline barrier. After one that waits for compute work, the
    /// split rows' counters are free again, and so are their partial sums
    /// unless reductions still wait to read them.
    pub fn barrier(&mut self, src: vk::PipelineStageFlags, access: vk::AccessFlags, dst: vk::PipelineStageFlags) {
        let dst_access = if dst == vk::PipelineStageFlags::TRANSFER {
            vk::AccessFlags::TRANSFER_READ
        } else {
            vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE
        };
        let mb = [vk::MemoryBarrier::default().src_access_mask(access).dst_access_mask(dst_access)];
        // SAFETY: recording command buffer.
        unsafe { self.ctx.device.cmd_pipeline_barrier(self.cmd, src, dst, vk::DependencyFlags::empty(), &mb, &[], &[]) };
        self.stats.barriers += 1;
        if src.contains(vk::PipelineStageFlags::COMPUTE_SHADER) {
            self.counts_used = 0;
            if self.reduce.is_empty() {
                self.partial_used = 0;
            }
        }
    }

    /// Fills the work split and layout fields of a matvec push for `part`
    /// and returns the pipeline (`pipe`, or its batch module for a tile of
    /// several entries whose rounded activations are in place:
    /// [`Pipe::batch`]) and the workgroup grid for
    /// `experts` per token and `n` tokens (grid y: tiles of the tuning's
    /// tokens for a plain matrix or grouped pairs, one pair per workgroup
    /// otherwise). The split is the one token's, so a token's sums are added
    /// in the same order in a batch as alone.
    fn matvec_split(&self, pipe: Pipe, part: &PartLayout, push: &mut MatvecPush, experts: u32, n: u32, tiled: bool) -> (Pipe, [u32; 3]) {
        assert!(push.x_off.is_multiple_of(4) && push.x_stride.is_multiple_of(4), "matvec activations must start at multiples of 4 floats");
        let entries = experts * n;
        push.cols = part.cols as u32;
        push.row_bytes = part.row_bytes as u32;
        push.fld0 = part.fields[0] as u32;
        push.fld1 = part.fields[1] as u32;
        let arena = pipe.spec().sets == Sets::StateArena;
        let swiglu = push.mode == 4;
        if let Some(mm) = part.ty.and_then(|ty| self.mm(ty, arena, part.cols, entries as usize, push.total_rows as usize)).filter(|_| tiled) {
            // shaders/mm.comp: tiles of MM_ROWS rows (SwiGLU: half of them gate
            // rows, half up rows) by mm_entries entries.
            let tile_rows = if swiglu { MM_ROWS / 2 } else { MM_ROWS };
            let tile = mm_entries(arena);
            (push.tpr_shift, push.tile, push.ntok) = (0, tile, entries);
            return (mm, grid(self.ctx, (push.rows as usize).div_ceil(tile_rows), entries.div_ceil(tile)));
        }
        let tile = if tiled { self.pipes.tuning[pipe as usize].tile.min(entries) } else { 1 };
        // The batch modules read the activations act_int8 rounded (push.xq_off).
        let pipe = if tile > 1 && push.xq_off != 0 && self.pipes.tuning[pipe as usize].share > 1 { pipe.batch() } else { pipe };
        let (shift, per_group) = self.row_sets(pipe, part.items, push.rows as usize, experts as usize);
        push.tpr_shift = shift;
        if push.mode == 5 {
            // (Recorder::fuses_combine held.)
            assert!(n == 1 && shift >= 1 && per_group.is_multiple_of(push.aux_n as usize), "mode 5 out of its bounds");
        }
        (push.tile, push.ntok) = (tile, entries);
        (pipe, grid(self.ctx, (push.rows as usize).div_ceil(per_group), entries.div_ceil(tile)))
    }

    /// Splits of the rows of a plain matrix of `rows` rows (gate and up rows
    /// with SwiGLU) of `cols` columns for a pass of `entries` tokens on the
    /// matrix-matrix modules: enough for its row tiles x token tiles x splits
    /// to reach [`Pipelines::mm_split`] workgroups, each split at least
    /// [`MM_SPLIT_STEPS`] steps; 1 where it fills them already, for the
    /// experts, or where the recorder has no partial region.
    fn mm_splits(&self, cols: usize, rows: usize, entries: usize) -> usize {
        let want = self.pipes.mm_split;
        if want == 0 || self.partials.is_none() || !cols.is_multiple_of(MM_COLS) {
            return 1;
        }
        let tiles = rows.div_ceil(MM_ROWS) * entries.div_ceil(mm_entries(false) as usize);
        let steps = cols / MM_COLS;
        let splits = (want / tiles.max(1)).min(steps / MM_SPLIT_STEPS);
        if splits < 2 {
            return 1;
        }
        steps.div_ceil(steps.div_ceil(splits))
    }

    /// Splits the rows of a plain matrix's dispatch on the matrix-matrix
    /// modules where [`Recorder::mm_splits`] says so and the partial region
    /// can hold them (`push` gets the split and its part of the region, `groups`
    /// the row tiles x splits workgroups) and queues its reduction for the
    /// end of the outermost group ([`Recorder::independent`]).
    fn split_rows(&mut self, set: vk::DescriptorSet, name: &str, push: &mut MatvecPush, groups: &mut [u32; 3]) {
        let Some(region) = self.partials else { return };
        let swiglu = push.mode == 4;
        let (rows, entries, cols) = (push.rows as usize, push.ntok as usize, push.cols as usize);
        // Floats of one split of one entry; at most as many splits as the
        // whole region holds (Recorder::take_split makes the room).
        let per_entry = if swiglu { 2 * rows } else { rows };
        let most = region.len as usize / (entries * per_entry).max(1);
        let splits = self.mm_splits(cols, per_entry, entries).min(most);
        if splits < 2 || push.mode == 5 {
            return;
        }
        let steps = cols / MM_COLS;
        let per = steps.div_ceil(splits);
        let splits = steps.div_ceil(per);
        push.kcols = (per * MM_COLS) as u32;
        let row_tiles = rows.div_ceil(if swiglu { MM_ROWS / 2 } else { MM_ROWS });
        *groups = grid(self.ctx, row_tiles * splits, groups[1]);
        self.queue_sums(set, name, push, splits, entries);
    }

    /// The splits of the rows of a plain matrix's matvec on `pipe` (`rows`
    /// rows, gate rows with SwiGLU, of `part`'s columns) and the columns of
    /// each, if they split ([`Pipelines::matvec_split`]): quantized rows of
    /// at least four times its columns whose row sets alone (each row's items
    /// over the tuning's invocations) leave fewer workgroups than the
    /// tuning's `fill`, cut into as many splits as the partial region allows
    /// an entry's half (its other half is for other split matrices of the
    /// group), each of whole blocks (and of the fast kernels' rounding blocks
    /// of 32) and at least [`Pipelines::matvec_split`] columns. The shape and
    /// tuning alone decide, so a token and a pass split a matrix alike (and
    /// sum it alike).
    fn matvec_splits(&self, pipe: Pipe, part: &PartLayout, rows: usize, mode: u32) -> Option<(usize, usize)> {
        let (region, min_cols) = (self.partials?, self.pipes.matvec_split);
        let align = part.ty.map_or(1, |t| t.block_size()).max(32);
        let quantized = part.ty.is_some_and(|t| t.block_size() > 1);
        if min_cols == 0 || mode == 5 || !quantized || pipe.spec().sets == Sets::StateArena || part.cols < 4 * min_cols {
            return None;
        }
        let tuning = self.pipes.tuning[pipe as usize];
        let per_group = tuning.rows_per_workgroup(tuning.tpr_shift(part.items)) as usize;
        if rows.div_ceil(per_group) >= tuning.fill as usize {
            return None;
        }
        let per_entry = if mode == 4 { 2 * rows } else { rows };
        let most = (region.per_entry as usize / 2 / per_entry).max(1);
        let kcols = part.cols.div_ceil(most).max(min_cols).div_ceil(align) * align;
        let splits = part.cols.div_ceil(kcols);
        (splits >= 2).then_some((splits, kcols))
    }

    /// Splits the rows of a plain matrix's matvec where
    /// [`Recorder::matvec_splits`] says so: `push` gets the splits' columns
    /// and row sets, `groups` the row groups x splits workgroups, and the
    /// splits are added by the last workgroup of each row group (push
    /// `expert_off`: its counters, one per row group and tile of entries)
    /// or, without room for the counters, by a reduction queued for the end
    /// of the outermost group.
    fn split_matvec(&mut self, set: vk::DescriptorSet, name: &str, pipe: Pipe, part: &PartLayout, push: &mut MatvecPush, groups: &mut [u32; 3]) {
        let rows = push.rows as usize;
        let Some((splits, kcols)) = self.matvec_splits(pipe, part, rows, push.mode) else { return };
        let (shift, per_group) = self.row_sets(pipe, part.items * kcols / part.cols, rows, splits);
        push.tpr_shift = shift;
        push.kcols = kcols as u32;
        let row_groups = rows.div_ceil(per_group);
        let tiles = groups[1] as usize;
        *groups = grid(self.ctx, row_groups * splits, groups[1]);
        let (entries, counters) = (push.ntok as usize, row_groups * tiles);
        if self.counts.is_some_and(|(_, len)| counters <= len as usize) {
            (push.partial_off, push.expert_off) = self.take_split(name, split_floats(push, splits, entries), counters);
        } else {
            self.queue_sums(set, name, push, splits, entries);
        }
    }

    /// log2 of the invocations per row set, and the rows of a workgroup, of
    /// pipeline `pipe` for `rows` rows of `items` items, `grids` times.
    fn row_sets(&self, pipe: Pipe, items: usize, rows: usize, grids: usize) -> (u32, usize) {
        let tuning = match self.force_tpr {
            Some(t) => MatvecTuning { tpr: Some(t), ..self.pipes.tuning[pipe as usize] },
            None => self.pipes.tuning[pipe as usize],
        };
        let shift = tuning.tpr_shift_filled(items, rows, grids);
        (shift, tuning.rows_per_workgroup(shift) as usize)
    }

    /// Whether one token's matvec of `m` can combine `streams`
    /// hyper-connection streams as its epilogue (mode 5): one chunk of
    /// `streams` x H rows, each workgroup's rows whole groups of `streams`,
    /// row sets of at least two invocations (their sums fit the shared
    /// reduction region).
    pub fn fuses_combine(&self, m: &GpuMatrix, streams: usize) -> bool {
        let [c] = &m.chunks[..] else { return false };
        let pipe = Pipe::matvec(m.ty, false, self.fast(c.layout.cols));
        let (shift, per_group) = self.row_sets(pipe, c.layout.items, m.rows, 1);
        streams > 0 && m.rows.is_multiple_of(streams) && shift >= 1 && per_group.is_multiple_of(streams)
    }

    /// The matrix-matrix module (shaders/mm.comp) for a batch of `entries`
    /// entries of a matrix of `rows` rows of `cols` values of `ty` (an
    /// expert part when `arena`), if the pipelines have it, the batch is
    /// large enough ([`Pipelines::mm_min`]) and the matrix is one the
    /// modules run faster than the batch modules ([`Pipelines::mm_rows`], or
    /// [`Pipelines::mm_split_rows`] with split rows; [`Pipelines::mm_experts`]).
    fn mm(&self, ty: GgmlType, arena: bool, cols: usize, entries: usize, rows: usize) -> Option<Pipe> {
        let p = &self.pipes;
        let splits = || rows >= p.mm_split_rows && self.mm_splits(cols, rows, entries) >= 2;
        let worth = if arena { p.mm_experts.takes(ty) } else { rows >= p.mm_rows || splits() };
        let fits = p.mm && worth && entries >= p.mm_min && cols.is_multiple_of(MM_COLS) && cols <= FAST_MAX_COLS;
        fits.then(|| Pipe::mm(ty, arena)).flatten()
    }

    /// Before the fast matvecs of `n` tokens whose input is `count` vectors
    /// of `cols` values per token (at `x_off + j * x_stride`, tokens
    /// `tok_stride` apart, which must be the region's): rounds them once
    /// into the [`Recorder::xq`] region and points `push.xq_off` there.
    /// Does nothing for one token (unless its rows are at least
    /// [`Pipelines::round_once_cols`] long), exact kernels, rows the region cannot
    /// hold, inside [`Recorder::independent`] (the matvec would not wait),
    /// or when `push` already has them.
    #[allow(clippy::too_many_arguments)]
    fn round_once(&mut self, set: vk::DescriptorSet, ty: GgmlType, arena: bool, push: &mut MatvecPush, (cols, rows): (usize, usize), count: usize, n: usize, tok_stride: u32) {
        let Some((q_off, stride)) = self.xq else { return };
        let once = n >= 2 || (self.pipes.round_once_cols > 0 && count * cols >= self.pipes.round_once_cols);
        if !once || !self.reads_rounded(ty, arena, cols, count) || push.xq_off != 0 || tok_stride != stride {
            return;
        }
        // The matrix-matrix modules read the activations as they are (experts: grouped pairs).
        if self.mm(ty, arena, cols, n, rows).is_some() && (!arena || push.order_off != 0) {
            return;
        }
        let p = ActInt8Push { x_off: push.x_off, x_stride: push.x_stride, tok_stride, cols: cols as u32, count: count as u32, q_off };
        // Four invocations per block of 32; at most FAST_MAX_COLS / 32 blocks.
        let groups = (count * cols / 32).div_ceil(Pipe::ActInt8.spec().workgroup as usize / 4);
        self.dispatch(Pipe::ActInt8, &[set], &p, [groups as u32, n as u32, 1]);
        push.xq_off = q_off;
    }

    /// Where a producer may write one token's input of `cols` values for a
    /// fast matvec of a plain matrix of `ty` already rounded (hc_norm): the
    /// [`Recorder::xq`] region, or `None` where that matvec runs no fast
    /// kernel or the region cannot hold the rows.
    pub fn single_round(&self, ty: GgmlType, cols: usize) -> Option<u32> {
        let (q_off, _) = self.xq?;
        self.reads_rounded(ty, false, cols, 1).then_some(q_off)
    }

    /// Whether a matvec of `ty` (an expert part when `arena`) over `count`
    /// vectors of `cols` values per entry can read them from the region
    /// rounded once: fast kernels, rows of whole blocks the region holds,
    /// outside an [`Recorder::independent`] group (its matvecs would not wait).
    fn reads_rounded(&self, ty: GgmlType, arena: bool, cols: usize, count: usize) -> bool {
        let fast = self.fast(cols) && Pipe::matvec(ty, arena, true) != Pipe::matvec(ty, arena, false);
        fast && !self.grouped && cols.is_multiple_of(32) && count * cols <= FAST_MAX_COLS
    }

    /// Rounds the input of `m`'s matvec for `n` tokens once
    /// ([`Recorder::round_once`]); [`Recorder::matvec_n`] does it itself, and
    /// a caller does it ahead of an [`Recorder::independent`] group that
    /// holds the matvec, so that it runs the batch modules there too.
    pub fn round_for(&mut self, set: vk::DescriptorSet, m: &GpuMatrix, push: &mut MatvecPush, n: usize) {
        let stride = push.x_stride;
        self.round_once(set, m.ty, false, push, (m.chunks[0].layout.cols, m.rows), 1, n, stride);
    }

    /// `y = W x` over every chunk of `m`. The caller fills the offsets and epilogue of `push`.
    #[cfg(test)]
    pub fn matvec(&mut self, m: &GpuMatrix, state_set: vk::DescriptorSet, push: MatvecPush) {
        self.matvec_n(m, state_set, push, 1);
    }

    /// [`Recorder::matvec`] for `n` tokens: token `k` reads x at
    /// `x_off + k * x_stride` and writes y at `y_off + k * y_stride`.
    pub fn matvec_n(&mut self, m: &GpuMatrix, state_set: vk::DescriptorSet, mut push: MatvecPush, n: usize) {
        let swiglu = push.mode == 4;
        assert!(!swiglu || m.chunks.len() == 1, "{}: a SwiGLU matrix is never split", m.name);
        let cols = m.chunks[0].layout.cols;
        let pipe = Pipe::matvec(m.ty, false, self.fast(cols));
        self.round_for(state_set, m, &mut push, n);
        push.total_rows = m.rows as u32;
        push.scale = if push.scale == 0.0 { 1.0 } else { push.scale };
        // The chunks write disjoint rows.
        self.independent(|rec| {
            for c in &m.chunks {
                push.rows = if swiglu { c.rows / 2 } else { c.rows } as u32;
                push.row_base = c.first_row as u32;
                let (pipe, mut groups) = rec.matvec_split(pipe, &c.layout, &mut push, 1, n as u32, true);
                push.kcols = 0;
                if pipe.is_mm() {
                    rec.split_rows(state_set, &m.name, &mut push, &mut groups);
                } else {
                    rec.split_matvec(state_set, &m.name, pipe, &c.layout, &mut push, &mut groups);
                }
                rec.label_next(|| role(&m.name), c.layout.bytes as u64);
                rec.dispatch(pipe, &[state_set, c.set], &push, groups);
            }
        });
        self.stats.weight_bytes += m.device_bytes();
    }

    /// Whether the router logits of `n` tokens go to [`Recorder::router_n`]:
    /// it takes `m` and [`Pipelines::router`] asks for it.
    pub fn routes(&self, m: &GpuMatrix, n: usize) -> bool {
        let wanted = match self.pipes.router {
            RouterUse::Never => false,
            RouterUse::Passes => n > 1,
            RouterUse::Always => true,
        };
        wanted && Self::router_takes(m)
    }

    /// Whether [`Recorder::router_n`] takes `m`: F32 weights in one chunk.
    pub fn router_takes(m: &GpuMatrix) -> bool {
        m.ty == GgmlType::F32 && m.chunks.len() == 1
    }

    /// The MoE router's logits of `n` tokens (inputs at `x_off`, logits at
    /// `y_off`, `tok_stride` floats apart per token) from `m`'s F32 weights
    /// on shaders/router.comp: one token on its plain module, a pass on its
    /// batch module, each logit summed in the same order by both.
    pub fn router_n(&mut self, m: &GpuMatrix, state_set: vk::DescriptorSet, x_off: u32, y_off: u32, tok_stride: u32, n: usize) {
        assert!(Self::router_takes(m), "{}: the router module takes F32 weights in one chunk", m.name);
        assert!(x_off.is_multiple_of(4) && tok_stride.is_multiple_of(4), "router activations must start at multiples of 4 floats");
        let c = &m.chunks[0];
        let push = RouterPush {
            rows: m.rows as u32,
            cols: c.layout.cols as u32,
            row_bytes: c.layout.row_bytes as u32,
            x_off,
            y_off,
            tok_stride,
            n: n as u32,
        };
        // Experts and tokens a workgroup covers (shaders/router.comp: 4 x 1, or 16 x 16).
        let (pipe, (experts, tokens)) = if n == 1 { (Pipe::Router, (4, 1)) } else { (Pipe::RouterBatch, (16, 16)) };
        let groups = [m.rows.div_ceil(experts) as u32, n.div_ceil(tokens) as u32, 1];
        self.label_next(|| role(&m.name), c.layout.bytes as u64);
        self.dispatch(pipe, &[state_set, c.set], &push, groups);
        self.stats.weight_bytes += m.device_bytes();
    }

    /// Matvecs of matrices whose rows are consecutive outputs (one fused
    /// projection, split where the parts' types differ), for `n` tokens (as
    /// [`Recorder::matvec_n`]).
    pub fn matvecs_n(&mut self, ms: &[GpuMatrix], state_set: vk::DescriptorSet, mut push: MatvecPush, n: usize) {
        // One rounding of the input for every part with fast kernels.
        for m in ms {
            self.round_for(state_set, m, &mut push, n);
        }
        // The parts write disjoint rows.
        self.independent(|rec| {
            let mut rows = 0;
            for m in ms {
                let p = MatvecPush { y_off: push.y_off + rows, split_row: push.split_row.saturating_sub(rows), ..push };
                rec.matvec_n(m, state_set, p, n);
                rows += m.rows as u32;
            }
        });
    }

    /// A matvec of the arena part `part` (at `push.part_off` of each slot) for
    /// `experts` experts (ids in scratch at `push.expert_off`; with
    /// `push.kdiv`, (token, expert) pairs, taken in the order at
    /// `push.order_off` when set, in tiles as a plain matrix's tokens);
    /// `push.rows` is the part's output rows (its gate rows with SwiGLU).
    #[cfg(test)]
    pub fn expert_matvec(&mut self, ty: GgmlType, sets: [vk::DescriptorSet; 2], push: MatvecPush, part: &PartLayout, experts: usize) {
        assert_eq!(push.tiles_off, 0, "a tile table needs its bound: expert_matvec_tiled");
        self.expert_matvec_tiled(ty, sets, push, part, experts, 0);
    }

    /// [`Recorder::expert_matvec`] of a pass's pairs grouped by expert
    /// whose tiles of one expert each moe_group wrote at `push.tiles_off`
    /// (at most `max_tiles`): the matrix-matrix modules run them (a row of
    /// `max_tiles` workgroups, those past the table's tiles return at once);
    /// the batch modules ignore the table.
    pub fn expert_matvec_tiled(&mut self, ty: GgmlType, sets: [vk::DescriptorSet; 2], mut push: MatvecPush, part: &PartLayout, experts: usize, max_tiles: u32) {
        let pipe = Pipe::matvec(ty, true, self.fast(part.cols));
        push.total_rows = push.rows;
        let per_token = if push.kdiv > 0 { push.kdiv as usize } else { experts };
        if push.kdiv > 0 {
            // A token's one input (gate/up), or each pair's own (down).
            let count = if push.x_stride == 0 { 1 } else { per_token };
            let (shape, tok) = ((part.cols, push.rows as usize), push.tok_stride);
            self.round_once(sets[0], ty, true, &mut push, shape, count, experts / per_token, tok);
        }
        let grouped = push.order_off != 0;
        let (pipe, mut g) = self.matvec_split(pipe, part, &mut push, per_token as u32, (experts / per_token) as u32, grouped);
        if pipe.is_mm() && push.tiles_off != 0 {
            assert!(grouped && max_tiles > 0, "a tile table of pairs grouped by expert");
            g[1] = max_tiles;
        }
        let what = if push.mode == 4 { "experts gate/up" } else { "experts down" };
        self.label_next(|| what.to_string(), (experts * part.bytes) as u64);
        self.dispatch(pipe, &sets, &push, g);
        self.stats.weight_bytes += (experts * part.bytes) as u64;
    }
}

impl Recorder<'_> {
    /// The expert matvec over entries `start..start + count` of the pairs'
    /// order at `push.order_off` (a round of a pass streamed through the
    /// expert cache's slots; `push.expert_off` holds each pair's slot). Each
    /// workgroup rounds its own inputs.
    pub fn expert_entries(&mut self, ty: GgmlType, sets: [vk::DescriptorSet; 2], mut push: MatvecPush, part: &PartLayout, start: usize, count: usize) {
        if count == 0 {
            return;
        }
        let pipe = Pipe::matvec(ty, true, self.fast(part.cols));
        push.total_rows = push.rows;
        push.order_base = start as u32;
        let (pipe, g) = self.matvec_split(pipe, part, &mut push, count as u32, 1, true);
        let what = if push.mode == 4 { "experts gate/up" } else { "experts down" };
        self.label_next(|| what.to_string(), part.bytes as u64);
        self.dispatch(pipe, &sets, &push, g);
    }
}

/// A descriptor pool for a known number of storage-buffer sets.
pub(crate) struct DescriptorPool {
    pub raw: vk::DescriptorPool,
    device: ash::Device,
}

impl DescriptorPool {
    pub fn new(ctx: &Context, sets: u32, buffers: u32) -> Result<Self> {
        let sizes = [vk::DescriptorPoolSize { ty: vk::DescriptorType::STORAGE_BUFFER, descriptor_count: buffers.max(1) }];
        let info = vk::DescriptorPoolCreateInfo::default().max_sets(sets.max(1)).pool_sizes(&sizes);
        // SAFETY: valid device and create info.
        let raw = unsafe { ctx.device.create_descriptor_pool(&info, None) }.map_err(err("creating a descriptor pool"))?;
        Ok(DescriptorPool { raw, device: ctx.device.clone() })
    }

    /// Allocates a set of `layout` and writes `bindings` (binding i = bindings[i]).
    pub fn set(&self, layout: vk::DescriptorSetLayout, bindings: &[&[vk::DescriptorBufferInfo]]) -> Result<vk::DescriptorSet> {
        let layouts = [layout];
        let info = vk::DescriptorSetAllocateInfo::default().descriptor_pool(self.raw).set_layouts(&layouts);
        // SAFETY: the pool was sized for every set its owner allocates.
        let set = unsafe { self.device.allocate_descriptor_sets(&info) }.map_err(err("allocating a descriptor set"))?[0];
        let writes: Vec<_> = bindings
            .iter()
            .enumerate()
            .map(|(i, b)| {
                vk::WriteDescriptorSet::default()
                    .dst_set(set)
                    .dst_binding(i as u32)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(b)
            })
            .collect();
        // SAFETY: the set is fresh and not in use; buffer infos name live buffers.
        unsafe { self.device.update_descriptor_sets(&writes, &[]) };
        Ok(set)
    }
}

impl Drop for DescriptorPool {
    fn drop(&mut self) {
        // SAFETY: no pending command buffer uses the pool's sets.
        unsafe { self.device.destroy_descriptor_pool(self.raw, None) };
    }
}

/// A query pool for per-dispatch GPU timestamps (profiling is opt-in: the
/// timestamps themselves cost a little per dispatch).
pub(crate) struct Timestamps {
    ctx: std::sync::Arc<Context>,
    pub pool: vk::QueryPool,
}

impl Timestamps {
    /// An error when the device cannot time compute work.
    pub fn new(ctx: &std::sync::Arc<Context>) -> Result<Timestamps> {
        if ctx.limits.timestamp_compute_and_graphics == vk::FALSE {
            return Err(crate::Error::Backend("this Vulkan device cannot time compute work".into()));
        }
        let info = vk::QueryPoolCreateInfo::default().query_type(vk::QueryType::TIMESTAMP).query_count(MAX_TIMESTAMPS);
        // SAFETY: a valid device and create info.
        let pool = unsafe { ctx.device.create_query_pool(&info, None) }.map_err(err("creating a timestamp query pool"))?;
        Ok(Timestamps { ctx: ctx.clone(), pool })
    }

    /// Milliseconds of each of the dispatches `timed` of the finished token
    /// (from the end of the one before: the barrier and the launch count).
    pub fn read(&self, timed: &[Timed]) -> Result<Vec<f64>> {
        let mut ticks = vec![0u64; timed.len() + 1];
        // SAFETY: the token's submission was waited for; the queries were written.
        unsafe {
            self.ctx.device.get_query_pool_results(self.pool, 0, &mut ticks, vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT)
        }
        .map_err(err("reading GPU timestamps"))?;
        let ms_per_tick = self.ctx.limits.timestamp_period as f64 * 1e-6;
        Ok(ticks.windows(2).map(|w| w[1].saturating_sub(w[0]) as f64 * ms_per_tick).collect())
    }
}

/// Microseconds one dependent dispatch costs on this device when it does
/// nothing: the median over `n` empty dispatches recorded as a token's are
/// (each followed by its barrier), timed from the end of the one before.
/// A token's barriers times this is the part of its GPU time spent waiting
/// for one step to finish before the next starts (its dependency latency).
pub(crate) fn empty_dispatch_us(ctx: &Arc<Context>, pipes: &Pipelines, n: usize) -> Result<f64> {
    use super::buffer::{Buffer, Commands};
    let ts = Timestamps::new(ctx)?;
    let cmds = Commands::new(ctx)?;
    let buf = Buffer::new(ctx, "empty dispatches", 16, gpu_allocator::MemoryLocation::GpuOnly)?;
    let pool = DescriptorPool::new(ctx, 1, 3)?;
    let set = pool.set(pipes.state_layout, &[&[buf.info()], &[buf.info()], &[buf.info()]])?;
    // split_sums with no rows: every invocation returns at once.
    let push = MatvecPush { rows: 0, ntok: 1, kcols: 1, ..Default::default() };
    let mut ms = Vec::new();
    for timed in [false, true] {
        cmds.begin()?;
        let mut rec = Recorder::new(ctx, pipes, cmds.cmd);
        if timed {
            rec.profile_into(ts.pool);
        }
        for _ in 0..n.clamp(1, MAX_TIMESTAMPS as usize - 1) {
            rec.dispatch(Pipe::SplitSums, &[set], &push, [1, 1, 1]);
        }
        cmds.submit()?;
        if timed {
            ms = ts.read(rec.profiled())?;
        }
    }
    ms.sort_by(f64::total_cmp);
    Ok(1e3 * ms[ms.len() / 2])
}

/// Milliseconds per pipeline, summed over its dispatches, in order of first use.
pub(crate) fn per_pipeline(timed: &[Timed], ms: &[f64]) -> Vec<(&'static str, f64)> {
    let mut stages: Vec<(&'static str, f64)> = Vec::new();
    for (t, &ms) in timed.iter().zip(ms) {
        let name = t.pipe.spec().name;
        match stages.iter_mut().find(|(n, _)| *n == name) {
            Some((_, s)) => *s += ms,
            None => stages.push((name, ms)),
        }
    }
    stages
}

/// Dispatches, milliseconds and weight bytes per label, in order of first use.
pub(crate) fn per_label(timed: &[Timed], ms: &[f64]) -> Vec<crate::model::backend::DispatchTime> {
    let mut out: Vec<crate::model::backend::DispatchTime> = Vec::new();
    for (t, &ms) in timed.iter().zip(ms) {
        let label = format!("{} ({})", t.label, t.pipe.spec().name);
        match out.iter_mut().find(|d| d.label == label) {
            Some(d) => {
                d.dispatches += 1;
                d.ms += ms;
                d.bytes += t.bytes;
            }
            None => out.push(crate::model::backend::DispatchTime { label, dispatches: 1, ms, bytes: t.bytes }),
        }
    }
    out
}

impl Drop for Timestamps {
    fn drop(&mut self) {
        // SAFETY: no submission using the pool is pending (every token is waited for).
        unsafe { self.ctx.device.destroy_query_pool(self.pool, None) };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn roles_drop_the_layer_and_suffix() {
        assert_eq!(super::role("blk.3.ssm_out.weight"), "ssm_out");
        assert_eq!(super::role("blk.12.hc_attn_down.weight+blk.12.hc_attn_inject.weight"), "hc_attn_down+hc_attn_inject");
        assert_eq!(super::role("output.weight"), "output");
        assert_eq!(super::role("blk.x.odd"), "blk.x.odd");
    }
}
