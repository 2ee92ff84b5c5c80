//! The Hugging Face → GGUF tensor mapping (spec §3): which checkpoint tensor
//! becomes which `blk.N.*` tensor, with which shape check, transform and type.
//!
//! Planning reads only safetensors headers (plus the three tiny PLE int64
//! buffers). Every check — missing tensors, shapes, dtypes, PLE shard set,
//! leftover tensors nobody consumed — happens here, before the output file is
//! created, so a conversion either fails in seconds or writes a complete file.

use super::config::{HfConfig, PleConfig};
use super::source::{SourceSet, SrcId};
use super::tensors::{v_head_perm, ElemOp, OutTensor, RowMap};
use super::{OutType, SkipReason, SkippedTensor};
use crate::error::{Error, Result};
use crate::gguf::GgmlType;
use crate::quant::policy::{ModelShape, TensorTypeOverride, TypePolicy};
use safetensors::Dtype;

/// The three PLE hash constants, exact (written as UINT64 arrays).
pub(crate) struct PleArrays {
    pub layer_multipliers: Vec<u64>,
    pub head_offsets: Vec<u64>,
    pub head_vocab_sizes: Vec<u64>,
}

pub(crate) struct Plan {
    pub tensors: Vec<OutTensor>,
    pub skipped: Vec<SkippedTensor>,
    pub ple: Option<PleArrays>,
}

/// Tensors always stored as F32 (spec §3.9): 1-D, norms, routers, the GDN
/// conv kernel and names without `.weight`. llama-quantize keeps them too.
fn forced_f32(name: &str, dims: &[usize]) -> bool {
    dims.len() <= 1
        || name.ends_with("_norm.weight")
        || name.ends_with(".ffn_gate_inp.weight")
        || name.ends_with(".ffn_gate_inp_shexp.weight")
        || name.ends_with(".ssm_conv1d.weight")
        || !name.ends_with(".weight")
}

/// The type a tensor is stored as (spec §3.9).
pub(crate) fn storage_type(name: &str, dims: &[usize], out: OutType) -> GgmlType {
    // A preset is applied to the whole f32 plan afterwards (`apply_policy`).
    let ty = if matches!(out, OutType::Quant(_)) { GgmlType::F32 } else { out.ggml_type() };
    match () {
        _ if forced_f32(name, dims) => GgmlType::F32,
        // A row that is not a whole number of blocks (Q8_0 on ple_conv1d) falls back to F16.
        _ if ty.row_bytes(dims[0]).is_none() => GgmlType::F16,
        _ => ty,
    }
}

/// GGUF dims of an HF shape: reversed, with the singleton middle axis of a
/// depthwise conv kernel `[channels, 1, K]` squeezed out (→ `{K, channels}`).
fn ggml_dims(shape: &[usize]) -> Vec<usize> {
    match shape {
        [ch, 1, k] => vec![*k, *ch],
        _ => shape.iter().rev().copied().collect(),
    }
}

struct Planner<'a> {
    cfg: &'a HfConfig,
    src: &'a SourceSet,
    out: OutType,
    used: Vec<bool>,
    tensors: Vec<OutTensor>,
}

impl Planner<'_> {
    /// Finds `name`, checks it is a float tensor of exactly `shape`, marks it used.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<SrcId> {
        let id = self.src.get(name).ok_or_else(|| Error::convert(format!("missing tensor {name}")))?;
        self.check(id, shape)?;
        Ok(id)
    }

    fn check(&mut self, id: SrcId, shape: &[usize]) -> Result<()> {
        let t = &self.src.tensors[id];
        if !matches!(t.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
            return Err(Error::convert(format!(
                "tensor {}: unsupported dtype {:?} (expected F32, F16 or BF16)",
                t.orig_name, t.dtype
            )));
        }
        if t.shape != shape {
            return Err(Error::convert(format!(
                "tensor {}: shape {:?}, expected {:?} from config.json",
                t.orig_name, t.shape, shape
            )));
        }
        self.used[id] = true;
        Ok(())
    }

    fn push(&mut self, name: String, dims: Vec<usize>, rows: RowMap) -> &mut OutTensor {
        let ty = storage_type(&name, &dims, self.out);
        self.tensors.push(OutTensor { name, dims, ty, rows, col_perm: None, op: ElemOp::None });
        self.tensors.last_mut().unwrap()
    }

    /// `hf` (HF shape `shape`) → `out` with dims [`ggml_dims`], rows picked by `rows(src)`.
    fn map(
        &mut self,
        out: String,
        hf: &str,
        shape: &[usize],
        rows: impl FnOnce(SrcId) -> RowMap,
    ) -> Result<&mut OutTensor> {
        let src = self.take(hf, shape)?;
        Ok(self.push(out, ggml_dims(shape), rows(src)))
    }

    /// A tensor copied as is, then `op`.
    fn plain(&mut self, out: String, hf: &str, shape: &[usize], op: ElemOp) -> Result<()> {
        self.map(out, hf, shape, |src| RowMap::Range { src, start: 0 })?.op = op;
        Ok(())
    }

    /// Rows gathered by `perm` (the V-head reorder of rows / conv channels).
    fn rows(&mut self, out: String, hf: &str, shape: &[usize], perm: Vec<usize>) -> Result<()> {
        self.map(out, hf, shape, |src| RowMap::Perm { src, perm })?;
        Ok(())
    }

    /// Values permuted by `perm` inside every row (V-head reorder of columns and
    /// of 1-D vectors, which are a single row), then `op`.
    fn cols(&mut self, out: String, hf: &str, shape: &[usize], perm: Vec<usize>, op: ElemOp) -> Result<()> {
        let t = self.map(out, hf, shape, |src| RowMap::Range { src, start: 0 })?;
        t.col_perm = Some(perm);
        t.op = op;
        Ok(())
    }

    fn globals(&mut self) -> Result<()> {
        let c = self.cfg;
        let (h, v, ch, r) = (c.hidden_size, c.vocab_size, c.hc_count * c.hidden_size, c.hc_lowrank);
        let mix = |s: &str| format!("model.hyper_connection_mixer.{s}.weight");
        let o = |s: &str| s.to_string();
        self.plain(o("token_embd.weight"), "model.embed_tokens.weight", &[v, h], ElemOp::None)?;
        self.plain(o("output_hc_norm.weight"), &mix("hc_norm"), &[ch], ElemOp::OnePlus)?;
        self.plain(o("output_hc_down.weight"), &mix("input_mix_weight_down"), &[r, ch], ElemOp::None)?;
        self.plain(o("output_hc_up.weight"), &mix("input_mix_weight_up"), &[ch, r], ElemOp::None)?;
        if !c.tie_word_embeddings {
            self.plain(o("output.weight"), "lm_head.weight", &[v, h], ElemOp::None)?;
        }
        Ok(())
    }

    fn hyper_connections(&mut self, n: usize) -> Result<()> {
        let c = self.cfg;
        let (ch, r, cc) = (c.hc_count * c.hidden_size, c.hc_lowrank, c.hc_count);
        for (short, module) in [("attn", "attn_hyper_connection"), ("ffn", "mlp_hyper_connection")] {
            for (out, hf, shape, op) in [
                ("norm", "hc_norm", vec![ch], ElemOp::OnePlus),
                ("down", "input_mix_weight_down", vec![r, ch], ElemOp::None),
                ("up", "input_mix_weight_up", vec![ch, r], ElemOp::None),
                ("inject", "block_inject_weight", vec![cc, ch], ElemOp::None),
            ] {
                let hf = format!("model.layers.{n}.{module}.{hf}.weight");
                self.plain(format!("blk.{n}.hc_{short}_{out}.weight"), &hf, &shape, op)?;
            }
        }
        Ok(())
    }

    fn linear_attention(&mut self, n: usize) -> Result<()> {
        let c = self.cfg;
        let (h, nk, nv, dk, dv) = (c.hidden_size, c.lin_k_heads, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim);
        let (dc, kc, qk) = (c.conv_dim(), c.lin_conv_kernel, 2 * nk * dk);
        let o = |s: &str| format!("blk.{n}.{s}");
        let i = |s: &str| format!("model.layers.{n}.linear_attn.{s}");
        let vp = |unit: usize| v_head_perm(nk, nv, unit);
        // q and k channels unchanged, the V channels reordered in units of dv.
        let qkv: Vec<usize> = (0..qk).chain(vp(dv).into_iter().map(|x| qk + x)).collect();

        self.rows(o("attn_qkv.weight"), &i("in_proj_qkv.weight"), &[dc, h], qkv.clone())?;
        self.rows(o("attn_gate.weight"), &i("in_proj_z.weight"), &[nv * dv, h], vp(dv))?;
        self.rows(o("ssm_beta.weight"), &i("in_proj_b.weight"), &[nv, h], vp(1))?;
        self.rows(o("ssm_alpha.weight"), &i("in_proj_a.weight"), &[nv, h], vp(1))?;
        // [Dc, 1, Kc] squeezed to {Kc, Dc}: each channel is one row of Kc taps.
        self.rows(o("ssm_conv1d.weight"), &i("conv1d.weight"), &[dc, 1, kc], qkv)?;
        self.cols(o("ssm_dt.bias"), &i("dt_bias"), &[nv], vp(1), ElemOp::None)?;
        self.cols(o("ssm_a"), &i("A_log"), &[nv], vp(1), ElemOp::NegExp)?;
        // The gated norm's gamma is plain (not 1+w) and shared by all heads.
        self.plain(o("ssm_norm.weight"), &i("norm.weight"), &[dv], ElemOp::None)?;
        self.cols(o("ssm_out.weight"), &i("out_proj.weight"), &[h, nv * dv], vp(dv), ElemOp::None)?;
        Ok(())
    }

    fn full_attention(&mut self, n: usize) -> Result<()> {
        let c = self.cfg;
        let (h, nh, nkv, hd) = (c.hidden_size, c.n_head, c.n_head_kv, c.head_dim);
        let (ih, id) = (c.idx_heads, c.idx_head_dim);
        let o = |s: &str| format!("blk.{n}.{s}.weight");
        let i = |s: &str| format!("model.layers.{n}.self_attn.{s}.weight");
        for (out, hf, shape, op) in [
            ("attn_q", "q_proj", vec![2 * nh * hd, h], ElemOp::None),
            ("attn_k", "k_proj", vec![nkv * hd, h], ElemOp::None),
            ("attn_v", "v_proj", vec![nkv * hd, h], ElemOp::None),
            ("attn_output", "o_proj", vec![h, nh * hd], ElemOp::None),
            ("attn_q_norm", "q_norm", vec![hd], ElemOp::OnePlus),
            ("attn_k_norm", "k_norm", vec![hd], ElemOp::OnePlus),
            ("indexer.q_norm", "indexer.q_layernorm", vec![id], ElemOp::OnePlus),
            ("indexer.k_norm", "indexer.k_layernorm", vec![id], ElemOp::OnePlus),
        ] {
            self.plain(o(out), &i(hf), &shape, op)?;
        }
        // index_qk_proj = [ih query heads (ih*id rows); one key head (id rows)].
        let src = self.take(&i("indexer.index_qk_proj"), &[(ih + 1) * id, h])?;
        self.push(o("indexer.q_proj"), vec![h, ih * id], RowMap::Range { src, start: 0 });
        self.push(o("indexer.k_proj"), vec![h, id], RowMap::Range { src, start: ih * id });
        Ok(())
    }

    fn moe(&mut self, n: usize) -> Result<()> {
        let c = self.cfg;
        let (h, e, f, fs) = (c.hidden_size, c.n_expert, c.expert_ff, c.shared_ff);
        let o = |s: &str| format!("blk.{n}.{s}.weight");
        let i = |s: &str| format!("model.layers.{n}.mlp.{s}");
        self.plain(o("ffn_gate_inp"), &i("gate.weight"), &[e, h], ElemOp::None)?;

        let fused =
            ["", ".weight"].into_iter().find(|x| self.src.get(&i(&format!("experts.gate_up_proj{x}"))).is_some());
        let (gate, up, down) = if let Some(x) = fused {
            // Fused 3-D experts: expert k's gate rows are [2kF, 2kF + F) of gate_up_proj, its up rows the next F.
            let gu = self.take(&i(&format!("experts.gate_up_proj{x}")), &[e, 2 * f, h])?;
            let dn = self.take(&i(&format!("experts.down_proj{x}")), &[e, h, f])?;
            let half = |start| RowMap::Strided { src: gu, rows_each: f, stride: 2 * f, start };
            (half(0), half(f), RowMap::Range { src: dn, start: 0 })
        } else if self.src.get(&i("experts.0.gate_proj.weight")).is_some() {
            // Per-expert 2-D tensors (what save_pretrained writes), stacked on the fly.
            let (mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new());
            for k in 0..e {
                gate.push(self.take(&i(&format!("experts.{k}.gate_proj.weight")), &[f, h])?);
                up.push(self.take(&i(&format!("experts.{k}.up_proj.weight")), &[f, h])?);
                down.push(self.take(&i(&format!("experts.{k}.down_proj.weight")), &[h, f])?);
            }
            let stack = |srcs, rows_each| RowMap::PerSource { srcs, rows_each };
            (stack(gate, f), stack(up, f), stack(down, h))
        } else {
            return Err(Error::convert(format!(
                "missing experts of layer {n}: neither {} nor {}",
                i("experts.gate_up_proj"),
                i("experts.0.gate_proj.weight")
            )));
        };
        self.push(o("ffn_gate_exps"), vec![h, f, e], gate);
        self.push(o("ffn_up_exps"), vec![h, f, e], up);
        self.push(o("ffn_down_exps"), vec![f, h, e], down);

        for (out, hf, shape) in [
            ("ffn_gate_inp_shexp", "shared_expert_gate", vec![1, h]),
            ("ffn_gate_shexp", "shared_expert.gate_proj", vec![fs, h]),
            ("ffn_up_shexp", "shared_expert.up_proj", vec![fs, h]),
            ("ffn_down_shexp", "shared_expert.down_proj", vec![h, fs]),
        ] {
            self.plain(o(out), &i(&format!("{hf}.weight")), &shape, ElemOp::None)?;
        }
        Ok(())
    }

    /// The PLE layer's tensors; returns the hash constants and the table.
    fn ple(&mut self, ple: &PleConfig) -> Result<(PleArrays, OutTensor)> {
        let c = self.cfg;
        let (h, ch, n, pd) = (c.hidden_size, c.hc_count * c.hidden_size, ple.layer, ple.embed_dim);
        let o = |s: &str| format!("blk.{n}.{s}.weight");
        let i = |s: &str| format!("model.layers.{n}.ple.{s}");
        self.plain(o("ple_key"), &i("key_proj.weight"), &[ch, pd], ElemOp::None)?;
        self.plain(o("ple_value"), &i("value_proj.weight"), &[h, pd], ElemOp::None)?;
        for k in ["key", "query", "conv"] {
            self.plain(o(&format!("ple_norm_{k}")), &i(&format!("norm_{k}.weight")), &[ch], ElemOp::OnePlus)?;
        }
        // [C*H, 1, Kp] squeezed to {Kp, C*H}.
        self.plain(o("ple_conv1d"), &i("conv1d.weight"), &[ch, 1, ple.conv_kernel], ElemOp::None)?;

        let hp = ple.heads();
        let arrays = PleArrays {
            layer_multipliers: self.int_buffer(&i("ple_embedding.layer_multipliers"), ple.ngram_size)?,
            head_offsets: self.int_buffer(&i("ple_embedding.ngram_heads_offsets"), hp)?,
            head_vocab_sizes: self.int_buffer(&i("ple_embedding.ngram_heads_vocab_sizes"), hp)?,
        };
        let table = self.ple_table(ple, &i("ple_embedding.ngram_embedding"))?;
        let rows = table.dims[1] as u64;
        for (hh, (&off, &size)) in arrays.head_offsets.iter().zip(&arrays.head_vocab_sizes).take(hp).enumerate() {
            if size == 0 || off + size > rows || off + size > i32::MAX as u64 {
                return Err(Error::convert(format!(
                    "PLE head {hh}: rows [{off}, {}) do not fit the {rows}-row table (or pass 2^31-1)",
                    off + size
                )));
            }
        }
        Ok((arrays, table))
    }

    /// One of the int64 PLE hash buffers, exactly, with at least `min_len` values.
    fn int_buffer(&mut self, name: &str, min_len: usize) -> Result<Vec<u64>> {
        let id = self.src.get(name).ok_or_else(|| Error::convert(format!("missing tensor {name}")))?;
        self.used[id] = true;
        let v = self.src.read_u64s(id)?;
        if v.len() < min_len {
            return Err(Error::convert(format!("tensor {name}: {} values, need at least {min_len}", v.len())));
        }
        Ok(v)
    }

    /// `per_layer_token_embd`: shards `<base>.shard_<k>[.weight]` concatenated in
    /// ascending `k` (all `split_ngram_parts` of them), or one unsharded `<base>.weight`.
    fn ple_table(&mut self, ple: &PleConfig, base: &str) -> Result<OutTensor> {
        let dp = ple.head_dim();
        let prefix = format!("{base}.shard_");
        let mut shards: Vec<(usize, SrcId)> = Vec::new();
        for (id, t) in self.src.tensors.iter().enumerate() {
            if let Some(rest) = t.name.strip_prefix(&prefix) {
                let k = rest
                    .strip_suffix(".weight")
                    .unwrap_or(rest)
                    .parse()
                    .map_err(|_| Error::convert(format!("tensor {}: cannot read the shard index", t.orig_name)))?;
                shards.push((k, id));
            }
        }
        shards.sort_unstable();
        let whole = [format!("{base}.weight"), base.to_string()].into_iter().find_map(|n| self.src.get(&n));
        let srcs: Vec<SrcId> = match (shards.is_empty(), whole) {
            (true, Some(id)) => vec![id],
            (true, None) => return Err(Error::convert(format!("missing PLE table: no {prefix}<k>.weight tensors"))),
            (false, Some(_)) => return Err(Error::convert(format!("PLE table {base} is both sharded and whole"))),
            (false, None) => {
                if shards.len() != ple.split_parts || shards.iter().enumerate().any(|(i, (k, _))| *k != i) {
                    let ks: Vec<usize> = shards.iter().map(|s| s.0).collect();
                    return Err(Error::convert(format!(
                        "PLE table: expected shards 0..{} (split_ngram_parts), found {} shard(s) with indices {}",
                        ple.split_parts,
                        ks.len(),
                        summarize(&ks)
                    )));
                }
                shards.into_iter().map(|s| s.1).collect()
            }
        };
        let mut ends = Vec::with_capacity(srcs.len());
        let mut total = 0usize;
        for &id in &srcs {
            let shape = self.src.tensors[id].shape.clone();
            if shape.len() != 2 || shape[1] != dp {
                return Err(Error::convert(format!(
                    "PLE shard {}: shape {shape:?}, expected [rows, {dp}] (ple_embed_dim / ((ngram_size-1)*heads_per_ngram))",
                    self.src.tensors[id].orig_name
                )));
            }
            self.check(id, &shape)?;
            total += shape[0];
            ends.push(total);
        }
        let name = "per_layer_token_embd.weight".to_string();
        let ty = storage_type(&name, &[dp, total], self.out);
        let rows = RowMap::Concat { srcs, ends };
        Ok(OutTensor { name, dims: vec![dp, total], ty, rows, col_perm: None, op: ElemOp::None })
    }
}

fn summarize(ks: &[usize]) -> String {
    if ks.len() <= 12 {
        format!("{ks:?}")
    } else {
        format!("{:?} ... {:?}", &ks[..6], &ks[ks.len() - 6..])
    }
}

/// Why a checkpoint tensor the model does not use may be dropped, or `None` if it is unexpected.
fn skip_reason(name: &str) -> Option<SkipReason> {
    if name.starts_with("mtp.") || name.starts_with("model.mtp.") {
        Some(SkipReason::Mtp)
    } else if name.contains("visual.") || name.contains("vision") || name.contains("audio") {
        Some(SkipReason::Vision)
    } else if name.ends_with("rotary_emb.inv_freq") {
        Some(SkipReason::RotaryInvFreq)
    } else {
        None
    }
}

/// Maps the whole checkpoint; see the module docs.
pub(crate) fn plan(cfg: &HfConfig, src: &SourceSet, out: OutType, overrides: &[TensorTypeOverride]) -> Result<Plan> {
    let mut p = Planner { cfg, src, out, used: vec![false; src.tensors.len()], tensors: Vec::new() };
    p.globals()?;
    for n in 0..cfg.num_layers {
        p.hyper_connections(n)?;
        if cfg.is_linear[n] {
            p.linear_attention(n)?;
        } else {
            p.full_attention(n)?;
        }
        p.moe(n)?;
    }
    // The PLE layer's tensors come after all layers, the table last (it is by far the largest).
    let ple = match &cfg.ple {
        Some(ple) => {
            let (arrays, table) = p.ple(ple)?;
            p.tensors.push(table);
            Some(arrays)
        }
        None => None,
    };

    let mut skipped = Vec::new();
    let mut unexpected = Vec::new();
    for (_, t) in src.tensors.iter().enumerate().filter(|(id, _)| !p.used[*id]) {
        let reason = match t.name.as_str() {
            "lm_head.weight" if cfg.tie_word_embeddings => Some(SkipReason::TiedOutput),
            name => skip_reason(name),
        };
        match reason {
            Some(reason) => skipped.push(SkippedTensor { name: t.orig_name.clone(), reason }),
            None => unexpected.push(t.orig_name.clone()),
        }
    }
    if !unexpected.is_empty() {
        unexpected.sort();
        let shown: Vec<&str> = unexpected.iter().take(8).map(String::as_str).collect();
        return Err(Error::convert(format!(
            "{} checkpoint tensor(s) are not part of the qwen4exp text model as configured (e.g. {}); \
             check config.json (layer_types, ple_layer_ids, num_hidden_layers)",
            unexpected.len(),
            shown.join(", ")
        )));
    }
    let mut tensors = p.tensors;
    apply_policy(cfg, out, overrides, &mut tensors);
    Ok(Plan { tensors, skipped, ple })
}

/// Gives every tensor its preset / `--tensor-type` type, in file order.
fn apply_policy(cfg: &HfConfig, out: OutType, overrides: &[TensorTypeOverride], tensors: &mut [OutTensor]) {
    let current: Vec<(&str, &[usize], GgmlType)> =
        tensors.iter().map(|t| (t.name.as_str(), t.dims.as_slice(), t.ty)).collect();
    let types = policy_types(cfg, out, overrides, &current);
    for (t, ty) in tensors.iter_mut().zip(types) {
        t.ty = ty;
    }
}

/// The types of `tensors` (name, ggml dims, converter type; in file order)
/// after the preset of `out` and the `--tensor-type` overrides.
pub(crate) fn policy_types(
    cfg: &HfConfig,
    out: OutType,
    overrides: &[TensorTypeOverride],
    tensors: &[(&str, &[usize], GgmlType)],
) -> Vec<GgmlType> {
    let preset = match out {
        OutType::Quant(p) => Some(p),
        _ => None,
    };
    if preset.is_none() && overrides.is_empty() {
        return tensors.iter().map(|t| t.2).collect();
    }
    let shape = ModelShape { n_layers: cfg.num_layers, gqa: cfg.n_head / cfg.n_head_kv.max(1), n_experts: cfg.n_expert };
    let mut policy = TypePolicy::new(preset, overrides.to_vec(), tensors.iter().map(|t| t.0), shape);
    tensors.iter().map(|&(name, dims, ty)| policy.choose(name, dims, ty)).collect()
}
