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

impl State {
    pub fn new(model: Arc<Model>) -> Self {
        let cfg = &model.config;
        let layers = cfg
            .layers
            .iter()
            .map(|k| match k {
                LayerKind::Linear => LayerState::Gdn(GdnState::new(cfg)),
                LayerKind::Attention { .. } => LayerState::Attention(AttnState::default()),
            })
            .collect();
        let ple = cfg.ple.as_ref().map(|p| PleState::new(cfg, p));
        State { model, pos: 0, layers, ple, logits: Vec::new() }
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

    /// Forgets the sequence; keeps allocations where it can.
    pub fn reset(&mut self) {
        *self = State::new(self.model.clone());
    }

    /// Appends `token` at the next position and computes its logits. On error
    /// nothing has changed.
    pub fn decode(&mut self, token: u32) -> Result<()> {
        let vocab = self.model.config.vocab;
        if token as usize >= vocab {
            return Err(Error::TokenOutOfRange(format!("token {token} is out of range: the vocabulary has {vocab} tokens")));
        }
        if self.pos >= self.model.n_ctx {
            return Err(Error::ContextFull(format!(
                "the state is full: {} positions decoded, context limit {}",
                self.pos, self.model.n_ctx
            )));
        }
        let model = self.model.clone();
        let logits = model.install(|| super::forward::token(&model, self, token));
        self.logits = logits;
        self.pos += 1;
        Ok(())
    }
}
