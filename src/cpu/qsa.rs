//! Gated attention with QSA block selection, one token at position `t`
//! (transformers `Qwen4ExpTextAttention` + `Qwen4ExpTextQSAIndexer`).
//!
//! Indexer: the raw indexer key of every token is cached. Tokens `0..=t` are
//! grouped in order into complete blocks of `r`; a block's key is the mean of
//! its `r` raw keys, RMS-normed, rotated to the block's first position (cached
//! once the block completes). The query's score for block `b` is
//! `sum_h relu(q_h . k_b) / sqrt(id)`; the best `min(B/r, n_complete)` blocks
//! are attended whole, plus every token of the incomplete tail.
//!
//! Ties: scores are sums of ReLUs, so exact ties (often at 0) occur. flashnext
//! ranks by score, then by lower block index (earlier blocks win). PyTorch's
//! `topk` has no documented tie order, so reference positions with a tie at
//! the selection boundary are flagged in the fixtures.
//!
//! Attention: `q_h`, `k` RMS-normed per head, partial NeoX RoPE on the first
//! `rope_dims` features, GQA (query head `h` uses KV head `h / (nh/nkv)`),
//! softmax over the selected tokens, output gated by `sigmoid(gate_h)`.
//!
//! In stages, as the Vulkan backend runs them: [`project`] (matvecs),
//! [`prep`] (`attn_prep`), [`index`] (`qsa_index`), [`score_blocks`]
//! (`qsa_score`), [`top_blocks`] (`qsa_topk`), [`attend`] (`attention`), the
//! out projection.

use super::prof;
use super::ops::{dot, rms_norm, sigmoid, softmax, Rope};
use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::weights::{Attention, Indexer};
use crate::tensor::{matmul_all, matvec_all};
use rayon::prelude::*;

/// KV and indexer caches of one attention layer; they grow with the sequence.
#[derive(Clone, Default)]
pub struct AttnState {
    /// Roped, normed keys: [t][nkv*hd]
    pub keys: Vec<f32>,
    /// [t][nkv*hd]
    pub values: Vec<f32>,
    /// Raw indexer keys: [t][id]
    pub index_keys: Vec<f32>,
    /// Pooled, normed, roped keys of complete blocks: [n_blocks][id]
    pub block_keys: Vec<f32>,
}

impl AttnState {
    pub fn clear(&mut self) {
        self.keys.clear();
        self.values.clear();
        self.index_keys.clear();
        self.block_keys.clear();
    }

    /// Makes room for `n` more tokens so a decode step cannot fail half way.
    pub fn reserve(&mut self, cfg: &Config, n: usize) -> Result<()> {
        let kv = cfg.n_kv_heads * cfg.head_dim;
        let id = cfg.qsa.as_ref().map_or(0, |q| q.head_dim);
        let oom = |_| Error::OutOfMemory("attention cache cannot grow".into());
        self.keys.try_reserve(kv * n).map_err(oom)?;
        self.values.try_reserve(kv * n).map_err(oom)?;
        self.index_keys.try_reserve(id * n).map_err(oom)?;
        self.block_keys.try_reserve(id * n).map_err(oom)?;
        Ok(())
    }

    /// Forgets the positions from `pos` on (blocks of `ratio`; 0 = dense).
    pub fn truncate(&mut self, cfg: &Config, ratio: usize, pos: usize) {
        let kv = cfg.n_kv_heads * cfg.head_dim;
        self.keys.truncate(pos * kv);
        self.values.truncate(pos * kv);
        if let Some(blocks) = pos.checked_div(ratio) {
            let id = cfg.qsa.as_ref().map_or(0, |q| q.head_dim);
            self.index_keys.truncate(pos * id);
            self.block_keys.truncate(blocks * id);
        }
    }
}

/// The input projections: `[q_h | gate_h]` per head, k, v.
pub fn project(w: &Attention, cfg: &Config, x: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
    let mut qg = vec![0f32; 2 * nh * hd];
    let mut k = vec![0f32; nkv * hd];
    let mut v = vec![0f32; nkv * hd];
    matvec_all(&mut [w.q.matvec_job(0, x, &mut qg), w.k.matvec_job(0, x, &mut k), w.v.matvec_job(0, x, &mut v)]);
    (qg, k, v)
}

/// Queries and keys RMS-normed per head and rotated to `t`; the key and
/// `v` appended to the caches. Returns the queries [nh*hd].
#[allow(clippy::too_many_arguments)]
pub fn prep(w: &Attention, cfg: &Config, rope: &Rope, st: &mut AttnState, qg: &[f32], k: &[f32], v: &[f32], t: usize) -> Vec<f32> {
    let (nh, hd) = (cfg.n_heads, cfg.head_dim);
    let mut q = vec![0f32; nh * hd];
    for (h, qh) in q.chunks_mut(hd).enumerate() {
        rms_norm(&qg[h * 2 * hd..][..hd], &w.q_norm, cfg.eps, qh);
        rope.apply(qh, t);
    }
    let mut kn = vec![0f32; k.len()];
    for (src, dst) in k.chunks(hd).zip(kn.chunks_mut(hd)) {
        rms_norm(src, &w.k_norm, cfg.eps, dst);
        rope.apply(dst, t);
    }
    st.keys.extend_from_slice(&kn);
    st.values.extend_from_slice(v);
    q
}

/// The indexer at `t`: caches the raw key `raw`, pools every block that is
/// complete now, and norms and rotates the query heads `iq` in place.
#[allow(clippy::too_many_arguments)]
pub fn index(ix: &Indexer, cfg: &Config, ratio: usize, rope: &Rope, st: &mut AttnState, raw: &[f32], iq: &mut [f32], t: usize) {
    let id = raw.len();
    st.index_keys.extend_from_slice(raw);
    let n_complete = (t + 1) / ratio;
    while st.block_keys.len() / id < n_complete {
        let b = st.block_keys.len() / id;
        let mut pooled = vec![0f32; id];
        for tok in b * ratio..(b + 1) * ratio {
            for (p, v) in pooled.iter_mut().zip(&st.index_keys[tok * id..(tok + 1) * id]) {
                *p += v;
            }
        }
        pooled.iter_mut().for_each(|p| *p /= ratio as f32);
        let mut key = vec![0f32; id];
        rms_norm(&pooled, &ix.k_norm, cfg.eps, &mut key);
        rope.apply(&mut key, b * ratio);
        st.block_keys.extend_from_slice(&key);
    }
    for qh in iq.chunks_mut(id) {
        let mut normed = vec![0f32; id];
        rms_norm(qh, &ix.q_norm, cfg.eps, &mut normed);
        rope.apply(&mut normed, t);
        qh.copy_from_slice(&normed);
    }
}

/// Every complete block's score, `sum_h relu(q_h . k_b) / sqrt(id)`.
pub fn score_blocks(q: &[f32], block_keys: &[f32], id: usize) -> Vec<f32> {
    let scale = 1.0 / (id as f32).sqrt();
    block_keys.chunks(id).map(|k| q.chunks(id).map(|qh| dot(qh, k).max(0.0)).sum::<f32>() * scale).collect()
}

/// The `keep` best blocks, higher score first, equal scores to the earlier block.
pub fn top_blocks(scores: &[f32], keep: usize) -> Vec<usize> {
    let mut scored: Vec<(f32, usize)> = scores.iter().copied().zip(0..).collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    scored[..keep].iter().map(|&(_, b)| b).collect()
}

/// Indices of the tokens the query at `t` attends to: the chosen blocks
/// whole, then the incomplete tail (every token when the layer is dense).
fn select_tokens(ix: Option<&Indexer>, cfg: &Config, ratio: usize, rope: &Rope, st: &mut AttnState, x: &[f32], t: usize) -> Vec<usize> {
    let Some(ix) = ix else { return (0..=t).collect() };
    let qsa = cfg.qsa.as_ref().expect("indexer implies QSA config");
    let mut raw = vec![0f32; qsa.head_dim];
    ix.k_proj.matvec(x, &mut raw);
    let n_tokens = t + 1;
    let n_complete = n_tokens / ratio;
    // The query heads only matter once a block is complete.
    let mut iq = vec![0f32; if n_complete > 0 { qsa.n_heads * qsa.head_dim } else { 0 }];
    if n_complete > 0 {
        ix.q_proj.matvec(x, &mut iq);
    }
    index(ix, cfg, ratio, rope, st, &raw, &mut iq, t);
    chosen(cfg, ratio, &st.block_keys, &iq, t)
}

/// The chosen blocks whole, then the tail, for the query at `t` whose
/// indexer heads `iq` are normed and rotated; reads only the blocks complete
/// at `t` (of `block_keys`, which may hold later ones).
fn chosen(cfg: &Config, ratio: usize, block_keys: &[f32], iq: &[f32], t: usize) -> Vec<usize> {
    let qsa = cfg.qsa.as_ref().expect("indexer implies QSA config");
    let n_tokens = t + 1;
    let n_complete = n_tokens / ratio;
    let mut selected: Vec<usize> = Vec::with_capacity((qsa.budget + ratio).min(n_tokens));
    if n_complete > 0 {
        let keep = (qsa.budget / ratio).min(n_complete);
        for b in top_blocks(&score_blocks(iq, &block_keys[..n_complete * qsa.head_dim], qsa.head_dim), keep) {
            selected.extend(b * ratio..(b + 1) * ratio);
        }
    }
    selected.extend(n_complete * ratio..n_tokens);
    selected
}

/// Softmax attention of each query head over the `selected` tokens of the
/// caches, gated by `sigmoid(gate_h)` (the second half of each head in `qg`):
/// [nh*hd]. Long selections spread the heads over the threads
/// ([`attend_split`] with `split`).
pub fn attend(cfg: &Config, q: &[f32], qg: &[f32], keys: &[f32], values: &[f32], selected: &[usize]) -> Vec<f32> {
    attend_split(cfg, q, qg, keys, values, selected, true)
}

/// [`attend`]: with `split` and a long selection, tasks of as few query
/// heads as give every thread one (a single token's attention); otherwise
/// one KV head's whole group of query heads after another on this thread
/// (a batch's queries, already one task each). Either way each head's
/// numbers are the same: [`attend_heads`].
fn attend_split(cfg: &Config, q: &[f32], qg: &[f32], keys: &[f32], values: &[f32], selected: &[usize], split: bool) -> Vec<f32> {
    let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
    let group = nh / nkv;
    let mut out = vec![0f32; nh * hd];
    if split && selected.len() * nh * hd >= 1 << 16 {
        // The largest divisor of the group that leaves a task per thread.
        let most = (nh / rayon::current_num_threads().max(1)).max(1);
        let per = (1..=group.min(most)).rev().find(|d| group.is_multiple_of(*d)).unwrap_or(1);
        out.par_chunks_mut(per * hd).enumerate().for_each(|(c, o)| attend_heads(cfg, q, qg, keys, values, selected, c * per, o));
    } else {
        out.chunks_mut(group * hd).enumerate().for_each(|(c, o)| attend_heads(cfg, q, qg, keys, values, selected, c * group, o));
    }
    out
}

/// Query heads `h0..` (`out.len() / hd` of them, all of one KV head) over
/// the `selected` tokens, into `out`. Each key and value row is read once
/// for all of them (twelve heads share one at the real shapes: the rows
/// stay in L1 instead of streaming the caches from memory once per head),
/// while each head's numbers are formed as alone: its scores one `dot`
/// each, its softmax, its weighted values added token by token in the
/// selection's order, its gate.
#[allow(clippy::too_many_arguments)]
fn attend_heads(cfg: &Config, q: &[f32], qg: &[f32], keys: &[f32], values: &[f32], selected: &[usize], h0: usize, out: &mut [f32]) {
    let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
    let kvh = h0 / (nh / nkv);
    let (heads, len) = (out.len() / hd, selected.len());
    let scale = 1.0 / (hd as f32).sqrt();
    let kv_stride = nkv * hd;
    let mut scores = vec![0f32; heads * len];
    for (i, &j) in selected.iter().enumerate() {
        let k = &keys[j * kv_stride + kvh * hd..][..hd];
        for a in 0..heads {
            scores[a * len + i] = dot(&q[(h0 + a) * hd..][..hd], k) * scale;
        }
    }
    for s in scores.chunks_mut(len.max(1)) {
        softmax(s);
    }
    for (i, &j) in selected.iter().enumerate() {
        let v = &values[j * kv_stride + kvh * hd..][..hd];
        for (a, oh) in out.chunks_mut(hd).enumerate() {
            let p = scores[a * len + i];
            for (o, vv) in oh.iter_mut().zip(v) {
                *o += p * vv;
            }
        }
    }
    for (a, oh) in out.chunks_mut(hd).enumerate() {
        for (o, g) in oh.iter_mut().zip(&qg[(h0 + a) * 2 * hd + hd..][..hd]) {
            *o *= sigmoid(*g);
        }
    }
}

/// The token at `t` through the whole layer: [H].
pub fn forward(w: &Attention, cfg: &Config, ratio: usize, rope: &Rope, st: &mut AttnState, x: &[f32], t: usize) -> Vec<f32> {
    let (qg, k, v) = project(w, cfg, x);
    let q = prep(w, cfg, rope, st, &qg, &k, &v, t);
    let selected = select_tokens(w.indexer.as_ref(), cfg, ratio, rope, st, x, t);
    let out = attend(cfg, &q, &qg, &st.keys, &st.values, &selected);
    let mut y = vec![0f32; cfg.hidden];
    w.o.matvec(&out, &mut y);
    y
}

/// The tokens at `t, t + 1, ..` (inputs `xs`: [T][H]) through the whole
/// layer: [T][H]. The projections (indexer included) read each matrix once
/// for the batch; the caches then grow token by token in order ([`prep`],
/// [`index`]); each query's selection and attention read only what was
/// cached up to its own position, so they run in parallel over the tokens.
/// Every number is the one [`forward`] computes token by token.
#[allow(clippy::too_many_arguments)]
pub fn forward_batch(w: &Attention, cfg: &Config, ratio: usize, rope: &Rope, st: &mut AttnState, xs: &[f32], t: usize) -> Vec<f32> {
    let (nh, nkv, hd, h) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden);
    let n = xs.len() / h;
    let span = prof::span("attention: q/k/v and indexer projections");
    let (mut qg, mut k, mut v) = (vec![0f32; n * 2 * nh * hd], vec![0f32; n * nkv * hd], vec![0f32; n * nkv * hd]);
    let ix = w.indexer.as_ref();
    let (iw, qw) = cfg.qsa.as_ref().filter(|_| ix.is_some()).map_or((0, 0), |q| (q.head_dim, q.n_heads * q.head_dim));
    let (mut raw, mut iq) = (vec![0f32; n * iw], vec![0f32; n * qw]);
    {
        let mut jobs = vec![w.q.matmul_job(0, xs, &mut qg), w.k.matmul_job(0, xs, &mut k), w.v.matmul_job(0, xs, &mut v)];
        if let Some(ix) = ix {
            jobs.push(ix.k_proj.matmul_job(0, xs, &mut raw));
            jobs.push(ix.q_proj.matmul_job(0, xs, &mut iq));
        }
        matmul_all(&mut jobs);
    }
    drop(span);
    let span = prof::span("attention: norms, RoPE, cache and indexer appends (in order)");
    let mut q = vec![0f32; n * nh * hd];
    let (qgw, kw) = (2 * nh * hd, nkv * hd);
    for i in 0..n {
        let qi = prep(w, cfg, rope, st, &qg[i * qgw..(i + 1) * qgw], &k[i * kw..(i + 1) * kw], &v[i * kw..(i + 1) * kw], t + i);
        q[i * nh * hd..(i + 1) * nh * hd].copy_from_slice(&qi);
        if let Some(ix) = ix {
            index(ix, cfg, ratio, rope, st, &raw[i * iw..(i + 1) * iw], &mut iq[i * qw..(i + 1) * qw], t + i);
        }
    }
    drop(span);
    let span = prof::span("attention: selection, attention");
    let st = &*st;
    let mut out = vec![0f32; n * nh * hd];
    // Queries fewer than the threads also spread their heads over them.
    let split = n < rayon::current_num_threads();
    let query = |(i, o): (usize, &mut [f32])| {
        let selected = match ix {
            Some(_) => chosen(cfg, ratio, &st.block_keys, &iq[i * qw..(i + 1) * qw], t + i),
            None => (0..=t + i).collect(),
        };
        let (qi, qgi) = (&q[i * nh * hd..(i + 1) * nh * hd], &qg[i * qgw..(i + 1) * qgw]);
        o.copy_from_slice(&attend_split(cfg, qi, qgi, &st.keys, &st.values, &selected, split));
    };
    if n > 1 {
        out.par_chunks_mut(nh * hd).enumerate().for_each(query);
    } else {
        out.chunks_mut(nh * hd).enumerate().for_each(query);
    }
    drop(span);
    let _span = prof::span("attention: out-projection");
    let mut y = vec![0f32; n * h];
    w.o.matmul(&out, &mut y);
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pseudo-random values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::synth::fill::Rng::new(seed);
        (0..n).map(|_| 2.0 * r.unit() - 1.0).collect()
    }

    /// A token's attention and a batch query's take the heads in tasks of
    /// different sizes (one head per thread, or a KV head's whole group):
    /// every size gives the same bits, and each head's numbers are those
    /// of softmax attention over its own KV head's rows formed alone.
    #[test]
    fn every_split_of_the_heads_gives_the_same_bits() {
        let cfg = Config::published_one_layer();
        let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let ctx = 300;
        let (q, qg) = (values(nh * hd, 1), values(2 * nh * hd, 2));
        let (keys, values) = (values(ctx * nkv * hd, 3), values(ctx * nkv * hd, 4));
        // Blocks out of order, then a tail, as QSA selects them.
        let selected: Vec<usize> = (200..240).chain(0..40).chain(120..160).chain(296..300).collect();
        let whole = attend_split(&cfg, &q, &qg, &keys, &values, &selected, false);
        for threads in [1, 2, 3, 5, 8, 16, 24, 32] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let split = pool.install(|| attend_split(&cfg, &q, &qg, &keys, &values, &selected, true));
            assert!(whole.iter().zip(&split).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads");
        }
        let (group, scale) = (nh / nkv, 1.0 / (hd as f32).sqrt());
        for h in [0, 5, 11, 12, 23] {
            let row = |m: &[f32], j: usize| m[j * nkv * hd + h / group * hd..][..hd].to_vec();
            let mut p: Vec<f32> = selected.iter().map(|&j| dot(&q[h * hd..][..hd], &row(&keys, j)) * scale).collect();
            softmax(&mut p);
            let mut o = vec![0f32; hd];
            for (&j, &pj) in selected.iter().zip(&p) {
                o.iter_mut().zip(row(&values, j)).for_each(|(o, v)| *o += pj * v);
            }
            o.iter_mut().zip(&qg[h * 2 * hd + hd..][..hd]).for_each(|(o, g)| *o *= sigmoid(*g));
            assert!(o.iter().zip(&whole[h * hd..][..hd]).all(|(a, b)| a.to_bits() == b.to_bits()), "head {h}");
        }
    }
}
