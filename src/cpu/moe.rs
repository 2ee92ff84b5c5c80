//! Mixture of experts (transformers `Qwen3NextSparseMoeBlock`): softmax
//! router, top-k (ties to the lower expert id), weights renormalised over the
//! chosen k, SwiGLU experts, plus a sigmoid-gated shared expert.
//!
//! In stages, as the walk calls them: [`route`] (`moe_route`),
//! [`expert_outputs`] (experts by id: the expert matvecs), [`combine`]
//! (`moe_combine`, with the hyper-connection post step).

use super::ops::{dot, sigmoid, silu, softmax};
use super::{per_chunk, prof};
use rayon::prelude::*;
use crate::model::config::Config;
use crate::model::weights::{ExpertGateUp, Moe};
use crate::quant::kernels::{glu_batch, Glu};
use crate::tensor::matmul_all;

/// The router's choice for one token: expert ids and their normalised weights.
pub fn route(w: &Moe, cfg: &Config, x: &[f32]) -> Vec<(usize, f32)> {
    let mut p = vec![0f32; cfg.n_experts];
    w.router.matvec(x, &mut p);
    choose(cfg, p)
}

/// The router's choice from its logits `p` ([E]).
pub fn choose(cfg: &Config, mut p: Vec<f32>) -> Vec<(usize, f32)> {
    softmax(&mut p);
    let mut order: Vec<usize> = (0..cfg.n_experts).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order.truncate(cfg.n_experts_used);
    let total: f32 = order.iter().map(|&e| p[e]).sum();
    order.into_iter().map(|e| (e, p[e] / total)).collect()
}

/// The shared expert's gate, `sigmoid(w . x)`.
pub fn shared_gate(w: &Moe, x: &[f32]) -> f32 {
    sigmoid(dot(&w.shared_gate, x))
}

/// An expert of a MoE block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expert {
    Routed(usize),
    Shared,
}

/// `down(silu(gate x) * up x)` of each of `experts`, in order: [n][H]. One
/// parallel region ([`glu_batch`]): the gate and up rows of all of them (one
/// rounded `x` on the fast path), then the down rows of each expert as soon
/// as its gate and up are done.
pub fn expert_outputs(w: &Moe, cfg: &Config, x: &[f32], experts: &[Expert]) -> Vec<f32> {
    let (h, f, fs) = (cfg.hidden, cfg.expert_ff, cfg.shared_ff);
    let units: Vec<Glu<'_>> = experts
        .iter()
        .map(|e| match (e, &w.gate_up) {
            (Expert::Routed(id), ExpertGateUp::Fused(t)) => Glu { gate: t.rows_at(id * 2 * f, f), up: t.rows_at(id * 2 * f + f, f), down: w.down.rows_at(id * h, h) },
            (Expert::Routed(id), ExpertGateUp::Separate { gate, up }) => Glu { gate: gate.rows_at(id * f, f), up: up.rows_at(id * f, f), down: w.down.rows_at(id * h, h) },
            (Expert::Shared, _) => Glu { gate: w.shared_gate_proj.rows_at(0, fs), up: w.shared_up.rows_at(0, fs), down: w.shared_down.rows_at(0, h) },
        })
        .collect();
    let mut ys = vec![0f32; experts.len() * h];
    let swiglu = |g: &mut [f32], u: &[f32]| {
        for (gv, uv) in g.iter_mut().zip(u) {
            *gv = silu(*gv) * uv;
        }
    };
    glu_batch(&units, x, swiglu, &mut ys);
    ys
}

/// The expert outputs of a batch as [`expert_outputs_grouped`] leaves them:
/// each used expert's outputs over its tokens, where the combine reads them.
pub struct GroupedOutputs {
    /// Per used expert, its outputs over its tokens: [m][H], token order.
    downs: Vec<Vec<f32>>,
    /// Per token and route, the routed expert's index in `downs` and the
    /// token's row among its outputs.
    at: Vec<Vec<(usize, usize)>>,
    /// The shared expert's outputs: [T][H].
    shared: Vec<f32>,
}

impl GroupedOutputs {
    /// Token `tok`'s routed experts' outputs, in route order: [H] each.
    pub fn routed(&self, tok: usize) -> impl Iterator<Item = &[f32]> {
        let h = self.shared.len() / self.at.len().max(1);
        self.at[tok].iter().map(move |&(slot, row)| &self.downs[slot][row * h..(row + 1) * h])
    }

    /// Token `tok`'s shared expert output: [H].
    pub fn shared(&self, tok: usize) -> &[f32] {
        let h = self.shared.len() / self.at.len().max(1);
        &self.shared[tok * h..(tok + 1) * h]
    }
}

/// [`expert_outputs_grouped`] for one token (`x`: [H]) through
/// [`expert_outputs`]: its routed experts and the shared one in one parallel
/// region ([`glu_batch`]) rather than two. The numbers are the same: each
/// product is the same kernel call on the same rounded input (the grouped
/// path's kernels for several tokens give each token what it gets alone).
pub fn expert_outputs_single(w: &Moe, cfg: &Config, x: &[f32], routes: &[(usize, f32)]) -> GroupedOutputs {
    let h = cfg.hidden;
    let _span = prof::span("moe: experts of one token (gate/up, SwiGLU, down in one region)");
    let mut experts: Vec<Expert> = routes.iter().map(|&(e, _)| Expert::Routed(e)).collect();
    experts.push(Expert::Shared);
    let mut ys = expert_outputs(w, cfg, x, &experts);
    let shared = ys.split_off(routes.len() * h);
    GroupedOutputs { downs: ys.chunks_exact(h).map(<[f32]>::to_vec).collect(), at: vec![(0..routes.len()).map(|j| (j, 0)).collect()], shared }
}

/// The expert outputs of a batch (`xs`: [T][H], `routes` per token), grouped
/// by expert: each expert runs once over the tokens routed to it (its weights
/// read once for the batch), reading them in place in `xs` (on the integer
/// path each token is rounded once for all its experts), the shared expert
/// once over all the tokens; gate and up of every expert share one parallel
/// region, the down projections another. Per token the numbers
/// [`expert_outputs`] gives its routed experts in route order and the shared
/// one.
pub fn expert_outputs_grouped(w: &Moe, cfg: &Config, xs: &[f32], routes: &[Vec<(usize, f32)>]) -> GroupedOutputs {
    let (h, f, fs) = (cfg.hidden, cfg.expert_ff, cfg.shared_ff);
    let t = xs.len() / h;
    let span = prof::span("moe: tokens grouped by expert");
    // Per expert the tokens routed to it, in token order; per (token, route)
    // the expert's row among them.
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); cfg.n_experts];
    let rows: Vec<Vec<usize>> = routes
        .iter()
        .enumerate()
        .map(|(tok, r)| {
            r.iter()
                .map(|&(e, _)| {
                    members[e].push(tok);
                    members[e].len() - 1
                })
                .collect()
        })
        .collect();
    let used: Vec<usize> = (0..cfg.n_experts).filter(|&e| !members[e].is_empty()).collect();
    let mut slot_of = vec![usize::MAX; cfg.n_experts];
    for (i, &e) in used.iter().enumerate() {
        slot_of[e] = i;
    }
    let at: Vec<Vec<(usize, usize)>> =
        routes.iter().zip(&rows).map(|(r, rows)| r.iter().zip(rows).map(|(&(e, _), &row)| (slot_of[e], row)).collect()).collect();
    // Per used expert `gate` and `up`: [m][f] each; the shared expert's: [T][fs].
    let mut gates: Vec<Vec<f32>> = used.iter().map(|&e| vec![0f32; members[e].len() * f]).collect();
    let mut ups: Vec<Vec<f32>> = used.iter().map(|&e| vec![0f32; members[e].len() * f]).collect();
    let mut fused: Vec<Vec<f32>> = Vec::new();
    let (mut shared_g, mut shared_u) = (vec![0f32; t * fs], vec![0f32; t * fs]);
    drop(span);
    {
        let _span = prof::span("moe: experts' gate/up products (and the shared expert's)");
        let mut jobs = Vec::with_capacity(2 * used.len() + 2);
        match &w.gate_up {
            ExpertGateUp::Fused(gu) => {
                fused = used.iter().map(|&e| vec![0f32; members[e].len() * 2 * f]).collect();
                for (&e, y) in used.iter().zip(fused.iter_mut()) {
                    jobs.push(gu.matmul_job_picked(e * 2 * f, xs, Some(&members[e]), y));
                }
            }
            ExpertGateUp::Separate { gate, up } => {
                for ((&e, g), u) in used.iter().zip(gates.iter_mut()).zip(ups.iter_mut()) {
                    jobs.push(gate.matmul_job_picked(e * f, xs, Some(&members[e]), g));
                    jobs.push(up.matmul_job_picked(e * f, xs, Some(&members[e]), u));
                }
            }
        }
        jobs.push(w.shared_gate_proj.matmul_job(0, xs, &mut shared_g));
        jobs.push(w.shared_up.matmul_job(0, xs, &mut shared_u));
        matmul_all(&mut jobs);
    }
    // gate = silu(gate) * up, per expert (split from the fused product first), then the shared expert's.
    let span = prof::span("moe: SwiGLU");
    let swiglu = |i: usize, g: &mut Vec<f32>, u: &mut Vec<f32>| {
        if let Some(gu) = fused.get(i) {
            for (tok, both) in gu.chunks_exact(2 * f).enumerate() {
                g[tok * f..(tok + 1) * f].copy_from_slice(&both[..f]);
                u[tok * f..(tok + 1) * f].copy_from_slice(&both[f..]);
            }
        }
        for (gv, uv) in g.iter_mut().zip(u.iter()) {
            *gv = silu(*gv) * uv;
        }
    };
    if t > 1 {
        gates.par_iter_mut().zip(ups.par_iter_mut()).enumerate().for_each(|(i, (g, u))| swiglu(i, g, u));
    } else {
        gates.iter_mut().zip(ups.iter_mut()).enumerate().for_each(|(i, (g, u))| swiglu(i, g, u));
    }
    per_chunk(&mut shared_g, fs, |i, g| {
        for (gv, uv) in g.iter_mut().zip(&shared_u[i * fs..(i + 1) * fs]) {
            *gv = silu(*gv) * uv;
        }
    });
    drop(span);
    let _span = prof::span("moe: experts' down products (and the shared expert's)");
    let mut downs: Vec<Vec<f32>> = used.iter().map(|&e| vec![0f32; members[e].len() * h]).collect();
    let mut shared = vec![0f32; t * h];
    {
        let mut jobs = Vec::with_capacity(used.len() + 1);
        for ((&e, hidden), y) in used.iter().zip(&gates).zip(downs.iter_mut()) {
            jobs.push(w.down.matmul_job(e * h, hidden, y));
        }
        jobs.push(w.shared_down.matmul_job(0, &shared_g, &mut shared));
        matmul_all(&mut jobs);
    }
    GroupedOutputs { downs, at, shared }
}

/// `sum_e w_e y_e` in route order, then `+ gate * shared`: [H].
pub fn combine(routes: &[(usize, f32)], ys: &[f32], shared: &[f32], gate: f32) -> Vec<f32> {
    combine_rows(routes, ys.chunks_exact(shared.len()), shared, gate)
}

/// [`combine`] with the routed experts' outputs `ys` ([H] each, route order)
/// wherever they are.
pub fn combine_rows<'a>(routes: &[(usize, f32)], ys: impl IntoIterator<Item = &'a [f32]>, shared: &[f32], gate: f32) -> Vec<f32> {
    let h = shared.len();
    let mut out = vec![0f32; h];
    for (&(_, weight), y) in routes.iter().zip(ys) {
        for (o, v) in out.iter_mut().zip(y) {
            *o += v * weight;
        }
    }
    for (o, v) in out.iter_mut().zip(shared) {
        *o += gate * v;
    }
    out
}

/// The whole block for one token: [H].
pub fn forward(w: &Moe, cfg: &Config, x: &[f32]) -> Vec<f32> {
    let h = cfg.hidden;
    let routes = route(w, cfg, x);
    let mut experts: Vec<Expert> = routes.iter().map(|&(e, _)| Expert::Routed(e)).collect();
    experts.push(Expert::Shared);
    let ys = expert_outputs(w, cfg, x, &experts);
    let (routed, shared) = ys.split_at(routes.len() * h);
    combine(&routes, routed, shared, shared_gate(w, x))
}
