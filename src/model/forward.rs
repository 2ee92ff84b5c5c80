//! The network, once, for every backend: transformers'
//! `Qwen4ExpTextModel.forward` and `Qwen4ExpTextDecoderLayer.forward`
//! (modular_qwen4_exp.py), top to bottom, over [`Blocks`].

use super::backend::{Batch, Blocks, Site};
use super::{ple, LayerKind, Model};
use crate::error::{Error, Result};
use rayon::prelude::*;

/// Runs `batch` through the network on `b`; the logits are `b`'s to read.
pub fn forward<B: Blocks>(model: &Model, batch: &Batch, b: &mut B) -> Result<()> {
    let (cfg, w) = (&model.config, &model.weights);
    // inputs_embeds = embed_tokens(input_ids); hidden_states = inputs_embeds.repeat(1, 1, hc_count)
    let mut x = b.embed(&embedding_rows(model, batch.tokens))?;
    for (l, kind) in cfg.layers.iter().enumerate() {
        // if self.ple is not None: hidden_states = hidden_states + self.ple(hidden_states, ple_input_ids)
        if let (Some(p), Some(table)) = (cfg.ple.as_ref().filter(|p| p.layer == l), &w.ple_table) {
            let rows = ple::gather_rows(table, p, cfg.hidden, batch.history, batch.tokens);
            b.ple(l, &rows, &mut x)?;
        }
        // hidden_states, hyper_input, injection_weights = self.attn_hyper_connection(hidden_states)
        let branch = b.hyper_pre(Site::Mixer(l), &x)?;
        // linear_attn or self_attn; hidden_states = hyper_input + hidden_states * injection_weights
        match kind {
            LayerKind::Linear => b.gdn(l, &branch, &mut x)?,
            LayerKind::Attention { .. } => b.attention(l, &branch, &mut x)?,
        }
        // hidden_states, hyper_input, injection_weights = self.mlp_hyper_connection(hidden_states)
        let branch = b.hyper_pre(Site::Moe(l), &x)?;
        // self.mlp(hidden_states): router, experts by id, shared expert; then the injection
        let routes = b.moe_route(l, &branch)?;
        let experts = b.moe_experts(l, &branch, &routes)?;
        b.moe_combine(l, &branch, &routes, experts, &mut x)?;
        // Not in transformers: a long pass can be cancelled between layers.
        if batch.tokens.len() > 1 && l + 1 < cfg.layers.len() && batch.abort.is_some_and(|a| a.aborted()) {
            return Err(Error::Aborted);
        }
    }
    // hidden_states = self.hyper_connection_mixer(hidden_states); logits = lm_head(hidden_states)
    b.head(&x)
}

/// The token embedding rows of `tokens`: [T][H] (read from the mapped file).
fn embedding_rows(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let h = model.config.hidden;
    let mut rows = vec![0f32; tokens.len() * h];
    let row = |(i, row): (usize, &mut [f32])| model.weights.token_embd.dequantize_row(tokens[i] as usize, row);
    if tokens.len() > 1 {
        rows.par_chunks_exact_mut(h).enumerate().for_each(row);
    } else {
        rows.chunks_exact_mut(h).enumerate().for_each(row);
    }
    rows
}
