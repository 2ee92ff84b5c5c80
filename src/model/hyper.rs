//! Hyper-connections (`Qwen4ExpTextGatedResidual`): the residual is `C`
//! streams of `H`; a block reads a sigmoid-weighted mean of the normalised
//! streams and writes its output back into each stream with weight
//! `2*sigmoid(.)`.

use super::ops::{rms_norm_grouped, sigmoid, silu};
use super::weights::HyperConnection;

/// Result of the pre step: the block input and per-stream injection weights.
pub struct HcPre {
    /// Block input: [H]
    pub input: Vec<f32>,
    /// Injection weight per stream: [C]
    pub inject: Vec<f32>,
}

/// `Xn = rms(X_c)*g`; `m = sigmoid(up(silu(down(Xn)/C)))`; `y = mean_c m_c*Xn_c`;
/// `w = 2*sigmoid(inject(Xn)/C)`.
pub fn pre(hc: &HyperConnection, residual: &[f32], streams: usize, eps: f32) -> HcPre {
    let ch = residual.len();
    let h = ch / streams;
    let mut xn = vec![0f32; ch];
    rms_norm_grouped(residual, &hc.norm, h, eps, &mut xn);
    let mut low = vec![0f32; hc.down.rows()];
    hc.down.matvec(&xn, &mut low);
    let c = streams as f32;
    low.iter_mut().for_each(|v| *v = silu(*v / c));
    let mut mix = vec![0f32; ch];
    hc.up.matvec(&low, &mut mix);
    let mut input = vec![0f32; h];
    for s in 0..streams {
        for d in 0..h {
            input[d] += sigmoid(mix[s * h + d]) * xn[s * h + d];
        }
    }
    input.iter_mut().for_each(|v| *v /= c);
    let inject = match &hc.inject {
        Some(w) => {
            let mut logits = vec![0f32; streams];
            w.matvec(&xn, &mut logits);
            logits.iter().map(|&v| 2.0 * sigmoid(v / c)).collect()
        }
        None => Vec::new(),
    };
    HcPre { input, inject }
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
