//! The checkpoint converter on synthetic Hugging Face checkpoints built here:
//! both expert layouts, one file vs. shards with an index, `model.` vs.
//! `model.language_model.` prefixes, flat vs. nested config, F32/BF16/F16
//! sources, and each stored transform checked value by value against the
//! source tensors. The last test converts the real transformers fixtures under
//! `tests/fixtures/*/hf` when they exist.

#![recursion_limit = "256"]

use flashnext::convert::{convert, ConvertOptions, ConvertReport, OutType, SkipReason};
use flashnext::gguf::{GgmlType, GgufFile, Value};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

// ---- the synthetic model -------------------------------------------------------------------

const H: usize = 32;
const V: usize = 40;
const L: usize = 4;
const NH: usize = 2;
const NKV: usize = 1;
const HD: usize = 16;
const NK: usize = 2;
const NV: usize = 4;
const DK: usize = 8;
const KC: usize = 4;
const E: usize = 4;
const F: usize = 16;
const FS: usize = 16;
const C: usize = 2;
const R: usize = 8;
const IH: usize = 2;
const ID: usize = 16;
const G: usize = 3;
const HPN: usize = 2;
const HP: usize = (G - 1) * HPN;
const DP: usize = H / HP;
const KP: usize = 3;
const DC: usize = 2 * NK * DK + NV * DK;
/// PLE layer, 0-based (HF id 2).
const PLE_LAYER: usize = 1;
const SHARD_ROWS: [usize; 3] = [5, 5, 6];
const MULTIPLIERS: [i64; 3] = [0x1234_5678_9abc_def1, 0x0fed_cba9_8765_4321, 0x0000_7fff_ffff_ffff];
const OFFSETS: [i64; 4] = [0, 3, 6, 10];
const VOCABS: [i64; 4] = [3, 3, 4, 5];

/// Layout choices of a synthetic checkpoint.
#[derive(Clone, Copy)]
struct Variant {
    fused_experts: bool,
    /// `model.language_model.` names, nested `text_config`, list-valued eos, vision tensors.
    nested: bool,
    /// Number of safetensors files (> 1 writes an index).
    files: usize,
    dtype: Dtype,
    tokenizer: bool,
}

/// Deterministic values that are exact in f32, bf16 and f16 (multiples of 1/32 in [-1.5, 1.5]).
fn values(name: &str, n: usize) -> Vec<f32> {
    let seed = name.bytes().fold(7u64, |h, b| h.wrapping_mul(131).wrapping_add(b as u64));
    (0..n).map(|i| (((seed.wrapping_add(i as u64 * 17)) % 97) as f32 - 48.0) / 32.0).collect()
}

struct Ckpt {
    /// Canonical name (`model.` prefix) → (shape, values).
    t: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// Exact integer buffers.
    ints: BTreeMap<String, Vec<i64>>,
}

impl Ckpt {
    fn add(&mut self, name: &str, shape: &[usize]) {
        let n = shape.iter().product();
        self.t.insert(name.to_string(), (shape.to_vec(), values(name, n)));
    }
    fn get(&self, name: &str) -> &[f32] {
        &self.t.get(name).unwrap_or_else(|| panic!("no source tensor {name}")).1
    }
}

fn layer_types(nested: bool) -> Vec<&'static str> {
    let full = if nested { "indexed_attention" } else { "full_attention" };
    vec!["linear_attention", "linear_attention", "linear_attention", full]
}

fn text_config(v: Variant) -> serde_json::Value {
    json!({
        "model_type": "qwen4_exp_text",
        "vocab_size": V, "hidden_size": H, "num_hidden_layers": L,
        "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "layer_types": layer_types(v.nested),
        "linear_num_key_heads": NK, "linear_num_value_heads": NV,
        "linear_key_head_dim": DK, "linear_value_head_dim": DK, "linear_conv_kernel_dim": KC,
        "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": F,
        "shared_expert_intermediate_size": FS,
        "hc_count": C, "hc_lowrank": R,
        "indexer_n_heads": IH, "indexer_kv_heads": 1, "indexer_head_dim": ID,
        "indexer_budget": 8, "indexer_compress_ratio": 4,
        "ple_layer_ids": [PLE_LAYER + 1], "ple_conv_kernel_size": KP, "ngram_size": G,
        "heads_per_ngram": HPN, "split_ngram_parts": SHARD_ROWS.len(),
        "eos_token_id": if v.nested { json!([37, 36]) } else { json!(37) },
        "pad_token_id": 36,
        "hidden_act": "silu",
        "output_gate_type": if v.nested { json!(null) } else { json!("sigmoid") },
        "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1.0e6,
                             "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}
    })
}

fn build(v: Variant) -> Ckpt {
    let mut c = Ckpt { t: BTreeMap::new(), ints: BTreeMap::new() };
    c.add("model.embed_tokens.weight", &[V, H]);
    c.add("lm_head.weight", &[V, H]);
    c.add("model.hyper_connection_mixer.hc_norm.weight", &[C * H]);
    c.add("model.hyper_connection_mixer.input_mix_weight_down.weight", &[R, C * H]);
    c.add("model.hyper_connection_mixer.input_mix_weight_up.weight", &[C * H, R]);
    for n in 0..L {
        let p = format!("model.layers.{n}");
        for hc in ["attn_hyper_connection", "mlp_hyper_connection"] {
            c.add(&format!("{p}.{hc}.hc_norm.weight"), &[C * H]);
            c.add(&format!("{p}.{hc}.input_mix_weight_down.weight"), &[R, C * H]);
            c.add(&format!("{p}.{hc}.input_mix_weight_up.weight"), &[C * H, R]);
            c.add(&format!("{p}.{hc}.block_inject_weight.weight"), &[C, C * H]);
        }
        if n < 3 {
            let a = format!("{p}.linear_attn");
            c.add(&format!("{a}.in_proj_qkv.weight"), &[DC, H]);
            c.add(&format!("{a}.in_proj_z.weight"), &[NV * DK, H]);
            c.add(&format!("{a}.in_proj_b.weight"), &[NV, H]);
            c.add(&format!("{a}.in_proj_a.weight"), &[NV, H]);
            c.add(&format!("{a}.conv1d.weight"), &[DC, 1, KC]);
            c.add(&format!("{a}.dt_bias"), &[NV]);
            c.add(&format!("{a}.A_log"), &[NV]);
            c.add(&format!("{a}.norm.weight"), &[DK]);
            c.add(&format!("{a}.out_proj.weight"), &[H, NV * DK]);
        } else {
            let a = format!("{p}.self_attn");
            c.add(&format!("{a}.q_proj.weight"), &[2 * NH * HD, H]);
            c.add(&format!("{a}.k_proj.weight"), &[NKV * HD, H]);
            c.add(&format!("{a}.v_proj.weight"), &[NKV * HD, H]);
            c.add(&format!("{a}.o_proj.weight"), &[H, NH * HD]);
            c.add(&format!("{a}.q_norm.weight"), &[HD]);
            c.add(&format!("{a}.k_norm.weight"), &[HD]);
            c.add(&format!("{a}.indexer.index_qk_proj.weight"), &[(IH + 1) * ID, H]);
            c.add(&format!("{a}.indexer.q_layernorm.weight"), &[ID]);
            c.add(&format!("{a}.indexer.k_layernorm.weight"), &[ID]);
        }
        let m = format!("{p}.mlp");
        c.add(&format!("{m}.gate.weight"), &[E, H]);
        if v.fused_experts {
            c.add(&format!("{m}.experts.gate_up_proj"), &[E, 2 * F, H]);
            c.add(&format!("{m}.experts.down_proj"), &[E, H, F]);
        } else {
            for e in 0..E {
                c.add(&format!("{m}.experts.{e}.gate_proj.weight"), &[F, H]);
                c.add(&format!("{m}.experts.{e}.up_proj.weight"), &[F, H]);
                c.add(&format!("{m}.experts.{e}.down_proj.weight"), &[H, F]);
            }
        }
        c.add(&format!("{m}.shared_expert_gate.weight"), &[1, H]);
        c.add(&format!("{m}.shared_expert.gate_proj.weight"), &[FS, H]);
        c.add(&format!("{m}.shared_expert.up_proj.weight"), &[FS, H]);
        c.add(&format!("{m}.shared_expert.down_proj.weight"), &[H, FS]);
    }
    let p = format!("model.layers.{PLE_LAYER}.ple");
    c.add(&format!("{p}.key_proj.weight"), &[C * H, H]);
    c.add(&format!("{p}.value_proj.weight"), &[H, H]);
    for k in ["key", "query", "conv"] {
        c.add(&format!("{p}.norm_{k}.weight"), &[C * H]);
    }
    c.add(&format!("{p}.conv1d.weight"), &[C * H, 1, KP]);
    for (k, rows) in SHARD_ROWS.iter().enumerate() {
        c.add(&format!("{p}.ple_embedding.ngram_embedding.shard_{k}.weight"), &[*rows, DP]);
    }
    c.ints.insert(format!("{p}.ple_embedding.layer_multipliers"), MULTIPLIERS.to_vec());
    c.ints.insert(format!("{p}.ple_embedding.ngram_heads_offsets"), OFFSETS.to_vec());
    c.ints.insert(format!("{p}.ple_embedding.ngram_heads_vocab_sizes"), VOCABS.to_vec());
    // Tensors the converter must drop.
    c.add("mtp.fc.weight", &[H, 2 * H]);
    c.add("mtp.layers.0.mlp.gate.weight", &[E, H]);
    if v.nested {
        c.add("model.visual.blocks.0.attn.qkv.weight", &[3 * 8, 8]);
    }
    c
}

fn encode(dtype: Dtype, vals: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::F16 => vals.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        Dtype::BF16 => vals.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        other => panic!("{other:?}"),
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flashnext-convert-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes the checkpoint in `dir` and returns its source values.
fn write_checkpoint(dir: &Path, v: Variant) -> Ckpt {
    let ck = build(v);
    let stored = |name: &str| {
        if v.nested && name.starts_with("model.") && !name.starts_with("model.visual.") {
            name.replacen("model.", "model.language_model.", 1)
        } else {
            name.to_string()
        }
    };
    // (stored name, dtype, shape, bytes); alternate the float dtype a little in nested mode.
    let mut all: Vec<RawTensor> = Vec::new();
    for (i, (name, (shape, vals))) in ck.t.iter().enumerate() {
        let dt = if v.nested && i % 3 == 0 { Dtype::F16 } else { v.dtype };
        all.push((stored(name), dt, shape.clone(), encode(dt, vals)));
    }
    for (name, ints) in &ck.ints {
        let bytes = ints.iter().flat_map(|x| x.to_le_bytes()).collect();
        all.push((stored(name), Dtype::I64, vec![ints.len()], bytes));
    }
    let mut weight_map = serde_json::Map::new();
    let per_file = all.len().div_ceil(v.files);
    for (f, chunk) in all.chunks(per_file).enumerate() {
        let fname = if v.files == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", f + 1, v.files)
        };
        let views: Vec<(String, TensorView)> =
            chunk.iter().map(|(n, dt, s, b)| (n.clone(), TensorView::new(*dt, s.clone(), b).unwrap())).collect();
        for (n, ..) in chunk {
            weight_map.insert(n.clone(), json!(fname));
        }
        safetensors::serialize_to_file(views, &None, &dir.join(&fname)).unwrap();
    }
    if v.files > 1 {
        let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
    let config = if v.nested {
        json!({"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
               "image_token_id": 38, "text_config": text_config(v),
               "vision_config": {"depth": 1}})
    } else {
        text_config(v)
    };
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    if v.tokenizer {
        write_tokenizer(dir);
    }
    ck
}

/// A byte-level BPE tokenizer.json with pair-form merges (one containing a
/// space) and added tokens; ids 30..36 have no token at all.
fn write_tokenizer(dir: &Path) {
    let mut vocab = serde_json::Map::new();
    for i in 0..30u32 {
        vocab.insert(format!("t{i}"), json!(i));
    }
    let tok = json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 36, "content": "<|endoftext|>", "special": true, "normalized": false},
            {"id": 37, "content": "<|im_end|>", "special": true, "normalized": false},
            {"id": 38, "content": "<|image_pad|>", "special": false, "normalized": false},
            {"id": 39, "content": "<think>", "special": false, "normalized": false}
        ],
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false},
        "model": {"type": "BPE", "vocab": vocab, "merges": [["t1", "t2"], ["a b", "c"]]}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let tc = json!({"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"},
                    "bos_token": null, "add_bos_token": false, "chat_template": "{{ messages }}"});
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
}

// ---- reading the result --------------------------------------------------------------------

/// A checkpoint tensor as written: (name, dtype, shape, bytes).
type RawTensor = (String, Dtype, Vec<usize>, Vec<u8>);

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn tensor(f: &GgufFile, name: &str, ty: GgmlType, dims: &[usize]) -> Vec<u8> {
    let t = f.tensor(name).unwrap_or_else(|| panic!("output has no tensor {name}"));
    assert_eq!((t.ty, t.dims.as_slice()), (ty, dims), "{name}: type/dims");
    f.tensor_data(t).to_vec()
}

fn f32_tensor(f: &GgufFile, name: &str, dims: &[usize]) -> Vec<f32> {
    f32s(&tensor(f, name, GgmlType::F32, dims))
}

fn meta<'a>(f: &'a GgufFile, key: &str) -> &'a Value {
    f.metadata.get(key).unwrap_or_else(|| panic!("missing key {key}"))
}

fn run(dir: &Path, out_type: OutType) -> (GgufFile, ConvertReport) {
    let out = dir.join(format!("out-{out_type}.gguf"));
    let report = convert(dir, &out, &ConvertOptions::new(out_type)).expect("conversion succeeds");
    assert!(!dir.join(format!("out-{out_type}.gguf.partial")).exists());
    (GgufFile::open(&out).unwrap(), report)
}

/// V-head reorder of spec §3.5: new head `j*NK + i` ← old head `i*r_v + j`.
fn old_head(new_head: usize) -> usize {
    let rv = NV / NK;
    (new_head % NK) * rv + new_head / NK
}

fn check_common(f: &GgufFile, ck: &Ckpt, v: Variant, report: &ConvertReport) {
    // Keys and their exact GGUF types.
    assert_eq!(meta(f, "general.architecture"), &Value::String("qwen4exp".into()));
    assert_eq!(meta(f, "general.file_type"), &Value::U32(0));
    assert_eq!(meta(f, "qwen4exp.block_count"), &Value::U32(L as u32));
    assert_eq!(meta(f, "qwen4exp.embedding_length"), &Value::U32(H as u32));
    assert_eq!(meta(f, "qwen4exp.attention.key_length"), &Value::U32(HD as u32));
    assert_eq!(meta(f, "qwen4exp.attention.layer_norm_rms_epsilon"), &Value::F32(1e-6));
    assert_eq!(meta(f, "qwen4exp.rope.dimension_count"), &Value::U32((HD / 2) as u32));
    assert_eq!(meta(f, "qwen4exp.rope.freq_base"), &Value::F32(1e6));
    assert_eq!(
        meta(f, "qwen4exp.rope.dimension_sections"),
        &Value::Array(5, vec![Value::I32(2), Value::I32(1), Value::I32(1), Value::I32(0)])
    );
    assert_eq!(meta(f, "qwen4exp.ssm.inner_size"), &Value::U32((NV * DK) as u32));
    assert_eq!(meta(f, "qwen4exp.ssm.time_step_rank"), &Value::U32(NV as u32));
    assert_eq!(meta(f, "qwen4exp.hyper_connection.count"), &Value::U32(C as u32));
    assert_eq!(meta(f, "qwen4exp.attention.indexer.top_k"), &Value::U32(8));
    assert_eq!(meta(f, "qwen4exp.expert_count"), &Value::U32(E as u32));
    assert_eq!(
        meta(f, "qwen4exp.attention.recurrent_layers"),
        &Value::Array(7, vec![Value::Bool(true), Value::Bool(true), Value::Bool(true), Value::Bool(false)])
    );
    // "indexed_attention" (nested variant) is a QSA layer just like "full_attention".
    assert_eq!(
        meta(f, "qwen4exp.attention.compress_ratios"),
        &Value::Array(5, vec![Value::I32(0), Value::I32(0), Value::I32(0), Value::I32(4)])
    );
    assert_eq!(meta(f, "qwen4exp.ple.layers"), &Value::Array(5, vec![Value::I32(PLE_LAYER as i32)]));
    assert_eq!(meta(f, "qwen4exp.ple.eos_token_id"), &Value::U32(37), "first eos of the list");
    assert_eq!(meta(f, "qwen4exp.embedding_length_per_layer_input"), &Value::U32(DP as u32));
    let u64s = |v: &[i64]| Value::Array(10, v.iter().map(|&x| Value::U64(x as u64)).collect());
    assert_eq!(meta(f, "qwen4exp.ple.layer_multipliers"), &u64s(&MULTIPLIERS));
    assert_eq!(meta(f, "qwen4exp.ple.head_offsets"), &u64s(&OFFSETS));
    assert_eq!(meta(f, "qwen4exp.ple.head_vocab_sizes"), &u64s(&VOCABS));
    let gate = if v.nested { "silu" } else { "sigmoid" };
    assert_eq!(meta(f, "flashnext.ssm.output_gate"), &Value::String(gate.into()));
    assert!(f.metadata.get("qwen4exp.nextn_predict_layers").is_none());
    if v.nested {
        assert_eq!(meta(f, "qwen4exp.ple.image_token_id"), &Value::U32(38));
    }

    // Tensor inventory: globals 5 (+table), per layer 8 HC + 8 MoE, 9 linear / 10 full, 6 PLE.
    assert_eq!(f.tensors.len(), 5 + 1 + L * 16 + 3 * 9 + 10 + 6);
    assert_eq!(report.written.len(), f.tensors.len());
    let skipped: HashMap<&str, SkipReason> = report.skipped.iter().map(|s| (s.name.as_str(), s.reason)).collect();
    assert_eq!(skipped.get("mtp.fc.weight"), Some(&SkipReason::Mtp));
    assert_eq!(skipped.get("mtp.layers.0.mlp.gate.weight"), Some(&SkipReason::Mtp));
    if v.nested {
        assert_eq!(skipped.get("model.visual.blocks.0.attn.qkv.weight"), Some(&SkipReason::Vision));
    }
    assert_eq!(report.skipped.len(), if v.nested { 3 } else { 2 });

    // 1 + w on the zero-centred norms; ssm_norm is plain.
    let norm = f32_tensor(f, "blk.2.hc_ffn_norm.weight", &[C * H]);
    let src = ck.get("model.layers.2.mlp_hyper_connection.hc_norm.weight");
    assert!(norm.iter().zip(src).all(|(o, s)| *o == 1.0 + s));
    let qn = f32_tensor(f, "blk.3.indexer.q_norm.weight", &[ID]);
    let src = ck.get("model.layers.3.self_attn.indexer.q_layernorm.weight");
    assert!(qn.iter().zip(src).all(|(o, s)| *o == 1.0 + s));
    let pn = f32_tensor(f, &format!("blk.{PLE_LAYER}.ple_norm_query.weight"), &[C * H]);
    let src = ck.get(&format!("model.layers.{PLE_LAYER}.ple.norm_query.weight"));
    assert!(pn.iter().zip(src).all(|(o, s)| *o == 1.0 + s));
    assert_eq!(f32_tensor(f, "blk.0.ssm_norm.weight", &[DK]), ck.get("model.layers.0.linear_attn.norm.weight"));

    // ssm_a = -exp(A_log) after the V reorder, dt_bias reordered.
    let a = f32_tensor(f, "blk.0.ssm_a", &[NV]);
    let a_log = ck.get("model.layers.0.linear_attn.A_log");
    let dt = f32_tensor(f, "blk.0.ssm_dt.bias", &[NV]);
    let dt_src = ck.get("model.layers.0.linear_attn.dt_bias");
    for h in 0..NV {
        let want = -a_log[old_head(h)].exp();
        assert!((a[h] - want).abs() <= 1e-6 * want.abs(), "ssm_a[{h}] = {} want {want}", a[h]);
        assert_eq!(dt[h], dt_src[old_head(h)]);
    }
    // Old head order [0 1 | 2 3] (two value heads per key head) becomes tiled [0 2 1 3].
    assert_eq!((0..NV).map(old_head).collect::<Vec<_>>(), vec![0, 2, 1, 3]);

    // qkv: q/k rows unchanged, V rows reordered by head (unit DK).
    let qkv = f32_tensor(f, "blk.1.attn_qkv.weight", &[H, DC]);
    let src = ck.get("model.layers.1.linear_attn.in_proj_qkv.weight");
    for row in 0..DC {
        let src_row = if row < 2 * NK * DK {
            row
        } else {
            let (h, t) = ((row - 2 * NK * DK) / DK, (row - 2 * NK * DK) % DK);
            2 * NK * DK + old_head(h) * DK + t
        };
        assert_eq!(&qkv[row * H..(row + 1) * H], &src[src_row * H..(src_row + 1) * H], "qkv row {row}");
    }
    // Conv: [DC, 1, KC] squeezed to {KC, DC}, same channel reorder, kept F32.
    let conv = f32_tensor(f, "blk.1.ssm_conv1d.weight", &[KC, DC]);
    let src = ck.get("model.layers.1.linear_attn.conv1d.weight");
    let ch = 2 * NK * DK + DK; // first channel of new V head 1 = old head 2
    let src_ch = 2 * NK * DK + old_head(1) * DK;
    assert_eq!(&conv[ch * KC..(ch + 1) * KC], &src[src_ch * KC..(src_ch + 1) * KC]);
    assert_eq!(&conv[..KC], &src[..KC]);
    // z rows and a/b rows.
    let z = f32_tensor(f, "blk.0.attn_gate.weight", &[H, NV * DK]);
    let src = ck.get("model.layers.0.linear_attn.in_proj_z.weight");
    for h in 0..NV {
        let (o, s) = (h * DK * H, old_head(h) * DK * H);
        assert_eq!(&z[o..o + DK * H], &src[s..s + DK * H]);
    }
    let beta = f32_tensor(f, "blk.0.ssm_beta.weight", &[H, NV]);
    let src = ck.get("model.layers.0.linear_attn.in_proj_b.weight");
    assert_eq!(&beta[H..2 * H], &src[old_head(1) * H..(old_head(1) + 1) * H]);
    // out_proj: columns reordered.
    let out = f32_tensor(f, "blk.2.ssm_out.weight", &[NV * DK, H]);
    let src = ck.get("model.layers.2.linear_attn.out_proj.weight");
    for r in 0..H {
        for col in 0..NV * DK {
            let sc = old_head(col / DK) * DK + col % DK;
            assert_eq!(out[r * NV * DK + col], src[r * NV * DK + sc]);
        }
    }

    // Indexer split.
    let src = ck.get("model.layers.3.self_attn.indexer.index_qk_proj.weight");
    let q = f32_tensor(f, "blk.3.indexer.q_proj.weight", &[H, IH * ID]);
    let k = f32_tensor(f, "blk.3.indexer.k_proj.weight", &[H, ID]);
    assert_eq!(q.as_slice(), &src[..IH * ID * H]);
    assert_eq!(k.as_slice(), &src[IH * ID * H..]);

    // Expert stacking: gate/up {H, F, E}, down {F, H, E}.
    let gate = f32_tensor(f, "blk.2.ffn_gate_exps.weight", &[H, F, E]);
    let up = f32_tensor(f, "blk.2.ffn_up_exps.weight", &[H, F, E]);
    let down = f32_tensor(f, "blk.2.ffn_down_exps.weight", &[F, H, E]);
    for e in 0..E {
        let (g_src, u_src, d_src): (Vec<f32>, Vec<f32>, Vec<f32>) = if v.fused_experts {
            let gu = ck.get("model.layers.2.mlp.experts.gate_up_proj");
            let ex = &gu[e * 2 * F * H..(e + 1) * 2 * F * H];
            let d = ck.get("model.layers.2.mlp.experts.down_proj");
            (ex[..F * H].to_vec(), ex[F * H..].to_vec(), d[e * H * F..(e + 1) * H * F].to_vec())
        } else {
            let g = |w: &str| ck.get(&format!("model.layers.2.mlp.experts.{e}.{w}_proj.weight")).to_vec();
            (g("gate"), g("up"), g("down"))
        };
        assert_eq!(&gate[e * F * H..(e + 1) * F * H], g_src.as_slice(), "gate expert {e}");
        assert_eq!(&up[e * F * H..(e + 1) * F * H], u_src.as_slice(), "up expert {e}");
        assert_eq!(&down[e * H * F..(e + 1) * H * F], d_src.as_slice(), "down expert {e}");
    }
    let router = f32_tensor(f, "blk.2.ffn_gate_inp.weight", &[H, E]);
    assert_eq!(router, ck.get("model.layers.2.mlp.gate.weight"));
    f32_tensor(f, "blk.2.ffn_gate_inp_shexp.weight", &[H, 1]);

    // PLE table = shards concatenated in index order; conv squeezed.
    let rows: usize = SHARD_ROWS.iter().sum();
    let table = f32_tensor(f, "per_layer_token_embd.weight", &[DP, rows]);
    let mut want = Vec::new();
    for k in 0..SHARD_ROWS.len() {
        want.extend_from_slice(
            ck.get(&format!("model.layers.{PLE_LAYER}.ple.ple_embedding.ngram_embedding.shard_{k}.weight")),
        );
    }
    assert_eq!(table, want);
    let conv = f32_tensor(f, &format!("blk.{PLE_LAYER}.ple_conv1d.weight"), &[KP, C * H]);
    assert_eq!(conv, ck.get(&format!("model.layers.{PLE_LAYER}.ple.conv1d.weight")));

    // Plain copies.
    assert_eq!(f32_tensor(f, "token_embd.weight", &[H, V]), ck.get("model.embed_tokens.weight"));
    assert_eq!(f32_tensor(f, "output.weight", &[H, V]), ck.get("lm_head.weight"));
    assert_eq!(
        f32_tensor(f, "blk.0.hc_attn_inject.weight", &[C * H, C]),
        ck.get("model.layers.0.attn_hyper_connection.block_inject_weight.weight")
    );
    assert_eq!(
        f32_tensor(f, "blk.3.attn_q.weight", &[H, 2 * NH * HD]),
        ck.get("model.layers.3.self_attn.q_proj.weight")
    );
    assert_eq!(
        f32_tensor(f, "blk.3.attn_output.weight", &[NH * HD, H]),
        ck.get("model.layers.3.self_attn.o_proj.weight")
    );
}

// ---- tests ---------------------------------------------------------------------------------

#[test]
fn flat_single_file_fused_experts_with_tokenizer() {
    let dir = temp_dir("flat");
    let v = Variant { fused_experts: true, nested: false, files: 1, dtype: Dtype::F32, tokenizer: true };
    let ck = write_checkpoint(&dir, v);
    let (f, report) = run(&dir, OutType::F32);
    check_common(&f, &ck, v, &report);

    // Tokenizer keys as llama.cpp's _set_vocab_gpt2 writes them.
    assert!(report.tokenizer);
    assert_eq!(meta(&f, "tokenizer.ggml.model"), &Value::String("gpt2".into()));
    assert_eq!(meta(&f, "tokenizer.ggml.pre"), &Value::String("qwen35".into()));
    let Value::Array(8, tokens) = meta(&f, "tokenizer.ggml.tokens") else { panic!("tokens type") };
    assert_eq!(tokens.len(), V);
    assert_eq!(tokens[5], Value::String("t5".into()));
    assert_eq!(tokens[31], Value::String("[PAD31]".into()));
    assert_eq!(tokens[37], Value::String("<|im_end|>".into()));
    let Value::Array(5, types) = meta(&f, "tokenizer.ggml.token_type") else { panic!("token_type must be INT32") };
    let ty = |i: usize| types[i].clone();
    assert_eq!((ty(0), ty(31), ty(36), ty(37)), (Value::I32(1), Value::I32(5), Value::I32(3), Value::I32(3)));
    // Not special but looks like <|...|> → control; plain added token → user-defined.
    assert_eq!((ty(38), ty(39)), (Value::I32(3), Value::I32(4)));
    assert_eq!(
        meta(&f, "tokenizer.ggml.merges"),
        &Value::Array(8, vec![Value::String("t1 t2".into()), Value::String("a\u{120}b c".into())])
    );
    assert_eq!(meta(&f, "tokenizer.ggml.eos_token_id"), &Value::U32(37));
    assert_eq!(meta(&f, "tokenizer.ggml.padding_token_id"), &Value::U32(36));
    assert!(f.metadata.get("tokenizer.ggml.bos_token_id").is_none());
    assert_eq!(meta(&f, "tokenizer.ggml.add_bos_token"), &Value::Bool(false));
    assert_eq!(meta(&f, "tokenizer.chat_template"), &Value::String("{{ messages }}".into()));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn nested_sharded_per_expert_bf16_without_tokenizer() {
    let dir = temp_dir("nested");
    let v = Variant { fused_experts: false, nested: true, files: 3, dtype: Dtype::BF16, tokenizer: false };
    let ck = write_checkpoint(&dir, v);
    assert!(dir.join("model.safetensors.index.json").exists());
    let (f, report) = run(&dir, OutType::F32);
    check_common(&f, &ck, v, &report);
    assert!(!report.tokenizer);
    assert!(f.metadata.get("tokenizer.ggml.tokens").is_none());
    assert!(report.notes.iter().any(|n| n.contains("no tokenizer.json")));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn storage_types_and_encodings() {
    let dir = temp_dir("types");
    let v = Variant { fused_experts: true, nested: false, files: 2, dtype: Dtype::F16, tokenizer: false };
    let ck = write_checkpoint(&dir, v);

    let (f, _) = run(&dir, OutType::Q8_0);
    assert_eq!(meta(&f, "general.file_type"), &Value::U32(7));
    let ty = |n: &str| f.tensor(n).unwrap_or_else(|| panic!("{n}")).ty;
    assert_eq!(ty("token_embd.weight"), GgmlType::Q8_0);
    assert_eq!(ty("blk.0.ffn_gate_exps.weight"), GgmlType::Q8_0);
    assert_eq!(ty("blk.3.indexer.q_proj.weight"), GgmlType::Q8_0);
    assert_eq!(ty("blk.0.ffn_gate_inp.weight"), GgmlType::F32);
    assert_eq!(ty("blk.0.ffn_gate_inp_shexp.weight"), GgmlType::F32);
    assert_eq!(ty("blk.0.ssm_conv1d.weight"), GgmlType::F32);
    assert_eq!(ty("blk.0.ssm_a"), GgmlType::F32);
    assert_eq!(ty("blk.0.hc_attn_norm.weight"), GgmlType::F32);
    // Rows not a multiple of 32 fall back to F16.
    assert_eq!(ty(&format!("blk.{PLE_LAYER}.ple_conv1d.weight")), GgmlType::F16);
    assert_eq!(ty("per_layer_token_embd.weight"), GgmlType::F16);
    assert_eq!(ty("blk.0.hc_attn_up.weight"), GgmlType::F16); // ne0 = R = 8
                                                              // Q8_0 bytes equal the reference quantizer on the source values.
    let src = ck.get("model.embed_tokens.weight");
    let mut want = vec![0u8; V * H / 32 * 34];
    flashnext::quant::legacy::quantize_q8_0(src, &mut want);
    assert_eq!(tensor(&f, "token_embd.weight", GgmlType::Q8_0, &[H, V]), want);

    let (f, _) = run(&dir, OutType::BF16);
    assert_eq!(meta(&f, "general.file_type"), &Value::U32(32));
    let got = tensor(&f, "blk.1.ssm_alpha.weight", GgmlType::BF16, &[H, NV]);
    let src = ck.get("model.layers.1.linear_attn.in_proj_a.weight");
    let want: Vec<f32> = (0..NV).flat_map(|h| src[old_head(h) * H..(old_head(h) + 1) * H].to_vec()).collect();
    let got: Vec<f32> = got.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
    assert_eq!(got, want);

    let (f, _) = run(&dir, OutType::F16);
    assert_eq!(meta(&f, "general.file_type"), &Value::U32(1));
    let got = tensor(&f, "output.weight", GgmlType::F16, &[H, V]);
    let got: Vec<f32> = got.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
    assert_eq!(got, ck.get("lm_head.weight"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each broken checkpoint is refused with a message naming the problem, and no output is left behind.
#[test]
fn refuses_broken_checkpoints() {
    let base = Variant { fused_experts: true, nested: false, files: 1, dtype: Dtype::F32, tokenizer: false };
    let expect_err = |tag: &str, edit: &dyn Fn(&Path), needle: &str| {
        let dir = temp_dir(&format!("err-{tag}"));
        write_checkpoint(&dir, base);
        edit(&dir);
        let out = dir.join("out.gguf");
        let err = convert(&dir, &out, &ConvertOptions::new(OutType::F32)).expect_err(tag).to_string();
        assert!(err.contains(needle), "{tag}: error {err:?} does not mention {needle:?}");
        assert!(!out.exists() && !dir.join("out.gguf.partial").exists(), "{tag}: output left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    };
    let set = |k: &'static str, v: serde_json::Value| {
        move |dir: &Path| {
            let p = dir.join("config.json");
            let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            c[k] = v.clone();
            std::fs::write(&p, c.to_string()).unwrap();
        }
    };
    // Rewrites model.safetensors with `f` applied to the tensor list.
    let retensor = |f: fn(&mut Vec<RawTensor>)| {
        move |dir: &Path| {
            let p = dir.join("model.safetensors");
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let mut all: Vec<_> =
                st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
            f(&mut all);
            let views: Vec<_> =
                all.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
            safetensors::serialize_to_file(views, &None, &p).unwrap();
        }
    };

    expect_err("hc", &set("hc_count", json!(1)), "hc_count");
    expect_err("idxkv", &set("indexer_kv_heads", json!(2)), "indexer_kv_heads");
    expect_err("ple2", &set("ple_layer_ids", json!([1, 2])), "exactly one");
    expect_err("plefull", &set("ple_layer_ids", json!([4])), "not a linear_attention layer");
    expect_err("pledim", &set("ple_embed_dim", json!(16)), "ple_embed_dim");
    expect_err(
        "ltype",
        &set("layer_types", json!(["linear_attention", "linear_attention", "linear_attention", "sliding_attention"])),
        "layer_types[3]",
    );
    expect_err("missing-field", &set("hidden_size", json!(null)), "hidden_size");
    expect_err("shards", &set("split_ngram_parts", json!(4)), "shards");
    expect_err(
        "missing",
        &retensor(|all| all.retain(|t| t.0 != "model.layers.3.self_attn.k_norm.weight")),
        "missing tensor model.layers.3.self_attn.k_norm.weight",
    );
    expect_err(
        "shape",
        &retensor(|all| {
            let t = all.iter_mut().find(|t| t.0 == "model.layers.0.linear_attn.in_proj_z.weight").unwrap();
            t.2 = vec![NV * DK / 2, 2 * H];
        }),
        "shape [16, 64], expected [32, 32]",
    );
    expect_err(
        "dtype",
        &retensor(|all| {
            let t = all.iter_mut().find(|t| t.0 == "model.layers.0.mlp.gate.weight").unwrap();
            t.1 = Dtype::I32;
        }),
        "unsupported dtype",
    );
    expect_err(
        "shardwidth",
        &retensor(|all| {
            let t = all.iter_mut().find(|t| t.0.ends_with("shard_1.weight")).unwrap();
            t.2 = vec![SHARD_ROWS[1] * 2, DP / 2];
        }),
        "PLE shard",
    );
    expect_err(
        "unexpected",
        &retensor(|all| all.push(("model.layers.0.self_attn.q_proj.bias".into(), Dtype::F32, vec![1], vec![0; 4]))),
        "not part of the qwen4exp text model",
    );
}

/// The tiny transformers checkpoints under tests/fixtures, when present, convert
/// in every output type and name every tensor the way llama.cpp expects.
#[test]
fn fixtures_convert() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let Ok(entries) = std::fs::read_dir(&root) else {
        return;
    };
    let mut dirs: Vec<PathBuf> =
        entries.flatten().map(|e| e.path().join("hf")).filter(|p| p.join("config.json").is_file()).collect();
    dirs.sort();
    for hf in dirs {
        let out_dir = temp_dir(&format!("fixture-{}", hf.parent().unwrap().file_name().unwrap().to_string_lossy()));
        for t in [OutType::F32, OutType::BF16, OutType::Q8_0] {
            let out = out_dir.join(format!("{t}.gguf"));
            let report =
                convert(&hf, &out, &ConvertOptions::new(t)).unwrap_or_else(|e| panic!("{}: {e}", hf.display()));
            let f = GgufFile::open(&out).unwrap();
            assert_eq!(f.tensors.len(), report.written.len());
            assert_eq!(meta(&f, "general.architecture"), &Value::String("qwen4exp".into()));
            assert!(f.tensor("token_embd.weight").is_some());
            assert!(f.tensors.iter().all(|t| t.name.len() <= 63));
            assert!(report.skipped.iter().all(|s| matches!(s.reason, SkipReason::Mtp | SkipReason::Vision)));
        }
        std::fs::remove_dir_all(&out_dir).unwrap();
    }
}
