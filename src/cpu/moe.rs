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
use crate::tensor::{matmul_all, matvec_all};

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

/// The expert outputs of a batch (`xs`: [T][H], `routes` per token), grouped
/// by expert: the tokens routed to an expert are gathered and the expert runs
/// once over them (its weights read once for the batch), the shared expert
/// once over all the tokens; gate and up of every expert share one parallel
/// region, the down projections another. Returns per token what
/// [`expert_outputs`] returns for its routed experts in route order and the
/// shared one, the same numbers: [T][k+1][H].
pub fn expert_outputs_grouped(w: &Moe, cfg: &Config, xs: &[f32], routes: &[Vec<(usize, f32)>]) -> Vec<Vec<f32>> {
    let (h, f, fs) = (cfg.hidden, cfg.expert_ff, cfg.shared_ff);
    let t = xs.len() / h;
    // Per expert the (token, slot) pairs routed to it, in token order.
    let mut members: Vec<Vec<(usize, usize)>> = vec![Vec::new(); cfg.n_experts];
    for (tok, r) in routes.iter().enumerate() {
        for (slot, &(e, _)) in r.iter().enumerate() {
            members[e].push((tok, slot));
        }
    }
    let used: Vec<usize> = (0..cfg.n_experts).filter(|&e| !members[e].is_empty()).collect();
    let inputs: Vec<Vec<f32>> = used.iter().map(|&e| members[e].iter().flat_map(|&(tok, _)| &xs[tok * h..(tok + 1) * h]).copied().collect()).collect();
    // Per used expert `gate` and `up`: [m][f] each; the shared expert's: [T][fs].
    let mut gates: Vec<Vec<f32>> = used.iter().map(|&e| vec![0f32; members[e].len() * f]).collect();
    let mut ups: Vec<Vec<f32>> = gates.clone();
    let mut fused: Vec<Vec<f32>> = Vec::new();
    let (mut shared_g, mut shared_u) = (vec![0f32; t * fs], vec![0f32; t * fs]);
    {
        let mut jobs = Vec::with_capacity(2 * used.len() + 2);
        match &w.gate_up {
            ExpertGateUp::Fused(gu) => {
                fused = used.iter().map(|&e| vec![0f32; members[e].len() * 2 * f]).collect();
                for ((&e, x), y) in used.iter().zip(&inputs).zip(fused.iter_mut()) {
                    jobs.push(gu.matmul_job(e * 2 * f, x, y));
                }
            }
            ExpertGateUp::Separate { gate, up } => {
                for (((&e, x), g), u) in used.iter().zip(&inputs).zip(gates.iter_mut()).zip(ups.iter_mut()) {
                    jobs.push(gate.matmul_job(e * f, x, g));
                    jobs.push(up.matmul_job(e * f, x, u));
                }
            }
        }
        jobs.push(w.shared_gate_proj.matmul_job(0, xs, &mut shared_g));
        jobs.push(w.shared_up.matmul_job(0, xs, &mut shared_u));
        matmul_all(&mut jobs);
    }
    for (i, gu) in fused.iter().enumerate() {
        for (tok, both) in gu.chunks_exact(2 * f).enumerate() {
            gates[i][tok * f..(tok + 1) * f].copy_from_slice(&both[..f]);
            ups[i][tok * f..(tok + 1) * f].copy_from_slice(&both[f..]);
        }
    }
    for (g, u) in gates.iter_mut().chain(std::iter::once(&mut shared_g)).zip(ups.iter().chain(std::iter::once(&shared_u))) {
        for (gv, uv) in g.iter_mut().zip(u) {
            *gv = silu(*gv) * uv;
        }
    }
    let mut downs: Vec<Vec<f32>> = used.iter().map(|&e| vec![0f32; members[e].len() * h]).collect();
    let mut shared_y = vec![0f32; t * h];
    {
        let mut jobs = Vec::with_capacity(used.len() + 1);
        for ((&e, hidden), y) in used.iter().zip(&gates).zip(downs.iter_mut()) {
            jobs.push(w.down.matmul_job(e * h, hidden, y));
        }
        jobs.push(w.shared_down.matmul_job(0, &shared_g, &mut shared_y));
        matmul_all(&mut jobs);
    }
    let mut out: Vec<Vec<f32>> = routes.iter().map(|r| vec![0f32; (r.len() + 1) * h]).collect();
    for (&e, y) in used.iter().zip(&downs) {
        for (&(tok, slot), yt) in members[e].iter().zip(y.chunks_exact(h)) {
            out[tok][slot * h..(slot + 1) * h].copy_from_slice(yt);
        }
    }
    for ((o, r), y) in out.iter_mut().zip(routes).zip(shared_y.chunks_exact(h)) {
        o[r.len() * h..].copy_from_slice(y);
    }
    out
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
