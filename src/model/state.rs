//! Decode state of one sequence: recurrent GDN states, attention and indexer
//! caches, PLE history, the position and the last logits.
//!
//! A state belongs to one model and is used by one thread at a time; any
//! number of states may decode in parallel against the same shared model.
//!
//! When the model was loaded for Vulkan the recurrent states and caches live
//! on the GPU ([`crate::vulkan::GpuState`]) and `layers` stays empty; the
//! host keeps the position, the PLE token history and the logits.
//! Checkpoints, rollback and copies read and write the GPU buffers.

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

pub struct State {
    pub(crate) model: Arc<Model>,
    pub(crate) pos: usize,
    pub(crate) layers: Vec<LayerState>,
    pub(crate) ple: Option<PleState>,
    /// Logits of the last decoded token: [V]; empty before the first token.
    pub(crate) logits: Vec<f32>,
    /// The GPU buffers, for models loaded for Vulkan.
    pub(crate) gpu: Option<Box<crate::vulkan::GpuState>>,
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
        let gpu = match &model.gpu {
            Some(_) => Some(Box::new(crate::vulkan::GpuState::new(&model)?)),
            None => None,
        };
        let host_layers = if gpu.is_some() { &[][..] } else { &cfg.layers[..] };
        let layers = host_layers
            .iter()
            .map(|k| {
                Ok(match k {
                    LayerKind::Linear => LayerState::Gdn(GdnState::new(cfg)?),
                    LayerKind::Attention { .. } => LayerState::Attention(AttnState::default()),
                })
            })
            .collect::<Result<_>>()?;
        let ple = cfg.ple.as_ref().map(|p| PleState::new(cfg, p)).transpose()?;
        Ok(State { model, pos: 0, layers, ple, logits: Vec::new(), gpu })
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

    /// GPU work of the last decoded token, for states of a Vulkan model.
    pub fn gpu_stats(&self) -> Option<crate::vulkan::TokenStats> {
        self.gpu.as_ref().map(|g| g.stats())
    }

    /// Times every GPU dispatch of the following tokens (opt-in: the
    /// timestamps cost a little); an error on a CPU state or a device that
    /// cannot time compute work.
    /// Positions the GPU attention caches hold now (they grow with the
    /// context); `None` on the CPU.
    pub fn gpu_capacity(&self) -> Option<usize> {
        self.gpu.as_ref().map(|g| g.capacity())
    }

    pub fn enable_gpu_timestamps(&mut self) -> Result<()> {
        match self.gpu.as_mut() {
            Some(g) => g.enable_timestamps(),
            None => Err(Error::arg("GPU timestamps: this state decodes on the CPU")),
        }
    }

    /// GPU milliseconds per pipeline of the last token, once timestamps are enabled.
    pub fn gpu_stage_ms(&self) -> &[(&'static str, f64)] {
        self.gpu.as_ref().map_or(&[], |g| g.stage_ms())
    }

    /// Forgets the sequence: zeroes the recurrent states, empties the caches.
    pub fn reset(&mut self) {
        if let Some(g) = self.gpu.as_mut() {
            // A failed fill leaves stale state that the next decode's error reports.
            let _ = g.reset();
        }
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
        let logits = match self.gpu.as_mut() {
            Some(g) => {
                let rows = match (&self.ple, model.config.ple.as_ref(), model.weights.ple_table.as_ref()) {
                    (Some(ps), Some(pc), Some(table)) => {
                        Some(super::ple::gather_rows(table, pc, model.config.hidden, &ps.tokens, token))
                    }
                    _ => None,
                };
                let logits = g.decode(&model, token, self.pos, rows.as_deref())?;
                if let Some(ps) = self.ple.as_mut() {
                    ps.tokens.remove(0);
                    ps.tokens.push(token);
                }
                logits
            }
            None => model.install(|| super::forward::token(&model, self, token)),
        };
        self.logits = logits;
        self.pos += 1;
        Ok(())
    }

    /// Checks that `tokens` are all in the vocabulary and fit in the context,
    /// without changing anything.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab;
        if let Some((i, t)) = tokens.iter().enumerate().find(|(_, t)| **t as usize >= vocab) {
            return Err(Error::TokenOutOfRange(format!(
                "token {t} (index {i}) is out of range: the vocabulary has {vocab} tokens"
            )));
        }
        let room = self.model.n_ctx.saturating_sub(self.pos);
        if tokens.len() > room {
            return Err(Error::ContextFull(format!(
                "{} tokens do not fit: {} positions decoded, context limit {} ({room} left)",
                tokens.len(),
                self.pos,
                self.model.n_ctx
            )));
        }
        Ok(())
    }

    /// Decodes `tokens` in order; the logits are the last token's. Every
    /// token and the context room are checked before anything is decoded, and
    /// a failure part way (out of memory) rolls back: on error nothing has changed.
    pub fn decode_tokens(&mut self, tokens: &[u32]) -> Result<()> {
        self.check_tokens(tokens)?;
        let checkpoint = if tokens.len() > 1 { Some(self.checkpoint()?) } else { None };
        for &t in tokens {
            if let Err(e) = self.decode(t) {
                if let Some(c) = checkpoint {
                    self.rollback(c);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// For a GPU state: a host state with the same contents (the GPU buffers
    /// read back into the CPU layout), for snapshots.
    pub(crate) fn host_copy(&self) -> Result<Option<State>> {
        let Some(g) = &self.gpu else { return Ok(None) };
        let cfg = &self.model.config;
        let (parts, ple_conv) = g.export(cfg, self.pos)?;
        let layers = cfg
            .layers
            .iter()
            .zip(parts)
            .map(|(kind, mut p)| match kind {
                LayerKind::Linear => {
                    let recurrent = p.pop().unwrap_or_default();
                    LayerState::Gdn(GdnState { conv: p.pop().unwrap_or_default(), recurrent })
                }
                LayerKind::Attention { .. } => {
                    let mut next = || if p.is_empty() { Vec::new() } else { p.remove(0) };
                    LayerState::Attention(AttnState { keys: next(), values: next(), index_keys: next(), block_keys: next() })
                }
            })
            .collect();
        let ple = match (&self.ple, ple_conv) {
            (Some(p), Some(conv)) => Some(PleState { tokens: p.tokens.clone(), conv }),
            _ => None,
        };
        Ok(Some(State { model: self.model.clone(), pos: self.pos, layers, ple, logits: self.logits.clone(), gpu: None }))
    }

    /// Moves the contents of a host-layout state (a parsed snapshot) into
    /// this state: onto the GPU for GPU states.
    pub(crate) fn take_contents(&mut self, pos: usize, layers: Vec<LayerState>, ple: Option<PleState>, logits: Vec<f32>) -> Result<()> {
        if let Some(g) = self.gpu.as_mut() {
            let parts: Vec<Vec<Vec<f32>>> = layers
                .into_iter()
                .map(|l| match l {
                    LayerState::Gdn(s) => vec![s.conv, s.recurrent],
                    LayerState::Attention(a) => vec![a.keys, a.values, a.index_keys, a.block_keys],
                })
                .collect();
            g.import(&self.model, pos, &parts, ple.as_ref().map(|p| &p.conv[..]))?;
        } else {
            self.layers = layers;
        }
        self.pos = pos;
        self.ple = ple;
        self.logits = logits;
        Ok(())
    }

    /// A deep copy, or an out-of-memory error instead of an allocation abort.
    pub fn try_clone(&self) -> Result<State> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Gdn(g) => LayerState::Gdn(GdnState {
                        conv: copy_of(&g.conv, "GDN conv state")?,
                        recurrent: copy_of(&g.recurrent, "GDN recurrent state")?,
                    }),
                    LayerState::Attention(a) => LayerState::Attention(AttnState {
                        keys: copy_of(&a.keys, "attention keys")?,
                        values: copy_of(&a.values, "attention values")?,
                        index_keys: copy_of(&a.index_keys, "indexer keys")?,
                        block_keys: copy_of(&a.block_keys, "block keys")?,
                    }),
                })
            })
            .collect::<Result<_>>()?;
        let ple = match &self.ple {
            None => None,
            Some(p) => Some(PleState { tokens: p.tokens.clone(), conv: copy_of(&p.conv, "PLE conv history")? }),
        };
        let gpu = match &self.gpu {
            None => None,
            Some(g) => {
                let mut copy = crate::vulkan::GpuState::new(&self.model)?;
                copy.restore(&self.model, &g.save()?)?;
                Some(Box::new(copy))
            }
        };
        Ok(State { model: self.model.clone(), pos: self.pos, layers, ple, logits: copy_of(&self.logits, "logits")?, gpu })
    }

    /// What [`State::rollback`] needs to undo any number of decode steps:
    /// copies of the fixed-size recurrent buffers, the lengths of the
    /// append-only attention caches, the position and the logits.
    pub(crate) fn checkpoint(&self) -> Result<Checkpoint> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Gdn(g) => LayerCheckpoint::Gdn(GdnState {
                        conv: copy_of(&g.conv, "GDN conv checkpoint")?,
                        recurrent: copy_of(&g.recurrent, "GDN recurrent checkpoint")?,
                    }),
                    LayerState::Attention(a) => LayerCheckpoint::Attention([
                        a.keys.len(),
                        a.values.len(),
                        a.index_keys.len(),
                        a.block_keys.len(),
                    ]),
                })
            })
            .collect::<Result<_>>()?;
        let ple = match &self.ple {
            None => None,
            Some(p) => Some(PleState { tokens: p.tokens.clone(), conv: copy_of(&p.conv, "PLE checkpoint")? }),
        };
        // Attention caches past the position are overwritten later, so the
        // GPU buffers' contents at the checkpoint suffice to undo.
        let gpu = self.gpu.as_ref().map(|g| g.save()).transpose()?;
        Ok(Checkpoint { pos: self.pos, logits: copy_of(&self.logits, "logits checkpoint")?, layers, ple, gpu })
    }

    /// Returns to `checkpoint`, taken from this state: everything decoded
    /// since is forgotten.
    pub(crate) fn rollback(&mut self, checkpoint: Checkpoint) {
        for (l, c) in self.layers.iter_mut().zip(checkpoint.layers) {
            match (l, c) {
                (LayerState::Gdn(g), LayerCheckpoint::Gdn(saved)) => *g = saved,
                (LayerState::Attention(a), LayerCheckpoint::Attention([k, v, ik, bk])) => {
                    a.keys.truncate(k);
                    a.values.truncate(v);
                    a.index_keys.truncate(ik);
                    a.block_keys.truncate(bk);
                }
                _ => unreachable!("a checkpoint is taken from the same state"),
            }
        }
        if let (Some(g), Some(saved)) = (self.gpu.as_mut(), checkpoint.gpu) {
            // Rollback cannot fail for host states; a failed GPU upload leaves
            // this state unusable, which its next decode reports.
            let _ = g.restore(&self.model, &saved);
        }
        self.ple = checkpoint.ple;
        self.logits = checkpoint.logits;
        self.pos = checkpoint.pos;
    }
}

/// Saved by [`State::checkpoint`]. Attention caches only grow while
/// decoding, so their lengths suffice to undo.
pub(crate) struct Checkpoint {
    pos: usize,
    logits: Vec<f32>,
    layers: Vec<LayerCheckpoint>,
    ple: Option<PleState>,
    /// The GPU state buffers ([`crate::vulkan::GpuState::save`]).
    gpu: Option<crate::vulkan::SavedState>,
}

enum LayerCheckpoint {
    Gdn(GdnState),
    Attention([usize; 4]),
}

/// A copy of `v`, or an out-of-memory error instead of an allocation abort.
fn copy_of(v: &[f32], what: &str) -> Result<Vec<f32>> {
    let mut c = Vec::new();
    c.try_reserve_exact(v.len())
        .map_err(|_| Error::OutOfMemory(format!("{what}: cannot allocate {} floats", v.len())))?;
    c.extend_from_slice(v);
    Ok(c)
}
