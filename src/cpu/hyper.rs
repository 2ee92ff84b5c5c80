//! Hyper-connections (`Qwen4ExpTextGatedResidual`): the residual is `C`
//! streams of `H`; a block reads a sigmoid-weighted mean of the normalised
//! streams and writes its output back into each stream with weight
//! `2*sigmoid(.)`.
//!
//! The pre step in its stages (each a shader of the Vulkan backend):
//! [`norm`] (`hc_norm`), [`mix_logits`] (matvecs), [`combine`]
//! (`hc_combine`), [`inject`] (a matvec with its epilogue).

use super::ops::{rms_norm_grouped, sigmoid, silu};
use super::{per_chunk, prof};
use crate::model::weights::HyperConnection;
use crate::tensor::matmul_all;

/// Result of the pre step for a batch of `T` tokens: the block inputs side
/// by side (what the block's products read in place) and each token's
/// injection weights per stream.
pub struct HcBatch {
    /// Block inputs: [T][H]
    pub inputs: Vec<f32>,
    /// Injection weights: [T][C] (empty for the output mixer)
    pub inject: Vec<f32>,
    /// Number of tokens `T`.
    pub tokens: usize,
}

impl HcBatch {
    /// Token `i`'s block input: [H].
    pub fn input(&self, i: usize) -> &[f32] {
        let h = self.inputs.len() / self.tokens.max(1);
        &self.inputs[i * h..(i + 1) * h]
    }

    /// Token `i`'s injection weights: [C].
    pub fn inject(&self, i: usize) -> &[f32] {
        let c = self.inject.len() / self.tokens.max(1);
        &self.inject[i * c..(i + 1) * c]
    }
}

/// `Xn = rms(X_c) * g`, per stream: [C*H] (`gamma`: the hyper-connection's norm).
pub fn norm(gamma: &[f32], residual: &[f32], streams: usize, eps: f32) -> Vec<f32> {
    let mut xn = vec![0f32; residual.len()];
    rms_norm_grouped(residual, gamma, residual.len() / streams, eps, &mut xn);
    xn
}

/// The mix logits `up(silu(down(Xn) / C))`: [C*H].
pub fn mix_logits(hc: &HyperConnection, xn: &[f32], streams: usize) -> Vec<f32> {
    let mut low = vec![0f32; hc.down.rows()];
    hc.down.matvec(xn, &mut low);
    let c = streams as f32;
    low.iter_mut().for_each(|v| *v = silu(*v / c));
    let mut mix = vec![0f32; xn.len()];
    hc.up.matvec(&low, &mut mix);
    mix
}

/// `y = mean_c sigmoid(mix_c) * Xn_c`: [H].
pub fn combine(mix: &[f32], xn: &[f32], streams: usize) -> Vec<f32> {
    let mut input = vec![0f32; xn.len() / streams];
    combine_into(mix, xn, &mut input);
    input
}

/// [`combine`] into `input` ([H], zeroed), the streams `xn.len() / H`.
fn combine_into(mix: &[f32], xn: &[f32], input: &mut [f32]) {
    let h = input.len();
    for (m, x) in mix.chunks_exact(h).zip(xn.chunks_exact(h)) {
        for ((y, &m), &x) in input.iter_mut().zip(m).zip(x) {
            *y += sigmoid(m) * x;
        }
    }
    let c = (xn.len() / h) as f32;
    input.iter_mut().for_each(|v| *v /= c);
}

/// `w = 2 * sigmoid(inject(Xn) / C)`: [C]; empty for the output mixer.
pub fn inject(hc: &HyperConnection, xn: &[f32], streams: usize) -> Vec<f32> {
    let Some(w) = &hc.inject else { return Vec::new() };
    let mut logits = vec![0f32; streams];
    w.matvec(xn, &mut logits);
    let c = streams as f32;
    logits.iter().map(|&v| 2.0 * sigmoid(v / c)).collect()
}

/// The whole pre step for a batch of residuals ([T][C*H]): [`norm`],
/// [`mix_logits`], [`combine`] and [`inject`] per token, each matrix read
/// once for all the tokens.
pub fn pre_batch(hc: &HyperConnection, residuals: &[f32], streams: usize, eps: f32) -> HcBatch {
    let ch = hc.up.rows();
    let t = residuals.len() / ch;
    let span = prof::span("hyper-connection pre: norm");
    let mut xn = vec![0f32; residuals.len()];
    per_chunk(&mut xn, ch, |i, o| rms_norm_grouped(&residuals[i * ch..(i + 1) * ch], &hc.norm, ch / streams, eps, o));
    drop(span);
    let span = prof::span("hyper-connection pre: down and inject products");
    let c = streams as f32;
    let mut low = vec![0f32; t * hc.down.rows()];
    let mut logits = vec![0f32; t * hc.inject.as_ref().map_or(0, |w| w.rows())];
    match &hc.inject {
        Some(w) => matmul_all(&mut [hc.down.matmul_job(0, &xn, &mut low), w.matmul_job(0, &xn, &mut logits)]),
        None => hc.down.matmul(&xn, &mut low),
    }
    drop(span);
    let span = prof::span("hyper-connection pre: up product");
    per_chunk(&mut low, hc.down.rows(), |_, l| l.iter_mut().for_each(|v| *v = silu(*v / c)));
    let mut mix = vec![0f32; t * ch];
    hc.up.matmul(&low, &mut mix);
    drop(span);
    let _span = prof::span("hyper-connection pre: streams mixed");
    let h = ch / streams;
    let mut inputs = vec![0f32; t * h];
    per_chunk(&mut inputs, h, |i, input| combine_into(&mix[i * ch..(i + 1) * ch], &xn[i * ch..(i + 1) * ch], input));
    logits.iter_mut().for_each(|v| *v = 2.0 * sigmoid(*v / c));
    HcBatch { inputs, inject: logits, tokens: t }
}

/// `X_c += w_c * o` for every stream.
pub fn post(residual: &mut [f32], block_out: &[f32], inject: &[f32]) {
    let h = block_out.len();
    for (stream, w) in residual.chunks_mut(h).zip(inject) {
        for (x, o) in stream.iter_mut().zip(block_out) {
            *x += w * o;
        }
    }
}
