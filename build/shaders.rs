//! The Vulkan shader modules and their committed SPIR-V, shared by `build.rs`,
//! `tests/spirv.rs` and `scripts/build-shaders.sh` (through `build/regenerate.rs`).
//!
//! Every module is one `.comp` source of `shaders/` compiled by `glslc` with
//! [`FLAGS`] and its `#define`s. Its SPIR-V is committed as
//! `shaders/spirv/<module>.spv`, and `shaders/spirv/manifest.txt` records, per
//! module, a hash of what it was made from (the flags, the defines, the
//! `.comp` and every file it includes) and a hash of the `.spv` bytes. A
//! module is *fresh* while both hashes match the files: then the build needs
//! no `glslc`.
//!
//! Hashes are 64-bit FNV-1a (enough to notice edits; nothing here is
//! adversarial), over sources with `\r\n` read as `\n` (a checkout with
//! Windows line endings compiles to the same SPIR-V).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `glslc` arguments every module is compiled with (besides `-I`, `-D`, `-o`).
pub const FLAGS: &[&str] = &["-fshader-stage=compute", "--target-env=vulkan1.1", "-O", "-Werror"];

/// (module name, source file, defines)
const VARIANTS: &[(&str, &str, &[&str])] = &[
    ("hc_norm", "hc_norm.comp", &[]),
    ("hc_combine", "hc_combine.comp", &[]),
    ("ple_mix", "ple_mix.comp", &[]),
    ("gdn_conv", "gdn_conv.comp", &[]),
    ("gdn_recurrent", "gdn_recurrent.comp", &[]),
    ("gdn_token", "gdn_recurrent.comp", &["TOKEN"]),
    ("gdn_norm", "gdn_norm.comp", &[]),
    ("attn_prep", "attn_prep.comp", &[]),
    ("qsa_index", "qsa_index.comp", &[]),
    ("qsa_score", "qsa_score.comp", &[]),
    ("qsa_topk", "qsa_topk.comp", &[]),
    ("attention", "attention.comp", &[]),
    ("moe_route", "moe_route.comp", &[]),
    ("router", "router.comp", &[]),
    ("router_batch", "router.comp", &["BATCH"]),
    ("moe_combine", "moe_combine.comp", &[]),
    ("moe_group", "moe_group.comp", &[]),
    ("act_int8", "act_int8.comp", &[]),
    ("split_sums", "split_sums.comp", &[]),
];

/// Weight types of the matvec modules: (module suffix, `WEIGHT_*` define).
/// Each gives `matvec_<suffix>` and, with `ARENA`, `expert_<suffix>`.
const WEIGHT_TYPES: &[(&str, &str)] = &[
    ("f32", "WEIGHT_F32"),
    ("f16", "WEIGHT_F16"),
    ("bf16", "WEIGHT_BF16"),
    ("q4_0", "WEIGHT_Q4_0"),
    ("q4_1", "WEIGHT_Q4_1"),
    ("q5_0", "WEIGHT_Q5_0"),
    ("q5_1", "WEIGHT_Q5_1"),
    ("q8_0", "WEIGHT_Q8_0"),
    ("q2_k", "WEIGHT_Q2_K"),
    ("q3_k", "WEIGHT_Q3_K"),
    ("q4_k", "WEIGHT_Q4_K"),
    ("q5_k", "WEIGHT_Q5_K"),
    ("q6_k", "WEIGHT_Q6_K"),
];

/// Types with batch modules (the real model's files: the reference mix and
/// the 2-bit file); a pass over the others runs their plain fast modules.
/// Each batch module is 100-170 KB of SPIR-V (its loops over entries unrolled).
const BATCH_TYPES: &[&str] = &["q4_0", "q5_0", "q8_0", "q2_k", "q4_k", "q6_k"];

/// Types with matrix-matrix modules for passes on cooperative matrices
/// (shaders/mm.comp: `mm_<t>`, with `ARENA` `mm_expert_<t>`): every quantized type.
const MM_TYPES: &[&str] = &["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"];

/// One SPIR-V module: `shaders/<file>` compiled with `-D<define>` for each define.
pub struct Module {
    pub name: String,
    pub file: &'static str,
    pub defines: Vec<&'static str>,
}

/// Every module, matvecs first: per weight type `matvec_<t>` and
/// `expert_<t>`, then for the quantized types the fast kernels (`FAST`:
/// 8-bit activations, integer dot products) `matvec_<t>_fast` and
/// `expert_<t>_fast`, then for [`BATCH_TYPES`] their batch modules (`BATCH`:
/// entries of a pass share each weight decode) `matvec_<t>_fast_batch` and
/// `expert_<t>_fast_batch`, then for [`MM_TYPES`] the matrix-matrix modules
/// `mm_<t>` and `mm_expert_<t>`.
pub fn modules() -> Vec<Module> {
    let mut out = Vec::new();
    for (suffix, define) in WEIGHT_TYPES {
        out.push(Module { name: format!("matvec_{suffix}"), file: "matvec.comp", defines: vec![define] });
        out.push(Module { name: format!("expert_{suffix}"), file: "matvec.comp", defines: vec![define, "ARENA"] });
    }
    for (suffix, define) in WEIGHT_TYPES.iter().filter(|(s, _)| s.starts_with('q')) {
        out.push(Module { name: format!("matvec_{suffix}_fast"), file: "matvec.comp", defines: vec![define, "FAST"] });
        out.push(Module { name: format!("expert_{suffix}_fast"), file: "matvec.comp", defines: vec![define, "ARENA", "FAST"] });
    }
    for (suffix, define) in WEIGHT_TYPES.iter().filter(|(s, _)| BATCH_TYPES.contains(s)) {
        out.push(Module { name: format!("matvec_{suffix}_fast_batch"), file: "matvec.comp", defines: vec![define, "FAST", "BATCH"] });
        out.push(Module {
            name: format!("expert_{suffix}_fast_batch"),
            file: "matvec.comp",
            defines: vec![define, "ARENA", "FAST", "BATCH"],
        });
    }
    for (suffix, define) in WEIGHT_TYPES.iter().filter(|(s, _)| MM_TYPES.contains(s)) {
        out.push(Module { name: format!("mm_{suffix}"), file: "mm.comp", defines: vec![define] });
        out.push(Module { name: format!("mm_expert_{suffix}"), file: "mm.comp", defines: vec![define, "ARENA"] });
    }
    out.extend(VARIANTS.iter().map(|(name, file, defines)| Module {
        name: name.to_string(),
        file,
        defines: defines.to_vec(),
    }));
    out
}

/// The manifest's file name inside the SPIR-V folder.
pub const MANIFEST: &str = "manifest.txt";

/// FNV-1a, 64 bits, continuing from `h`.
pub fn fnv1a64(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// A file's text as hashed: `\r\n` read as `\n`.
fn normalized(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    for (i, &b) in bytes.iter().enumerate() {
        if !(b == b'\r' && bytes.get(i + 1) == Some(&b'\n')) {
            out.push(b);
        }
    }
    out
}

/// The file named by an `#include "x"` or `#include <x>` line, if it is one.
/// Every such line counts, whatever `#if` it sits in (a superset is safe).
fn include_target(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix('#')?.trim_start().strip_prefix("include")?.trim();
    let (open, close) = match rest.chars().next()? {
        '"' => ('"', '"'),
        '<' => ('<', '>'),
        _ => return None,
    };
    let inner = rest.strip_prefix(open)?;
    Some(&inner[..inner.find(close)?])
}

/// `file` (relative to `src`) and every file it includes, transitively:
/// paths relative to `src`, `file` first, the rest sorted.
pub fn sources(src: &Path, file: &str) -> Result<Vec<String>, String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![file.to_string()];
    while let Some(f) = todo.pop() {
        if !seen.insert(f.clone()) {
            continue;
        }
        let path = src.join(&f);
        let text = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let dir = Path::new(&f).parent().unwrap_or(Path::new(""));
        for line in String::from_utf8_lossy(&text).lines() {
            if let Some(inc) = include_target(line) {
                // glslc looks next to the including file first, then in `-I src`.
                let near = dir.join(inc);
                let name = if src.join(&near).is_file() { near } else { PathBuf::from(inc) };
                todo.push(name.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    seen.remove(file);
    Ok(std::iter::once(file.to_string()).chain(seen).collect())
}

/// The hash of what `m`'s SPIR-V is made from: the flags, its defines, and
/// the name and text of its `.comp` and of every file that includes.
pub fn source_hash(src: &Path, m: &Module) -> Result<u64, String> {
    let mut h = FNV_OFFSET;
    for f in FLAGS {
        h = fnv1a64(h, format!("flag {f}\n").as_bytes());
    }
    for d in &m.defines {
        h = fnv1a64(h, format!("define {d}\n").as_bytes());
    }
    for f in sources(src, m.file)? {
        let path = src.join(&f);
        let text = normalized(&std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?);
        h = fnv1a64(h, format!("file {f} {}\n", text.len()).as_bytes());
        h = fnv1a64(h, &text);
    }
    Ok(h)
}

/// What `manifest.txt` says.
#[derive(Default)]
pub struct Manifest {
    /// `glslc --version` of the compiler that made the files (one line).
    pub glslc: String,
    /// Per module: (source hash, SPIR-V hash).
    pub modules: BTreeMap<String, (u64, u64)>,
}

impl Manifest {
    /// Reads `dir/manifest.txt`; `None` when it is missing or malformed.
    pub fn read(dir: &Path) -> Option<Manifest> {
        let text = std::fs::read_to_string(dir.join(MANIFEST)).ok()?;
        let mut m = Manifest::default();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(v) = line.strip_prefix("glslc:") {
                m.glslc = v.trim().to_string();
                continue;
            }
            let mut f = line.split_whitespace();
            let (Some(name), Some(src), Some(spv), None) = (f.next(), f.next(), f.next(), f.next()) else {
                return None;
            };
            let hex = |s: &str| u64::from_str_radix(s, 16).ok();
            m.modules.insert(name.to_string(), (hex(src)?, hex(spv)?));
        }
        Some(m)
    }

    /// The manifest's text.
    pub fn render(&self) -> String {
        let mut s = String::from(
            "# The committed SPIR-V of the Vulkan shaders: written by scripts/build-shaders.sh, do not edit.\n\
             # Per module: FNV-1a 64 of its sources (glslc flags, defines, the .comp and every file it\n\
             # includes) and of its .spv. build.rs embeds a .spv as it is while both match.\n",
        );
        s.push_str(&format!("glslc: {}\n", self.glslc));
        s.push_str(&format!("# flags: {}\n", FLAGS.join(" ")));
        for (name, (src, spv)) in &self.modules {
            s.push_str(&format!("{name} {src:016x} {spv:016x}\n"));
        }
        s
    }
}

/// Why a committed module cannot be used, or its bytes.
pub fn committed(src: &Path, spirv: &Path, manifest: Option<&Manifest>, m: &Module) -> Result<Vec<u8>, String> {
    let Some(manifest) = manifest else {
        return Err(format!("shaders/spirv/{MANIFEST} is missing or malformed"));
    };
    let Some(&(want_src, want_spv)) = manifest.modules.get(&m.name) else {
        return Err("not in the manifest".into());
    };
    if source_hash(src, m)? != want_src {
        return Err(format!("shaders/{} or a file it includes changed since its SPIR-V was made", m.file));
    }
    let path = spirv.join(format!("{}.spv", m.name));
    let bytes = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if fnv1a64(FNV_OFFSET, &bytes) != want_spv {
        return Err(format!("{} is not the file the manifest names", path.display()));
    }
    Ok(bytes)
}

/// `glslc --version` on one line, or `None` when `glslc` cannot be run.
pub fn glslc_version(glslc: &str) -> Option<String> {
    let out = Command::new(glslc).arg("--version").output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("Target:")).collect();
    Some(lines.join("; "))
}

/// Compiles `m` to `out` with `glslc`.
pub fn compile(glslc: &str, src: &Path, m: &Module, out: &Path) -> Result<(), String> {
    let mut cmd = Command::new(glslc);
    cmd.args(FLAGS).arg("-I").arg(src);
    for d in &m.defines {
        cmd.arg(format!("-D{d}"));
    }
    cmd.arg(src.join(m.file)).arg("-o").arg(out);
    let status = cmd.status().map_err(|e| format!("cannot run `{glslc}` ({e})"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("glslc failed on shaders/{} ({}); see the messages above", m.file, m.name))
    }
}

/// Compiles every module into `dir/<module>.spv` and writes `dir/manifest.txt`;
/// returns the manifest. Other `.spv` files in `dir` are removed.
pub fn regenerate(glslc: &str, src: &Path, dir: &Path) -> Result<Manifest, String> {
    let version = glslc_version(glslc).ok_or_else(|| format!("cannot run `{glslc} --version`"))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let mut manifest = Manifest { glslc: version, modules: BTreeMap::new() };
    let names: BTreeSet<String> = modules().into_iter().map(|m| m.name).collect();
    for entry in std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        if path.extension().is_some_and(|e| e == "spv") && !names.contains(stem) {
            std::fs::remove_file(&path).map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
        }
    }
    for m in modules() {
        let out = dir.join(format!("{}.spv", m.name));
        compile(glslc, src, &m, &out)?;
        let bytes = std::fs::read(&out).map_err(|e| format!("cannot read {}: {e}", out.display()))?;
        manifest.modules.insert(m.name.clone(), (source_hash(src, &m)?, fnv1a64(FNV_OFFSET, &bytes)));
    }
    std::fs::write(dir.join(MANIFEST), manifest.render()).map_err(|e| format!("cannot write the manifest: {e}"))?;
    Ok(manifest)
}
