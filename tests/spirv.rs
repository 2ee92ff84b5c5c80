//! The committed SPIR-V of the Vulkan shaders (`shaders/spirv/`, embedded by
//! `build.rs`) against the shader sources: fails while it is stale. Refresh it
//! with `bash scripts/build-shaders.sh`.

#[path = "../build/shaders.rs"]
#[allow(dead_code)]
mod shaders;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const REFRESH: &str = "run `bash scripts/build-shaders.sh` and commit shaders/spirv/";

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders")
}

fn manifest() -> shaders::Manifest {
    shaders::Manifest::read(&src().join("spirv"))
        .unwrap_or_else(|| panic!("shaders/spirv/{} is missing or malformed: {REFRESH}", shaders::MANIFEST))
}

/// Without glslc: the manifest lists every module and nothing else, each
/// module's sources hash as recorded, and each `.spv` is the recorded file.
#[test]
fn committed_spirv_matches_the_sources() {
    let (src, manifest) = (src(), manifest());
    let modules = shaders::modules();
    let names: BTreeSet<String> = modules.iter().map(|m| m.name.clone()).collect();
    let listed: BTreeSet<String> = manifest.modules.keys().cloned().collect();
    assert_eq!(listed, names, "the manifest's modules are not build/shaders.rs's: {REFRESH}");
    let on_disk: BTreeSet<String> = std::fs::read_dir(src.join("spirv"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "spv"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(on_disk, names, "shaders/spirv/ holds other .spv files than the modules: {REFRESH}");
    let stale: Vec<String> = modules
        .iter()
        .filter_map(|m| {
            shaders::committed(&src, &src.join("spirv"), Some(&manifest), m).err().map(|e| format!("  {}: {e}", m.name))
        })
        .collect();
    assert!(stale.is_empty(), "the committed SPIR-V is stale:\n{}\n{REFRESH}", stale.join("\n"));
}

/// With glslc (`FNX_REQUIRE_GLSLC=1`, as `scripts/test.sh` sets, makes it
/// required): every module compiles, and where this glslc is the version that
/// made the committed files, to exactly their bytes. glslc's output depends
/// only on its version, flags and sources (not on paths or line endings), so
/// another version is no evidence of staleness: then the hash check above is
/// what guards the files, and this test only compiles.
#[test]
fn committed_spirv_is_what_glslc_makes() {
    let glslc = std::env::var("GLSLC").unwrap_or_else(|_| "glslc".into());
    let Some(version) = shaders::glslc_version(&glslc) else {
        assert!(std::env::var_os("FNX_REQUIRE_GLSLC").is_none(), "FNX_REQUIRE_GLSLC is set but `{glslc}` cannot run");
        eprintln!("skipped: `{glslc}` cannot run (the committed SPIR-V's hashes are checked without it)");
        return;
    };
    let (src, committed) = (src(), manifest());
    let tmp = std::env::temp_dir().join(format!("flashnext-spirv-{}", std::process::id()));
    let fresh = shaders::regenerate(&glslc, &src, &tmp).unwrap_or_else(|e| panic!("{e}"));
    let mut differ = Vec::new();
    for m in shaders::modules() {
        let name = format!("{}.spv", m.name);
        let made = std::fs::read(tmp.join(&name)).unwrap();
        let kept = std::fs::read(src.join("spirv").join(&name)).unwrap_or_default();
        if made != kept {
            differ.push(m.name);
        }
    }
    std::fs::remove_dir_all(&tmp).ok();
    let sources_differ: Vec<&String> = fresh
        .modules
        .iter()
        .filter(|(k, v)| committed.modules.get(*k).map(|c| c.0) != Some(v.0))
        .map(|(k, _)| k)
        .collect();
    assert!(sources_differ.is_empty(), "sources changed since the SPIR-V was made: {sources_differ:?}; {REFRESH}");
    if version == committed.glslc {
        assert!(differ.is_empty(), "glslc makes other SPIR-V than the committed for {differ:?}: {REFRESH}");
        eprintln!("{} modules: glslc ({version}) makes exactly the committed SPIR-V", fresh.modules.len());
    } else {
        eprintln!(
            "note: this glslc ({version}) is not the one that made the committed SPIR-V ({}); every module \
             compiles, {} of them to other bytes, which says nothing about staleness",
            committed.glslc,
            differ.len()
        );
    }
}
