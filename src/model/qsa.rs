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

use super::config::Config;
use super::ops::{dot, rms_norm, sigmoid, softmax, Rope};
use super::weights::{Attention, Indexer};
use crate::error::{Error, Result};
use crate::tensor::matvec_all;
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

    /// Makes room for one more token so the decode step cannot fail half way.
    pub fn reserve_one(&mut self, cfg: &Config) -> Result<()> {
        let kv = cfg.n_kv_heads * cfg.head_dim;
        let id = cfg.qsa.as_ref().map_or(0, |q| q.head_dim);
        let oom = |_| Error::OutOfMemory("attention cache cannot grow".into());
        self.keys.try_reserve(kv).map_err(oom)?;
        self.values.try_reserve(kv).map_err(oom)?;
        self.index_keys.try_reserve(id).map_err(oom)?;
        self.block_keys.try_reserve(id).map_err(oom)?;
        Ok(())
    }
}

/// Indices of the tokens a query at position `t` attends to.
fn select_tokens(ix: &Indexer, cfg: &Config, ratio: usize, rope: &Rope, st: &mut AttnState, x: &[f32], t: usize) -> Vec<usize> {
    let qsa = cfg.qsa.as_ref().expect("indexer implies QSA config");
    let id = qsa.head_dim;
    let mut raw = vec![0f32; id];
    ix.k_proj.matvec(x, &mut raw);
    st.index_keys.extend_from_slice(&raw);

    let n_tokens = t + 1;
    let n_complete = n_tokens / ratio;
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

    let mut selected: Vec<usize> = Vec::with_capacity((qsa.budget + ratio).min(n_tokens));
    if n_complete > 0 {
        let mut q = vec![0f32; qsa.n_heads * id];
        ix.q_proj.matvec(x, &mut q);
        for qh in q.chunks_mut(id) {
            let mut normed = vec![0f32; id];
            rms_norm(qh, &ix.q_norm, cfg.eps, &mut normed);
            rope.apply(&mut normed, t);
            qh.copy_from_slice(&normed);
        }
        let scale = 1.0 / (id as f32).sqrt();
        let mut scored: Vec<(f32, usize)> = st
            .block_keys
            .chunks(id)
            .enumerate()
            .map(|(b, k)| (q.chunks(id).map(|qh| dot(qh, k).max(0.0)).sum::<f32>() * scale, b))
            .collect();
        let keep = (qsa.budget / ratio).min(n_complete);
        // Higher score first; equal scores keep the earlier block.
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, b) in &scored[..keep] {
            selected.extend(b * ratio..(b + 1) * ratio);
        }
    }
    selected.extend(n_complete * ratio..n_tokens);
    selected
}

pub fn forward(w: &Attention, cfg: &Config, ratio: usize, rope: &Rope, st: &mut AttnState, x: &[f32], t: usize) -> Vec<f32> {
    let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
    let mut qg = vec![0f32; 2 * nh * hd];
    let mut k = vec![0f32; nkv * hd];
    let mut v = vec![0f32; nkv * hd];
    matvec_all(&mut [w.q.matvec_job(0, x, &mut qg), w.k.matvec_job(0, x, &mut k), w.v.matvec_job(0, x, &mut v)]);

    let mut q = vec![0f32; nh * hd];
    let mut gate = vec![0f32; nh * hd];
    for h in 0..nh {
        let src = &qg[h * 2 * hd..(h + 1) * 2 * hd];
        rms_norm(&src[..hd], &w.q_norm, cfg.eps, &mut q[h * hd..(h + 1) * hd]);
        rope.apply(&mut q[h * hd..(h + 1) * hd], t);
        gate[h * hd..(h + 1) * hd].copy_from_slice(&src[hd..]);
    }
    let mut kn = vec![0f32; nkv * hd];
    for (src, dst) in k.chunks(hd).zip(kn.chunks_mut(hd)) {
        rms_norm(src, &w.k_norm, cfg.eps, dst);
        rope.apply(dst, t);
    }
    st.keys.extend_from_slice(&kn);
    st.values.extend_from_slice(&v);

    let selected: Vec<usize> = match &w.indexer {
        Some(ix) => select_tokens(ix, cfg, ratio, rope, st, x, t),
        None => (0..=t).collect(),
    };

    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let kv_stride = nkv * hd;
    let mut out = vec![0f32; nh * hd];
    let (keys, values) = (&st.keys, &st.values);
    let head = |(h, oh): (usize, &mut [f32])| {
        let kvh = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let mut scores: Vec<f32> =
            selected.iter().map(|&j| dot(qh, &keys[j * kv_stride + kvh * hd..][..hd]) * scale).collect();
        softmax(&mut scores);
        for (&j, &p) in selected.iter().zip(&scores) {
            for (o, vv) in oh.iter_mut().zip(&values[j * kv_stride + kvh * hd..][..hd]) {
                *o += p * vv;
            }
        }
        for (o, g) in oh.iter_mut().zip(&gate[h * hd..(h + 1) * hd]) {
            *o *= sigmoid(*g);
        }
    };
    if selected.len() * nh * hd >= 1 << 16 {
        out.par_chunks_mut(hd).enumerate().for_each(head);
    } else {
        out.chunks_mut(hd).enumerate().for_each(head);
    }
    let mut y = vec![0f32; cfg.hidden];
    w.o.matvec(&out, &mut y);
    y
}
