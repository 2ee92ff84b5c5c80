//! The CPU backend: the network's math in f32 on the host's cores, each
//! block computed when the walk (`model::forward`) calls it, the matrix
//! products on `quant::kernels` (exact or integer, per model).
//!
//! Every block function comes in the stages the Vulkan backend runs as
//! shaders, so that each formula exists once: the Vulkan stage twins call
//! these functions to check the shaders.
//!
//! # Batches (prefill)
//!
//! A batch of `T` tokens (a prompt's micro-batch, `LoadOptions::micro_batch`,
//! 512 by default) goes through each block at once, its weights read once
//! for the batch:
//!
//! * every dense projection (GDN and attention inputs and outputs, the QSA
//!   indexer, hyper-connections, PLE, router, shared expert, LM head) is one
//!   matrix product over the `T` activations (`quant::matmul`: each row meets
//!   all the tokens while it is in cache, activations rounded once per token
//!   on the integer path, parallel over pieces of rows);
//! * a hyper-connection's pre step leaves the block inputs side by side
//!   ([`hyper::HcBatch`]), where every product of the block reads them;
//! * the MoE is grouped by expert ([`moe::expert_outputs_grouped`]): each
//!   expert runs once over the tokens routed to it, reading them in place
//!   (`quant::matmul`'s picked tokens: each token rounded once for all its
//!   experts, nothing gathered), and each token's combine reads its experts'
//!   outputs where they were written, in route order as one token's are; a
//!   batch of one token runs its experts in one parallel region instead
//!   ([`moe::expert_outputs_single`], the offloaded decode's host share:
//!   the same numbers);
//! * what carries state from one token to the next runs over the batch in
//!   position order where it must and in parallel where it can: the GDN
//!   delta rule head by head (each head's state carried through the batch
//!   in the thread's cache, [`gdn::delta_rule_batch`]), the GDN and PLE
//!   convs token by token in parallel (each tap reading the batch's earlier
//!   inputs, or the ring before the batch), the attention and indexer caches
//!   appended in order; QSA's selection and attention then run in parallel
//!   over the batch's queries, each reading only what was cached up to its
//!   own position;
//! * the per-token stages between the products (norms, hyper-connection
//!   mixes, routing, SwiGLU, combines) run in parallel over the tokens
//!   ([`per_chunk`], [`par_map`]): on a 2-core host they were a fifth of a
//!   512-token pass on one thread while the other waited, and on 16 cores
//!   they would be more than half of it;
//! * the LM head runs for the positions whose logits are wanted only.
//!
//! Each number is the one the token-by-token path computes (the products
//! are the same row kernels on the same rounded activations, the sums in
//! the same order), so a batch's logits equal token-by-token decoding bit
//! for bit: tests/prefill.rs checks that and the golden logits at batch
//! splits 1, 7, 64 and whole sequences. Scratch grows with `T`: the largest
//! is the MoE's gathered inputs and hidden activations, about
//! `T * k * (H + 3 F)` floats for `k` experts per token of `F` features,
//! plus the logits asked for (`T * V` with every position's).

pub mod gdn;
pub mod host;
pub mod hyper;
pub mod moe;
pub mod ops;
pub mod ple;
pub(crate) mod prof;
pub mod qsa;

use crate::error::{Error, Result};
use crate::model::backend::{
    Batch, BackendKind, BackendModel, BackendState, Blocks, Checkpoint, HostLayer, HostState, LogitsFor, Site,
};
use crate::model::weights::Mixer;
use crate::error::copy_of;
use crate::model::{LayerKind, Model};
use gdn::{ring_row, GdnState};
use hyper::HcBatch;
use ops::Rope;
use qsa::AttnState;
use rayon::prelude::*;

/// `f(i, chunk)` for each `n`-long chunk of `data` (a batch's tokens, one
/// chunk each): on the thread pool when there are several, on the calling
/// thread for one (a decoded token does not pay the hand-over to the pool).
/// The per-token stages between the matrix products run through here and
/// [`par_map`], so a batch keeps every core busy between the products.
pub(crate) fn per_chunk<T: Send>(data: &mut [T], n: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    if data.len() > n {
        data.par_chunks_mut(n).enumerate().for_each(|(i, c)| f(i, c));
    } else {
        data.chunks_mut(n).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// `(0..n).map(f).collect()`, on the thread pool when `n > 1`.
pub(crate) fn par_map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
    if n > 1 {
        (0..n).into_par_iter().map(f).collect()
    } else {
        (0..n).map(f).collect()
    }
}

/// The CPU backend: the weights are the mapped file's (nothing to hold).
pub struct CpuBackend;

impl BackendModel for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn device_name(&self) -> String {
        host::Machine::describe().cpu
    }

    fn new_state(&self, model: &Model) -> Result<Box<dyn BackendState>> {
        Ok(Box::new(CpuState::new(model)?))
    }
}

#[derive(Clone)]
enum LayerState {
    Gdn(GdnState),
    Attention(AttnState),
}

/// A sequence's state on the CPU.
pub struct CpuState {
    layers: Vec<LayerState>,
    /// The PLE conv ring (`cpu::ple`), when the model has PLE.
    ple_ring: Option<Vec<f32>>,
    /// Wall time per stage of the passes since profiling was enabled ([`prof`]).
    stages: Option<Vec<prof::StageTime>>,
}

impl CpuState {
    fn new(model: &Model) -> Result<CpuState> {
        let cfg = &model.config;
        let window = model.rewind_window;
        let layers = cfg
            .layers
            .iter()
            .map(|k| {
                Ok(match k {
                    LayerKind::Linear => LayerState::Gdn(GdnState::new(cfg, window)?),
                    LayerKind::Attention { .. } => LayerState::Attention(AttnState::default()),
                })
            })
            .collect::<Result<_>>()?;
        let ple_ring = cfg.ple.as_ref().map(|p| ple::new_ring(cfg, p, window)).transpose()?;
        Ok(CpuState { layers, ple_ring, stages: None })
    }
}

/// The ring rows of positions `pos - n .. pos`, oldest first, in a ring of rows of `width`.
fn ring_rows(ring: &[f32], width: usize, pos: usize, n: usize) -> Vec<f32> {
    let rows = ring.len() / width;
    let mut out = Vec::with_capacity(n * width);
    for q in pos as isize - n as isize..pos as isize {
        let r = ring_row(q, rows);
        out.extend_from_slice(&ring[r * width..(r + 1) * width]);
    }
    out
}

/// Writes `hist` (rows of positions `pos - n .. pos`, oldest first) into the ring.
fn set_ring_rows(ring: &mut [f32], width: usize, pos: usize, hist: &[f32]) {
    let rows = ring.len() / width;
    let n = hist.len() / width;
    for (i, row) in hist.chunks_exact(width).enumerate() {
        let r = ring_row(pos as isize - n as isize + i as isize, rows);
        ring[r * width..(r + 1) * width].copy_from_slice(row);
    }
}

/// What [`CpuState::rollback`] restores: per GDN layer its conv ring and
/// current recurrent plane, the PLE ring.
struct CpuCheckpoint {
    gdn: Vec<Option<(Vec<f32>, Vec<f32>)>>,
    ple_ring: Option<Vec<f32>>,
}

impl BackendState for CpuState {
    fn max_batch(&self) -> usize {
        usize::MAX
    }

    fn forward(&mut self, model: &Model, batch: &Batch) -> Result<Vec<f32>> {
        for l in &mut self.layers {
            if let LayerState::Attention(a) = l {
                a.reserve(&model.config, batch.tokens.len())?;
            }
        }
        let profiled = self.stages.is_some();
        let (logits, stages) = model.install(|| {
            prof::collect(profiled, || {
                let cfg = &model.config;
                let mut pass = CpuPass { model, state: self, batch, rope: Rope::new(cfg.rope_dims, cfg.rope_theta), logits: Vec::new() };
                crate::model::forward::forward(model, batch, &mut pass)?;
                Ok(pass.logits)
            })
        });
        if let Some(all) = self.stages.as_mut() {
            stages.into_iter().for_each(|t| prof::add(all, t));
        }
        logits
    }

    /// Starts (or restarts) the stage times of [`BackendState::dispatch_ms`]:
    /// the wall time of each stage of the passes from now on ([`prof`]).
    fn enable_profiling(&mut self) -> Result<()> {
        self.stages = Some(Vec::new());
        Ok(())
    }

    /// The stages' wall times since [`Self::enable_profiling`] (`dispatches`:
    /// how often each ran; no weight bytes).
    fn dispatch_ms(&self) -> Vec<crate::model::backend::DispatchTime> {
        let stages = self.stages.iter().flatten();
        stages.map(|&(name, count, ms)| crate::model::backend::DispatchTime { label: name.to_string(), dispatches: count, ms, bytes: 0 }).collect()
    }

    fn reset(&mut self) -> Result<()> {
        for l in &mut self.layers {
            match l {
                LayerState::Gdn(g) => {
                    g.conv.fill(0.0);
                    g.planes.fill(0.0);
                }
                LayerState::Attention(a) => a.clear(),
            }
        }
        if let Some(r) = self.ple_ring.as_mut() {
            r.fill(0.0);
        }
        Ok(())
    }

    fn rewind(&mut self, model: &Model, to: usize) -> Result<()> {
        for (l, kind) in self.layers.iter_mut().zip(&model.config.layers) {
            if let (LayerState::Attention(a), LayerKind::Attention { compress_ratio }) = (l, kind) {
                a.truncate(&model.config, *compress_ratio, to);
            }
        }
        Ok(())
    }

    fn checkpoint(&self, model: &Model, pos: usize) -> Result<Checkpoint> {
        let plane = GdnState::plane_len(&model.config);
        let gdn = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn(g) => {
                    let at = pos % (g.planes.len() / plane) * plane;
                    Ok(Some((copy_of(&g.conv, "GDN conv checkpoint")?, copy_of(&g.planes[at..at + plane], "GDN recurrent checkpoint")?)))
                }
                LayerState::Attention(_) => Ok(None),
            })
            .collect::<Result<_>>()?;
        let ple_ring = self.ple_ring.as_deref().map(|r| copy_of(r, "PLE checkpoint")).transpose()?;
        Ok(Checkpoint { pos, inner: Box::new(CpuCheckpoint { gdn, ple_ring }) })
    }

    fn rollback(&mut self, model: &Model, checkpoint: &Checkpoint) -> Result<()> {
        let c = checkpoint.inner.downcast_ref::<CpuCheckpoint>().ok_or_else(|| Error::arg("a checkpoint of another backend"))?;
        let plane = GdnState::plane_len(&model.config);
        for (l, saved) in self.layers.iter_mut().zip(&c.gdn) {
            if let (LayerState::Gdn(g), Some((conv, current))) = (&mut *l, saved) {
                let at = checkpoint.pos % (g.planes.len() / plane) * plane;
                g.conv.copy_from_slice(conv);
                g.planes[at..at + plane].copy_from_slice(current);
            }
        }
        if let (Some(r), Some(saved)) = (self.ple_ring.as_mut(), &c.ple_ring) {
            r.copy_from_slice(saved);
        }
        self.rewind(model, checkpoint.pos)
    }

    fn try_clone(&self, _model: &Model) -> Result<Box<dyn BackendState>> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Gdn(g) => LayerState::Gdn(GdnState {
                        conv: copy_of(&g.conv, "GDN conv state")?,
                        planes: copy_of(&g.planes, "GDN recurrent state")?,
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
        let ple_ring = self.ple_ring.as_deref().map(|r| copy_of(r, "PLE conv history")).transpose()?;
        Ok(Box::new(CpuState { layers, ple_ring, stages: None }))
    }

    fn export(&self, model: &Model, pos: usize) -> Result<HostState> {
        let cfg = &model.config;
        let plane = GdnState::plane_len(cfg);
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn(g) => {
                    let at = pos % (g.planes.len() / plane) * plane;
                    HostLayer::Gdn {
                        conv: ring_rows(&g.conv, cfg.ssm_conv_dim(), pos, cfg.ssm_conv - 1),
                        recurrent: g.planes[at..at + plane].to_vec(),
                    }
                }
                LayerState::Attention(a) => HostLayer::Attention {
                    keys: a.keys.clone(),
                    values: a.values.clone(),
                    index_keys: a.index_keys.clone(),
                    block_keys: a.block_keys.clone(),
                },
            })
            .collect();
        let ple_conv = match (&self.ple_ring, &cfg.ple) {
            (Some(r), Some(p)) => Some(ring_rows(r, cfg.hc * cfg.hidden, pos, (p.conv_kernel - 1) * p.ngram)),
            _ => None,
        };
        Ok(HostState { layers, ple_conv })
    }

    fn import(&mut self, model: &Model, pos: usize, host: HostState) -> Result<()> {
        let cfg = &model.config;
        let plane = GdnState::plane_len(cfg);
        self.reset()?;
        for (l, h) in self.layers.iter_mut().zip(host.layers) {
            match (l, h) {
                (LayerState::Gdn(g), HostLayer::Gdn { conv, recurrent }) => {
                    set_ring_rows(&mut g.conv, cfg.ssm_conv_dim(), pos, &conv);
                    let at = pos % (g.planes.len() / plane) * plane;
                    g.planes[at..at + plane].copy_from_slice(&recurrent);
                }
                (LayerState::Attention(a), HostLayer::Attention { keys, values, index_keys, block_keys }) => {
                    *a = AttnState { keys, values, index_keys, block_keys };
                }
                _ => return Err(Error::arg("the host state's layer kinds do not match the model")),
            }
        }
        if let (Some(r), Some(conv)) = (self.ple_ring.as_mut(), host.ple_conv) {
            set_ring_rows(r, cfg.hc * cfg.hidden, pos, &conv);
        }
        Ok(())
    }

    fn capacity(&self) -> usize {
        usize::MAX
    }
}

/// One batch on the CPU: the activations are host vectors, per token.
struct CpuPass<'a> {
    model: &'a Model,
    state: &'a mut CpuState,
    batch: &'a Batch<'a>,
    rope: Rope,
    logits: Vec<f32>,
}

/// The router's choice for one token and its shared-expert gate.
struct Routing {
    routes: Vec<(usize, f32)>,
    gate: f32,
}

impl CpuPass<'_> {
    fn width(&self) -> usize {
        self.model.config.hc * self.model.config.hidden
    }
}

/// Each token's block output `ys` ([T][H]) written back into its streams
/// (`x`: [T][ch]) with its injection weights.
fn post_all(branch: &HcBatch, ys: &[f32], x: &mut [f32], ch: usize) {
    let h = ys.len() / branch.tokens.max(1);
    let _span = prof::span("hyper-connection post (block outputs into the streams)");
    per_chunk(x, ch, |i, xi| hyper::post(xi, &ys[i * h..(i + 1) * h], branch.inject(i)));
}

impl Blocks for CpuPass<'_> {
    type Streams = Vec<f32>;
    type Branch = HcBatch;
    type Routes = Vec<Routing>;
    type Experts = moe::GroupedOutputs;

    fn embed(&mut self, rows: &[f32]) -> Result<Vec<f32>> {
        let (c, h) = (self.model.config.hc, self.model.config.hidden);
        let _span = prof::span("embedding into the streams");
        let mut x = vec![0f32; rows.len() * c];
        per_chunk(&mut x, c * h, |i, xi| xi.chunks_exact_mut(h).for_each(|s| s.copy_from_slice(&rows[i * h..(i + 1) * h])));
        Ok(x)
    }

    fn ple(&mut self, layer: usize, rows: &[f32], x: &mut Vec<f32>) -> Result<()> {
        let cfg = &self.model.config;
        let (Some(w), Some(p), Some(ring)) = (&self.model.weights.layers[layer].ple, &cfg.ple, self.state.ple_ring.as_mut()) else {
            return Ok(());
        };
        let _span = prof::span("PLE");
        ple::forward_batch(w, p, cfg, ring, self.batch.pos, rows, x);
        Ok(())
    }

    fn hyper_pre(&mut self, site: Site, x: &Vec<f32>) -> Result<HcBatch> {
        let l = &self.model.weights.layers;
        let hc = match site {
            Site::Mixer(i) => &l[i].attn_hc,
            Site::Moe(i) => &l[i].ffn_hc,
        };
        let cfg = &self.model.config;
        Ok(hyper::pre_batch(hc, x, cfg.hc, cfg.eps))
    }

    fn gdn(&mut self, layer: usize, branch: &HcBatch, x: &mut Vec<f32>) -> Result<()> {
        let (cfg, ch, pos) = (&self.model.config, self.width(), self.batch.pos);
        let (Mixer::Gdn(w), LayerState::Gdn(st)) = (&self.model.weights.layers[layer].mixer, &mut self.state.layers[layer]) else {
            unreachable!("weights, config and state agree on layer kinds")
        };
        let ys = gdn::forward_batch(w, cfg, st, pos, &branch.inputs);
        post_all(branch, &ys, x, ch);
        Ok(())
    }

    fn attention(&mut self, layer: usize, branch: &HcBatch, x: &mut Vec<f32>) -> Result<()> {
        let (cfg, ch, pos) = (&self.model.config, self.width(), self.batch.pos);
        let ratio = match cfg.layers[layer] {
            LayerKind::Attention { compress_ratio } => compress_ratio,
            LayerKind::Linear => unreachable!("the walk calls attention on attention layers"),
        };
        let (Mixer::Attention(w), LayerState::Attention(st)) = (&self.model.weights.layers[layer].mixer, &mut self.state.layers[layer])
        else {
            unreachable!("weights, config and state agree on layer kinds")
        };
        let ys = qsa::forward_batch(w, cfg, ratio, &self.rope, st, &branch.inputs, pos);
        post_all(branch, &ys, x, ch);
        Ok(())
    }

    fn moe_route(&mut self, layer: usize, branch: &HcBatch) -> Result<Vec<Routing>> {
        let (w, cfg) = (&self.model.weights.layers[layer].moe, &self.model.config);
        let span = prof::span("moe: router product");
        let mut logits = vec![0f32; branch.tokens * cfg.n_experts];
        w.router.matmul(&branch.inputs, &mut logits);
        drop(span);
        let _span = prof::span("moe: top-k, shared gate, routing reported");
        let n = cfg.n_experts;
        let routes: Vec<Routing> = par_map(branch.tokens, |i| Routing {
            routes: moe::choose(cfg, logits[i * n..(i + 1) * n].to_vec()),
            gate: moe::shared_gate(w, branch.input(i)),
        });
        for r in &routes {
            self.model.report_routing(layer, &r.routes.iter().map(|&(e, _)| e as u32).collect::<Vec<_>>());
        }
        Ok(routes)
    }

    fn moe_experts(&mut self, layer: usize, branch: &HcBatch, routes: &Vec<Routing>) -> Result<moe::GroupedOutputs> {
        let w = &self.model.weights.layers[layer].moe;
        if let [one] = routes.as_slice() {
            // One token: its experts in one parallel region (the same numbers).
            return Ok(moe::expert_outputs_single(w, &self.model.config, &branch.inputs, &one.routes));
        }
        let chosen: Vec<Vec<(usize, f32)>> = routes.iter().map(|r| r.routes.clone()).collect();
        Ok(moe::expert_outputs_grouped(w, &self.model.config, &branch.inputs, &chosen))
    }

    fn moe_combine(&mut self, _layer: usize, branch: &HcBatch, routes: &Vec<Routing>, experts: moe::GroupedOutputs, x: &mut Vec<f32>) -> Result<()> {
        let ch = self.width();
        let _span = prof::span("moe: combine, hyper-connection post");
        per_chunk(x, ch, |i, xi| {
            let r = &routes[i];
            let out = moe::combine_rows(&r.routes, experts.routed(i), experts.shared(i), r.gate);
            hyper::post(xi, &out, branch.inject(i));
        });
        Ok(())
    }

    fn head(&mut self, x: &Vec<f32>) -> Result<()> {
        let (cfg, w) = (&self.model.config, &self.model.weights);
        let ch = self.width();
        let wanted = match self.batch.logits {
            LogitsFor::Last => &x[x.len() - ch..],
            LogitsFor::All => &x[..],
        };
        let n = wanted.len() / ch;
        let _span = prof::span("LM head");
        let mut logits = crate::error::zeros(n.checked_mul(cfg.vocab), "logits")?;
        let mixed = hyper::pre_batch(&w.output_hc, wanted, cfg.hc, cfg.eps);
        w.output.matmul(&mixed.inputs, &mut logits);
        self.logits = logits;
        Ok(())
    }
}
