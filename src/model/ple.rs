//! Per-layer n-gram embeddings (transformers `Qwen4ExpTextPLELayer`).
//!
//! Hashing, per token: `ctx[0]` is the token; `ctx[s]` the token `s` back,
//! except that once a predecessor is missing (before the sequence start) or is
//! the EOS id, it and every older slot read as EOS (a document boundary). For
//! each order `n` in `2..=G`: `mixed = XOR_{j<n} ctx[j] * m_j` (wrapping 64-bit),
//! and head `h` of that order reads table row `mixed % vocab_h + offset_h`.
//!
//! Then, with the residual `X` ([C][H]) and the concatenated rows `e` ([H]):
//! `K = rms_c(key e)`, `Q = rms_c(X)`, `s_c = K_c.Q_c / sqrt(H)`,
//! `gate_c = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))`, `Gv_c = gate_c * (value e)`,
//! `N = rms_c(Gv)`, and `X += Gv + silu(dilated_depthwise_conv(N))` with
//! dilation `G`, kernel `Kp`, over its own history of `(Kp-1)*G` steps.

use super::config::{Config, PleConfig};
use super::ops::{dot, rms_norm_grouped, sigmoid, silu};
use super::weights::Ple;
use super::state::zeros;
use crate::error::Result;
use crate::tensor::Tensor;

/// PLE history of one sequence.
#[derive(Clone)]
pub struct PleState {
    /// The last `G-1` tokens, oldest first; EOS before the sequence start.
    pub tokens: Vec<u32>,
    /// Normed gated values of the last `(Kp-1)*G` tokens, oldest first: [(Kp-1)*G][C*H]
    pub conv: Vec<f32>,
}

impl PleState {
    pub fn new(cfg: &Config, p: &PleConfig) -> Result<Self> {
        let n = ((p.conv_kernel - 1) * p.ngram).checked_mul(cfg.hc).and_then(|x| x.checked_mul(cfg.hidden));
        Ok(Self { tokens: vec![p.eos; p.ngram - 1], conv: zeros(n, "PLE conv history")? })
    }
}

/// Table rows of every head for `token`, given the history.
pub fn hash_rows(p: &PleConfig, history: &[u32], token: u32) -> Vec<u64> {
    let g = p.ngram;
    let mut ctx = vec![p.eos as u64; g];
    ctx[0] = token as u64;
    for s in 1..g {
        let prev = history[history.len() - s];
        if prev == p.eos {
            break;
        }
        ctx[s] = prev as u64;
    }
    let mut rows = Vec::with_capacity(p.n_heads());
    for n in 2..=g {
        let mixed = (0..n).fold(0u64, |acc, j| acc ^ ctx[j].wrapping_mul(p.multipliers[j]));
        for k in 0..p.heads_per_ngram {
            let h = (n - 2) * p.heads_per_ngram + k;
            rows.push(mixed % p.head_vocab[h] + p.head_offsets[h]);
        }
    }
    rows
}

/// The table rows of every head for `token`, concatenated: [H].
pub fn gather_rows(table: &Tensor, p: &PleConfig, hidden: usize, history: &[u32], token: u32) -> Vec<f32> {
    let mut e = vec![0f32; hidden];
    for (row, dst) in hash_rows(p, history, token).into_iter().zip(e.chunks_mut(p.row_dim)) {
        table.dequantize_row(row as usize, dst);
    }
    e
}

pub fn forward(w: &Ple, table: &Tensor, p: &PleConfig, cfg: &Config, st: &mut PleState, residual: &mut [f32], token: u32) {
    let (h, c) = (cfg.hidden, cfg.hc);
    let ch = h * c;
    let e = gather_rows(table, p, h, &st.tokens, token);
    let mut key = vec![0f32; ch];
    w.key.matvec(&e, &mut key);
    let mut kn = vec![0f32; ch];
    rms_norm_grouped(&key, &w.norm_key, h, cfg.eps, &mut kn);
    let mut qn = vec![0f32; ch];
    rms_norm_grouped(residual, &w.norm_query, h, cfg.eps, &mut qn);
    let mut value = vec![0f32; h];
    w.value.matvec(&e, &mut value);

    let mut gated = vec![0f32; ch];
    for s in 0..c {
        let score = dot(&kn[s * h..(s + 1) * h], &qn[s * h..(s + 1) * h]) / (h as f32).sqrt();
        let signed_sqrt = if score == 0.0 { 0.0 } else { score.abs().max(1e-6).sqrt().copysign(score) };
        let gate = sigmoid(signed_sqrt);
        for d in 0..h {
            gated[s * h + d] = gate * value[d];
        }
    }
    let mut normed = vec![0f32; ch];
    rms_norm_grouped(&gated, &w.norm_conv, h, cfg.eps, &mut normed);

    let (kp, dil) = (p.conv_kernel, p.ngram);
    let hist_rows = (kp - 1) * dil;
    for i in 0..ch {
        let taps = &w.conv[i * kp..(i + 1) * kp];
        let mut acc = taps[kp - 1] * normed[i];
        for (k, tap) in taps[..kp - 1].iter().enumerate() {
            // Tap k reads the input (kp-1-k)*dil steps back.
            let back = (kp - 1 - k) * dil;
            acc += tap * st.conv[(hist_rows - back) * ch + i];
        }
        residual[i] += gated[i] + silu(acc);
    }
    if hist_rows > 0 {
        st.conv.copy_within(ch.., 0);
        st.conv[(hist_rows - 1) * ch..].copy_from_slice(&normed);
    }
    st.tokens.remove(0);
    st.tokens.push(token);
}
