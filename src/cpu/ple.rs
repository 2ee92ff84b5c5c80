//! Per-layer n-gram embeddings, the network side (transformers
//! `Qwen4ExpTextPLELayer`; `model::ple` gathers the table rows `e`).
//!
//! With the residual `X` ([C][H]) and the concatenated rows `e` ([H]):
//! `K = rms_c(key e)`, `Q = rms_c(X)`, `s_c = K_c.Q_c / sqrt(H)`,
//! `gate_c = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))`, `Gv_c = gate_c * (value e)`,
//! `N = rms_c(Gv)`, and `X += Gv + silu(dilated_depthwise_conv(N))` with
//! dilation `G`, kernel `Kp`, over the normed values of the positions
//! `G, 2G, .. (Kp-1)G` back (a ring by position: `model::backend`).
//!
//! In stages, as the Vulkan backend runs them: [`project`] (matvecs), [`mix`] (`ple_mix`).

use super::gdn::ring_row;
use super::ops::{dot, rms_norm_grouped, sigmoid, silu};
use crate::error::Result;
use crate::model::config::{Config, PleConfig};
use crate::error::zeros;
use crate::model::weights::Ple;
use crate::tensor::matmul_all;

/// Rows of the PLE conv ring: the conv's reach `(Kp-1)*G` plus the rewind window.
pub fn conv_rows(p: &PleConfig, window: usize) -> usize {
    (p.conv_kernel - 1) * p.ngram + window
}

/// The PLE conv ring of a sequence: normed gated values by position,
/// position `q` in row `q mod rows`: [rows][C*H].
pub fn new_ring(cfg: &Config, p: &PleConfig, window: usize) -> Result<Vec<f32>> {
    zeros(conv_rows(p, window).checked_mul(cfg.hc).and_then(|x| x.checked_mul(cfg.hidden)), "PLE conv history")
}

/// The key [C*H] and value [H] projections of the rows `e`.
pub fn project(w: &Ple, e: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut key = vec![0f32; w.key.rows()];
    w.key.matvec(e, &mut key);
    let mut value = vec![0f32; w.value.rows()];
    w.value.matvec(e, &mut value);
    (key, value)
}

/// The injection of the token at `pos` into `residual`, from its projected
/// `key` and `value`; stores its normed gated values in the `ring`.
#[allow(clippy::too_many_arguments)]
pub fn mix(w: &Ple, p: &PleConfig, cfg: &Config, ring: &mut [f32], pos: usize, key: &[f32], value: &[f32], residual: &mut [f32]) {
    mix_batch(w, p, cfg, ring, pos, key, value, residual)
}

/// One token's gated values and their norm ([C*H] each), from its `key`,
/// `value` and `residual`.
fn gate(w: &Ple, cfg: &Config, key: &[f32], value: &[f32], residual: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (h, c) = (cfg.hidden, cfg.hc);
    let ch = h * c;
    let mut kn = vec![0f32; ch];
    rms_norm_grouped(key, &w.norm_key, h, cfg.eps, &mut kn);
    let mut qn = vec![0f32; ch];
    rms_norm_grouped(residual, &w.norm_query, h, cfg.eps, &mut qn);

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
    (gated, normed)
}

/// [`mix`] for the tokens at `pos, pos + 1, ..` (`keys` [T][C*H], `values`
/// [T][H], `residuals` [T][C*H]). The gates of all the tokens first (in
/// parallel), then each token's conv (in parallel) over the normed values of
/// the positions `G, 2G, ..` back, from the batch or, before it, the ring;
/// then the ring takes the batch's normed values (its last `rows`).
#[allow(clippy::too_many_arguments)]
pub fn mix_batch(w: &Ple, p: &PleConfig, cfg: &Config, ring: &mut [f32], pos: usize, keys: &[f32], values: &[f32], residuals: &mut [f32]) {
    let ch = cfg.hidden * cfg.hc;
    let t = residuals.len() / ch;
    let (kw, vw) = (keys.len() / t.max(1), values.len() / t.max(1));
    let gates = super::par_map(t, |i| gate(w, cfg, &keys[i * kw..(i + 1) * kw], &values[i * vw..(i + 1) * vw], &residuals[i * ch..(i + 1) * ch]));
    let (kp, dil) = (p.conv_kernel, p.ngram);
    let rows = ring.len() / ch;
    let history = &*ring;
    super::per_chunk(residuals, ch, |i, residual| {
        let (gated, normed) = &gates[i];
        // Tap k reads the normed values (kp-1-k)*dil positions back.
        let taps: Vec<&[f32]> = (0..kp - 1)
            .map(|k| {
                let b = (kp - 1 - k) * dil;
                match i.checked_sub(b) {
                    Some(j) => &gates[j].1[..],
                    None => {
                        let r = ring_row((pos + i) as isize - b as isize, rows);
                        &history[r * ch..(r + 1) * ch]
                    }
                }
            })
            .collect();
        for e in 0..ch {
            let conv = &w.conv[e * kp..(e + 1) * kp];
            let mut acc = conv[kp - 1] * normed[e];
            for (tap, row) in conv[..kp - 1].iter().zip(&taps) {
                acc += tap * row[e];
            }
            residual[e] += gated[e] + silu(acc);
        }
    });
    for (i, (_, normed)) in gates.iter().enumerate().skip(t.saturating_sub(rows)) {
        let r = ring_row((pos + i) as isize, rows);
        ring[r * ch..(r + 1) * ch].copy_from_slice(normed);
    }
}

/// The whole injection for one token, from its table rows `e` ([H]).
#[allow(clippy::too_many_arguments)]
pub fn forward(w: &Ple, p: &PleConfig, cfg: &Config, ring: &mut [f32], pos: usize, e: &[f32], residual: &mut [f32]) {
    let (key, value) = project(w, e);
    mix(w, p, cfg, ring, pos, &key, &value, residual);
}

/// [`forward`] for the tokens at `pos, pos + 1, ..` (table rows `es`: [T][H],
/// residuals [T][C*H]): the projections read each matrix once for the batch,
/// the mix runs over the batch ([`mix_batch`]).
#[allow(clippy::too_many_arguments)]
pub fn forward_batch(w: &Ple, p: &PleConfig, cfg: &Config, ring: &mut [f32], pos: usize, es: &[f32], residuals: &mut [f32]) {
    let t = es.len() / cfg.hidden;
    let (kw, vw) = (w.key.rows(), w.value.rows());
    let (mut keys, mut values) = (vec![0f32; t * kw], vec![0f32; t * vw]);
    matmul_all(&mut [w.key.matmul_job(0, es, &mut keys), w.value.matmul_job(0, es, &mut values)]);
    mix_batch(w, p, cfg, ring, pos, &keys, &values, residuals);
}
