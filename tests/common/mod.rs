//! Shared test helpers: a generator of small but complete, valid `qwen4exp`
//! GGUF files, and ways to break them.
//!
//! Use it from an integration test with `mod common;` (the fuzz seed example
//! includes it with `#[path]`). Two levels:
//!
//! - [`TinyModel`]: the model as a list of metadata entries and tensors
//!   (values kept as f32, encoded at write time). Build the default valid
//!   model with [`TinyModel::new`] (or from a custom [`TinyConfig`] with
//!   [`TinyModel::build`]), change it with [`TinyModel::set`] /
//!   [`TinyModel::remove_key`] / [`TinyModel::remove_tensor`] /
//!   [`TinyModel::set_shape`] / [`TinyModel::set_type`] /
//!   [`TinyModel::set_value`], and serialize it with the crate's own
//!   `GgufWriter` ([`TinyModel::to_bytes`], [`TinyModel::write`]). Everything
//!   the writer can express is reachable this way (wrong key types, missing
//!   keys/tensors, wrong shapes, other tensor types).
//! - [`RawGguf`]: the same file as an editable container (kv entries as raw
//!   type id + payload bytes, tensor infos with explicit dims, ggml type ids
//!   and offsets, the data section as bytes, header counts that may lie). For
//!   things a well-behaved writer refuses to produce: duplicate keys or
//!   tensors, unknown type ids, misaligned or overlapping offsets, absurd
//!   counts. `TinyModel::to_raw().to_bytes()` is byte-identical to
//!   `TinyModel::to_bytes()` (checked by `tests/hostile_gguf.rs`).
//!
//! The default model ([`TinyConfig::default`]): hidden 32, 2 hyper-connection
//! streams (rank 4), vocab 64, 4 layers — 0..=2 Gated DeltaNet (2 key heads,
//! 4 value heads, head dim 8, conv kernel 4), 3 full attention (2 heads, 1 KV
//! head, head dim 8, 4 rope dims) with QSA (2 indexer heads of dim 8, compress
//! ratio 2, budget 4) — PLE on layer 1 (n-gram 3, 2 heads per order, rows of
//! 8, conv kernel 2), MoE with 4 experts (top 2, width 16) plus a shared
//! expert of width 16. All tensors F32 with small deterministic
//! pseudo-random values (norm gammas near 1, `ssm_a` negative); each
//! tensor's values depend only on its name and size, so changing one tensor
//! leaves the others bit-identical. About 240 KB.

#![allow(dead_code)]

use flashnext::gguf::{GgmlType, GgufWriter, Value};
use std::io::Cursor;
use std::path::Path;

/// Dimensions of a generated model. `Default` is the small model described
/// in the module docs; every field can be changed (the generator derives the
/// keys and every tensor shape from these).
#[derive(Clone, Debug)]
pub struct TinyConfig {
    pub hidden: usize,
    pub vocab: usize,
    pub context_length: usize,
    pub eps: f32,
    /// `true` = Gated DeltaNet layer, `false` = full attention; its length is the layer count.
    pub recurrent: Vec<bool>,
    pub hc: usize,
    pub hc_rank: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub rope_theta: f32,
    pub ssm_k_heads: usize,
    pub ssm_v_heads: usize,
    pub ssm_head_dim: usize,
    pub ssm_conv: usize,
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub expert_ff: usize,
    pub shared_ff: usize,
    /// Write `ffn_gate_up_exps` instead of separate gate/up expert stacks.
    pub fused_experts: bool,
    /// Write `output.weight` (otherwise the head is tied to `token_embd`).
    pub output_head: bool,
    pub indexer_heads: usize,
    pub indexer_dim: usize,
    /// QSA compress ratio of every attention layer (0 = dense).
    pub compress_ratio: usize,
    pub budget: usize,
    /// The one PLE layer (0-based), or `None` for no PLE.
    pub ple_layer: Option<usize>,
    pub ngram: usize,
    pub heads_per_ngram: usize,
    pub ple_conv: usize,
    pub ple_eos: u32,
}

impl Default for TinyConfig {
    fn default() -> Self {
        TinyConfig {
            hidden: 32,
            vocab: 64,
            context_length: 256,
            eps: 1e-6,
            recurrent: vec![true, true, true, false],
            hc: 2,
            hc_rank: 4,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 8,
            rope_dims: 4,
            rope_theta: 10000.0,
            ssm_k_heads: 2,
            ssm_v_heads: 4,
            ssm_head_dim: 8,
            ssm_conv: 4,
            n_experts: 4,
            n_experts_used: 2,
            expert_ff: 16,
            shared_ff: 16,
            fused_experts: false,
            output_head: true,
            indexer_heads: 2,
            indexer_dim: 8,
            compress_ratio: 2,
            budget: 4,
            ple_layer: Some(1),
            ngram: 3,
            heads_per_ngram: 2,
            ple_conv: 2,
            ple_eos: 1,
        }
    }
}

impl TinyConfig {
    pub fn n_layers(&self) -> usize {
        self.recurrent.len()
    }
    /// PLE heads `(G-1) * heads_per_ngram`.
    pub fn ple_heads(&self) -> usize {
        (self.ngram - 1) * self.heads_per_ngram
    }
    /// PLE table row width `hidden / ple_heads`.
    pub fn ple_row_dim(&self) -> usize {
        self.hidden / self.ple_heads()
    }
    /// Per-head hash vocabulary sizes (small primes) and their offsets (prefix sums).
    pub fn ple_heads_layout(&self) -> (Vec<u64>, Vec<u64>) {
        const PRIMES: [u64; 16] = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67];
        let vocab: Vec<u64> = (0..self.ple_heads()).map(|h| PRIMES[h % PRIMES.len()]).collect();
        let offsets = vocab.iter().scan(0u64, |acc, &v| {
            let o = *acc;
            *acc += v;
            Some(o)
        });
        (offsets.collect(), vocab)
    }
    /// Rows of `per_layer_token_embd` (sum of the head vocabularies, padded to 8).
    pub fn ple_table_rows(&self) -> usize {
        let (_, vocab) = self.ple_heads_layout();
        (vocab.iter().sum::<u64>() as usize).div_ceil(8) * 8
    }
    /// GDN conv channels `2*nk*d + nv*d`.
    pub fn ssm_conv_dim(&self) -> usize {
        (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_head_dim
    }
}

/// One tensor of a [`TinyModel`]. `values` holds `dims.product()` f32 values;
/// they are encoded to `ty` when the file is written (F32/F16/BF16/Q8_0
/// exactly as the CPU reads them; any other type as zero bytes of the right
/// size, which is enough to test that it is refused).
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the contiguous axis.
    pub dims: Vec<usize>,
    pub values: Vec<f32>,
}

impl TensorSpec {
    /// The tensor's bytes as stored in the file.
    pub fn encode(&self) -> Vec<u8> {
        encode(self.ty, self.dims[0], &self.values)
    }
    pub fn nbytes(&self) -> usize {
        let rows: usize = self.dims[1..].iter().product();
        self.ty.row_bytes(self.dims[0]).expect("row length is a whole number of blocks") * rows
    }
}

/// A qwen4exp model as metadata entries (in file order) and tensors (in file order).
#[derive(Clone, Debug)]
pub struct TinyModel {
    pub config: TinyConfig,
    pub kv: Vec<(String, Value)>,
    pub tensors: Vec<TensorSpec>,
}

impl Default for TinyModel {
    fn default() -> Self {
        Self::new()
    }
}

fn u32v(x: usize) -> Value {
    Value::U32(x as u32)
}

impl TinyModel {
    /// The default valid model (see the module docs).
    pub fn new() -> Self {
        Self::build(&TinyConfig::default())
    }

    /// A valid model with the dimensions of `c`. Panics if `c` is not itself
    /// consistent (e.g. `hidden` not divisible by the PLE heads).
    pub fn build(c: &TinyConfig) -> Self {
        let mut m = TinyModel { config: c.clone(), kv: Vec::new(), tensors: Vec::new() };
        let a = |k: &str| format!("qwen4exp.{k}");
        let n_layers = c.n_layers();
        let mut kv: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String("qwen4exp".into())),
            ("general.type".into(), Value::String("model".into())),
            ("general.name".into(), Value::String("flashnext tiny test model".into())),
            ("general.file_type".into(), Value::U32(0)),
            ("general.quantization_version".into(), Value::U32(2)),
            (a("block_count"), u32v(n_layers)),
            (a("context_length"), u32v(c.context_length)),
            (a("embedding_length"), u32v(c.hidden)),
            (a("attention.head_count"), u32v(c.n_heads)),
            (a("attention.head_count_kv"), u32v(c.n_kv_heads)),
            (a("attention.key_length"), u32v(c.head_dim)),
            (a("attention.value_length"), u32v(c.head_dim)),
            (a("attention.layer_norm_rms_epsilon"), Value::F32(c.eps)),
            (a("rope.dimension_count"), u32v(c.rope_dims)),
            (
                a("rope.dimension_sections"),
                Value::Array(5, vec![Value::I32(11), Value::I32(11), Value::I32(10), Value::I32(0)]),
            ),
            (a("rope.freq_base"), Value::F32(c.rope_theta)),
            (a("expert_count"), u32v(c.n_experts)),
            (a("expert_used_count"), u32v(c.n_experts_used)),
            (a("expert_feed_forward_length"), u32v(c.expert_ff)),
            (a("expert_shared_feed_forward_length"), u32v(c.shared_ff)),
            (a("ssm.conv_kernel"), u32v(c.ssm_conv)),
            (a("ssm.state_size"), u32v(c.ssm_head_dim)),
            (a("ssm.group_count"), u32v(c.ssm_k_heads)),
            (a("ssm.time_step_rank"), u32v(c.ssm_v_heads)),
            (a("ssm.inner_size"), u32v(c.ssm_v_heads * c.ssm_head_dim)),
            (a("attention.recurrent_layers"), Value::Array(7, c.recurrent.iter().map(|&r| Value::Bool(r)).collect())),
            (a("full_attention_interval"), Value::U32(4)),
            (a("hyper_connection.count"), u32v(c.hc)),
            (a("hyper_connection.low_rank"), u32v(c.hc_rank)),
            (a("attention.indexer.head_count"), u32v(c.indexer_heads)),
            (a("attention.indexer.key_length"), u32v(c.indexer_dim)),
            (a("attention.indexer.top_k"), u32v(c.budget)),
            (
                a("attention.compress_ratios"),
                Value::Array(
                    5,
                    c.recurrent.iter().map(|&r| Value::I32(if r { 0 } else { c.compress_ratio as i32 })).collect(),
                ),
            ),
        ];
        if let Some(pl) = c.ple_layer {
            let (offsets, vocab) = c.ple_heads_layout();
            let limit = (i64::MAX as u64) / c.vocab as u64;
            let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
            let multipliers: Vec<Value> = (0..c.ngram).map(|_| Value::U64((rng.next() % limit) | 1)).collect();
            kv.extend([
                (a("ple.layers"), Value::Array(5, vec![Value::I32(pl as i32)])),
                (a("ple.ngram_size"), u32v(c.ngram)),
                (a("ple.heads_per_ngram"), u32v(c.heads_per_ngram)),
                (a("ple.conv_kernel"), u32v(c.ple_conv)),
                (a("ple.eos_token_id"), Value::U32(c.ple_eos)),
                (a("embedding_length_per_layer_input"), u32v(c.ple_row_dim())),
                (a("ple.layer_multipliers"), Value::Array(10, multipliers)),
                (a("ple.head_offsets"), Value::Array(10, offsets.into_iter().map(Value::U64).collect())),
                (a("ple.head_vocab_sizes"), Value::Array(10, vocab.into_iter().map(Value::U64).collect())),
            ]);
        }
        kv.extend([
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::String("qwen35".into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(8, (0..c.vocab).map(|i| Value::String(format!("t{i}"))).collect()),
            ),
            ("tokenizer.ggml.merges".into(), Value::Array(8, vec![Value::String("t 1".into())])),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(c.ple_eos)),
        ]);
        m.kv = kv;

        let (h, ch, r) = (c.hidden, c.hc * c.hidden, c.hc_rank);
        m.add("token_embd.weight", &[h, c.vocab]);
        if c.output_head {
            m.add("output.weight", &[h, c.vocab]);
        }
        m.add("output_hc_norm.weight", &[ch]);
        m.add("output_hc_down.weight", &[ch, r]);
        m.add("output_hc_up.weight", &[r, ch]);
        if c.ple_layer.is_some() {
            m.add("per_layer_token_embd.weight", &[c.ple_row_dim(), c.ple_table_rows()]);
        }
        for (i, &rec) in c.recurrent.iter().enumerate() {
            let b = |s: &str| format!("blk.{i}.{s}");
            for hc in ["hc_attn", "hc_ffn"] {
                m.add(&b(&format!("{hc}_norm.weight")), &[ch]);
                m.add(&b(&format!("{hc}_down.weight")), &[ch, r]);
                m.add(&b(&format!("{hc}_up.weight")), &[r, ch]);
                m.add(&b(&format!("{hc}_inject.weight")), &[ch, c.hc]);
            }
            if rec {
                let (nv, d) = (c.ssm_v_heads, c.ssm_head_dim);
                m.add(&b("attn_qkv.weight"), &[h, c.ssm_conv_dim()]);
                m.add(&b("attn_gate.weight"), &[h, nv * d]);
                m.add(&b("ssm_beta.weight"), &[h, nv]);
                m.add(&b("ssm_alpha.weight"), &[h, nv]);
                m.add(&b("ssm_conv1d.weight"), &[c.ssm_conv, c.ssm_conv_dim()]);
                m.add(&b("ssm_dt.bias"), &[nv]);
                m.add(&b("ssm_a"), &[nv]);
                m.add(&b("ssm_norm.weight"), &[d]);
                m.add(&b("ssm_out.weight"), &[nv * d, h]);
            } else {
                let (nh, nkv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
                m.add(&b("attn_q.weight"), &[h, 2 * nh * hd]);
                m.add(&b("attn_k.weight"), &[h, nkv * hd]);
                m.add(&b("attn_v.weight"), &[h, nkv * hd]);
                m.add(&b("attn_output.weight"), &[nh * hd, h]);
                m.add(&b("attn_q_norm.weight"), &[hd]);
                m.add(&b("attn_k_norm.weight"), &[hd]);
                if c.compress_ratio > 0 {
                    m.add(&b("indexer.q_proj.weight"), &[h, c.indexer_heads * c.indexer_dim]);
                    m.add(&b("indexer.k_proj.weight"), &[h, c.indexer_dim]);
                    m.add(&b("indexer.q_norm.weight"), &[c.indexer_dim]);
                    m.add(&b("indexer.k_norm.weight"), &[c.indexer_dim]);
                }
            }
            if c.ple_layer == Some(i) {
                m.add(&b("ple_key.weight"), &[h, ch]);
                m.add(&b("ple_value.weight"), &[h, h]);
                m.add(&b("ple_norm_key.weight"), &[ch]);
                m.add(&b("ple_norm_query.weight"), &[ch]);
                m.add(&b("ple_norm_conv.weight"), &[ch]);
                m.add(&b("ple_conv1d.weight"), &[c.ple_conv, ch]);
            }
            let (e, f, fs) = (c.n_experts, c.expert_ff, c.shared_ff);
            m.add(&b("ffn_gate_inp.weight"), &[h, e]);
            if c.fused_experts {
                m.add(&b("ffn_gate_up_exps.weight"), &[h, 2 * f, e]);
            } else {
                m.add(&b("ffn_gate_exps.weight"), &[h, f, e]);
                m.add(&b("ffn_up_exps.weight"), &[h, f, e]);
            }
            m.add(&b("ffn_down_exps.weight"), &[f, h, e]);
            m.add(&b("ffn_gate_inp_shexp.weight"), &[h, 1]);
            m.add(&b("ffn_gate_shexp.weight"), &[h, fs]);
            m.add(&b("ffn_up_shexp.weight"), &[h, fs]);
            m.add(&b("ffn_down_shexp.weight"), &[fs, h]);
        }
        m
    }

    /// Appends an F32 tensor with generated values.
    fn add(&mut self, name: &str, dims: &[usize]) {
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            ty: GgmlType::F32,
            dims: dims.to_vec(),
            values: values_for(name, dims.iter().product()),
        });
    }

    // ---- metadata edits -------------------------------------------------

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kv.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Sets `key` to `value` (in place if present, appended otherwise).
    pub fn set(&mut self, key: &str, value: Value) -> &mut Self {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.kv.push((key.to_string(), value)),
        }
        self
    }

    /// `set("qwen4exp.<key>", value)`.
    pub fn set_arch(&mut self, key: &str, value: Value) -> &mut Self {
        self.set(&format!("qwen4exp.{key}"), value)
    }

    /// Removes `key`; panics if it was not there (to catch typos in tests).
    pub fn remove_key(&mut self, key: &str) -> &mut Self {
        let n = self.kv.len();
        self.kv.retain(|(k, _)| k != key);
        assert!(self.kv.len() < n, "no metadata key {key}");
        self
    }

    // ---- tensor edits ---------------------------------------------------

    pub fn tensor(&self, name: &str) -> &TensorSpec {
        self.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"))
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut TensorSpec {
        self.tensors.iter_mut().find(|t| t.name == name).unwrap_or_else(|| panic!("no tensor {name}"))
    }

    /// Removes tensor `name`; panics if it was not there.
    pub fn remove_tensor(&mut self, name: &str) -> &mut Self {
        let n = self.tensors.len();
        self.tensors.retain(|t| t.name != name);
        assert!(self.tensors.len() < n, "no tensor {name}");
        self
    }

    /// Gives tensor `name` new dims (ggml order) and freshly generated values of that size.
    pub fn set_shape(&mut self, name: &str, dims: &[usize]) -> &mut Self {
        let t = self.tensor_mut(name);
        t.dims = dims.to_vec();
        t.values = values_for(name, dims.iter().product());
        self
    }

    /// Changes the stored type of tensor `name` (values are re-encoded at write time).
    pub fn set_type(&mut self, name: &str, ty: GgmlType) -> &mut Self {
        self.tensor_mut(name).ty = ty;
        self
    }

    /// Sets element `index` (flat, ggml order) of tensor `name`.
    pub fn set_value(&mut self, name: &str, index: usize, v: f32) -> &mut Self {
        self.tensor_mut(name).values[index] = v;
        self
    }

    // ---- output ---------------------------------------------------------

    /// The file as the crate's `GgufWriter` writes it. Panics if the writer
    /// refuses (e.g. a row length that is not a whole number of blocks: use
    /// [`TinyModel::to_raw`] for those).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = GgufWriter::new();
        for (k, v) in &self.kv {
            w.add(k, v.clone());
        }
        for t in &self.tensors {
            let bytes = t.encode();
            w.add_tensor(
                &t.name,
                t.ty,
                &t.dims,
                Box::new(move |out| {
                    out.write_all(&bytes).map_err(|e| flashnext::Error::io("test writer", e))
                }),
            )
            .expect("GgufWriter accepts the tensor");
        }
        let mut out = Cursor::new(Vec::new());
        w.write(&mut out, |_, _, _| {}).expect("GgufWriter writes the model");
        out.into_inner()
    }

    /// Writes [`TinyModel::to_bytes`] to `path`.
    pub fn write(&self, path: &Path) {
        std::fs::write(path, self.to_bytes()).expect("write test GGUF");
    }

    /// The same file as an editable raw container (32-byte alignment,
    /// offsets laid out as `GgufWriter` lays them out).
    pub fn to_raw(&self) -> RawGguf {
        let mut raw = RawGguf::new();
        for (k, v) in &self.kv {
            raw.kv.push(RawKv::new(k, v));
        }
        for t in &self.tensors {
            let bytes = t.encode();
            raw.push_tensor(&t.name, &t.dims.iter().map(|&d| d as u64).collect::<Vec<_>>(), t.ty.id(), &bytes);
        }
        raw
    }
}

// ---- raw container -------------------------------------------------------

/// One metadata entry as stored: key, value type id, and the value's bytes.
#[derive(Clone, Debug)]
pub struct RawKv {
    pub key: Vec<u8>,
    pub ty: u32,
    pub payload: Vec<u8>,
}

impl RawKv {
    pub fn new(key: &str, v: &Value) -> Self {
        let mut payload = Vec::new();
        put_value(&mut payload, v);
        RawKv { key: key.as_bytes().to_vec(), ty: v.type_id(), payload }
    }
    /// An entry with an arbitrary type id and payload.
    pub fn raw(key: &str, ty: u32, payload: Vec<u8>) -> Self {
        RawKv { key: key.as_bytes().to_vec(), ty, payload }
    }
}

/// One tensor info as stored. `offset` is relative to the data section.
#[derive(Clone, Debug)]
pub struct RawTensorInfo {
    pub name: Vec<u8>,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub offset: u64,
}

/// A GGUF file as editable parts; [`RawGguf::to_bytes`] serializes it with
/// no checks at all.
#[derive(Clone, Debug)]
pub struct RawGguf {
    pub magic: [u8; 4],
    pub version: u32,
    /// Header counts; `None` = the true number of entries.
    pub tensor_count: Option<u64>,
    pub kv_count: Option<u64>,
    pub kv: Vec<RawKv>,
    pub tensors: Vec<RawTensorInfo>,
    /// Padding unit of the tensor-info end (the data section starts at the next multiple).
    pub alignment: u64,
    /// The data section.
    pub data: Vec<u8>,
}

impl Default for RawGguf {
    fn default() -> Self {
        Self::new()
    }
}

impl RawGguf {
    /// An empty, valid GGUF v3 container.
    pub fn new() -> Self {
        RawGguf {
            magic: *b"GGUF",
            version: 3,
            tensor_count: None,
            kv_count: None,
            kv: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
            data: Vec::new(),
        }
    }

    /// Appends `bytes` to the data section (after padding it to the
    /// alignment) and a tensor info pointing at them.
    pub fn push_tensor(&mut self, name: &str, dims: &[u64], ty: u32, bytes: &[u8]) {
        let a = self.alignment as usize;
        self.data.resize(self.data.len().div_ceil(a) * a, 0);
        self.tensors.push(RawTensorInfo {
            name: name.as_bytes().to_vec(),
            dims: dims.to_vec(),
            ty,
            offset: self.data.len() as u64,
        });
        self.data.extend_from_slice(bytes);
        self.data.resize(self.data.len().div_ceil(a) * a, 0);
    }

    pub fn tensor_mut(&mut self, name: &str) -> &mut RawTensorInfo {
        self.tensors.iter_mut().find(|t| t.name == name.as_bytes()).unwrap_or_else(|| panic!("no tensor {name}"))
    }

    pub fn kv_mut(&mut self, key: &str) -> &mut RawKv {
        self.kv.iter_mut().find(|k| k.key == key.as_bytes()).unwrap_or_else(|| panic!("no key {key}"))
    }

    /// Header, metadata and tensor infos, unpadded.
    pub fn header_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.magic);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.tensor_count.unwrap_or(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.kv_count.unwrap_or(self.kv.len() as u64).to_le_bytes());
        for kv in &self.kv {
            put_bytes(&mut out, &kv.key);
            out.extend_from_slice(&kv.ty.to_le_bytes());
            out.extend_from_slice(&kv.payload);
        }
        for t in &self.tensors {
            put_bytes(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.to_le_bytes());
            out.extend_from_slice(&t.offset.to_le_bytes());
        }
        out
    }

    /// The whole file: header, zero padding to the alignment, data section.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.header_bytes();
        let a = self.alignment.max(1) as usize;
        out.resize(out.len().div_ceil(a) * a, 0);
        out.extend_from_slice(&self.data);
        out
    }
}

/// Appends a GGUF string (u64 length + bytes).
pub fn put_bytes(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

/// Appends a value's payload exactly as GGUF stores it (no type id).
pub fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_bytes(out, s.as_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(elem, items) => {
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(out, it);
            }
        }
    }
}

// ---- values and encoding -------------------------------------------------

/// SplitMix64: a tiny deterministic generator for weights and test mutations.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, n)` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Uniform in `[-1, 1)`.
    pub fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

fn name_seed(name: &str) -> u64 {
    // FNV-1a
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Deterministic values for a tensor called `name`: norm gammas near 1
/// (`1 + w` folded, as the schema stores them), `ssm_a` in about
/// `[-1.2, -0.8]` (`-exp(A_log)`), biases small, weight matrices uniform in
/// `±0.5/sqrt(n)`-ish magnitudes.
pub fn values_for(name: &str, n: usize) -> Vec<f32> {
    let mut rng = Rng::new(name_seed(name));
    let kind = if name.contains("norm") {
        0
    } else if name.ends_with("ssm_a") {
        1
    } else if name.ends_with(".bias") {
        2
    } else {
        3
    };
    (0..n)
        .map(|_| {
            let u = rng.unit();
            match kind {
                0 => 1.0 + 0.1 * u,
                1 => -(0.2 * u).exp(),
                2 => 0.1 * u,
                _ => 0.2 * u,
            }
        })
        .collect()
}

/// Encodes f32 `values` (rows of `row_len`) as `ty`.
pub fn encode(ty: GgmlType, row_len: usize, values: &[f32]) -> Vec<u8> {
    match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        GgmlType::BF16 => values.iter().flat_map(|&v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect(),
        GgmlType::Q8_0 => {
            assert_eq!(row_len % 32, 0, "Q8_0 rows are whole blocks");
            let mut out = Vec::with_capacity(values.len() / 32 * 34);
            for blk in values.chunks(32) {
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
                out.extend(blk.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
            }
            out
        }
        other => {
            let rows = values.len() / row_len;
            vec![0u8; other.row_bytes(row_len).expect("row length is a whole number of blocks") * rows]
        }
    }
}
