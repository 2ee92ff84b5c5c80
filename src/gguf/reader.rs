//! Bounds-checked GGUF parsing.

use super::{GgmlType, DEFAULT_ALIGNMENT, MAGIC, MAX_NAME_LEN, VERSION};
use crate::error::{Error, Result};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// A metadata value. Arrays hold values of one scalar type (nested arrays are refused).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    U64(u64),
    I64(i64),
    F64(f64),
    /// Element type id and the elements.
    Array(u32, Vec<Value>),
}

impl Value {
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(..) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            Value::Bool(v) => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }
}

/// Ordered key/value metadata of a GGUF file.
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    entries: BTreeMap<String, Value>,
}

impl Metadata {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entries.get(key)
    }
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Value)> {
        self.entries.iter()
    }
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// One tensor's description; `offset` is absolute in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// Dimensions in ggml order: `dims[0]` is the contiguous axis.
    pub dims: Vec<usize>,
    pub offset: usize,
    pub nbytes: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }
}

/// Where a model's bytes live: a read-only memory map of the file, or a
/// buffer the caller owns (an embedded model, a file read into memory).
pub type Storage = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A parsed GGUF file; tensors are views into its storage.
pub struct GgufFile {
    map: Storage,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
}

impl GgufFile {
    /// Maps `path` and parses it. The map is shared by every tensor view.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
        // SAFETY: the file is mapped read-only; flashnext never writes through it. A file
        // truncated by another process while mapped is outside what any mmap reader can guard.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(format!("cannot map {}", path.display()), e))?;
        Self::from_storage(Arc::new(map))
    }

    /// Parses a GGUF image already in memory.
    pub fn from_storage(map: Storage) -> Result<Self> {
        let (metadata, tensors, alignment) = parse((*map).as_ref())?;
        Ok(Self { map, metadata, tensors, alignment })
    }

    pub fn bytes(&self) -> &[u8] {
        (*self.map).as_ref()
    }

    pub fn storage(&self) -> &Storage {
        &self.map
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        &self.bytes()[info.offset..info.offset + info.nbytes]
    }
}

/// Most metadata entries or tensors a file may declare. Far above any real model
/// (the 48-layer model has ~1000 tensors and ~60 keys), low enough that a hostile
/// count is refused before anything is allocated.
const MAX_COUNT: u64 = 1 << 20;

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| {
            Error::format(format!(
                "file truncated: {what} needs {n} bytes at offset {} but the file has {}",
                self.pos,
                self.buf.len()
            ))
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(Error::format(format!(
                "{what}: string length {len} exceeds the {} bytes left in the file",
                self.remaining()
            )));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::format(format!("{what}: string is not valid UTF-8")))
    }

    fn scalar(&mut self, ty: u32, what: &str) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.u8(what)?),
            1 => Value::I8(self.u8(what)? as i8),
            2 => Value::U16(self.u16(what)?),
            3 => Value::I16(self.u16(what)? as i16),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(self.u32(what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(what)?)),
            7 => match self.u8(what)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(Error::format(format!("{what}: boolean byte is {b}, not 0 or 1"))),
            },
            8 => Value::String(self.string(what)?),
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(self.u64(what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(what)?)),
            9 => return Err(Error::format(format!("{what}: nested arrays are not supported"))),
            t => return Err(Error::format(format!("{what}: unknown value type {t}"))),
        })
    }

    fn value(&mut self, ty: u32, what: &str) -> Result<Value> {
        if ty != 9 {
            return self.scalar(ty, what);
        }
        let elem = self.u32(what)?;
        let count = self.u64(what)?;
        // Each element takes at least one byte (strings at least eight), so a count
        // larger than the bytes left is a lie; refuse it before allocating.
        let min_size: u64 = match elem {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => return Err(Error::format(format!("{what}: nested arrays are not supported"))),
            t => return Err(Error::format(format!("{what}: unknown array element type {t}"))),
        };
        if count.saturating_mul(min_size) > self.remaining() as u64 {
            return Err(Error::format(format!(
                "{what}: array of {count} elements cannot fit in the {} bytes left",
                self.remaining()
            )));
        }
        let mut items = Vec::with_capacity(count as usize);
        for _ in 0..count {
            items.push(self.scalar(elem, what)?);
        }
        Ok(Value::Array(elem, items))
    }
}

/// Parses header, metadata and tensor infos of a GGUF image and checks that
/// every tensor lies inside the data section, aligned, without overlap.
pub fn parse(buf: &[u8]) -> Result<(Metadata, Vec<TensorInfo>, u64)> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.take(4, "magic").map_err(|_| Error::format("not a GGUF file: shorter than its 4-byte magic"))?;
    if magic != MAGIC {
        return Err(Error::format(format!("not a GGUF file: magic is {magic:02x?}, expected \"GGUF\"")));
    }
    let version = c.u32("version")?;
    if version != VERSION {
        return Err(Error::format(format!("unsupported GGUF version {version} (only version {VERSION} is read)")));
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    if n_tensors > MAX_COUNT || n_kv > MAX_COUNT {
        return Err(Error::format(format!(
            "absurd header: {n_tensors} tensors and {n_kv} metadata entries (limit {MAX_COUNT})"
        )));
    }

    let mut entries = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let ty = c.u32(&format!("type of metadata {key}"))?;
        let value = c.value(ty, &format!("metadata {key}"))?;
        if entries.insert(key.clone(), value).is_some() {
            return Err(Error::format(format!("duplicate metadata key {key}")));
        }
    }
    let metadata = Metadata { entries };

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if a.is_power_of_two() => *a as u64,
        Some(v) => {
            return Err(Error::format(format!("general.alignment must be a power-of-two UINT32, found {v:?}")))
        }
    };

    // A tensor info takes at least 32 bytes (name length, one dim, type, offset):
    // never reserve for more infos than the bytes left could hold.
    let mut raw = Vec::with_capacity((n_tensors as usize).min(c.remaining() / 32));
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let name = c.string(&format!("name of tensor #{i}"))?;
        if name.len() > MAX_NAME_LEN {
            return Err(Error::format(format!("tensor name {name:?} is longer than {MAX_NAME_LEN} bytes")));
        }
        if !names.insert(name.clone()) {
            return Err(Error::format(format!("duplicate tensor {name}")));
        }
        let n_dims = c.u32(&format!("dimension count of {name}"))?;
        if n_dims == 0 || n_dims > 4 {
            return Err(Error::format(format!("tensor {name} has {n_dims} dimensions (1 to 4 allowed)")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = c.u64(&format!("dimensions of {name}"))?;
            if d == 0 || d > i64::MAX as u64 {
                return Err(Error::format(format!("tensor {name} has dimension {d}")));
            }
            dims.push(d);
        }
        let ty_id = c.u32(&format!("type of {name}"))?;
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| Error::format(format!("tensor {name} has unsupported ggml type {ty_id}")))?;
        let offset = c.u64(&format!("offset of {name}"))?;
        raw.push((name, dims, ty, offset));
    }

    // A file without tensors (a vocabulary-only GGUF) needs no padding after its header.
    let data_start = align_up(c.pos as u64, alignment)
        .map(|s| if raw.is_empty() { s.min(buf.len() as u64) } else { s })
        .filter(|&s| s <= buf.len() as u64)
        .ok_or_else(|| Error::format("file truncated: it ends before its tensor data section"))?;
    let data_len = buf.len() as u64 - data_start;

    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ty, offset) in raw {
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| Error::format(format!("tensor {name} has {dims:?} elements: too many")))?;
        let bs = ty.block_size() as u64;
        if dims[0] % bs != 0 {
            return Err(Error::format(format!(
                "tensor {name}: row length {} is not a multiple of the {ty} block size {bs}",
                dims[0]
            )));
        }
        let nbytes = (n_elements / bs)
            .checked_mul(ty.block_bytes() as u64)
            .ok_or_else(|| Error::format(format!("tensor {name} is too large")))?;
        if offset % alignment != 0 {
            return Err(Error::format(format!("tensor {name}: offset {offset} is not aligned to {alignment}")));
        }
        let end = offset.checked_add(nbytes).filter(|&e| e <= data_len).ok_or_else(|| {
            Error::format(format!(
                "tensor {name}: {nbytes} bytes at data offset {offset} lie outside the file's {data_len}-byte data section"
            ))
        })?;
        let _ = end;
        tensors.push(TensorInfo {
            name,
            ty,
            dims: dims.iter().map(|&d| d as usize).collect(),
            offset: (data_start + offset) as usize,
            nbytes: nbytes as usize,
        });
    }

    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        if pair[0].offset + pair[0].nbytes > pair[1].offset {
            return Err(Error::format(format!("tensors {} and {} overlap", pair[0].name, pair[1].name)));
        }
    }

    Ok((metadata, tensors, alignment))
}

pub(crate) fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}
