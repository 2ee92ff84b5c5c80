//! The host's share of an offloaded MoE layer, alone (`flashnext
//! bench-host-moe`): on a real model file, the routed experts the GPU's
//! cache misses are computed on the host, one layer at a time, exactly as a
//! Vulkan decode with an expert cache computes them (`cpu::moe::expert_outputs`
//! on the model's threads). Between layers the host is idle while the GPU
//! runs the layer's dense part; `gap` reproduces that idle time, so what the
//! pause costs (threads gone to sleep, caches gone cold) shows next to the
//! back-to-back figure.
//!
//! * Experts: `misses` distinct ids per layer, drawn uniformly from a fixed
//!   pseudo-random stream, so across layers and calls the working set is
//!   the whole file's experts (cold, as in decode) rather than a few
//!   experts the last-level cache keeps.
//! * Idle: `sleep` (what a host blocked on a fence does) or `spin` (the
//!   model's workers kept busy-waiting, as a polling thread pool would).
//! * GB/s counts the expert bytes one call reads; "ms/token" is the layer
//!   time times the number of MoE layers.

use crate::cpu::moe::{expert_outputs, Expert};
use crate::error::{Error, Result};
use crate::load::{Backend, LoadOptions};
use crate::gguf::{Storage, TensorInfo};
use crate::model::weights::{ExpertGateUp, Moe};
use crate::tensor::Tensor;
use crate::model::Model;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How the host spends the gap between two layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Idle {
    /// Blocked (`thread::sleep`): the model's workers go to sleep too.
    Sleep,
    /// The model's workers busy-wait until the next layer.
    Spin,
}

impl Idle {
    pub fn name(self) -> &'static str {
        match self {
            Idle::Sleep => "sleep",
            Idle::Spin => "spin",
        }
    }
}

/// Where the experts' bytes are read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// The memory-mapped model file (the page cache).
    File,
    /// A copy in anonymous memory the kernel is asked to back with huge pages.
    Anon,
}

impl Store {
    pub fn name(self) -> &'static str {
        match self {
            Store::File => "file",
            Store::Anon => "anon",
        }
    }

    pub fn parse(s: &str) -> Option<Store> {
        match s {
            "file" => Some(Store::File),
            "anon" => Some(Store::Anon),
            _ => None,
        }
    }
}

/// One measured configuration.
#[derive(Clone, Debug)]
pub struct HostMoeRow {
    pub store: Store,
    pub misses: usize,
    pub gap_us: u64,
    pub idle: Idle,
    /// Median seconds of one layer's expert work (the gap excluded).
    pub layer_s: f64,
    /// Expert bytes one layer's call reads.
    pub bytes: usize,
    pub layers: usize,
}

impl HostMoeRow {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.layer_s / 1e9
    }
}

/// What [`run`] measured.
pub struct HostMoeReport {
    pub threads: usize,
    pub expert_bytes: usize,
    pub rows: Vec<HostMoeRow>,
}

/// What to measure.
pub struct HostMoeOptions<'a> {
    pub model: &'a Path,
    pub misses: Vec<usize>,
    pub gaps_us: Vec<u64>,
    pub idle: Vec<Idle>,
    pub stores: Vec<Store>,
    /// The first this many layers are used (a working set far above any cache).
    pub layers: usize,
    /// Layer calls timed per configuration.
    pub calls: usize,
    /// Worker threads (0 = all cores).
    pub threads: usize,
}

/// Anonymous memory, advised to be backed by huge pages.
struct AnonStore(memmap2::MmapMut);

impl AsRef<[u8]> for AnonStore {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// A copy of `moe`'s routed experts in anonymous memory (the rest shared).
fn copy_experts(moe: &Moe) -> Result<Moe> {
    let mut parts: Vec<&Tensor> = vec![&moe.down];
    match &moe.gate_up {
        ExpertGateUp::Fused(t) => parts.push(t),
        ExpertGateUp::Separate { gate, up } => parts.extend([gate, up]),
    }
    const ALIGN: usize = 2 << 20;
    let sizes: Vec<usize> = parts.iter().map(|t| t.bytes().len().next_multiple_of(ALIGN)).collect();
    let mut map = memmap2::MmapMut::map_anon(sizes.iter().sum()).map_err(|e| Error::io("anonymous memory for the experts".to_string(), e))?;
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    let mut infos = Vec::new();
    let mut at = 0;
    for (t, size) in parts.iter().zip(&sizes) {
        map[at..at + t.bytes().len()].copy_from_slice(t.bytes());
        infos.push(TensorInfo { name: t.name.clone(), ty: t.ty, dims: t.dims.clone(), offset: at, nbytes: t.bytes().len() });
        at += size;
    }
    let store: Storage = std::sync::Arc::new(AnonStore(map));
    let mut copies = infos.iter().map(|info| Tensor::new(store.clone(), info));
    let down = copies.next().expect("the down projection");
    let gate_up = match &moe.gate_up {
        ExpertGateUp::Fused(_) => ExpertGateUp::Fused(copies.next().expect("gate_up")),
        ExpertGateUp::Separate { .. } => ExpertGateUp::Separate { gate: copies.next().expect("gate"), up: copies.next().expect("up") },
    };
    Ok(Moe {
        router: moe.router.clone(),
        gate_up,
        down,
        shared_gate: moe.shared_gate.clone(),
        shared_gate_proj: moe.shared_gate_proj.clone(),
        shared_up: moe.shared_up.clone(),
        shared_down: moe.shared_down.clone(),
    })
}

/// Bytes of routed expert `e` of a layer's MoE: its gate, up and down rows.
fn expert_bytes(model: &Model) -> usize {
    let cfg = &model.config;
    let moe = &model.weights.layers[0].moe;
    let row = |t: &crate::tensor::Tensor| t.bytes().len() / t.rows();
    let gate_up = match &moe.gate_up {
        ExpertGateUp::Fused(t) => 2 * cfg.expert_ff * row(t),
        ExpertGateUp::Separate { gate, up } => cfg.expert_ff * (row(gate) + row(up)),
    };
    gate_up + cfg.hidden * row(&moe.down)
}

/// Runs every (misses, gap, idle) configuration on the model's MoE layers.
pub fn run(opts: &HostMoeOptions<'_>) -> Result<HostMoeReport> {
    let load = LoadOptions { backend: Backend::Cpu, n_threads: opts.threads, ..LoadOptions::default() };
    let model = Model::load(opts.model, &load)?;
    let cfg = &model.config;
    if let Some(&m) = opts.misses.iter().find(|&&m| m == 0 || m > cfg.n_experts) {
        return Err(Error::arg(format!("--misses {m}: expected 1..={} experts", cfg.n_experts)));
    }
    let per_expert = expert_bytes(&model);
    let x: Vec<f32> = (0..cfg.hidden).map(|i| ((i * 7919) % 1000) as f32 * 2e-4 - 0.1).collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let threads = model.install(rayon::current_num_threads);
    let layers = opts.layers.clamp(1, cfg.n_layers);
    let mut rows = Vec::new();
    for &store in &opts.stores {
        let copies: Vec<Moe> = match store {
            Store::File => Vec::new(),
            Store::Anon => (0..layers).map(|l| copy_experts(&model.weights.layers[l].moe)).collect::<Result<_>>()?,
        };
        let moe_of = |l: usize| match store {
            Store::File => &model.weights.layers[l].moe,
            Store::Anon => &copies[l],
        };
        for (misses, gap_us, idle) in configurations(opts) {
            let mut times = Vec::with_capacity(opts.calls);
            // A few untimed calls first: the file's pages and the pool's threads.
            for call in 0..opts.calls + layers {
                let layer = call % layers;
                let mut experts: Vec<Expert> = Vec::with_capacity(misses);
                while experts.len() < misses {
                    let e = Expert::Routed((next() % cfg.n_experts as u64) as usize);
                    if !experts.contains(&e) {
                        experts.push(e);
                    }
                }
                idle_for(&model, Duration::from_micros(gap_us), idle);
                let moe = moe_of(layer);
                let t = Instant::now();
                std::hint::black_box(model.install(|| expert_outputs(moe, cfg, &x, &experts)));
                if call >= layers {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            times.sort_by(f64::total_cmp);
            rows.push(HostMoeRow {
                store,
                misses,
                gap_us,
                idle,
                layer_s: times[times.len() / 2],
                bytes: misses * per_expert,
                layers: cfg.n_layers,
            });
        }
    }
    Ok(HostMoeReport { threads, expert_bytes: per_expert, rows })
}

/// Every (misses, gap, idle) to measure; a gap of 0 has no idle mode.
fn configurations(opts: &HostMoeOptions<'_>) -> Vec<(usize, u64, Idle)> {
    let mut out = Vec::new();
    for &misses in &opts.misses {
        for &gap_us in &opts.gaps_us {
            for &idle in &opts.idle {
                if gap_us > 0 || idle == opts.idle[0] {
                    out.push((misses, gap_us, idle));
                }
            }
        }
    }
    out
}

/// Lets `gap` pass the way `idle` says.
fn idle_for(model: &Model, gap: Duration, idle: Idle) {
    if gap.is_zero() {
        return;
    }
    match idle {
        Idle::Sleep => std::thread::sleep(gap),
        Idle::Spin => {
            let done = AtomicBool::new(false);
            let start = Instant::now();
            model.install(|| {
                rayon::broadcast(|ctx| {
                    if ctx.index() == 0 {
                        while start.elapsed() < gap {
                            std::hint::spin_loop();
                        }
                        done.store(true, Ordering::Release);
                    } else {
                        while !done.load(Ordering::Acquire) {
                            std::hint::spin_loop();
                        }
                    }
                })
            });
        }
    }
}

impl fmt::Display for HostMoeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "host MoE: {} threads, {:.2} MB per expert", self.threads, self.expert_bytes as f64 / 1e6)?;
        writeln!(f, "{:>5} {:>6} {:>7} {:>6} {:>9} {:>7} {:>9}", "store", "misses", "gap us", "idle", "ms/layer", "GB/s", "ms/token")?;
        for r in &self.rows {
            writeln!(
                f,
                "{:>5} {:>6} {:>7} {:>6} {:>9.3} {:>7.1} {:>9.1}",
                r.store.name(),
                r.misses,
                r.gap_us,
                if r.gap_us == 0 { "-" } else { r.idle.name() },
                r.layer_s * 1e3,
                r.gbps(),
                r.layer_s * 1e3 * r.layers as f64
            )?;
        }
        Ok(())
    }
}
