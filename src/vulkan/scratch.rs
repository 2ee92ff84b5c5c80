//! The scratch buffer of a GPU state: every activation of a token at a
//! fixed float offset. A pass of `T` tokens (up to the layout's `batch`)
//! keeps token `t`'s activations in block `t`, `tok` floats after token
//! `t - 1`'s: [`ScratchLayout::at`] gives token `t`'s offsets, so the same
//! push constants serve any token, and a batched matvec reads and writes
//! every token's block at a stride of `tok`. The first `input_len` floats
//! of each block come from the host (residual seed, PLE rows, RoPE
//! tables): its upload holds the embedding row once per token, copied into
//! every residual stream, then the rest as it lies in the block
//! ([`ScratchLayout::upload_len`], [`ScratchLayout::upload_at`]).
//! After the blocks: the partial sums of matrices with split rows, the
//! logits of the tokens that get them, then the
//! regions that scale with the context: block scores and selections for a
//! run of up to `score_rows` tokens at a time (`n_ctx` floats apart), and
//! the attention partials (shaders/attention.comp's splits) of up to
//! `att_rows` tokens attended in one dispatch (`n_heads * att_stride`
//! floats apart).

use super::pipelines::{attention_head_floats, max_expert_tiles, mm_entries, XQ_FLOATS};
use crate::error::{Error, Result};
use crate::model::{Config, LayerKind};

/// Floats of the block scores (and of the selections) of the tokens of a
/// pass scored together: up to 16 MB each, a whole pass of 512 tokens up to
/// a context of 8192.
const SCORE_FLOATS: usize = 1 << 22;
/// Floats of the attention partials of the tokens of a pass attended
/// together (heads x `att_stride` each): up to 16 MB.
const ATT_FLOATS: usize = 1 << 22;
/// Arrival counters of split matvecs (one per row group and tile of
/// entries of each split matrix a group of dispatches holds: a 512-token
/// pass's hyper-connection down projections take a few thousand).
const SPLIT_COUNTERS: usize = 8192;

/// Float offsets of every activation in the scratch buffer.
#[derive(Clone, Default, Debug)]
pub(crate) struct ScratchLayout {
    pub residual: u32,
    pub ple_rows: u32,
    pub rope: u32,
    /// One block-key table per attention layer.
    pub block_rope: u32,
    /// End of the region the host's inputs fill per token.
    pub input_len: u32,
    /// Floats of the residual seed in the upload (the embedding row once).
    pub up_row: u32,
    pub xn: u32,
    pub low: u32,
    pub mix: u32,
    pub input: u32,
    pub inject: u32,
    pub ple_key: u32,
    pub ple_value: u32,
    pub ple_tmp: u32,
    pub qkv: u32,
    pub z: u32,
    pub beta: u32,
    pub alpha: u32,
    pub conv_out: u32,
    pub gdn_out: u32,
    pub qg: u32,
    pub k: u32,
    pub v: u32,
    pub q: u32,
    pub iq: u32,
    pub ik: u32,
    /// QSA block scores and selections of `score_rows` tokens, `n_ctx` floats apart.
    pub scores: u32,
    pub sel: u32,
    pub score_rows: u32,
    pub score_stride: u32,
    /// Attention partials of `att_rows` tokens, `n_heads * att_stride` floats apart.
    pub att_tmp: u32,
    pub att_rows: u32,
    /// Floats of one head's attention partials ([`attention_head_floats`]).
    pub att_stride: u32,
    pub att_out: u32,
    pub router: u32,
    pub ids: u32,
    /// A pass's (token, expert) pairs grouped by expert, k per token (moe_group).
    pub order: u32,
    /// The order's tiles of one expert each for the matrix-matrix modules
    /// (moe_group): their number, then (first entry, entries) per tile.
    pub tiles: u32,
    /// Tiles the region holds: the most a pass can have.
    pub max_tiles: u32,
    /// A matvec input rounded to 8 bits once for a pass's fast kernels (act_int8).
    pub xq: u32,
    pub weights: u32,
    pub exp_h: u32,
    pub exp_y: u32,
    pub sh_h: u32,
    pub sh_y: u32,
    /// The host's weighted sum of the experts it computed (expert cache): [H]
    pub partial: u32,
    /// Floats between consecutive tokens' blocks (a multiple of 64).
    pub tok: u32,
    /// Tokens a pass may hold.
    pub batch: u32,
    /// The partial sums of matrices with split rows (shaders/mm.comp,
    /// shaders/matvec.comp; `Recorder::partials`): `split_sums_len` floats,
    /// the streams' floats (`hc * hidden`) per token a pass may hold.
    pub split_sums: u32,
    pub split_sums_len: u32,
    /// The split matvecs' arrival counters (`Recorder::counts`, uints; zero
    /// between dispatches, zeroed with each pass's upload).
    pub split_counts: u32,
    pub split_counts_len: u32,
    /// The logits of up to `logit_rows` tokens, [logit_rows][V].
    pub logits: u32,
    pub logit_rows: u32,
    pub total: u32,
}

impl ScratchLayout {
    /// The layout for `n_ctx` positions, passes of up to `batch` tokens and
    /// logits for up to `logit_rows` of them.
    pub fn new(cfg: &Config, n_ctx: usize, batch: usize, logit_rows: usize) -> Result<Self> {
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
        l.up_row = (h.div_ceil(4) * 4) as u32;
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
        l.order = next(k);
        l.weights = next(k);
        l.exp_h = next(k * exp_h_stride(cfg) as usize);
        l.exp_y = next(k * h);
        l.sh_h = next(cfg.shared_ff);
        l.sh_y = next(h);
        l.partial = next(h);
        l.xq = next(XQ_FLOATS);
        let tok = next(0).div_ceil(64) * 64;
        l.tok = tok;
        l.batch = batch.max(1) as u32;
        at = tok as usize * l.batch as usize;
        let mut next = |n: usize| {
            let o = at;
            at += n.div_ceil(4) * 4;
            o as u32
        };
        // The routed experts and the shared one when it runs in the arena.
        l.max_tiles = max_expert_tiles(l.batch as usize * k, cfg.n_experts + 1, mm_entries(true) as usize) as u32;
        l.tiles = next(1 + 2 * l.max_tiles as usize);
        l.split_sums_len = (l.batch as usize * c * h).div_ceil(4) as u32 * 4;
        l.split_sums = next(l.split_sums_len as usize);
        l.split_counts_len = SPLIT_COUNTERS as u32;
        l.split_counts = next(SPLIT_COUNTERS);
        l.logit_rows = logit_rows.clamp(1, batch.max(1)) as u32;
        l.logits = next(l.logit_rows as usize * cfg.vocab);
        // Last: the regions that scale with the capacity.
        // FNX_VK_SCORE_ROWS caps both runs (to test runs shorter than a pass).
        let cap = std::env::var("FNX_VK_SCORE_ROWS").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(usize::MAX);
        l.score_rows = (SCORE_FLOATS / n_ctx.max(1)).min(cap).clamp(1, l.batch as usize) as u32;
        l.score_stride = n_ctx as u32;
        l.scores = next(l.score_rows as usize * n_ctx);
        l.sel = next(l.score_rows as usize * n_ctx);
        let att_stride = attention_head_floats(n_ctx, cfg.head_dim);
        l.att_stride = att_stride as u32;
        l.att_rows = (ATT_FLOATS / (cfg.n_heads * att_stride).max(1)).min(cap).clamp(1, l.batch as usize) as u32;
        l.att_tmp = next(l.att_rows as usize * cfg.n_heads * att_stride);
        l.total = next(0);
        if at > u32::MAX as usize / 4 {
            return Err(Error::OutOfMemory(format!("GPU scratch of {at} floats is too large; lower n_ctx")));
        }
        Ok(l)
    }

    /// Token `t`'s offsets: every per-token region moved to block `t` (the
    /// logits and the context-scaled regions stay).
    /// Floats per token of the host's upload: the embedding row once, then
    /// the block's inputs after the residual streams (from `ple_rows`).
    pub fn upload_len(&self) -> usize {
        (self.up_row + self.input_len - self.ple_rows) as usize
    }

    /// Where token `t`'s input at block offset `off` (`ple_rows` or later)
    /// lies in the upload.
    pub fn upload_at(&self, t: usize, off: u32) -> usize {
        debug_assert!((self.ple_rows..self.input_len).contains(&off), "an input after the residual streams");
        t * self.upload_len() + (self.up_row + off - self.ple_rows) as usize
    }

    /// The copies of a pass's `n` tokens' inputs from the upload into the
    /// scratch (bytes): the embedding row into each of the `streams`
    /// residual streams of `h` floats, the rest as one region.
    pub fn upload_regions(&self, n: usize, streams: usize, h: usize) -> Vec<ash::vk::BufferCopy> {
        debug_assert!(n <= self.batch as usize, "a pass of at most {} tokens", self.batch);
        let (up, f) = (self.upload_len() as u64, 4u64);
        let rest = (self.input_len - self.ple_rows) as u64;
        (0..n)
            .flat_map(|t| {
                // Token t's block starts t * tok floats in.
                let (src, block) = (t as u64 * up, t as u64 * self.tok as u64);
                let streams = (0..streams).map(move |c| ash::vk::BufferCopy {
                    src_offset: src * f,
                    dst_offset: (block + self.residual as u64 + (c * h) as u64) * f,
                    size: h as u64 * f,
                });
                let rest = (rest > 0).then(|| ash::vk::BufferCopy {
                    src_offset: (src + self.up_row as u64) * f,
                    dst_offset: (block + self.ple_rows as u64) * f,
                    size: rest * f,
                });
                streams.chain(rest)
            })
            .collect()
    }

    pub fn at(&self, t: usize) -> ScratchLayout {
        let d = t as u32 * self.tok;
        debug_assert!(t < self.batch as usize, "token {t} of a pass of at most {}", self.batch);
        let mut l = self.clone();
        for f in [
            &mut l.residual, &mut l.ple_rows, &mut l.rope, &mut l.block_rope, &mut l.xn, &mut l.low, &mut l.mix,
            &mut l.input, &mut l.inject, &mut l.ple_key, &mut l.ple_value, &mut l.ple_tmp, &mut l.qkv, &mut l.z,
            &mut l.beta, &mut l.alpha, &mut l.conv_out, &mut l.gdn_out, &mut l.qg, &mut l.k, &mut l.v, &mut l.q,
            &mut l.iq, &mut l.ik, &mut l.att_out, &mut l.router, &mut l.ids, &mut l.order, &mut l.weights, &mut l.exp_h,
            &mut l.exp_y, &mut l.sh_h, &mut l.sh_y, &mut l.partial, &mut l.xq,
        ] {
            *f += d;
        }
        l
    }
}

/// Floats between consecutive experts' hidden activations: the expert width
/// rounded up to 4, as the down matvec reads its input in vec4s.
pub(crate) fn exp_h_stride(cfg: &Config) -> u32 {
    cfg.expert_ff.div_ceil(4) as u32 * 4
}
