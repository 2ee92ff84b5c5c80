//! Model hyper-parameters read from the GGUF metadata (`qwen4exp.*` keys,
//! see the shared GGUF schema) and checked for consistency before any
//! tensor is touched.

use crate::error::{Error, Result};
use crate::gguf::{Metadata, Value};

/// Activation of the Gated DeltaNet output gate (`output_gate_type` in HF).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateActivation {
    Sigmoid,
    Silu,
}

/// QSA (sparse attention) settings shared by the full-attention layers.
#[derive(Clone, Debug)]
pub struct QsaConfig {
    /// Indexer query heads (`ih`).
    pub n_heads: usize,
    /// Indexer head dimension (`id`).
    pub head_dim: usize,
    /// Token budget `B` of complete blocks.
    pub budget: usize,
}

/// Per-layer n-gram embedding (PLE) settings; exactly one layer carries it.
#[derive(Clone, Debug)]
pub struct PleConfig {
    pub layer: usize,
    /// n-gram size `G` (also the conv dilation).
    pub ngram: usize,
    pub heads_per_ngram: usize,
    pub conv_kernel: usize,
    pub eos: u32,
    /// Width of one table row `dp`; `(G-1)*heads_per_ngram*dp == hidden`.
    pub row_dim: usize,
    pub multipliers: Vec<u64>,
    pub head_offsets: Vec<u64>,
    pub head_vocab: Vec<u64>,
}

impl PleConfig {
    pub fn n_heads(&self) -> usize {
        (self.ngram - 1) * self.heads_per_ngram
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet.
    Linear,
    /// Gated attention; `compress_ratio` 0 means dense, otherwise QSA with blocks of that many tokens.
    Attention { compress_ratio: usize },
}

#[derive(Clone, Debug)]
pub struct Config {
    pub n_layers: usize,
    pub context_length: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub eps: f32,
    /// Hyper-connection streams `C` and low rank `R`.
    pub hc: usize,
    pub hc_rank: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub rope_theta: f32,
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub expert_ff: usize,
    pub shared_ff: usize,
    /// GDN: conv kernel, key heads, value heads, head dim (key == value).
    pub ssm_conv: usize,
    pub ssm_k_heads: usize,
    pub ssm_v_heads: usize,
    pub ssm_head_dim: usize,
    pub ssm_gate: GateActivation,
    pub layers: Vec<LayerKind>,
    pub qsa: Option<QsaConfig>,
    pub ple: Option<PleConfig>,
}

const ARCH: &str = "qwen4exp";

struct Keys<'a>(&'a Metadata);

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(&format!("{ARCH}.{key}"))
    }
    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| Error::model(format!("{ARCH}.{key} must be an unsigned integer, found {v:?}"))),
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?.ok_or_else(|| Error::model(format!("missing key {ARCH}.{key}")))
    }
    /// A required positive count no larger than `max`.
    fn count(&self, key: &str, max: usize) -> Result<usize> {
        let v = self.usize(key)?;
        if v == 0 || v > max {
            return Err(Error::model(format!("{ARCH}.{key} = {v} is outside 1..={max}")));
        }
        Ok(v)
    }
    fn f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| Error::model(format!("{ARCH}.{key} must be a float, found {v:?}"))),
        }
    }
    fn u64_array(&self, key: &str) -> Result<Vec<u64>> {
        let v = self.get(key).ok_or_else(|| Error::model(format!("missing key {ARCH}.{key}")))?;
        let items = v.as_array().ok_or_else(|| Error::model(format!("{ARCH}.{key} must be an array")))?;
        items
            .iter()
            .map(|x| x.as_u64().ok_or_else(|| Error::model(format!("{ARCH}.{key} holds a non-integer {x:?}"))))
            .collect()
    }
}

/// Limits far above the real model, to refuse absurd files before allocating.
const MAX_DIM: usize = 1 << 20;
const MAX_LAYERS: usize = 512;

impl Config {
    pub fn from_metadata(md: &Metadata) -> Result<Self> {
        match md.get("general.architecture") {
            Some(Value::String(a)) if a == ARCH => {}
            Some(Value::String(other)) => {
                return Err(Error::model(format!("architecture is {other:?}; flashnext runs only {ARCH:?}")))
            }
            Some(v) => return Err(Error::model(format!("general.architecture must be a string, found {v:?}"))),
            None => return Err(Error::model("missing key general.architecture")),
        }
        let k = Keys(md);
        let n_layers = k.count("block_count", MAX_LAYERS)?;
        let hidden = k.count("embedding_length", MAX_DIM)?;
        let n_heads = k.count("attention.head_count", 4096)?;
        let n_kv_heads = k.usize_opt("attention.head_count_kv")?.unwrap_or(n_heads);
        let head_dim = k.usize_opt("attention.key_length")?.unwrap_or(hidden / n_heads);
        if let Some(vl) = k.usize_opt("attention.value_length")? {
            if vl != head_dim {
                return Err(Error::model(format!("attention value_length {vl} != key_length {head_dim}")));
            }
        }
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 || head_dim == 0 || head_dim > MAX_DIM {
            return Err(Error::model(format!(
                "attention heads {n_heads} / kv heads {n_kv_heads} / head dim {head_dim} are inconsistent"
            )));
        }
        let rope_dims = k.usize_opt("rope.dimension_count")?.unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(Error::model(format!("rope.dimension_count {rope_dims} must be even and <= {head_dim}")));
        }
        let eps = k
            .f32("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| Error::model(format!("missing key {ARCH}.attention.layer_norm_rms_epsilon")))?;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::model(format!("{ARCH}.attention.layer_norm_rms_epsilon = {eps} is not a finite value >= 0")));
        }
        let hc = k.count("hyper_connection.count", 64)?;
        if hc < 2 {
            return Err(Error::model("hyper_connection.count must be > 1"));
        }
        let ssm_k_heads = k.count("ssm.group_count", 4096)?;
        let ssm_v_heads = k.count("ssm.time_step_rank", 4096)?;
        let ssm_head_dim = k.count("ssm.state_size", 4096)?;
        let inner = k.usize("ssm.inner_size")?;
        if ssm_v_heads % ssm_k_heads != 0 || inner != ssm_v_heads * ssm_head_dim {
            return Err(Error::model(format!(
                "GDN heads inconsistent: {ssm_k_heads} key heads, {ssm_v_heads} value heads, \
                 state {ssm_head_dim}, inner {inner}"
            )));
        }
        let ssm_gate = match md.get("flashnext.ssm.output_gate").map(|v| v.as_str()) {
            None | Some(Some("sigmoid")) => GateActivation::Sigmoid,
            Some(Some("silu")) => GateActivation::Silu,
            Some(other) => {
                return Err(Error::model(format!("flashnext.ssm.output_gate {other:?} is not sigmoid or silu")))
            }
        };

        let recurrent: Vec<bool> = match k.get("attention.recurrent_layers") {
            Some(v) => {
                let items = v.as_array().ok_or_else(|| Error::model("attention.recurrent_layers must be an array"))?;
                if items.len() != n_layers {
                    return Err(Error::model(format!(
                        "attention.recurrent_layers has {} entries for {n_layers} layers",
                        items.len()
                    )));
                }
                items
                    .iter()
                    .map(|x| {
                        x.as_u64().map(|v| v != 0).ok_or_else(|| {
                            Error::model(format!("attention.recurrent_layers holds {x:?}, not a boolean"))
                        })
                    })
                    .collect::<Result<_>>()?
            }
            None => {
                let interval = k.usize_opt("full_attention_interval")?.unwrap_or(4);
                if interval == 0 {
                    return Err(Error::model("full_attention_interval must be > 0"));
                }
                (0..n_layers).map(|i| (i + 1) % interval != 0).collect()
            }
        };
        let ratios: Vec<usize> = match k.get("attention.compress_ratios") {
            None => vec![0; n_layers],
            Some(Value::Array(_, items)) => {
                if items.len() != n_layers {
                    return Err(Error::model(format!(
                        "attention.compress_ratios has {} entries for {n_layers} layers",
                        items.len()
                    )));
                }
                items
                    .iter()
                    .map(|x| {
                        x.as_u64().map(|v| v as usize).ok_or_else(|| {
                            Error::model(format!("attention.compress_ratios holds {x:?}, not a non-negative integer"))
                        })
                    })
                    .collect::<Result<_>>()?
            }
            Some(v) => match v.as_u64() {
                Some(r) => vec![r as usize; n_layers],
                None => {
                    return Err(Error::model(format!(
                        "attention.compress_ratios must be a non-negative integer or an array, found {v:?}"
                    )))
                }
            },
        };
        let layers: Vec<LayerKind> = recurrent
            .iter()
            .zip(&ratios)
            .map(|(&rec, &r)| if rec { LayerKind::Linear } else { LayerKind::Attention { compress_ratio: r } })
            .collect();
        let any_qsa = layers.iter().any(|l| matches!(l, LayerKind::Attention { compress_ratio } if *compress_ratio > 0));
        let qsa = if any_qsa {
            let q = QsaConfig {
                n_heads: k.count("attention.indexer.head_count", 4096)?,
                head_dim: k.count("attention.indexer.key_length", MAX_DIM)?,
                budget: k.count("attention.indexer.top_k", 1 << 30)?,
            };
            if q.head_dim < rope_dims {
                return Err(Error::model(format!(
                    "indexer key_length {} is smaller than the rope dimension {rope_dims}",
                    q.head_dim
                )));
            }
            for l in &layers {
                if let LayerKind::Attention { compress_ratio: r } = l {
                    if *r > 0 && !q.budget.is_multiple_of(*r) {
                        return Err(Error::model(format!("indexer budget {} is not a multiple of ratio {r}", q.budget)));
                    }
                }
            }
            Some(q)
        } else {
            None
        };

        let ple = match k.get("ple.layers") {
            None => None,
            Some(v) => {
                let ids = v.as_array().ok_or_else(|| Error::model("ple.layers must be an array"))?;
                if ids.len() != 1 {
                    return Err(Error::model(format!("ple.layers lists {} layers; exactly one is supported", ids.len())));
                }
                let layer = ids[0].as_u64().map(|x| x as usize).filter(|&l| l < n_layers).ok_or_else(|| {
                    Error::model(format!("ple.layers entry {:?} is not a layer below {n_layers}", ids[0]))
                })?;
                if layers[layer] != LayerKind::Linear {
                    return Err(Error::model(format!("PLE layer {layer} is not a linear-attention layer")));
                }
                let ngram = k.count("ple.ngram_size", 8)?;
                if ngram < 2 {
                    return Err(Error::model("ple.ngram_size must be >= 2"));
                }
                let heads_per_ngram = k.count("ple.heads_per_ngram", 64)?;
                let row_dim = k.count("embedding_length_per_layer_input", MAX_DIM)?;
                let p = PleConfig {
                    layer,
                    ngram,
                    heads_per_ngram,
                    conv_kernel: k.count("ple.conv_kernel", 64)?,
                    eos: u32::try_from(k.usize("ple.eos_token_id")?)
                        .map_err(|_| Error::model("ple.eos_token_id does not fit 32 bits"))?,
                    row_dim,
                    multipliers: k.u64_array("ple.layer_multipliers")?,
                    head_offsets: k.u64_array("ple.head_offsets")?,
                    head_vocab: k.u64_array("ple.head_vocab_sizes")?,
                };
                let nh = p.n_heads();
                if nh * row_dim != hidden {
                    return Err(Error::model(format!(
                        "PLE heads {nh} x row width {row_dim} != hidden size {hidden}"
                    )));
                }
                if p.multipliers.len() < ngram || p.head_offsets.len() < nh || p.head_vocab.len() < nh {
                    return Err(Error::model("PLE hash arrays are shorter than the n-gram heads need"));
                }
                if p.head_vocab[..nh].contains(&0) {
                    return Err(Error::model("ple.head_vocab_sizes contains 0"));
                }
                Some(p)
            }
        };

        let n_experts = k.count("expert_count", 1 << 16)?;
        let n_experts_used = k.count("expert_used_count", n_experts)?;
        let cfg = Config {
            n_layers,
            context_length: k.count("context_length", 1 << 31)?,
            hidden,
            vocab: 0, // from token_embd
            eps,
            hc,
            hc_rank: k.count("hyper_connection.low_rank", MAX_DIM)?,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dims,
            rope_theta: match k.f32("rope.freq_base")?.unwrap_or(10000.0) {
                t if t.is_finite() && t > 0.0 => t,
                t => return Err(Error::model(format!("{ARCH}.rope.freq_base = {t} is not a positive finite value"))),
            },
            n_experts,
            n_experts_used,
            expert_ff: k.count("expert_feed_forward_length", MAX_DIM)?,
            shared_ff: k.count("expert_shared_feed_forward_length", MAX_DIM)?,
            ssm_conv: k.count("ssm.conv_kernel", 64)?,
            ssm_k_heads,
            ssm_v_heads,
            ssm_head_dim,
            ssm_gate,
            layers,
            qsa,
            ple,
        };
        Ok(cfg)
    }

    /// Channels of the GDN causal conv: q, k and v.
    pub fn ssm_conv_dim(&self) -> usize {
        (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_head_dim
    }
}

#[cfg(test)]
impl Config {
    /// The published shapes (flash-next-text-config.json) with one GDN layer
    /// and no PLE: the base the unit tests' configs change what they need of.
    pub(crate) fn published_one_layer() -> Config {
        Config {
            n_layers: 1,
            context_length: 1 << 18,
            hidden: 2560,
            vocab: 0,
            eps: 1e-6,
            hc: 4,
            hc_rank: 320,
            n_heads: 24,
            n_kv_heads: 2,
            head_dim: 256,
            rope_dims: 64,
            rope_theta: 1e7,
            n_experts: 512,
            n_experts_used: 10,
            expert_ff: 640,
            shared_ff: 640,
            ssm_conv: 4,
            ssm_k_heads: 16,
            ssm_v_heads: 48,
            ssm_head_dim: 128,
            ssm_gate: GateActivation::Sigmoid,
            layers: vec![LayerKind::Linear],
            qsa: Some(QsaConfig { n_heads: 4, head_dim: 128, budget: 2048 }),
            ple: None,
        }
    }
}
