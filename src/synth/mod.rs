//! Synthetic `qwen4exp` models with the published shapes.
//!
//! The real model is 250 GB; what a speed measurement needs is its shapes,
//! not its weights. [`synthesize`] writes a GGUF file that flashnext and
//! llama.cpp load like a converted checkpoint: the published configuration
//! (`flash-next-text-config.json`, embedded) cut to the first N layers (the
//! 3 linear : 1 attention pattern is the prefix of the real one), every tensor
//! the loaders expect, each stored as `flashnext convert --type T
//! [--tensor-type REGEX=TYPE]` would store it (the llama-quantize presets of
//! [`crate::quant::policy`]), a tokenizer of the real vocabulary size, and
//! deterministic pseudo-random weights whose scales keep activations O(1)
//! over all layers (see [`shapes`]). The PLE table may be shortened (`ple_rows`): its hash keeps
//! transformers' rules and constants, with the per-head vocabularies taken
//! just below `ple_rows / 16` instead of 20 000 000.
//!
//! With [`RouteOptions`] (`--route-preset real`, `--route-skew`,
//! `--route-locality`, `--route-memory`) the weights are drawn so that the
//! model's own routing is skewed and local across tokens like the real
//! model's, for expert-cache benchmarks ([`routing`] has the mechanism);
//! without them every byte is as before (uniform routing, the worst case).
//!
//! Writing goes through the streaming [`GgufWriter`]; large tensors are filled
//! from pre-quantized block pools at memory speed (see [`fill`]), so a 50 GB
//! file takes about as long as the disk needs to take it.

pub(crate) mod fill;
pub mod routing;
pub mod shapes;
mod vocab;

pub use routing::RouteOptions;
pub use shapes::Dims;

use crate::convert::{policy_types, storage_type, HfConfig, OutType};
use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufWriter, Value};
use crate::quant::policy::TensorTypeOverride;
use shapes::{Init, PleHash, TensorPlan};
use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Default height of the PLE table: 2^21 rows (the real one has 320 001 536).
pub const DEFAULT_PLE_ROWS: u64 = 1 << 21;

/// What to synthesise.
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// First N decoder layers; `None` = all 48.
    pub layers: Option<usize>,
    /// Storage type or llama-quantize preset, as for `flashnext convert --type`.
    pub out_type: OutType,
    /// `--tensor-type REGEX=TYPE` overrides, first match wins.
    pub tensor_types: Vec<TensorTypeOverride>,
    /// Approximate rows of the PLE table; 0 = the published 320 001 536.
    pub ple_rows: u64,
    pub seed: u64,
    pub dims: Dims,
    /// Skew and locality of the routing the weights are drawn to produce
    /// (see [`routing`]); the default draws every weight as before: uniform routing.
    pub routing: RouteOptions,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            layers: None,
            out_type: OutType::Q8_0,
            tensor_types: Vec::new(),
            ple_rows: DEFAULT_PLE_ROWS,
            seed: 0,
            dims: Dims::Real,
            routing: RouteOptions::default(),
        }
    }
}

/// Progress of [`synthesize`]: bytes of tensor data written so far of the total.
#[derive(Clone, Copy, Debug)]
pub struct SynthProgress {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub seconds: f64,
}

/// What [`synthesize`] wrote.
#[derive(Clone, Debug)]
pub struct SynthReport {
    /// Bytes of the file.
    pub file_bytes: u64,
    pub n_tensors: usize,
    pub seconds: f64,
    /// Bytes of tensor data per storage type, largest first.
    pub bytes_by_type: Vec<(GgmlType, u64)>,
    /// Rows of the PLE table (0 without PLE).
    pub ple_rows: u64,
}

/// The model's metadata: `general.*`, the `qwen4exp.*` keys the converter
/// would write for the config, the PLE hash arrays and the tokenizer.
fn metadata(cfg: &HfConfig, opts: &SynthOptions, ple: Option<&PleHash>) -> Vec<(String, Value)> {
    let layers = cfg.num_layers;
    let mut kv = vec![
        (
            "general.architecture".to_string(),
            Value::String("qwen4exp".into()),
        ),
        ("general.type".to_string(), Value::String("model".into())),
        (
            "general.name".to_string(),
            Value::String(format!(
                "flashnext synthetic {layers}-layer {}",
                opts.out_type
            )),
        ),
        (
            "general.file_type".to_string(),
            Value::U32(opts.out_type.file_type()),
        ),
        ("general.quantization_version".to_string(), Value::U32(2)),
    ];
    kv.extend(cfg.metadata());
    if let Some(p) = ple {
        let arr = |v: &[u64]| Value::Array(10, v.iter().map(|&x| Value::U64(x)).collect());
        kv.push(("qwen4exp.ple.layer_multipliers".into(), arr(&p.multipliers)));
        kv.push(("qwen4exp.ple.head_offsets".into(), arr(&p.head_offsets)));
        kv.push(("qwen4exp.ple.head_vocab_sizes".into(), arr(&p.head_vocab)));
    }
    if !opts.routing.is_uniform() {
        let r = &opts.routing;
        kv.push(("flashnext.synth.route_skew".into(), Value::F32(r.skew)));
        kv.push(("flashnext.synth.route_locality".into(), Value::F32(r.locality)));
        kv.push(("flashnext.synth.route_memory".into(), Value::F32(r.memory)));
    }
    let first_special = cfg.vocab_size.saturating_sub(shapes::SPECIAL_FROM_END);
    kv.extend(vocab::tokenizer_keys(
        cfg.vocab_size,
        first_special,
        opts.seed,
    ));
    kv
}

/// Every tensor of the model `opts` describes with its storage type, and the
/// bytes of tensor data per type (largest first).
pub struct SynthPlan {
    pub config: HfConfig,
    ple: Option<PleHash>,
    tensors: Vec<(TensorPlan, GgmlType)>,
    pub bytes_by_type: Vec<(GgmlType, u64)>,
    /// Bytes of all tensor data.
    pub data_bytes: u64,
}

impl SynthPlan {
    pub fn new(opts: &SynthOptions) -> Result<Self> {
        let json = shapes::config_json(opts.dims, opts.layers)?;
        let config = HfConfig::from_json(&json)?;
        let ple = PleHash::for_config(&config, &json, opts.ple_rows);
        let mut plans = shapes::inventory(&config, ple.as_ref().map(|p| p.rows));
        routing::apply(&mut plans, &config, &opts.routing)?;
        let base: Vec<(&str, &[usize], GgmlType)> = plans
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.dims.as_slice(),
                    storage_type(&t.name, &t.dims, opts.out_type),
                )
            })
            .collect();
        let types = policy_types(&config, opts.out_type, &opts.tensor_types, &base);
        let tensors: Vec<(TensorPlan, GgmlType)> = plans.into_iter().zip(types).collect();
        let mut bytes_by_type: Vec<(GgmlType, u64)> = Vec::new();
        let mut data_bytes = 0u64;
        for (t, ty) in &tensors {
            let n = tensor_bytes(*ty, &t.dims)?;
            data_bytes += n;
            match bytes_by_type.iter_mut().find(|(x, _)| x == ty) {
                Some((_, b)) => *b += n,
                None => bytes_by_type.push((*ty, n)),
            }
        }
        bytes_by_type.sort_by_key(|b| std::cmp::Reverse(b.1));
        Ok(SynthPlan {
            config,
            ple,
            tensors,
            bytes_by_type,
            data_bytes,
        })
    }

    /// Bytes of tensor data of the tensors whose name satisfies `pred`.
    pub fn bytes_where(&self, pred: impl Fn(&str) -> bool) -> u64 {
        self.tensors
            .iter()
            .filter(|(t, _)| pred(&t.name))
            .map(|(t, ty)| tensor_bytes(*ty, &t.dims).unwrap_or(0))
            .sum()
    }

    /// The storage type of tensor `name`, if the model has it.
    pub fn tensor_type(&self, name: &str) -> Option<GgmlType> {
        self.tensors
            .iter()
            .find(|(t, _)| t.name == name)
            .map(|(_, ty)| *ty)
    }
}

/// Writes the synthetic model described by `opts` to `out` (through
/// `<out>.partial`, renamed when complete), reporting progress about every
/// 64 MiB.
pub fn synthesize(
    out: &Path,
    opts: &SynthOptions,
    progress: &(dyn Fn(&SynthProgress) + Sync),
) -> Result<SynthReport> {
    let start = Instant::now();
    let plan = SynthPlan::new(opts)?;
    let total = plan.data_bytes;
    let done = AtomicU64::new(0);
    let report = |n: u64| {
        let bytes_done = done.fetch_add(n, Ordering::Relaxed) + n;
        progress(&SynthProgress {
            bytes_done,
            bytes_total: total,
            seconds: start.elapsed().as_secs_f64(),
        });
    };
    let pools = RefCell::new(fill::Pools::default());
    let mut w = GgufWriter::new();
    for (k, v) in metadata(&plan.config, opts, plan.ple.as_ref()) {
        w.add(&k, v);
    }
    for (t, ty) in &plan.tensors {
        let (t, ty, pools, report, seed, cfg) = (
            t,
            *ty,
            &pools,
            &report,
            fill::tensor_seed(opts.seed, &t.name),
            &plan.config,
        );
        w.add_tensor(
            &t.name,
            ty,
            &t.dims,
            Box::new(move |out| {
                let n: usize = t.dims.iter().product();
                match t.init {
                    Init::Gauss(std) => {
                        let (pool, ub) = pools.borrow_mut().scaled(ty, t.dims[0], std)?;
                        let n_units = tensor_bytes(ty, &t.dims)? as usize / ub;
                        fill::write_pooled(out, &pool, ub, n_units, seed, report)
                    }
                    Init::Route(routing::RouteTensor::Embedding) => {
                        let shift = routing::embedding_shift(opts.seed);
                        let (pool, ub) = pools.borrow_mut().shifted(ty, t.dims[0], &shift)?;
                        let n_units = tensor_bytes(ty, &t.dims)? as usize / ub;
                        fill::write_pooled(out, &pool, ub, n_units, seed, report)
                    }
                    Init::Route(rt) => {
                        let values = routing::values(rt, &t.dims, cfg, &opts.routing, opts.seed, seed);
                        fill::write_values(out, ty, t.dims[0], &values)?;
                        report(tensor_bytes(ty, &t.dims)?);
                        Ok(())
                    }
                    init => {
                        fill::write_values(out, ty, t.dims[0], &fill::small_values(init, n, seed))?;
                        report(tensor_bytes(ty, &t.dims)?);
                        Ok(())
                    }
                }
            }),
        )?;
    }
    let n_tensors = w.tensor_count();

    w.write_to_path(out)?;
    let file_bytes = std::fs::metadata(out)
        .map_err(|e| Error::io(format!("reading {}", out.display()), e))?
        .len();
    Ok(SynthReport {
        file_bytes,
        n_tensors,
        seconds: start.elapsed().as_secs_f64(),
        ple_rows: plan.ple.as_ref().map_or(0, |p| p.rows),
        bytes_by_type: plan.bytes_by_type,
    })
}

fn tensor_bytes(ty: GgmlType, dims: &[usize]) -> Result<u64> {
    let row = ty.row_bytes(dims[0]).ok_or_else(|| {
        Error::arg(format!(
            "a row of {} is not a whole number of {ty} blocks",
            dims[0]
        ))
    })?;
    Ok((row * dims[1..].iter().product::<usize>()) as u64)
}
