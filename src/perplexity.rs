//! Perplexity of a model on a token stream, llama.cpp's `llama-perplexity`
//! convention: the tokens are cut into chunks of `ctx` (a remainder shorter
//! than `ctx` is dropped), each chunk is decoded from an empty state in one
//! call with every position's logits, and the second half of each chunk is
//! scored (positions `ctx/2 .. ctx-1` predicting the token after them), so
//! every scored token sees at least `ctx/2` tokens of context.
//!
//! `PPL = exp(mean nll)`; its error is the standard error of the mean nll
//! carried through the exponential, `PPL * sqrt(var(nll) / (n - 1))`, as
//! llama-perplexity prints it.

use crate::error::{Error, Result};
use crate::model::{LogitsFor, Model, State};
use std::sync::Arc;

/// A run's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    /// One standard error of `ppl`.
    pub error: f64,
    pub chunks: usize,
    /// Tokens scored.
    pub scored: usize,
}

/// Negative log-likelihoods, summed (f64).
#[derive(Clone, Debug, Default)]
pub struct NllSum {
    sum: f64,
    sum_sq: f64,
    count: usize,
}

impl NllSum {
    /// Adds `-log softmax(logits)[next]`.
    pub fn add(&mut self, logits: &[f32], next: u32) {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max + logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        let nll = lse - logits[next as usize] as f64;
        self.sum += nll;
        self.sum_sq += nll * nll;
        self.count += 1;
    }

    /// The perplexity and its standard error (`None` before two tokens).
    pub fn result(&self, chunks: usize) -> Option<Perplexity> {
        if self.count < 2 {
            return None;
        }
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = (self.sum_sq / n - mean * mean).max(0.0);
        let ppl = mean.exp();
        Some(Perplexity { ppl, error: ppl * (var / (n - 1.0)).sqrt(), chunks, scored: self.count })
    }
}

/// The perplexity of `model` on `tokens` in chunks of `ctx`; `on_chunk` sees
/// each chunk's running estimate (chunk index from 1, PPL so far).
pub fn perplexity(model: &Arc<Model>, tokens: &[u32], ctx: usize, on_chunk: &mut dyn FnMut(usize, f64)) -> Result<Perplexity> {
    if ctx < 4 {
        return Err(Error::arg(format!("perplexity: a context of {ctx} tokens is too short (at least 4)")));
    }
    if ctx > model.n_ctx {
        return Err(Error::arg(format!("perplexity: a context of {ctx} tokens exceeds the model's {}", model.n_ctx)));
    }
    let chunks = tokens.len() / ctx;
    if chunks == 0 {
        return Err(Error::arg(format!("perplexity: {} tokens are fewer than one chunk of {ctx}", tokens.len())));
    }
    let (vocab, first) = (model.vocab_size(), ctx / 2);
    let mut state = State::new(model.clone())?;
    let mut nll = NllSum::default();
    for (c, chunk) in tokens.chunks_exact(ctx).enumerate() {
        state.reset()?;
        let logits = crate::generate::decode_tokens_with(&mut state, chunk, LogitsFor::All, &mut || false)?;
        for j in first..ctx - 1 {
            nll.add(&logits[j * vocab..(j + 1) * vocab], chunk[j + 1]);
        }
        if let Some(p) = nll.result(c + 1) {
            on_chunk(c + 1, p.ppl);
        }
    }
    nll.result(chunks).ok_or_else(|| Error::arg("perplexity: fewer than two tokens scored"))
}
