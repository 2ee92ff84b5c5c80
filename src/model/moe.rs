//! Mixture of experts (transformers `Qwen3NextSparseMoeBlock`): softmax
//! router, top-k (ties to the lower expert id), weights renormalised over the
//! chosen k, SwiGLU experts, plus a sigmoid-gated shared expert.

use super::config::Config;
use super::ops::{dot, sigmoid, silu, softmax};
use super::weights::{ExpertGateUp, Moe};
use crate::tensor::Tensor;
use rayon::prelude::*;

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

/// `down(silu(gate x) * up x)` for an FFN whose gate/up rows start at the given rows.
fn swiglu(gate: (&Tensor, usize), up: (&Tensor, usize), down: (&Tensor, usize), ff: usize, x: &[f32], out: &mut [f32]) {
    let mut g = vec![0f32; ff];
    gate.0.matvec_rows(gate.1, x, &mut g);
    let mut u = vec![0f32; ff];
    up.0.matvec_rows(up.1, x, &mut u);
    for (gv, uv) in g.iter_mut().zip(&u) {
        *gv = silu(*gv) * uv;
    }
    down.0.matvec_rows(down.1, &g, out);
}

pub fn forward(w: &Moe, cfg: &Config, x: &[f32]) -> Vec<f32> {
    let (h, f) = (cfg.hidden, cfg.expert_ff);
    let routes = route(w, cfg, x);
    let expert = |&(e, weight): &(usize, f32)| {
        let (gate, up) = match &w.gate_up {
            ExpertGateUp::Separate { gate, up } => ((gate, e * f), (up, e * f)),
            ExpertGateUp::Fused(t) => ((t, e * 2 * f), (t, e * 2 * f + f)),
        };
        let mut y = vec![0f32; h];
        swiglu(gate, up, (&w.down, e * h), f, x, &mut y);
        y.iter_mut().for_each(|v| *v *= weight);
        y
    };
    let outs: Vec<Vec<f32>> = if routes.len() * 3 * h * f >= 1 << 16 {
        routes.par_iter().map(expert).collect()
    } else {
        routes.iter().map(expert).collect()
    };
    let mut out = vec![0f32; h];
    for y in &outs {
        for (o, v) in out.iter_mut().zip(y) {
            *o += v;
        }
    }
    let mut shared = vec![0f32; h];
    swiglu(
        (&w.shared_gate_proj, 0),
        (&w.shared_up, 0),
        (&w.shared_down, 0),
        cfg.shared_ff,
        x,
        &mut shared,
    );
    let s = sigmoid(dot(&w.shared_gate, x));
    for (o, v) in out.iter_mut().zip(&shared) {
        *o += s * v;
    }
    out
}
