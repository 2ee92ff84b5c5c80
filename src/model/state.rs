//! Decode state of one sequence: recurrent GDN states, attention and indexer
//! caches, PLE history, the position and the last logits.
//!
//! A state belongs to one model and is used by one thread at a time; any
//! number of states may decode in parallel against the same shared model.

use super::config::LayerKind;
use super::gdn::GdnState;
use super::ple::PleState;
use super::qsa::AttnState;
use super::Model;
use crate::error::{Error, Result};
use std::sync::Arc;

#[derive(Clone)]
pub(crate) enum LayerState {
    Gdn(GdnState),
    Attention(AttnState),
}

#[derive(Clone)]
pub struct State {
    pub(crate) model: Arc<Model>,
    pub(crate) pos: usize,
    pub(crate) layers: Vec<LayerState>,
    pub(crate) ple: Option<PleState>,
    /// Logits of the last decoded token: [V]; empty before the first token.
    pub(crate) logits: Vec<f32>,
}

/// A zeroed buffer of `n` floats, or an error instead of an allocation abort
/// (sizes come from the model file, which may be hostile).
pub(crate) fn zeros(n: Option<usize>, what: &str) -> Result<Vec<f32>> {
    let n = n.ok_or_else(|| Error::OutOfMemory(format!("{what}: size overflows")))?;
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| Error::OutOfMemory(format!("{what}: cannot allocate {n} floats")))?;
    v.resize(n, 0.0);
    Ok(v)
}

impl State {
    /// An empty state; fails only when its recurrent buffers cannot be allocated.
    pub fn new(model: Arc<Model>) -> Result<Self> {
        let cfg = &model.config;
        let layers = cfg
            .layers
            .iter()
            .map(|k| {
                Ok(match k {
                    LayerKind::Linear => LayerState::Gdn(GdnState::new(cfg)?),
                    LayerKind::Attention { .. } => LayerState::Attention(AttnState::default()),
                })
            })
            .collect::<Result<_>>()?;
        let ple = cfg.ple.as_ref().map(|p| PleState::new(cfg, p)).transpose()?;
        Ok(State { model, pos: 0, layers, ple, logits: Vec::new() })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens decoded so far (the position of the next token).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Logits of the last decoded token, or `None` before the first.
    pub fn logits(&self) -> Option<&[f32]> {
        (!self.logits.is_empty()).then_some(&self.logits[..])
    }

    /// Forgets the sequence: zeroes the recurrent states, empties the caches.
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            match l {
                LayerState::Gdn(g) => {
                    g.conv.fill(0.0);
                    g.recurrent.fill(0.0);
                }
                LayerState::Attention(a) => a.clear(),
            }
        }
        if let (Some(p), Some(cfg)) = (self.ple.as_mut(), self.model.config.ple.as_ref()) {
            p.tokens.fill(cfg.eos);
            p.conv.fill(0.0);
        }
        self.logits.clear();
        self.pos = 0;
    }

    /// Appends `token` at the next position and computes its logits. On error
    /// nothing has changed.
    pub fn decode(&mut self, token: u32) -> Result<()> {
        if token as usize >= self.model.config.vocab {
            let vocab = self.model.config.vocab;
            return Err(Error::TokenOutOfRange(format!("token {token} is out of range: the vocabulary has {vocab} tokens")));
        }
        if self.pos >= self.model.n_ctx {
            return Err(Error::ContextFull(format!(
                "the state is full: {} positions decoded, context limit {}",
                self.pos, self.model.n_ctx
            )));
        }
        let vocab = self.model.config.vocab;
        if self.logits.capacity() < vocab {
            self.logits
                .try_reserve_exact(vocab)
                .map_err(|_| Error::OutOfMemory(format!("cannot allocate {vocab} logits")))?;
        }
        for l in &mut self.layers {
            if let LayerState::Attention(a) = l {
                a.reserve_one(&self.model.config)?;
            }
        }
        let model = self.model.clone();
        let logits = model.install(|| super::forward::token(&model, self, token));
        self.logits = logits;
        self.pos += 1;
        Ok(())
    }
}
