//! Hugging Face checkpoint → GGUF (`qwen4exp`) conversion.
//!
//! [`convert`] reads a checkpoint directory as published (config.json, one
//! `model.safetensors` or shards with `model.safetensors.index.json`, optional
//! tokenizer files) and writes a single GGUF file in the layout
//! `/work/shared/spec/gguf-qwen4exp.md` pins down, loadable by llama.cpp and by
//! flashnext.
//!
//! # Design
//!
//! * **Plan first, then stream.** `config` validates the hyperparameters,
//!   `source` memory-maps every safetensors file and indexes the headers, and
//!   `plan` maps every checkpoint tensor to its GGUF tensor, checking names,
//!   shapes and dtypes before the output file is created. Only then is the file
//!   written, through [`crate::gguf::GgufWriter`], each tensor's bytes produced
//!   inside its source closure.
//! * **Rows, not tensors.** Every transform is a recipe over rows of `ne0` values
//!   (`tensors`): a chunk of a few million values is decoded from the maps to
//!   f32, transformed, encoded in parallel and written, so memory stays at a few
//!   chunk buffers whatever the checkpoint size: per-expert tensors are stacked
//!   expert by expert straight into the writer, fused `gate_up_proj` is split on
//!   the fly, and the PLE table is streamed shard by shard.
//! * **f32 in the middle.** Source F32/F16/BF16 values are widened to f32 before
//!   any transform, then encoded with `quant::float` / `quant` (bit-exact with ggml/gguf-py).
//! * The output is first written to `<out>.partial` and renamed when complete.
//!
//! # Transforms (spec §3)
//!
//! `1 + w` on the hc norms, `output_hc_norm`, `attn_{q,k}_norm`,
//! `indexer.{q,k}_norm` and the three PLE norms (not on `ssm_norm`);
//! `ssm_a = -exp(A_log)`; the grouped → tiled V-head reorder on the qkv V rows,
//! z rows, a/b rows, conv V channels, `dt_bias`, `A_log` and `out_proj` columns;
//! conv kernels squeezed to `{K, channels}`; `index_qk_proj` split into
//! `indexer.q_proj` (first `ih*id` rows) and `indexer.k_proj` (last `id` rows);
//! experts stacked as `ffn_{gate,up}_exps {H,F,E}` / `ffn_down_exps {F,H,E}`;
//! PLE shards concatenated in ascending shard index; the three int64 PLE hash
//! buffers written as exact UINT64 KV arrays. Storage types follow §3.9: 1-D
//! tensors, `*_norm.weight`, routers, `ssm_conv1d` and non-`.weight` tensors stay
//! F32; the rest gets the requested type, falling back to F16 when a row is not a
//! whole number of Q8_0 blocks (`ple_conv1d`). A K-quant preset (`q4_k_m`, ...)
//! instead plans the file as f32 and then gives each tensor the type
//! `llama-quantize` would ([`crate::quant::policy`]); `--tensor-type`
//! overrides apply last.
//!
//! # Where our file differs from llama.cpp's converter
//!
//! * `qwen4exp.ple.eos_token_id` is the **first** element of a list-valued
//!   `eos_token_id` — the id transformers hashes with; llama.cpp's converter takes
//!   the last. Same value when the config has a single id.
//! * Full-attention layers are recognised as "not `linear_attention`", so they
//!   get `attention.compress_ratios = indexer_compress_ratio` whether the config
//!   says `full_attention` or `indexed_attention`. llama.cpp's converter compares
//!   with `"full_attention"` *after* loading the config through transformers'
//!   `AutoConfig`, which renames those entries to `indexed_attention`, so its
//!   files have all-zero ratios (dense attention on every layer) — checked on
//!   the tiny fixtures with the 2026-10-01 tree.
//! * A missing `partial_rotary_factor` means 1.0, as transformers' Qwen4-Exp
//!   rotary embedding reads it (llama.cpp's converter assumes 0.25).
//! * We add `flashnext.ssm.output_gate` (STRING, `"sigmoid"` or `"silu"`, from
//!   `output_gate_type or hidden_act`); llama.cpp ignores it and always uses
//!   sigmoid. A file without the key means sigmoid.
//! * `tokenizer.ggml.pre` is always `"qwen35"` (llama.cpp derives it from a hash
//!   of the real tokenizer's output); the `tokenizer` module docs list the rest.
//! * MTP, vision and `rotary_emb.inv_freq` tensors are dropped, as llama.cpp
//!   does; any other tensor the configured model does not use is an error.
//! * Only `rope_type: "default"` is accepted (the model uses no RoPE scaling).
//! * `general.name` is the directory name as is; no `general.size_label`.
//! * `ssm_a` uses Rust's correctly rounded `expf`; torch's float32 `exp` (hence
//!   llama.cpp's file) can differ in the last bit.
//!
//! Everything else — every other key, value and type, every tensor's name,
//! shape, type and bytes, the tokenizer keys — is identical to what llama.cpp's
//! `convert_hf_to_gguf.py` writes for the tiny transformers fixtures in f32,
//! bf16 and q8_0.

mod config;
mod plan;
mod source;
mod tensors;
mod tokenizer;

pub use config::{HfConfig, PleConfig};
pub(crate) use plan::{policy_types, storage_type};

use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufWriter, Value};
use crate::quant::policy::{Preset, TensorTypeOverride};
use config::T_UINT64;
use std::fmt;
use std::path::Path;

/// Storage type for the large weight matrices (`--type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OutType {
    F32,
    F16,
    /// The checkpoint's own precision for the published model.
    #[default]
    BF16,
    /// Q8_0 wherever a row is whole blocks, as llama.cpp's converter writes it.
    Q8_0,
    /// A `llama-quantize` preset applied to the f32 values: each tensor's
    /// type as [`crate::quant::policy`] documents.
    Quant(Preset),
}

impl OutType {
    /// The type of the weight matrices (a preset's base type).
    pub fn ggml_type(self) -> GgmlType {
        match self {
            OutType::F32 => GgmlType::F32,
            OutType::F16 => GgmlType::F16,
            OutType::BF16 => GgmlType::BF16,
            OutType::Q8_0 => GgmlType::Q8_0,
            OutType::Quant(p) => p.base(),
        }
    }

    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_*`).
    pub fn file_type(self) -> u32 {
        match self {
            OutType::F32 => 0,
            OutType::F16 => 1,
            OutType::Q8_0 => 7,
            OutType::BF16 => 32,
            OutType::Quant(p) => p.file_type(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OutType::F32 => "f32",
            OutType::F16 => "f16",
            OutType::BF16 => "bf16",
            OutType::Q8_0 => "q8_0",
            OutType::Quant(p) => p.name(),
        }
    }
}

impl std::str::FromStr for OutType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => OutType::F32,
            "f16" => OutType::F16,
            "bf16" => OutType::BF16,
            "q8_0" => OutType::Q8_0,
            other => OutType::Quant(other.parse().map_err(|_| {
                Error::arg(format!(
                    "unknown output type {s:?} (expected f32, f16, bf16, q8_0, q6_k, q5_k_m, q4_k_m, q3_k_m or q2_k)"
                ))
            })?),
        })
    }
}

impl fmt::Display for OutType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the conversion is, passed to [`ConvertOptions::progress`] when a tensor
/// starts (`rows_done == 0`) and after each chunk of rows is written.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    /// 0-based index of the tensor being written.
    pub index: usize,
    /// Number of tensors in the file.
    pub count: usize,
    pub name: &'a str,
    pub ty: GgmlType,
    /// ggml order.
    pub dims: &'a [usize],
    pub rows_done: usize,
    pub rows_total: usize,
}

/// A progress callback.
pub type ProgressFn = Box<dyn Fn(&Progress<'_>) + Send + Sync>;

/// Options of [`convert`].
#[derive(Default)]
pub struct ConvertOptions {
    pub out_type: OutType,
    /// `--tensor-type REGEX=TYPE` overrides (see [`crate::quant::policy`]).
    pub tensor_types: Vec<TensorTypeOverride>,
    /// Called from the converting thread; see [`Progress`].
    pub progress: Option<ProgressFn>,
}

impl ConvertOptions {
    pub fn new(out_type: OutType) -> Self {
        ConvertOptions { out_type, tensor_types: Vec::new(), progress: None }
    }

    pub fn with_progress(mut self, f: impl Fn(&Progress<'_>) + Send + Sync + 'static) -> Self {
        self.progress = Some(Box::new(f));
        self
    }
}

impl fmt::Debug for ConvertOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConvertOptions")
            .field("out_type", &self.out_type)
            .field("tensor_types", &self.tensor_types)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

/// A tensor of the output file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrittenTensor {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order.
    pub dims: Vec<usize>,
}

/// Why a checkpoint tensor was left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SkipReason {
    /// Multi-token-prediction head (`mtp.*`): neither llama.cpp's qwen4exp nor
    /// transformers' model uses it.
    Mtp,
    /// Vision tower (`model.visual.*`): goes to a separate mmproj file, out of scope.
    Vision,
    /// `rotary_emb.inv_freq`: recomputed from the config.
    RotaryInvFreq,
    /// `lm_head.weight` of a model with `tie_word_embeddings`: `token_embd` is used.
    TiedOutput,
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SkipReason::Mtp => "MTP head (not used by llama.cpp's qwen4exp or transformers)",
            SkipReason::Vision => "vision tower (belongs in a separate mmproj file)",
            SkipReason::RotaryInvFreq => "rotary inv_freq buffer (recomputed)",
            SkipReason::TiedOutput => "lm_head tied to embed_tokens",
        })
    }
}

/// A checkpoint tensor that was not written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedTensor {
    /// The name as stored in the checkpoint.
    pub name: String,
    pub reason: SkipReason,
}

/// What [`convert`] did.
#[derive(Clone, Debug, Default)]
pub struct ConvertReport {
    /// Output tensors in file order.
    pub written: Vec<WrittenTensor>,
    /// Checkpoint tensors left out, in checkpoint order.
    pub skipped: Vec<SkippedTensor>,
    /// Whether tokenizer keys were written (`false`: no tokenizer.json).
    pub tokenizer: bool,
    /// Number of metadata keys written.
    pub n_metadata: usize,
    /// Things worth telling the user (missing tokenizer, filler tokens, ...).
    pub notes: Vec<String>,
}

/// Converts the checkpoint in `hf_dir` to the GGUF file `out`.
///
/// All validation happens before `out` is created; the file is written as
/// `<out>.partial` and renamed on success (removed on failure).
pub fn convert(hf_dir: &Path, out: &Path, opts: &ConvertOptions) -> Result<ConvertReport> {
    let cfg = HfConfig::load(hf_dir)?;
    let src = source::SourceSet::open(hf_dir)?;
    let plan = plan::plan(&cfg, &src, opts.out_type, &opts.tensor_types)?;
    let tok = tokenizer::load(hf_dir, &cfg)?;

    let mut report = ConvertReport::default();
    let mut w = GgufWriter::new();
    let mut n_kv = 0usize;
    let mut add = |w: &mut GgufWriter, k: &str, v: Value| {
        w.add(k, v);
        n_kv += 1;
    };
    add(&mut w, "general.architecture", Value::String("qwen4exp".into()));
    add(&mut w, "general.type", Value::String("model".into()));
    if let Some(name) = model_name(hf_dir) {
        add(&mut w, "general.name", Value::String(name));
    }
    add(&mut w, "general.file_type", Value::U32(opts.out_type.file_type()));
    add(&mut w, "general.quantization_version", Value::U32(2));
    for (k, v) in cfg.metadata() {
        add(&mut w, &k, v);
    }
    if let Some(ple) = &plan.ple {
        let arr = |v: &[u64]| Value::Array(T_UINT64, v.iter().map(|&x| Value::U64(x)).collect());
        add(&mut w, "qwen4exp.ple.layer_multipliers", arr(&ple.layer_multipliers));
        add(&mut w, "qwen4exp.ple.head_offsets", arr(&ple.head_offsets));
        add(&mut w, "qwen4exp.ple.head_vocab_sizes", arr(&ple.head_vocab_sizes));
    }
    match tok {
        Some(t) => {
            for (k, v) in t.kv {
                add(&mut w, &k, v);
            }
            report.tokenizer = true;
            report.notes.push(format!("tokenizer: {} tokens, {} merges", t.n_tokens, t.n_merges));
            report.notes.extend(t.notes);
        }
        None => {
            report.notes.push("no tokenizer.json in the checkpoint directory: the file has no tokenizer.* keys".into())
        }
    }
    report.n_metadata = n_kv;

    let count = plan.tensors.len();
    let progress = opts.progress.as_deref();
    for (index, t) in plan.tensors.iter().enumerate() {
        let src = &src;
        w.add_tensor(
            &t.name,
            t.ty,
            &t.dims,
            Box::new(move |out| {
                let rows_total = t.n_rows();
                let report = |rows_done| {
                    if let Some(p) = progress {
                        p(&Progress { index, count, name: &t.name, ty: t.ty, dims: &t.dims, rows_done, rows_total });
                    }
                };
                report(0);
                t.write(src, out, report)
            }),
        )?;
        report.written.push(WrittenTensor { name: t.name.clone(), ty: t.ty, dims: t.dims.clone() });
    }
    report.skipped = plan.skipped;

    w.write_to_path(out)?;
    Ok(report)
}

/// `general.name`: the checkpoint directory's name (as llama.cpp does by default).
fn model_name(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    Some(dir.file_name()?.to_string_lossy().into_owned())
}
