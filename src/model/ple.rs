//! Per-layer n-gram embeddings, the host side (transformers
//! `Qwen4ExpTextNGramEmbedding`): which table rows a token reads. The
//! table is far too large for any device; its rows are gathered here, for
//! every backend, and the backends compute the rest (`cpu::ple`).
//!
//! Hashing, per token: `ctx[0]` is the token; `ctx[s]` the token `s` back,
//! except that once a predecessor is missing (before the sequence start) or is
//! the EOS id, it and every older slot read as EOS (a document boundary). For
//! each order `n` in `2..=G`: `mixed = XOR_{j<n} ctx[j] * m_j` (wrapping 64-bit),
//! and head `h` of that order reads table row `mixed % vocab_h + offset_h`.

use super::config::PleConfig;
use crate::tensor::Tensor;

/// Table rows of every head for `token`, given the tokens before it
/// (oldest first; at least `G - 1` of them, EOS before the sequence start).
pub fn hash_rows(p: &PleConfig, history: &[u32], token: u32) -> Vec<u64> {
    let g = p.ngram;
    let mut ctx = vec![p.eos as u64; g];
    ctx[0] = token as u64;
    for s in 1..g {
        let prev = history[history.len() - s];
        if prev == p.eos {
            break;
        }
        ctx[s] = prev as u64;
    }
    let mut rows = Vec::with_capacity(p.n_heads());
    for n in 2..=g {
        let mixed = (0..n).fold(0u64, |acc, j| acc ^ ctx[j].wrapping_mul(p.multipliers[j]));
        for k in 0..p.heads_per_ngram {
            let h = (n - 2) * p.heads_per_ngram + k;
            rows.push(mixed % p.head_vocab[h] + p.head_offsets[h]);
        }
    }
    rows
}

/// The table rows of every head, concatenated, for each of `tokens`
/// ([T][H]); `history` holds the tokens before the first (oldest first).
pub fn gather_rows(table: &Tensor, p: &PleConfig, hidden: usize, history: &[u32], tokens: &[u32]) -> Vec<f32> {
    use rayon::prelude::*;
    // The rows of every token first (each hashes the tokens before it), then
    // the reads, of tokens in parallel for a pass of several.
    let mut context: Vec<u32> = history[history.len() + 1 - p.ngram..].to_vec();
    let rows: Vec<Vec<u64>> = tokens
        .iter()
        .map(|&token| {
            let rows = hash_rows(p, &context, token);
            context.remove(0);
            context.push(token);
            rows
        })
        .collect();
    let mut e = vec![0f32; tokens.len() * hidden];
    let read = |(rows, out): (&Vec<u64>, &mut [f32])| {
        for (&row, dst) in rows.iter().zip(out.chunks_mut(p.row_dim)) {
            table.dequantize_row(row as usize, dst);
        }
    };
    if tokens.len() > 1 {
        rows.par_iter().zip(e.par_chunks_exact_mut(hidden)).for_each(read);
    } else {
        rows.iter().zip(e.chunks_exact_mut(hidden)).for_each(read);
    }
    e
}
