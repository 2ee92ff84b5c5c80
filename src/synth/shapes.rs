//! What a synthetic model contains: the published configuration (cut to the
//! first N layers, or shrunk for tests), the PLE hash constants, and every
//! tensor with its shape and how its values are drawn.
//!
//! # Scales
//!
//! Values are chosen so one token's activations stay O(1) through all 48
//! layers and the router spreads tokens over every expert:
//!
//! * input projections (q/k/v/qkv/z/a/b, indexer, expert gate/up, shared
//!   gate/up, hyper-connection down/up/inject, PLE key) are N(0, 1/fan_in), so
//!   each output is about as large as the RMS-normalised input;
//! * output projections (`ssm_out`, `attn_output`, expert and shared down,
//!   PLE value) are N(0, 0.25/fan_in): each block adds a fraction of the
//!   residual's size, which therefore grows like a slow random walk;
//! * the router is N(0, 4/H), giving logits of about unit spread: the softmax
//!   is far from one-hot, and the top 10 change from token to token;
//! * embeddings and the PLE table are N(0, 1), the LM head N(0, 1/H);
//! * norm gammas are `1 + N(0, 0.02)` (the `1 + w` the schema stores);
//!   `ssm_a = -A` with `A ~ U(0.01, 16)` (transformers' `A_log` init);
//!   `dt_bias` is softplus⁻¹ of a log-uniform step in [1e-3, 0.1] (Mamba's
//!   init), so `exp(g)` decays the state over tens of tokens rather than one;
//!   conv kernels are U(-0.5, 0.5) (PyTorch's default for a kernel of 4).

use crate::convert::HfConfig;
use crate::error::{Error, Result};
use serde_json::{json, Value as Json};

/// The published text configuration of Qwen3.8-Flash-Next.
const REAL_CONFIG: &str = include_str!("flash-next-text-config.json");

/// Which dimensions the model has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Dims {
    /// The published shapes (hidden 2560, 512 experts, vocab 248 320, ...).
    #[default]
    Real,
    /// Every dimension shrunk but consistent (hidden 512, 64 experts, vocab
    /// 4096, an expert width of 128 that is not a multiple of 256 like the
    /// real 640): for tests that must load and decode in seconds.
    Small,
    /// The small dimensions with the real router: 512 experts, top 10
    /// (of width 64): routing studies on a model that decodes hundreds of
    /// tokens a second on a laptop.
    Narrow,
}

impl std::str::FromStr for Dims {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "real" => Ok(Dims::Real),
            "small" => Ok(Dims::Small),
            "narrow" => Ok(Dims::Narrow),
            _ => Err(Error::arg(format!(
                "unknown dims {s:?}: expected real, small or narrow"
            ))),
        }
    }
}

/// The overrides that turn the real configuration into the small one.
fn small_overrides() -> Json {
    json!({
        "hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
        "vocab_size": 4096, "eos_token_id": 4096 - SPECIAL_FROM_END,
        "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "hc_lowrank": 64, "indexer_n_heads": 2, "indexer_head_dim": 64, "indexer_budget": 64,
        "ple_embed_dim": 512, "max_position_embeddings": 4096
    })
}

/// What `narrow` changes on top of `small`: the real router's shape.
fn narrow_overrides() -> Json {
    json!({
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64
    })
}

/// Distance of the first special token (`<|endoftext|>`) from the end of the
/// vocabulary: 248 320 - 248 044 in the real model.
pub const SPECIAL_FROM_END: usize = 276;

/// The HF-style config of the model to synthesise: `dims`, cut to the first
/// `layers` layers (all when `None`). The PLE layer (layer 2, 1-based) is
/// dropped when fewer than 2 layers remain.
pub fn config_json(dims: Dims, layers: Option<usize>) -> Result<Json> {
    let mut cfg: Json =
        serde_json::from_str(REAL_CONFIG).expect("the embedded configuration is valid JSON");
    let obj = cfg
        .as_object_mut()
        .expect("the embedded configuration is an object");
    let overrides = match dims {
        Dims::Real => vec![],
        Dims::Small => vec![small_overrides()],
        Dims::Narrow => vec![small_overrides(), narrow_overrides()],
    };
    for o in overrides {
        for (k, v) in o.as_object().expect("object") {
            obj.insert(k.clone(), v.clone());
        }
    }
    let all = obj["num_hidden_layers"]
        .as_u64()
        .expect("num_hidden_layers") as usize;
    let n = layers.unwrap_or(all);
    if n == 0 || n > all {
        return Err(Error::arg(format!(
            "--layers {n}: the model has 1..={all} layers"
        )));
    }
    obj.insert("num_hidden_layers".into(), json!(n));
    let types: Vec<Json> = obj["layer_types"].as_array().expect("layer_types")[..n].to_vec();
    obj.insert("layer_types".into(), Json::Array(types));
    let ple_ids = obj["ple_layer_ids"]
        .as_array()
        .expect("ple_layer_ids")
        .clone();
    if ple_ids
        .iter()
        .any(|id| id.as_u64().is_some_and(|id| id as usize > n))
    {
        obj.remove("ple_layer_ids");
    }
    Ok(cfg)
}

/// The three PLE hash arrays and the table height, as transformers derives
/// them (`Qwen4ExpTextNGramEmbedding`): head `h`'s vocabulary is the
/// `(h+1)`-th prime after `base - 1`, offsets are prefix sums, the table is
/// padded to a multiple of `divisor` rows, and the multipliers come from
/// SplitMix64 of `seed` (forced odd, below `(2^63-1) / vocab`). A shortened
/// table keeps every rule and lowers only `base`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PleHash {
    pub multipliers: Vec<u64>,
    pub head_offsets: Vec<u64>,
    pub head_vocab: Vec<u64>,
    pub rows: u64,
}

fn is_prime(v: u64) -> bool {
    if v < 2 {
        return false;
    }
    if v.is_multiple_of(2) {
        return v == 2;
    }
    (3..)
        .step_by(2)
        .take_while(|d| d * d <= v)
        .all(|d| !v.is_multiple_of(d))
}

/// transformers' `_build_layer_multipliers` for PLE layer index 0.
fn layer_multipliers(vocab: u64, ngram: usize, seed: u64) -> Vec<u64> {
    let half_bound = ((i64::MAX as u64) / vocab.max(1) / 2).max(1);
    (0..ngram as u64)
        .map(|i| {
            let mut x = seed.wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i + 1));
            2 * (crate::sampling::splitmix64(&mut x) % half_bound) + 1
        })
        .collect()
}

impl PleHash {
    /// Constants for `heads` hashed heads over a vocabulary of `vocab` tokens,
    /// with per-head sizes starting at `base` (`ngram_vocab_size_base`).
    pub fn new(vocab: u64, ngram: usize, heads: usize, base: u64, divisor: u64, seed: u64) -> Self {
        let mut head_vocab = Vec::with_capacity(heads);
        let mut p = base.saturating_sub(1);
        for _ in 0..heads {
            p += 1;
            while !is_prime(p) {
                p += 1;
            }
            head_vocab.push(p);
        }
        let head_offsets: Vec<u64> = head_vocab
            .iter()
            .scan(0u64, |acc, &v| Some(std::mem::replace(acc, *acc + v)))
            .collect();
        let total: u64 = head_vocab.iter().sum();
        PleHash {
            multipliers: layer_multipliers(vocab, ngram, seed),
            head_offsets,
            head_vocab,
            rows: total.div_ceil(divisor) * divisor,
        }
    }

    /// The constants of `cfg`'s PLE layer with a table of about `rows` rows
    /// (0 = the published size, `ngram_vocab_size_base` rows per head).
    pub fn for_config(cfg: &HfConfig, json: &Json, rows: u64) -> Option<Self> {
        let ple = cfg.ple.as_ref()?;
        let get = |k: &str, d: u64| json.get(k).and_then(Json::as_u64).unwrap_or(d);
        let heads = ple.heads() as u64;
        let real_base = get("ngram_vocab_size_base", 20_000_000);
        // Primes after `base` are at most ~ln(base) apart: keep a margin so the padded table fits `rows`.
        let base = if rows == 0 {
            real_base
        } else {
            (rows / heads).saturating_sub(64 * heads).max(2)
        };
        Some(Self::new(
            cfg.vocab_size as u64,
            ple.ngram_size,
            ple.heads(),
            base,
            get("make_ngram_vocab_size_divisible_by", 128),
            get("seed", 1234),
        ))
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Gaussian with this standard deviation (large matrices, from a block pool).
    Gauss(f32),
    /// `1 + N(0, 0.02)`: RMSNorm gammas.
    Gamma,
    /// `-U(0.01, 16)`: `ssm_a`.
    Decay,
    /// softplus⁻¹ of a log-uniform step in [1e-3, 0.1]: `ssm_dt.bias`.
    DtBias,
    /// U(-0.5, 0.5): depthwise conv kernels.
    Conv,
    /// Drawn by [`super::routing`] for a model with routing options.
    Route(super::routing::RouteTensor),
}

/// One tensor of the synthetic file.
#[derive(Clone, Debug)]
pub struct TensorPlan {
    pub name: String,
    /// ggml order, `dims[0]` contiguous.
    pub dims: Vec<usize>,
    pub init: Init,
}

/// N(0, gain²/fan_in).
fn gauss(gain: f32, fan_in: usize) -> Init {
    Init::Gauss(gain / (fan_in as f32).sqrt())
}

struct Inventory {
    tensors: Vec<TensorPlan>,
}

impl Inventory {
    fn push(&mut self, name: String, dims: &[usize], init: Init) {
        self.tensors.push(TensorPlan {
            name,
            dims: dims.to_vec(),
            init,
        });
    }

    /// A linear layer `out x in` (ggml `{in, out}`), N(0, gain²/in).
    fn linear(&mut self, name: String, n_in: usize, n_out: usize, gain: f32) {
        self.push(name, &[n_in, n_out], gauss(gain, n_in));
    }

    fn hyper_connection(&mut self, p: &str, c: &HfConfig, inject: bool) {
        let (ch, r) = (c.hc_count * c.hidden_size, c.hc_lowrank);
        self.push(format!("{p}_norm.weight"), &[ch], Init::Gamma);
        self.linear(format!("{p}_down.weight"), ch, r, 1.0);
        self.linear(format!("{p}_up.weight"), r, ch, 1.0);
        if inject {
            self.linear(format!("{p}_inject.weight"), ch, c.hc_count, 1.0);
        }
    }

    fn gated_delta_net(&mut self, b: &str, c: &HfConfig) {
        let (h, nv, dv, dc) = (c.hidden_size, c.lin_v_heads, c.lin_v_dim, c.conv_dim());
        self.linear(format!("{b}.attn_qkv.weight"), h, dc, 1.0);
        self.linear(format!("{b}.attn_gate.weight"), h, nv * dv, 1.0);
        self.linear(format!("{b}.ssm_beta.weight"), h, nv, 1.0);
        self.linear(format!("{b}.ssm_alpha.weight"), h, nv, 1.0);
        self.push(
            format!("{b}.ssm_conv1d.weight"),
            &[c.lin_conv_kernel, dc],
            Init::Conv,
        );
        self.push(format!("{b}.ssm_dt.bias"), &[nv], Init::DtBias);
        self.push(format!("{b}.ssm_a"), &[nv], Init::Decay);
        self.push(format!("{b}.ssm_norm.weight"), &[dv], Init::Gamma);
        self.linear(format!("{b}.ssm_out.weight"), nv * dv, h, 0.5);
    }

    fn attention(&mut self, b: &str, c: &HfConfig) {
        let (h, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.n_head, c.n_head_kv);
        self.linear(format!("{b}.attn_q.weight"), h, 2 * nh * hd, 1.0);
        self.linear(format!("{b}.attn_k.weight"), h, nkv * hd, 1.0);
        self.linear(format!("{b}.attn_v.weight"), h, nkv * hd, 1.0);
        self.linear(format!("{b}.attn_output.weight"), nh * hd, h, 0.5);
        self.push(format!("{b}.attn_q_norm.weight"), &[hd], Init::Gamma);
        self.push(format!("{b}.attn_k_norm.weight"), &[hd], Init::Gamma);
        if c.idx_ratio > 0 {
            let id = c.idx_head_dim;
            self.linear(
                format!("{b}.indexer.q_proj.weight"),
                h,
                c.idx_heads * id,
                1.0,
            );
            self.linear(format!("{b}.indexer.k_proj.weight"), h, id, 1.0);
            self.push(format!("{b}.indexer.q_norm.weight"), &[id], Init::Gamma);
            self.push(format!("{b}.indexer.k_norm.weight"), &[id], Init::Gamma);
        }
    }

    fn ple(&mut self, b: &str, c: &HfConfig, kernel: usize) {
        let (h, ch) = (c.hidden_size, c.hc_count * c.hidden_size);
        self.linear(format!("{b}.ple_key.weight"), h, ch, 1.0);
        self.linear(format!("{b}.ple_value.weight"), h, h, 0.5);
        for k in ["key", "query", "conv"] {
            self.push(format!("{b}.ple_norm_{k}.weight"), &[ch], Init::Gamma);
        }
        self.push(format!("{b}.ple_conv1d.weight"), &[kernel, ch], Init::Conv);
    }

    fn moe(&mut self, b: &str, c: &HfConfig) {
        let (h, e, f, fs) = (c.hidden_size, c.n_expert, c.expert_ff, c.shared_ff);
        self.push(format!("{b}.ffn_gate_inp.weight"), &[h, e], gauss(2.0, h));
        self.push(
            format!("{b}.ffn_gate_exps.weight"),
            &[h, f, e],
            gauss(1.0, h),
        );
        self.push(format!("{b}.ffn_up_exps.weight"), &[h, f, e], gauss(1.0, h));
        self.push(
            format!("{b}.ffn_down_exps.weight"),
            &[f, h, e],
            gauss(0.5, f),
        );
        self.push(
            format!("{b}.ffn_gate_inp_shexp.weight"),
            &[h, 1],
            gauss(1.0, h),
        );
        self.linear(format!("{b}.ffn_gate_shexp.weight"), h, fs, 1.0);
        self.linear(format!("{b}.ffn_up_shexp.weight"), h, fs, 1.0);
        self.linear(format!("{b}.ffn_down_shexp.weight"), fs, h, 0.5);
    }
}

/// Every tensor of the model `c` (with a PLE table of `ple_rows` rows), in
/// file order: globals first, then layer by layer, the layer's experts last
/// (the order llama.cpp's converter writes them in).
pub fn inventory(c: &HfConfig, ple_rows: Option<u64>) -> Vec<TensorPlan> {
    let (h, v) = (c.hidden_size, c.vocab_size);
    let mut inv = Inventory {
        tensors: Vec::new(),
    };
    inv.push("token_embd.weight".into(), &[h, v], Init::Gauss(1.0));
    inv.linear("output.weight".into(), h, v, 1.0);
    inv.hyper_connection("output_hc", c, false);
    if let (Some(p), Some(rows)) = (&c.ple, ple_rows) {
        inv.push(
            "per_layer_token_embd.weight".into(),
            &[p.head_dim(), rows as usize],
            Init::Gauss(1.0),
        );
    }
    for (i, &linear) in c.is_linear.iter().enumerate() {
        let b = format!("blk.{i}");
        inv.hyper_connection(&format!("{b}.hc_attn"), c, true);
        inv.hyper_connection(&format!("{b}.hc_ffn"), c, true);
        if linear {
            inv.gated_delta_net(&b, c);
        } else {
            inv.attention(&b, c);
        }
        if let Some(p) = c.ple.as_ref().filter(|p| p.layer == i) {
            inv.ple(&b, c, p.conv_kernel);
        }
        inv.moe(&b, c);
    }
    inv.tensors
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primes() {
        let got: Vec<u64> = (0..30).filter(|&v| is_prime(v)).collect();
        assert_eq!(got, [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]);
        assert!(is_prime(20_000_003));
        assert!(!is_prime(20_000_001));
    }

    /// Golden values from transformers 5.23.0 (`_build_layer_multipliers(248320, 3, 0, 1234)`,
    /// `_find_nth_prime_after(19_999_999, h + 1)`, padded to 128 rows).
    #[test]
    fn ple_constants_match_transformers() {
        let cfg = config_json(Dims::Real, None).unwrap();
        let p = PleHash::for_config(&HfConfig::from_json(&cfg).unwrap(), &cfg, 0).unwrap();
        assert_eq!(
            p.multipliers,
            [23_703_573_157_769, 20_109_073_645_365, 8_052_911_324_071]
        );
        assert_eq!(
            &p.head_vocab[..4],
            &[20_000_003, 20_000_023, 20_000_033, 20_000_047]
        );
        assert_eq!(p.head_vocab[15], 20_000_171);
        assert_eq!(p.head_offsets[1], 20_000_003);
        assert_eq!(p.rows, 320_001_536);
        let short =
            PleHash::for_config(&HfConfig::from_json(&cfg).unwrap(), &cfg, 1 << 20).unwrap();
        assert_eq!(short.multipliers, p.multipliers);
        assert!(
            short.rows <= 1 << 20 && short.rows > 1 << 19,
            "{}",
            short.rows
        );
        assert!(short.head_vocab.iter().all(|&v| is_prime(v)));
    }

    #[test]
    fn layer_cut_keeps_the_pattern_and_drops_an_unreachable_ple() {
        let one = config_json(Dims::Real, Some(1)).unwrap();
        assert!(one.get("ple_layer_ids").is_none());
        let eight = HfConfig::from_json(&config_json(Dims::Real, Some(8)).unwrap()).unwrap();
        assert_eq!(
            eight.is_linear,
            [true, true, true, false, true, true, true, false]
        );
        assert_eq!(eight.ple.as_ref().map(|p| p.layer), Some(1));
        assert!(config_json(Dims::Real, Some(49)).is_err());
        assert!(config_json(Dims::Real, Some(0)).is_err());
    }
}
