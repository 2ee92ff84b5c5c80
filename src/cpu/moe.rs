//! Mixture of experts (transformers `Qwen3NextSparseMoeBlock`): softmax
//! router, top-k (ties to the lower expert id), weights renormalised over the
//! chosen k, SwiGLU experts, plus a sigmoid-gated shared expert.
//!
//! In stages, as the walk calls them: [`route`] (`moe_route`),
//! [`expert_outputs`] (experts by id: the expert matvecs), [`combine`]
//! (`moe_combine`, with the hyper-connection post step).

use super::ops::{dot, sigmoid, silu, softmax};
use crate::model::config::Config;
use crate::model::weights::{ExpertGateUp, Moe};
use crate::tensor::matvec_all;

/// The router's choice for one token: expert ids and their normalised weights.
pub fn route(w: &Moe, cfg: &Config, x: &[f32]) -> Vec<(usize, f32)> {
    let mut p = vec![0f32; cfg.n_experts];
    w.router.matvec(x, &mut p);
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

/// `down(silu(gate x) * up x)` of each of `experts`, in order: [n][H]. Two
/// parallel regions: gate and up of all of them (one rounded `x` on the fast
/// path), then all the down projections.
pub fn expert_outputs(w: &Moe, cfg: &Config, x: &[f32], experts: &[Expert]) -> Vec<f32> {
    let (h, f, fs) = (cfg.hidden, cfg.expert_ff, cfg.shared_ff);
    let width = |e: &Expert| if *e == Expert::Shared { fs } else { f };
    let offsets: Vec<usize> = experts.iter().scan(0, |at, e| Some(std::mem::replace(at, *at + 2 * width(e)))).collect();
    // Per expert `[gate | up]`.
    let mut gu = vec![0f32; experts.iter().map(|e| 2 * width(e)).sum()];
    {
        let mut jobs = Vec::with_capacity(2 * experts.len());
        let mut rest = &mut gu[..];
        for e in experts {
            let (buf, tail) = rest.split_at_mut(2 * width(e));
            rest = tail;
            match (e, &w.gate_up) {
                (Expert::Routed(id), ExpertGateUp::Fused(t)) => jobs.push(t.matvec_job(id * 2 * f, x, buf)),
                (Expert::Routed(id), ExpertGateUp::Separate { gate, up }) => {
                    let (g, u) = buf.split_at_mut(f);
                    jobs.push(gate.matvec_job(id * f, x, g));
                    jobs.push(up.matvec_job(id * f, x, u));
                }
                (Expert::Shared, _) => {
                    let (g, u) = buf.split_at_mut(fs);
                    jobs.push(w.shared_gate_proj.matvec_job(0, x, g));
                    jobs.push(w.shared_up.matvec_job(0, x, u));
                }
            }
        }
        matvec_all(&mut jobs);
    }
    for (e, &at) in experts.iter().zip(&offsets) {
        let n = width(e);
        let (g, u) = gu[at..at + 2 * n].split_at_mut(n);
        for (gv, uv) in g.iter_mut().zip(u.iter()) {
            *gv = silu(*gv) * uv;
        }
    }
    let mut ys = vec![0f32; experts.len() * h];
    {
        let mut jobs = Vec::with_capacity(experts.len());
        for ((e, &at), y) in experts.iter().zip(&offsets).zip(ys.chunks_exact_mut(h)) {
            let hidden = &gu[at..at + width(e)];
            jobs.push(match e {
                Expert::Routed(id) => w.down.matvec_job(id * h, hidden, y),
                Expert::Shared => w.shared_down.matvec_job(0, hidden, y),
            });
        }
        matvec_all(&mut jobs);
    }
    ys
}

/// `sum_e w_e y_e` in route order, then `+ gate * shared`: [H].
pub fn combine(routes: &[(usize, f32)], ys: &[f32], shared: &[f32], gate: f32) -> Vec<f32> {
    let h = shared.len();
    let mut out = vec![0f32; h];
    for (&(_, weight), y) in routes.iter().zip(ys.chunks_exact(h)) {
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
