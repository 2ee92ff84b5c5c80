//! Bytes of weights one decode token reads, from the model file's tensor
//! table: every tensor in full, except the three routed-expert stacks (only
//! the `k` chosen of `E` experts per layer), the token embedding (one row,
//! unless it doubles as the LM head)
//! and the PLE table (one row per hashed head). KV-cache and state reads are
//! not weights and are not counted.

use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::Model;
use serde::Serialize;
use std::path::Path;

/// Weight bytes per decode token, by kind.
#[derive(Clone, Debug, Default, Serialize)]
pub struct WeightBytes {
    pub total: u64,
    /// Every tensor read in full: projections, norms, routers, shared experts, LM head.
    pub dense: u64,
    /// `k / E` of each routed-expert stack.
    pub routed_experts: u64,
    /// One token-embedding row and the PLE table rows.
    pub embedding_rows: u64,
}

/// [`WeightBytes`] of `model`, loaded from `path`.
pub fn weight_bytes_per_token(path: &Path, model: &Model) -> Result<WeightBytes> {
    let file = GgufFile::open(path)?;
    let cfg = &model.config;
    let ple_heads = cfg.ple.as_ref().map_or(0, |p| p.n_heads()) as u64;
    let mut b = WeightBytes::default();
    for t in &file.tensors {
        let n = t.nbytes as u64;
        let rows = t.dims[1..].iter().product::<usize>().max(1) as u64;
        if t.name == "token_embd.weight" && file.tensor("output.weight").is_some() {
            b.embedding_rows += n / rows;
        } else if t.name == "per_layer_token_embd.weight" {
            b.embedding_rows += n / rows * ple_heads;
        } else if t.name.ends_with("_exps.weight") {
            b.routed_experts += n / cfg.n_experts as u64 * cfg.n_experts_used as u64;
        } else {
            b.dense += n;
        }
    }
    b.total = b.dense + b.routed_experts + b.embedding_rows;
    Ok(b)
}
