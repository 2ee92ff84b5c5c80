//! One decode step through the whole network, top to bottom.

use super::ops::Rope;
use super::state::{LayerState, State};
use super::weights::Mixer;
use super::{gdn, hyper, moe, ple, qsa, LayerKind, Model};

/// Runs `token` at `state.pos` and returns its logits; updates every cache.
pub(crate) fn token(model: &Model, state: &mut State, token: u32) -> Vec<f32> {
    let cfg = &model.config;
    let w = &model.weights;
    let (h, c) = (cfg.hidden, cfg.hc);
    let t = state.pos;
    let rope = Rope::new(cfg.rope_dims, cfg.rope_theta);

    let mut embedding = vec![0f32; h];
    w.token_embd.dequantize_row(token as usize, &mut embedding);
    let mut residual: Vec<f32> = embedding.repeat(c);

    for (l, (layer, ls)) in w.layers.iter().zip(state.layers.iter_mut()).enumerate() {
        if let (Some(pw), Some(ps), Some(pc), Some(table)) =
            (&layer.ple, state.ple.as_mut(), cfg.ple.as_ref(), w.ple_table.as_ref())
        {
            ple::forward(pw, table, pc, cfg, ps, &mut residual, token);
        }

        let pre = hyper::pre(&layer.attn_hc, &residual, c, cfg.eps);
        let mixed = match (&layer.mixer, ls) {
            (Mixer::Gdn(g), LayerState::Gdn(s)) => gdn::forward(g, cfg, s, &pre.input),
            (Mixer::Attention(a), LayerState::Attention(s)) => {
                let ratio = match cfg.layers[l] {
                    LayerKind::Attention { compress_ratio } => compress_ratio,
                    LayerKind::Linear => unreachable!("weights and config agree on layer kinds"),
                };
                qsa::forward(a, cfg, ratio, &rope, s, &pre.input, t)
            }
            _ => unreachable!("state layers are built from the same config"),
        };
        hyper::post(&mut residual, &mixed, &pre.inject);

        let pre = hyper::pre(&layer.ffn_hc, &residual, c, cfg.eps);
        let ffn = moe::forward(&layer.moe, cfg, &pre.input);
        hyper::post(&mut residual, &ffn, &pre.inject);
    }

    let out = hyper::pre(&w.output_hc, &residual, c, cfg.eps);
    let mut logits = vec![0f32; cfg.vocab];
    w.output.matvec(&out.input, &mut logits);
    logits
}
