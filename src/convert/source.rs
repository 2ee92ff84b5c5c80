//! The checkpoint side: every `*.safetensors` file of a Hugging Face directory,
//! memory-mapped, with a name → location table built from the headers alone.
//!
//! Nothing is read eagerly. [`SourceSet::row_f32`] decodes one row of a tensor
//! (F32, F16 or BF16) to `f32` straight from the map, so the working set while
//! converting is a few chunks of rows, and the kernel's page cache does the rest.
//!
//! Names are normalised on the way in: `language_model.` is removed wherever it
//! appears (as llama.cpp does), so `model.language_model.layers.0.x` and
//! `model.layers.0.x` are the same tensor, and `lm_head.weight` stays as it is.

use crate::error::{Error, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Index of a tensor in [`SourceSet::tensors`].
pub(crate) type SrcId = usize;

/// Where one checkpoint tensor lives.
#[derive(Clone, Debug)]
pub(crate) struct SrcTensor {
    /// Normalised name (see the module docs).
    pub name: String,
    /// The name as stored in the file.
    pub orig_name: String,
    pub file: usize,
    pub dtype: Dtype,
    /// Row-major (PyTorch) shape.
    pub shape: Vec<usize>,
    /// Byte offset of the data in the file's map.
    pub start: usize,
    pub nbytes: usize,
}

/// All safetensors files of a checkpoint directory.
pub(crate) struct SourceSet {
    files: Vec<(PathBuf, Mmap)>,
    pub tensors: Vec<SrcTensor>,
    by_name: HashMap<String, SrcId>,
}

/// The normalised form of a checkpoint tensor name.
pub(crate) fn normalize_name(name: &str) -> String {
    name.replace("language_model.", "")
}

impl SourceSet {
    /// Opens the files listed by `model.safetensors.index.json` if it exists,
    /// otherwise every `*.safetensors` file in `dir` (e.g. one `model.safetensors`).
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut expected: Option<HashMap<String, String>> = None;
        let names: Vec<String> = if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| Error::io(format!("reading {}", index_path.display()), e))?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::convert(format!("{}: not valid JSON: {e}", index_path.display())))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::convert(format!("{}: no `weight_map` object", index_path.display())))?;
            let mut wm = HashMap::new();
            let mut files = BTreeSet::new();
            for (k, v) in map {
                let f = v.as_str().ok_or_else(|| {
                    Error::convert(format!("{}: weight_map[{k:?}] is not a file name", index_path.display()))
                })?;
                files.insert(f.to_string());
                wm.insert(k.clone(), f.to_string());
            }
            expected = Some(wm);
            files.into_iter().collect()
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
            let mut names = Vec::new();
            for entry in rd {
                let entry = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.ends_with(".safetensors") {
                    names.push(name);
                }
            }
            names.sort();
            names
        };
        if names.is_empty() {
            return Err(Error::convert(format!(
                "{}: no model.safetensors, model.safetensors.index.json or other *.safetensors file",
                dir.display()
            )));
        }

        let mut set = SourceSet { files: Vec::new(), tensors: Vec::new(), by_name: HashMap::new() };
        for fname in names {
            let path = dir.join(&fname);
            let file = File::open(&path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
            // SAFETY: the map is read-only; the checkpoint must not be modified while converting.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
            let (n, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| Error::convert(format!("{}: invalid safetensors file: {e:?}", path.display())))?;
            let data_start = 8 + n;
            let file_idx = set.files.len();
            let mut infos: Vec<_> = meta.tensors().into_iter().collect();
            infos.sort_by_key(|(_, info)| info.data_offsets);
            for (orig, info) in infos {
                if let Some(listed) = expected.as_ref().and_then(|wm| wm.get(&orig)) {
                    if *listed != fname {
                        return Err(Error::convert(format!(
                            "{}: tensor {orig} is listed in model.safetensors.index.json under {listed}",
                            path.display()
                        )));
                    }
                }
                let name = normalize_name(&orig);
                let (b, e) = info.data_offsets;
                let id = set.tensors.len();
                if let Some(&prev) = set.by_name.get(&name) {
                    return Err(Error::convert(format!(
                        "tensor {name} appears twice (as {} and {orig})",
                        set.tensors[prev].orig_name
                    )));
                }
                set.by_name.insert(name.clone(), id);
                set.tensors.push(SrcTensor {
                    name,
                    orig_name: orig,
                    file: file_idx,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + b,
                    nbytes: e - b,
                });
            }
            set.files.push((path, map));
        }
        if let Some(wm) = &expected {
            for (k, f) in wm {
                if !set.by_name.contains_key(&normalize_name(k)) {
                    return Err(Error::convert(format!(
                        "model.safetensors.index.json lists {k} in {f}, but that file has no such tensor"
                    )));
                }
            }
        }
        Ok(set)
    }

    /// Looks a tensor up by its normalised name.
    pub fn get(&self, name: &str) -> Option<SrcId> {
        self.by_name.get(name).copied()
    }

    fn bytes(&self, id: SrcId) -> &[u8] {
        let t = &self.tensors[id];
        &self.files[t.file].1[t.start..t.start + t.nbytes]
    }

    /// Tells the kernel the pages of rows `[row, row + n)` (rows of `width` values)
    /// are no longer needed, so a long conversion's resident set stays at the
    /// chunk being converted instead of growing with every page ever touched. The
    /// map is read-only and file-backed, so a later read simply faults the data in
    /// again. Best effort: errors are ignored.
    pub fn release_rows(&self, id: SrcId, row: usize, n: usize, width: usize) {
        #[cfg(unix)]
        {
            let t = &self.tensors[id];
            let es = t.dtype.size();
            let start = t.start + row * width * es;
            let len = n * width * es;
            if len > 0 && start + len <= t.start + t.nbytes {
                // SAFETY: DONTNEED on a read-only shared file mapping only drops cached
                // pages; no data can be lost and later reads see the same bytes.
                let _ = unsafe {
                    self.files[t.file].1.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
                };
            }
        }
        #[cfg(not(unix))]
        let _ = (id, row, n, width);
    }

    /// Decodes `out.len()` consecutive values starting at row `row` of width
    /// `out.len()` (the tensor viewed as `[numel / width, width]`). The caller has
    /// checked the dtype is F32/F16/BF16 and the row is in range.
    pub fn row_f32(&self, id: SrcId, row: usize, out: &mut [f32]) {
        let t = &self.tensors[id];
        let w = out.len();
        let es = t.dtype.size();
        let b = &self.bytes(id)[row * w * es..(row + 1) * w * es];
        match t.dtype {
            Dtype::F32 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Dtype::F16 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            Dtype::BF16 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                }
            }
            other => unreachable!("row_f32 on a {other:?} tensor"),
        }
    }

    /// Reads an integer buffer exactly (I64, I32, U64 or U32); negative values are an error.
    pub fn read_u64s(&self, id: SrcId) -> Result<Vec<u64>> {
        let t = &self.tensors[id];
        let b = self.bytes(id);
        let neg = || Error::convert(format!("tensor {}: negative value in an unsigned hash buffer", t.orig_name));
        let v: Vec<u64> = match t.dtype {
            Dtype::I64 => b
                .chunks_exact(8)
                .map(|c| u64::try_from(i64::from_le_bytes(c.try_into().unwrap())).map_err(|_| neg()))
                .collect::<Result<_>>()?,
            Dtype::U64 => b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect(),
            Dtype::I32 => b
                .chunks_exact(4)
                .map(|c| u64::try_from(i32::from_le_bytes(c.try_into().unwrap())).map_err(|_| neg()))
                .collect::<Result<_>>()?,
            Dtype::U32 => b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap()) as u64).collect(),
            other => {
                return Err(Error::convert(format!(
                    "tensor {}: expected an integer buffer (int64), got {other:?}; a float copy would not be exact",
                    t.orig_name
                )))
            }
        };
        Ok(v)
    }
}
