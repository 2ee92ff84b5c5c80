//! State snapshots: a decode state written to bytes and read back
//! bit-exactly, and the model fingerprint that ties a snapshot to its model.
//!
//! Format (version 1), all integers little-endian, floats as their IEEE bits:
//!
//! ```text
//! header   magic "FNXSTATE" (8) | version u32 | n_layers u32
//!          | model fingerprint u64 | position u64 | payload length u64   (40 bytes)
//! payload  per layer: kind u32 (0 = Gated DeltaNet, 1 = attention), then its buffers:
//!            GDN:       conv, recurrent
//!            attention: keys, values, index_keys, block_keys
//!          PLE (only when the model has one): tokens (u32 elements), conv
//!          logits (empty before the first token, or after rewinding to a
//!          position whose logits were not computed)
//!          -- each buffer is an element count u64 followed by the elements
//! trailer  XXH64 (seed 0) of every byte before it, u64
//! ```
//!
//! Every size is implied by the model, the position and whether logits are
//! present, so [`State::restore`] knows the exact length to expect. It checks, in order: magic, version,
//! length (truncated / trailing bytes), checksum, model fingerprint, context
//! limit, then every buffer's element count; it builds the new buffers
//! aside and swaps them in only when all of that passed, so a refused
//! snapshot leaves the state as it was.
//!
//! The fingerprint ([`Model::fingerprint`]) is an XXH64 over the file size,
//! every metadata key and value, and every tensor's name, type, shape, offset
//! and its first and last 64 bytes of data: it tells apart models with the
//! same architecture but different weights (e.g. a base and a tuned
//! checkpoint) without reading the weights in full.

use super::backend::{HostLayer, HostState};
use super::config::LayerKind;
use super::state::State;
use super::Model;
use crate::error::Error;
use crate::gguf::{Metadata, TensorInfo, Value};

/// First eight bytes of every snapshot.
pub const MAGIC: [u8; 8] = *b"FNXSTATE";
/// The snapshot format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
const HEADER_LEN: usize = 40;
const TRAILER_LEN: usize = 8;
const KIND_GDN: u32 = 0;
const KIND_ATTENTION: u32 = 1;

/// Why a snapshot was refused.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("not a flashnext state snapshot (the magic bytes are wrong)")]
    NotASnapshot,
    #[error("snapshot format version {found}; this build reads version {FORMAT_VERSION}")]
    Version { found: u32 },
    #[error("snapshot was taken with a different model (fingerprint {found:016x}; this model's is {expected:016x})")]
    WrongModel { found: u64, expected: u64 },
    #[error("snapshot holds {pos} positions, more than this model's context limit of {n_ctx}")]
    ContextTooSmall { pos: usize, n_ctx: usize },
    #[error("snapshot is truncated: {have} bytes, {need} expected")]
    Truncated { have: usize, need: usize },
    #[error("snapshot is corrupt: {0}")]
    Corrupt(String),
}

impl SnapshotError {
    /// True when the snapshot is intact but belongs elsewhere (another model,
    /// format version or context limit); false when the bytes are damaged.
    pub fn is_mismatch(&self) -> bool {
        matches!(
            self,
            Self::Version { .. } | Self::WrongModel { .. } | Self::ContextTooSmall { .. }
        )
    }
}

// ---------------------------------------------------------------------------
// XXH64

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

fn read_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

fn xxh_round(acc: u64, input: u64) -> u64 {
    acc.wrapping_add(input.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

fn xxh_merge(acc: u64, v: u64) -> u64 {
    (acc ^ xxh_round(0, v)).wrapping_mul(P1).wrapping_add(P4)
}

/// XXH64 of `data` (Collet's xxHash, 64-bit variant).
pub fn xxh64(data: &[u8], seed: u64) -> u64 {
    let mut rest = data;
    let mut h = if data.len() >= 32 {
        let mut v = [
            seed.wrapping_add(P1).wrapping_add(P2),
            seed.wrapping_add(P2),
            seed,
            seed.wrapping_sub(P1),
        ];
        while rest.len() >= 32 {
            for (i, acc) in v.iter_mut().enumerate() {
                *acc = xxh_round(*acc, read_u64(&rest[i * 8..]));
            }
            rest = &rest[32..];
        }
        let mut h = v[0]
            .rotate_left(1)
            .wrapping_add(v[1].rotate_left(7))
            .wrapping_add(v[2].rotate_left(12))
            .wrapping_add(v[3].rotate_left(18));
        for x in v {
            h = xxh_merge(h, x);
        }
        h
    } else {
        seed.wrapping_add(P5)
    };
    h = h.wrapping_add(data.len() as u64);
    while rest.len() >= 8 {
        h ^= xxh_round(0, read_u64(rest));
        h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
        rest = &rest[8..];
    }
    if rest.len() >= 4 {
        h ^= (u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as u64).wrapping_mul(P1);
        h = h.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
        rest = &rest[4..];
    }
    for &b in rest {
        h ^= (b as u64).wrapping_mul(P5);
        h = h.rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

// ---------------------------------------------------------------------------
// Model fingerprint

/// Collects the canonical description of a model file; [`Fingerprinter::finish`] hashes it.
pub(crate) struct Fingerprinter {
    buf: Vec<u8>,
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &Value) {
    buf.extend_from_slice(&v.type_id().to_le_bytes());
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.push(*x as u8),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_bits().to_le_bytes()),
        Value::Bool(x) => buf.push(*x as u8),
        Value::String(s) => put_str(buf, s),
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_bits().to_le_bytes()),
        Value::Array(ty, items) => {
            buf.extend_from_slice(&ty.to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(buf, it);
            }
        }
    }
}

/// Bytes of tensor data sampled from each end.
const SAMPLE: usize = 64;

impl Fingerprinter {
    pub(crate) fn new(file_size: u64, metadata: &Metadata) -> Self {
        let mut buf = b"flashnext model fingerprint v1".to_vec();
        buf.extend_from_slice(&file_size.to_le_bytes());
        buf.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata.iter() {
            put_str(&mut buf, k);
            put_value(&mut buf, v);
        }
        Fingerprinter { buf }
    }

    /// Adds one tensor: its description and the first and last bytes of `data`.
    pub(crate) fn tensor(&mut self, info: &TensorInfo, data: &[u8]) {
        let b = &mut self.buf;
        put_str(b, &info.name);
        b.extend_from_slice(&info.ty.id().to_le_bytes());
        b.extend_from_slice(&(info.dims.len() as u32).to_le_bytes());
        for d in &info.dims {
            b.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        b.extend_from_slice(&(info.offset as u64).to_le_bytes());
        b.extend_from_slice(&(info.nbytes as u64).to_le_bytes());
        b.extend_from_slice(&data[..data.len().min(SAMPLE)]);
        b.extend_from_slice(&data[data.len().saturating_sub(SAMPLE)..]);
    }

    pub(crate) fn finish(self) -> u64 {
        xxh64(&self.buf, 0)
    }
}

// ---------------------------------------------------------------------------
// Sizes

/// Element counts of one layer's buffers at position `pos`.
fn layer_counts(model: &Model, kind: &LayerKind, pos: usize) -> Option<Vec<usize>> {
    let cfg = &model.config;
    Some(match kind {
        LayerKind::Linear => vec![
            (cfg.ssm_conv - 1).checked_mul(cfg.ssm_conv_dim())?,
            cfg.ssm_v_heads
                .checked_mul(cfg.ssm_head_dim)?
                .checked_mul(cfg.ssm_head_dim)?,
        ],
        LayerKind::Attention { compress_ratio } => {
            let kv = pos.checked_mul(cfg.n_kv_heads.checked_mul(cfg.head_dim)?)?;
            let (ik, bk) = match (&cfg.qsa, *compress_ratio) {
                (Some(q), r) if r > 0 => (
                    pos.checked_mul(q.head_dim)?,
                    (pos / r).checked_mul(q.head_dim)?,
                ),
                _ => (0, 0),
            };
            vec![kv, kv, ik, bk]
        }
    })
}

/// Element counts of the PLE buffers (tokens, conv), if the model has PLE.
fn ple_counts(model: &Model) -> Option<Option<[usize; 2]>> {
    let cfg = &model.config;
    match &cfg.ple {
        None => Some(None),
        Some(p) => {
            let conv = ((p.conv_kernel - 1).checked_mul(p.ngram)?)
                .checked_mul(cfg.hc)?
                .checked_mul(cfg.hidden)?;
            Some(Some([p.ngram - 1, conv]))
        }
    }
}

/// Payload bytes of a snapshot of `model` at `pos` (with `logits` or
/// without), or `None` on overflow.
fn expected_payload(model: &Model, pos: usize, logits: bool) -> Option<usize> {
    let buf = |n: usize| n.checked_mul(4)?.checked_add(8);
    let mut total = 0usize;
    for kind in &model.config.layers {
        total = total.checked_add(4)?;
        for n in layer_counts(model, kind, pos)? {
            total = total.checked_add(buf(n)?)?;
        }
    }
    if let Some([t, c]) = ple_counts(model)? {
        total = total.checked_add(buf(t)?)?.checked_add(buf(c)?)?;
    }
    let logits = if logits { model.config.vocab } else { 0 };
    total.checked_add(buf(logits)?)
}

// ---------------------------------------------------------------------------
// Writing

struct Writer<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn bytes(&mut self, b: &[u8]) {
        self.out[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn f32s(&mut self, v: &[f32]) {
        self.u64(v.len() as u64);
        let dst = &mut self.out[self.at..self.at + 4 * v.len()];
        for (d, x) in dst.chunks_exact_mut(4).zip(v) {
            d.copy_from_slice(&x.to_bits().to_le_bytes());
        }
        self.at += 4 * v.len();
    }
    fn u32s(&mut self, v: &[u32]) {
        self.u64(v.len() as u64);
        for x in v {
            self.u32(*x);
        }
    }
}


impl State {
    /// Exact length of [`State::save`]'s output (implied by the model, the
    /// position and whether the state has logits: nothing is read back).
    pub fn save_size(&self) -> usize {
        let logits = !self.current_logits().is_empty();
        HEADER_LEN + TRAILER_LEN + expected_payload(&self.model, self.pos, logits).expect("a live state's sizes fit")
    }

    /// The state as a snapshot (see the module documentation for the format).
    pub fn save(&self) -> crate::Result<Vec<u8>> {
        let mut out = Vec::new();
        let size = self.save_size();
        out.try_reserve_exact(size).map_err(|_| Error::OutOfMemory(format!("cannot allocate a {size}-byte snapshot")))?;
        out.resize(size, 0);
        let n = self.save_into(&mut out)?;
        debug_assert_eq!(n, out.len());
        Ok(out)
    }

    /// Writes the snapshot into the front of `out` and returns its length.
    /// Errors: `out` shorter than [`State::save_size`] (`InvalidArgument`,
    /// nothing written), no memory for the host copy of a device state, a
    /// failed read-back, a lost state.
    pub fn save_into(&self, out: &mut [u8]) -> crate::Result<usize> {
        self.check_usable()?;
        let size = self.save_size();
        if out.len() < size {
            return Err(Error::arg(format!("a snapshot needs {size} bytes, the buffer holds {}", out.len())));
        }
        let host = self.backend.export(&self.model, self.pos)?;
        let mut w = Writer { out: &mut out[..size], at: 0 };
        w.bytes(&MAGIC);
        w.u32(FORMAT_VERSION);
        w.u32(host.layers.len() as u32);
        w.u64(self.model.fingerprint());
        w.u64(self.pos as u64);
        w.u64((size - HEADER_LEN - TRAILER_LEN) as u64);
        for l in &host.layers {
            match l {
                HostLayer::Gdn { conv, recurrent } => {
                    w.u32(KIND_GDN);
                    w.f32s(conv);
                    w.f32s(recurrent);
                }
                HostLayer::Attention { keys, values, index_keys, block_keys } => {
                    w.u32(KIND_ATTENTION);
                    w.f32s(keys);
                    w.f32s(values);
                    w.f32s(index_keys);
                    w.f32s(block_keys);
                }
            }
        }
        if let Some(conv) = &host.ple_conv {
            w.u32s(&self.ple_tokens());
            w.f32s(conv);
        }
        w.f32s(self.current_logits());
        if w.at + TRAILER_LEN != size {
            return Err(Error::StateLost(format!("the backend's state does not have the snapshot's sizes ({} of {size} bytes)", w.at)));
        }
        let body = w.at;
        let sum = xxh64(&w.out[..body], 0);
        w.u64(sum);
        Ok(w.at)
    }

    /// Replaces this state's contents with a snapshot made by [`State::save`]
    /// from a state of the same model. On any error the state is unchanged
    /// (a device failure while loading leaves it lost). A successful load
    /// also makes a lost state usable again.
    pub fn restore(&mut self, bytes: &[u8]) -> crate::Result<()> {
        let parsed = parse(&self.model, bytes)?;
        self.take_contents(parsed.pos, parsed.ple_tokens, parsed.logits, parsed.host)
    }
}

// ---------------------------------------------------------------------------
// Reading

struct Parsed {
    pos: usize,
    ple_tokens: Vec<u32>,
    logits: Vec<f32>,
    host: HostState,
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

fn corrupt(msg: impl Into<String>) -> SnapshotError {
    SnapshotError::Corrupt(msg.into())
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], SnapshotError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| corrupt(format!("{what} runs past the end of the payload")))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
    /// A buffer of exactly `expect` 4-byte elements.
    fn elems<T>(
        &mut self,
        expect: usize,
        what: &str,
        f: impl Fn([u8; 4]) -> T,
    ) -> Result<Vec<T>, Error> {
        let n = self.u64(what)?;
        if n != expect as u64 {
            return Err(corrupt(format!(
                "{what} holds {n} elements, {expect} expected"
            ))
            .into());
        }
        let raw = self.take(expect * 4, what)?;
        let mut v = Vec::new();
        v.try_reserve_exact(expect)
            .map_err(|_| Error::OutOfMemory(format!("{what}: cannot allocate {expect} elements")))?;
        v.extend(
            raw.chunks_exact(4)
                .map(|c| f(c.try_into().expect("4 bytes"))),
        );
        Ok(v)
    }
    fn f32s(&mut self, expect: usize, what: &str) -> Result<Vec<f32>, Error> {
        self.elems(expect, what, |b| f32::from_bits(u32::from_le_bytes(b)))
    }
}

fn parse(model: &Model, bytes: &[u8]) -> Result<Parsed, Error> {
    if bytes.len() < MAGIC.len() {
        return Err(if MAGIC.starts_with(bytes) {
            SnapshotError::Truncated {
                have: bytes.len(),
                need: HEADER_LEN + TRAILER_LEN,
            }
        } else {
            SnapshotError::NotASnapshot
        }.into());
    }
    if bytes[..8] != MAGIC {
        return Err(SnapshotError::NotASnapshot.into());
    }
    if bytes.len() < HEADER_LEN + TRAILER_LEN {
        return Err(SnapshotError::Truncated {
            have: bytes.len(),
            need: HEADER_LEN + TRAILER_LEN,
        }.into());
    }
    let mut h = Reader {
        b: &bytes[..HEADER_LEN],
        at: 8,
    };
    let version = h.u32("version")?;
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version { found: version }.into());
    }
    let n_layers = h.u32("layer count")?;
    let fingerprint = h.u64("fingerprint")?;
    let pos = h.u64("position")?;
    let payload = h.u64("payload length")?;
    let need = usize::try_from(payload)
        .ok()
        .and_then(|p| p.checked_add(HEADER_LEN + TRAILER_LEN))
        .ok_or_else(|| corrupt(format!("payload length {payload} is impossible")))?;
    if bytes.len() < need {
        return Err(SnapshotError::Truncated {
            have: bytes.len(),
            need,
        }.into());
    }
    if bytes.len() > need {
        return Err(corrupt(format!(
            "{} bytes follow the end of the snapshot",
            bytes.len() - need
        )).into());
    }
    let body = need - TRAILER_LEN;
    let stored = read_u64(&bytes[body..]);
    if xxh64(&bytes[..body], 0) != stored {
        return Err(corrupt(
            "checksum mismatch (the bytes were changed or damaged)",
        ).into());
    }
    if fingerprint != model.fingerprint() {
        return Err(SnapshotError::WrongModel {
            found: fingerprint,
            expected: model.fingerprint(),
        }.into());
    }
    let cfg = &model.config;
    if n_layers as usize != cfg.n_layers {
        return Err(corrupt(format!(
            "{n_layers} layers, the model has {}",
            cfg.n_layers
        )).into());
    }
    let pos = usize::try_from(pos).map_err(|_| corrupt(format!("position {pos} is impossible")))?;
    if pos > model.n_ctx {
        return Err(SnapshotError::ContextTooSmall {
            pos,
            n_ctx: model.n_ctx,
        }.into());
    }
    let with_logits = pos > 0 && expected_payload(model, pos, true) == Some(payload as usize);
    if !with_logits && expected_payload(model, pos, false) != Some(payload as usize) {
        return Err(corrupt(format!(
            "payload of {payload} bytes does not fit position {pos}"
        )).into());
    }

    let mut r = Reader {
        b: &bytes[HEADER_LEN..body],
        at: 0,
    };
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for (i, kind) in cfg.layers.iter().enumerate() {
        let counts =
            layer_counts(model, kind, pos).ok_or_else(|| corrupt("buffer sizes overflow"))?;
        let tag = r.u32("layer kind")?;
        layers.push(match (kind, tag) {
            (LayerKind::Linear, KIND_GDN) => HostLayer::Gdn {
                conv: r.f32s(counts[0], &format!("layer {i} conv state"))?,
                recurrent: r.f32s(counts[1], &format!("layer {i} recurrent state"))?,
            },
            (LayerKind::Attention { .. }, KIND_ATTENTION) => HostLayer::Attention {
                keys: r.f32s(counts[0], &format!("layer {i} keys"))?,
                values: r.f32s(counts[1], &format!("layer {i} values"))?,
                index_keys: r.f32s(counts[2], &format!("layer {i} indexer keys"))?,
                block_keys: r.f32s(counts[3], &format!("layer {i} block keys"))?,
            },
            (_, t) => {
                return Err(corrupt(format!(
                    "layer {i} has kind {t}, which does not match the model"
                ))
                .into())
            }
        });
    }
    let (ple_tokens, ple_conv) = match ple_counts(model).ok_or_else(|| corrupt("buffer sizes overflow"))? {
        None => (Vec::new(), None),
        Some([t, c]) => {
            (r.elems(t, "PLE tokens", u32::from_le_bytes)?, Some(r.f32s(c, "PLE conv history")?))
        }
    };
    let logits = r.f32s(if with_logits { cfg.vocab } else { 0 }, "logits")?;
    if r.at != r.b.len() {
        return Err(corrupt(format!(
            "{} unread bytes in the payload",
            r.b.len() - r.at
        ))
        .into());
    }
    Ok(Parsed {
        pos,
        ple_tokens,
        logits,
        host: HostState { layers, ple_conv },
    })
}
