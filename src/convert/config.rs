//! `config.json` → the hyperparameters the converter needs, validated, and the
//! `qwen4exp.*` metadata keys built from them (spec §2.2–§2.9).
//!
//! The text config is the root object with `text_config` merged over it, exactly
//! like llama.cpp (`{**root, **root["text_config"]}`), so both the flat
//! `Qwen4ExpForCausalLM` layout and the nested `Qwen4ExpForConditionalGeneration`
//! layout work. Fields transformers gives a default are optional here too and take
//! that default; the dimensions of the network are required.

use crate::error::{Error, Result};
use crate::gguf::Value;
use serde_json::{Map, Value as Json};
use std::path::Path;

/// GGUF array element type ids (spec §1).
pub(crate) const T_INT32: u32 = 5;
pub(crate) const T_BOOL: u32 = 7;
pub(crate) const T_STRING: u32 = 8;
pub(crate) const T_UINT64: u32 = 10;

/// llama.cpp's `LLAMA_MAX_LAYERS`.
const MAX_LAYERS: usize = 512;
/// llama.cpp's `LLAMA_MAX_EXPERTS`.
const MAX_EXPERTS: usize = 1024;

/// The PLE (hashed n-gram embedding) settings of the one PLE layer.
#[derive(Clone, Debug)]
pub struct PleConfig {
    /// 0-based decoder layer (HF's `ple_layer_ids` are 1-based).
    pub layer: usize,
    /// `G`, also the dilation of the PLE conv.
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub conv_kernel: usize,
    /// `P`, must equal `hidden_size`.
    pub embed_dim: usize,
    /// Number of checkpoint shards of the embedding table.
    pub split_parts: usize,
    /// The id transformers hashes with: the **first** element of a list-valued
    /// `eos_token_id` (llama.cpp's converter writes the last).
    pub eos_token_id: u32,
    /// Root `image_token_id`, if any.
    pub image_token_id: Option<u32>,
}

impl PleConfig {
    /// `Hp = (G - 1) * heads_per_ngram`.
    pub fn heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }
    /// `dp = P / Hp`, the width of one table row.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.heads()
    }
}

/// Validated text-model hyperparameters.
#[derive(Clone, Debug)]
pub struct HfConfig {
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub num_layers: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub intermediate_size: Option<usize>,
    pub n_rot: usize,
    pub rope_theta: f32,
    pub mrope_sections: [i32; 4],
    pub lin_k_heads: usize,
    pub lin_v_heads: usize,
    pub lin_k_dim: usize,
    pub lin_v_dim: usize,
    pub lin_conv_kernel: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub expert_ff: usize,
    pub shared_ff: usize,
    pub hc_count: usize,
    pub hc_lowrank: usize,
    pub idx_heads: usize,
    pub idx_head_dim: usize,
    pub idx_budget: usize,
    pub idx_ratio: usize,
    /// Per layer: `true` for Gated DeltaNet, `false` for (QSA) full attention.
    pub is_linear: Vec<bool>,
    pub full_attention_interval: usize,
    pub ple: Option<PleConfig>,
    /// `output_gate_type or hidden_act`: `"sigmoid"` or `"silu"`.
    pub output_gate: String,
    pub tie_word_embeddings: bool,
    /// The raw root object of `config.json` (for the tokenizer's `<x>_token_id` fallbacks).
    pub root: Map<String, Json>,
}

impl HfConfig {
    /// GDN conv channels `Dc = 2*nk*dk + nv*dv`.
    pub fn conv_dim(&self) -> usize {
        2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim
    }

    /// A root-level config field, else the same field of `text_config` (how
    /// gguf-py's `SpecialVocab` looks up `<x>_token_id`).
    pub fn root_or_text(&self, key: &str) -> Option<&Json> {
        match self.root.get(key) {
            None | Some(Json::Null) => self.root.get("text_config").and_then(|t| t.get(key)),
            v => v,
        }
    }

    /// Reads and validates `<dir>/config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let root: Json = serde_json::from_str(&text)
            .map_err(|e| Error::convert(format!("{}: not valid JSON: {e}", path.display())))?;
        Self::from_json(&root)
    }

    /// Builds the config from the parsed `config.json` object.
    pub fn from_json(root: &Json) -> Result<Self> {
        let root = root.as_object().ok_or_else(|| Error::convert("config.json: top level is not an object"))?;
        let mut merged = root.clone();
        if let Some(tc) = root.get("text_config") {
            let tc = tc.as_object().ok_or_else(|| Error::convert("config.json: `text_config` is not an object"))?;
            for (k, v) in tc {
                merged.insert(k.clone(), v.clone());
            }
        }
        let c = Fields(&merged);

        if let Some(mt) = c.opt_str("model_type")? {
            if !matches!(mt, "qwen4_exp" | "qwen4_exp_text") {
                return Err(Error::convert(format!(
                    "config.json: model_type is {mt:?}, expected \"qwen4_exp\" or \"qwen4_exp_text\""
                )));
            }
        }

        let hidden_size = c.req("hidden_size")?;
        let num_layers = c.req("num_hidden_layers")?;
        let n_head = c.req("num_attention_heads")?;
        let head_dim = c.req("head_dim")?;

        // Layer pattern. transformers renames "full_attention" to "indexed_attention"
        // when it re-saves a config; both are QSA layers, so key on "not linear".
        let full_attention_interval = c.opt("full_attention_interval")?.unwrap_or(4);
        let is_linear: Vec<bool> = match merged.get("layer_types") {
            None | Some(Json::Null) => {
                if full_attention_interval == 0 {
                    return Err(Error::convert("config.json: full_attention_interval must be > 0"));
                }
                (0..num_layers).map(|i| (i + 1) % full_attention_interval != 0).collect()
            }
            Some(Json::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("linear_attention") => Ok(true),
                    Some("full_attention" | "indexed_attention") => Ok(false),
                    _ => Err(Error::convert(format!(
                        "config.json: layer_types[{i}] is {t}; known types are \"linear_attention\", \
                         \"full_attention\" and \"indexed_attention\""
                    ))),
                })
                .collect::<Result<_>>()?,
            Some(other) => return Err(Error::convert(format!("config.json: layer_types is not a list: {other}"))),
        };
        if is_linear.len() != num_layers {
            return Err(Error::convert(format!(
                "config.json: layer_types has {} entries but num_hidden_layers is {num_layers}",
                is_linear.len()
            )));
        }

        // RoPE. Qwen4-Exp's rotary embedding reads `partial_rotary_factor` with a
        // default of 1.0 (llama.cpp's converter assumes 0.25 when it is absent).
        let rope = match merged.get("rope_parameters") {
            Some(Json::Object(m)) => Some(m),
            None | Some(Json::Null) => None,
            Some(other) => {
                return Err(Error::convert(format!("config.json: rope_parameters is not an object: {other}")))
            }
        };
        let rope_f = |k: &str| -> Result<Option<f64>> {
            match rope.and_then(|r| r.get(k)).or_else(|| merged.get(k)) {
                None | Some(Json::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| Error::convert(format!("config.json: `{k}` must be a number, got {v}"))),
            }
        };
        let rope_type = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        if rope_type != "default" {
            return Err(Error::convert(format!(
                "config.json: rope_type {rope_type:?} is not supported (only \"default\")"
            )));
        }
        let partial = rope_f("partial_rotary_factor")?.unwrap_or(1.0);
        let n_rot = (head_dim as f64 * partial) as usize;
        let rope_theta = rope_f("rope_theta")?.unwrap_or(10000.0) as f32;
        let mut mrope_sections = [11, 11, 10, 0];
        if let Some(sec) = rope.and_then(|r| r.get("mrope_section")) {
            let sec = sec.as_array().filter(|s| s.len() <= 4).ok_or_else(|| {
                Error::convert(format!("config.json: mrope_section must be a list of at most 4 ints, got {sec}"))
            })?;
            mrope_sections = [0; 4];
            for (i, v) in sec.iter().enumerate() {
                mrope_sections[i] = v
                    .as_i64()
                    .and_then(|v| i32::try_from(v).ok())
                    .ok_or_else(|| Error::convert(format!("config.json: mrope_section entry {v} is not an int")))?;
            }
        }

        let output_gate = match c.opt_str("output_gate_type")? {
            Some(g) => g.to_string(),
            None => c.opt_str("hidden_act")?.unwrap_or("silu").to_string(),
        };
        if output_gate != "sigmoid" && output_gate != "silu" {
            return Err(Error::convert(format!(
                "config.json: linear-attention output gate {output_gate:?} (output_gate_type or hidden_act) \
                 must be \"sigmoid\" or \"silu\""
            )));
        }

        let cfg = HfConfig {
            hidden_size,
            vocab_size: c.req("vocab_size")?,
            num_layers,
            max_position_embeddings: c.req("max_position_embeddings")?,
            rms_norm_eps: c.req_f("rms_norm_eps")? as f32,
            n_head,
            n_head_kv: c.req("num_key_value_heads")?,
            head_dim,
            intermediate_size: c.opt("intermediate_size")?,
            n_rot,
            rope_theta,
            mrope_sections,
            lin_k_heads: c.req("linear_num_key_heads")?,
            lin_v_heads: c.req("linear_num_value_heads")?,
            lin_k_dim: c.req("linear_key_head_dim")?,
            lin_v_dim: c.req("linear_value_head_dim")?,
            lin_conv_kernel: c.req("linear_conv_kernel_dim")?,
            n_expert: c.req("num_experts")?,
            n_expert_used: c.req("num_experts_per_tok")?,
            expert_ff: c.req("moe_intermediate_size")?,
            shared_ff: c.req("shared_expert_intermediate_size")?,
            hc_count: c.req("hc_count")?,
            hc_lowrank: c.req("hc_lowrank")?,
            idx_heads: c.req("indexer_n_heads")?,
            idx_head_dim: c.req("indexer_head_dim")?,
            idx_budget: c.req("indexer_budget")?,
            idx_ratio: c.req("indexer_compress_ratio")?,
            is_linear,
            full_attention_interval,
            ple: None,
            output_gate,
            tie_word_embeddings: c.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            root: root.clone(),
        };
        let idx_kv_heads = c.req("indexer_kv_heads")?;
        let ple = Self::ple_config(&c, &cfg)?;
        let cfg = HfConfig { ple, ..cfg };
        cfg.validate(idx_kv_heads)?;
        Ok(cfg)
    }

    fn ple_config(c: &Fields, cfg: &HfConfig) -> Result<Option<PleConfig>> {
        let ids: Vec<usize> = match c.0.get("ple_layer_ids") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Array(v)) => {
                let mut ids = v
                    .iter()
                    .map(|x| {
                        x.as_u64().map(|x| x as usize).ok_or_else(|| {
                            Error::convert(format!("config.json: ple_layer_ids entry {x} is not an int"))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                ids.sort_unstable();
                ids.dedup();
                ids
            }
            Some(other) => return Err(Error::convert(format!("config.json: ple_layer_ids is not a list: {other}"))),
        };
        match ids.len() {
            0 => return Ok(None),
            1 => {}
            n => {
                return Err(Error::convert(format!(
                    "config.json: {n} PLE layers {ids:?}; llama.cpp's qwen4exp (and this converter) support exactly one"
                )))
            }
        }
        let id = ids[0];
        if id < 1 || id > cfg.num_layers {
            return Err(Error::convert(format!(
                "config.json: ple_layer_ids entry {id} is outside [1, {}] (ids are 1-based)",
                cfg.num_layers
            )));
        }
        if !cfg.is_linear[id - 1] {
            return Err(Error::convert(format!(
                "config.json: PLE layer {id} (1-based) is not a linear_attention layer"
            )));
        }
        let eos_token_id = match c.0.get("eos_token_id") {
            Some(Json::Array(v)) if !v.is_empty() => v[0].clone(),
            Some(v @ Json::Number(_)) => v.clone(),
            _ => {
                return Err(Error::convert("config.json: eos_token_id (an int or non-empty list) is required with PLE"))
            }
        };
        let eos_token_id = eos_token_id.as_u64().and_then(|v| u32::try_from(v).ok()).ok_or_else(|| {
            Error::convert(format!("config.json: eos_token_id {eos_token_id} is not a valid token id"))
        })?;
        let image_token_id = match c.opt("image_token_id")? {
            None => None,
            Some(v) => Some(u32::try_from(v).map_err(|_| Error::convert("config.json: image_token_id too large"))?),
        };
        let ple = PleConfig {
            layer: id - 1,
            ngram_size: c.opt("ngram_size")?.unwrap_or(3),
            heads_per_ngram: c.opt("heads_per_ngram")?.unwrap_or(8),
            conv_kernel: c.opt("ple_conv_kernel_size")?.unwrap_or(4),
            embed_dim: c.opt("ple_embed_dim")?.unwrap_or(cfg.hidden_size),
            split_parts: c.opt("split_ngram_parts")?.unwrap_or(512),
            eos_token_id,
            image_token_id,
        };
        if ple.embed_dim != cfg.hidden_size {
            return Err(Error::convert(format!(
                "config.json: ple_embed_dim {} differs from hidden_size {}; llama.cpp requires them equal",
                ple.embed_dim, cfg.hidden_size
            )));
        }
        if !(2..=8).contains(&ple.ngram_size) {
            return Err(Error::convert(format!("config.json: ngram_size {} is outside [2, 8]", ple.ngram_size)));
        }
        let hp = ple.heads();
        if hp == 0 || hp > 64 || !ple.embed_dim.is_multiple_of(hp) {
            return Err(Error::convert(format!(
                "config.json: (ngram_size-1)*heads_per_ngram = {hp} must be in [1, 64] and divide ple_embed_dim {}",
                ple.embed_dim
            )));
        }
        if ple.conv_kernel == 0 || ple.split_parts == 0 {
            return Err(Error::convert("config.json: ple_conv_kernel_size and split_ngram_parts must be > 0"));
        }
        Ok(Some(ple))
    }

    fn validate(&self, idx_kv_heads: usize) -> Result<()> {
        let bad = |m: String| Err(Error::convert(format!("config.json: {m}")));
        let nonzero = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("vocab_size", self.vocab_size),
            ("num_attention_heads", self.n_head),
            ("num_key_value_heads", self.n_head_kv),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.lin_k_heads),
            ("linear_num_value_heads", self.lin_v_heads),
            ("linear_key_head_dim", self.lin_k_dim),
            ("linear_value_head_dim", self.lin_v_dim),
            ("linear_conv_kernel_dim", self.lin_conv_kernel),
            ("num_experts", self.n_expert),
            ("moe_intermediate_size", self.expert_ff),
            ("shared_expert_intermediate_size", self.shared_ff),
            ("hc_lowrank", self.hc_lowrank),
            ("indexer_n_heads", self.idx_heads),
            ("indexer_head_dim", self.idx_head_dim),
            ("indexer_budget", self.idx_budget),
            ("indexer_compress_ratio", self.idx_ratio),
        ];
        for (k, v) in nonzero {
            if v == 0 {
                return bad(format!("{k} must be > 0"));
            }
        }
        if self.hc_count <= 1 {
            return bad(format!("hc_count must be > 1 (Qwen4-Exp hyper-connections), got {}", self.hc_count));
        }
        if idx_kv_heads != 1 {
            return bad(format!("indexer_kv_heads must be 1, got {idx_kv_heads}"));
        }
        if self.num_layers > MAX_LAYERS {
            return bad(format!("{} layers exceed llama.cpp's limit of {MAX_LAYERS}", self.num_layers));
        }
        if self.n_expert > MAX_EXPERTS {
            return bad(format!("{} experts exceed llama.cpp's limit of {MAX_EXPERTS}", self.n_expert));
        }
        if self.n_expert_used == 0 || self.n_expert_used > self.n_expert {
            return bad(format!("num_experts_per_tok {} must be in [1, {}]", self.n_expert_used, self.n_expert));
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.n_head, self.n_head_kv
            ));
        }
        if self.lin_k_dim != self.lin_v_dim {
            return bad(format!(
                "linear_key_head_dim {} != linear_value_head_dim {}; llama.cpp requires them equal",
                self.lin_k_dim, self.lin_v_dim
            ));
        }
        if !self.lin_v_heads.is_multiple_of(self.lin_k_heads) {
            return bad(format!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                self.lin_v_heads, self.lin_k_heads
            ));
        }
        if self.idx_ratio > 64 {
            return bad(format!("indexer_compress_ratio {} exceeds llama.cpp's limit of 64", self.idx_ratio));
        }
        if !self.idx_budget.is_multiple_of(self.idx_ratio) {
            return bad(format!(
                "indexer_budget {} is not a multiple of indexer_compress_ratio {}",
                self.idx_budget, self.idx_ratio
            ));
        }
        if self.n_rot > self.idx_head_dim || self.n_rot > self.head_dim || !self.n_rot.is_multiple_of(2) {
            return bad(format!(
                "rotary dims {} must be even and fit head_dim {} and indexer_head_dim {}",
                self.n_rot, self.head_dim, self.idx_head_dim
            ));
        }
        Ok(())
    }

    /// The `qwen4exp.*` and `flashnext.*` model keys (not `general.*`, not tokenizer).
    pub fn metadata(&self) -> Vec<(String, Value)> {
        let a = "qwen4exp";
        let u = |v: usize| Value::U32(v as u32);
        let mut kv: Vec<(String, Value)> = Vec::new();
        let mut put = |k: &str, v: Value| kv.push((format!("{a}.{k}"), v));
        put("block_count", u(self.num_layers));
        put("context_length", u(self.max_position_embeddings));
        put("embedding_length", u(self.hidden_size));
        if let Some(ff) = self.intermediate_size {
            put("feed_forward_length", u(ff));
        }
        put("attention.head_count", u(self.n_head));
        put("attention.head_count_kv", u(self.n_head_kv));
        put("attention.key_length", u(self.head_dim));
        put("attention.value_length", u(self.head_dim));
        put("attention.layer_norm_rms_epsilon", Value::F32(self.rms_norm_eps));
        put("rope.dimension_count", u(self.n_rot));
        put(
            "rope.dimension_sections",
            Value::Array(T_INT32, self.mrope_sections.iter().map(|&s| Value::I32(s)).collect()),
        );
        put("rope.freq_base", Value::F32(self.rope_theta));
        put("expert_count", u(self.n_expert));
        put("expert_used_count", u(self.n_expert_used));
        put("expert_feed_forward_length", u(self.expert_ff));
        put("expert_shared_feed_forward_length", u(self.shared_ff));
        put("ssm.conv_kernel", u(self.lin_conv_kernel));
        put("ssm.state_size", u(self.lin_k_dim));
        put("ssm.group_count", u(self.lin_k_heads));
        put("ssm.time_step_rank", u(self.lin_v_heads));
        put("ssm.inner_size", u(self.lin_v_dim * self.lin_v_heads));
        put(
            "attention.recurrent_layers",
            Value::Array(T_BOOL, self.is_linear.iter().map(|&l| Value::Bool(l)).collect()),
        );
        put("full_attention_interval", u(self.full_attention_interval));
        put("hyper_connection.count", u(self.hc_count));
        put("hyper_connection.low_rank", u(self.hc_lowrank));
        put("attention.indexer.head_count", u(self.idx_heads));
        put("attention.indexer.key_length", u(self.idx_head_dim));
        put("attention.indexer.top_k", u(self.idx_budget));
        put(
            "attention.compress_ratios",
            Value::Array(
                T_INT32,
                self.is_linear.iter().map(|&l| Value::I32(if l { 0 } else { self.idx_ratio as i32 })).collect(),
            ),
        );
        if let Some(p) = &self.ple {
            put("ple.layers", Value::Array(T_INT32, vec![Value::I32(p.layer as i32)]));
            put("ple.ngram_size", u(p.ngram_size));
            put("ple.heads_per_ngram", u(p.heads_per_ngram));
            put("ple.conv_kernel", u(p.conv_kernel));
            put("ple.eos_token_id", Value::U32(p.eos_token_id));
            if let Some(img) = p.image_token_id {
                put("ple.image_token_id", Value::U32(img));
            }
            put("embedding_length_per_layer_input", u(p.head_dim()));
        }
        kv.push(("flashnext.ssm.output_gate".to_string(), Value::String(self.output_gate.clone())));
        kv
    }
}

/// Typed access to the merged config object with error messages naming the field.
struct Fields<'a>(&'a Map<String, Json>);

impl Fields<'_> {
    fn opt(&self, k: &str) -> Result<Option<usize>> {
        match self.0.get(k) {
            None | Some(Json::Null) => Ok(None),
            Some(v) => {
                v.as_u64().and_then(|v| usize::try_from(v).ok()).map(Some).ok_or_else(|| {
                    Error::convert(format!("config.json: `{k}` must be a non-negative integer, got {v}"))
                })
            }
        }
    }
    fn req(&self, k: &str) -> Result<usize> {
        self.opt(k)?.ok_or_else(|| Error::convert(format!("config.json: required field `{k}` is missing")))
    }
    fn req_f(&self, k: &str) -> Result<f64> {
        match self.0.get(k) {
            None | Some(Json::Null) => Err(Error::convert(format!("config.json: required field `{k}` is missing"))),
            Some(v) => {
                v.as_f64().ok_or_else(|| Error::convert(format!("config.json: `{k}` must be a number, got {v}")))
            }
        }
    }
    fn opt_str(&self, k: &str) -> Result<Option<&str>> {
        match self.0.get(k) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(s)) => Ok(Some(s)),
            Some(v) => Err(Error::convert(format!("config.json: `{k}` must be a string, got {v}"))),
        }
    }
    fn opt_bool(&self, k: &str) -> Result<Option<bool>> {
        match self.0.get(k) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Error::convert(format!("config.json: `{k}` must be true or false, got {v}"))),
        }
    }
}
