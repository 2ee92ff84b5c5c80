//! Mixture of experts (transformers `Qwen3NextSparseMoeBlock`): softmax
//! router, top-k (ties to the lower expert id), weights renormalised over the
//! chosen k, SwiGLU experts, plus a sigmoid-gated shared expert.

use super::config::Config;
use super::ops::{dot, sigmoid, silu, softmax};
use super::weights::{ExpertGateUp, Moe};
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

/// The routed experts and the shared expert, in two parallel regions: gate
/// and up of all of them (one rounded `x` on the fast path), then all the
/// down projections.
pub fn forward(w: &Moe, cfg: &Config, x: &[f32]) -> Vec<f32> {
    let (h, f, fs) = (cfg.hidden, cfg.expert_ff, cfg.shared_ff);
    let routes = route(w, cfg, x);
    // Per routed expert `[gate | up]` (2f), then the shared expert's (2fs).
    let mut gu = vec![0f32; routes.len() * 2 * f + 2 * fs];
    {
        let (experts, shared) = gu.split_at_mut(routes.len() * 2 * f);
        let mut jobs = Vec::with_capacity(2 * routes.len() + 2);
        for (&(e, _), buf) in routes.iter().zip(experts.chunks_exact_mut(2 * f)) {
            match &w.gate_up {
                ExpertGateUp::Fused(t) => jobs.push(t.matvec_job(e * 2 * f, x, buf)),
                ExpertGateUp::Separate { gate, up } => {
                    let (g, u) = buf.split_at_mut(f);
                    jobs.push(gate.matvec_job(e * f, x, g));
                    jobs.push(up.matvec_job(e * f, x, u));
                }
            }
        }
        let (g, u) = shared.split_at_mut(fs);
        jobs.push(w.shared_gate_proj.matvec_job(0, x, g));
        jobs.push(w.shared_up.matvec_job(0, x, u));
        matvec_all(&mut jobs);
    }
    let (experts, shared) = gu.split_at_mut(routes.len() * 2 * f);
    for (buf, n) in experts.chunks_exact_mut(2 * f).map(|b| (b, f)).chain(std::iter::once((&mut *shared, fs))) {
        let (g, u) = buf.split_at_mut(n);
        for (gv, uv) in g.iter_mut().zip(u.iter()) {
            *gv = silu(*gv) * uv;
        }
    }
    // Per routed expert its output (h), then the shared expert's.
    let mut ys = vec![0f32; (routes.len() + 1) * h];
    {
        let (outs, shared_out) = ys.split_at_mut(routes.len() * h);
        let mut jobs = Vec::with_capacity(routes.len() + 1);
        for ((&(e, _), g), y) in routes.iter().zip(experts.chunks_exact(2 * f)).zip(outs.chunks_exact_mut(h)) {
            jobs.push(w.down.matvec_job(e * h, &g[..f], y));
        }
        jobs.push(w.shared_down.matvec_job(0, &shared[..fs], shared_out));
        matvec_all(&mut jobs);
    }
    let mut out = vec![0f32; h];
    for (&(_, weight), y) in routes.iter().zip(ys.chunks_exact(h)) {
        for (o, v) in out.iter_mut().zip(y) {
            *o += v * weight;
        }
    }
    let s = sigmoid(dot(&w.shared_gate, x));
    for (o, v) in out.iter_mut().zip(&ys[routes.len() * h..]) {
        *o += s * v;
    }
    out
}
