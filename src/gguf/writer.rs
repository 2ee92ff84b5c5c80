//! Streaming GGUF writer: all tensor descriptions first, then each tensor's
//! bytes produced on demand, so a 250 GB checkpoint never sits in memory.

use super::reader::{align_up, Value};
use super::{GgmlType, DEFAULT_ALIGNMENT, MAGIC, MAX_NAME_LEN, VERSION};
use crate::error::{Error, Result};
use std::fs::File;
use std::io::{BufWriter, Seek, Write};
use std::path::{Path, PathBuf};

/// Produces a tensor's bytes into the writer; called once, in file order.
pub type TensorSource<'a> = Box<dyn FnOnce(&mut dyn Write) -> Result<()> + 'a>;

struct PendingTensor<'a> {
    name: String,
    ty: GgmlType,
    dims: Vec<usize>,
    nbytes: usize,
    source: TensorSource<'a>,
}

/// Collects metadata and tensor producers, then writes a GGUF v3 file.
#[derive(Default)]
pub struct GgufWriter<'a> {
    kv: Vec<(String, Value)>,
    tensors: Vec<PendingTensor<'a>>,
}

impl<'a> GgufWriter<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry; a key given twice is an error at write time.
    pub fn add(&mut self, key: &str, value: Value) {
        self.kv.push((key.to_string(), value));
    }

    /// Declares a tensor of `dims` (ggml order) whose bytes `source` will produce.
    pub fn add_tensor(&mut self, name: &str, ty: GgmlType, dims: &[usize], source: TensorSource<'a>) -> Result<()> {
        if name.len() > MAX_NAME_LEN {
            return Err(Error::format(format!("tensor name {name:?} is longer than {MAX_NAME_LEN} bytes")));
        }
        let row = ty.row_bytes(dims[0]).ok_or_else(|| {
            Error::format(format!("tensor {name}: row length {} is not a multiple of the {ty} block", dims[0]))
        })?;
        let nbytes = row * dims[1..].iter().product::<usize>();
        self.tensors.push(PendingTensor { name: name.to_string(), ty, dims: dims.to_vec(), nbytes, source });
        Ok(())
    }

    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Writes the file to `path` through `<path>.partial`, renamed when
    /// complete and removed on failure, so no reader sees a half-written model.
    pub fn write_to_path(self, path: &Path) -> Result<()> {
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        let file = File::create(&partial).map_err(|e| Error::io(format!("creating {}", partial.display()), e))?;
        if let Err(e) = self.write(file, |_, _, _| {}) {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
        std::fs::rename(&partial, path)
            .map_err(|e| Error::io(format!("renaming {} to {}", partial.display(), path.display()), e))
    }

    /// Writes the file. `progress(done_tensors, total_tensors, name)` is called before each tensor.
    pub fn write<W: Write + Seek>(self, out: W, mut progress: impl FnMut(usize, usize, &str)) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for (k, _) in &self.kv {
            if !seen.insert(k.as_str()) {
                return Err(Error::format(format!("duplicate metadata key {k}")));
            }
        }
        let a = DEFAULT_ALIGNMENT;
        let mut w = BufWriter::with_capacity(1 << 22, out);
        let io = |e| Error::io("writing GGUF", e);
        let mut header = Vec::new();
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut header, k);
            header.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut header, v);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for &d in &t.dims {
                header.extend_from_slice(&(d as u64).to_le_bytes());
            }
            header.extend_from_slice(&t.ty.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offset = align_up(offset + t.nbytes as u64, a).unwrap();
        }
        let pad = align_up(header.len() as u64, a).unwrap() as usize - header.len();
        header.resize(header.len() + pad, 0);
        w.write_all(&header).map_err(io)?;

        let total = self.tensors.len();
        for (i, t) in self.tensors.into_iter().enumerate() {
            progress(i, total, &t.name);
            let mut counter = CountingWriter { inner: &mut w, count: 0 };
            (t.source)(&mut counter)?;
            if counter.count != t.nbytes as u64 {
                return Err(Error::format(format!(
                    "tensor {}: producer wrote {} bytes, expected {}",
                    t.name, counter.count, t.nbytes
                )));
            }
            let pad = align_up(t.nbytes as u64, a).unwrap() as usize - t.nbytes;
            w.write_all(&vec![0u8; pad]).map_err(io)?;
        }
        progress(total, total, "");
        w.flush().map_err(io)?;
        Ok(())
    }
}

struct CountingWriter<'w, W: Write> {
    inner: &'w mut W,
    count: u64,
}

impl<W: Write> Write for CountingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
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
