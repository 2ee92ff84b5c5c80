//! Compiles the GLSL compute shaders in `shaders/` to SPIR-V with `glslc`
//! (Debian/Ubuntu package `glslc`, also in the Vulkan SDK) and writes them to
//! `OUT_DIR`, where `src/vulkan/pipelines.rs` embeds them. Each entry of
//! `VARIANTS` is one SPIR-V module: a `.comp` source plus `#define`s; the
//! matvec modules come from `WEIGHT_TYPES` (plain and expert-arena each).

use std::path::{Path, PathBuf};
use std::process::Command;

/// (module name, source file, defines)
const VARIANTS: &[(&str, &str, &[&str])] = &[
    ("hc_norm", "hc_norm.comp", &[]),
    ("hc_combine", "hc_combine.comp", &[]),
    ("ple_mix", "ple_mix.comp", &[]),
    ("gdn_conv", "gdn_conv.comp", &[]),
    ("gdn_recurrent", "gdn_recurrent.comp", &[]),
    ("attn_prep", "attn_prep.comp", &[]),
    ("qsa_index", "qsa_index.comp", &[]),
    ("qsa_score", "qsa_score.comp", &[]),
    ("qsa_topk", "qsa_topk.comp", &[]),
    ("attention", "attention.comp", &[]),
    ("moe_route", "moe_route.comp", &[]),
    ("moe_combine", "moe_combine.comp", &[]),
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

fn main() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=shaders");
    println!("cargo:rerun-if-env-changed=GLSLC");
    let glslc = std::env::var("GLSLC").unwrap_or_else(|_| "glslc".into());
    let mut modules: Vec<(String, &str, Vec<&str>)> = Vec::new();
    for (suffix, define) in WEIGHT_TYPES {
        modules.push((format!("matvec_{suffix}"), "matvec.comp", vec![define]));
        modules.push((format!("expert_{suffix}"), "matvec.comp", vec![define, "ARENA"]));
    }
    modules.extend(VARIANTS.iter().map(|(name, file, defines)| (name.to_string(), *file, defines.to_vec())));
    for (name, file, defines) in &modules {
        let mut cmd = Command::new(&glslc);
        cmd.arg("-fshader-stage=compute").arg("--target-env=vulkan1.1").arg("-O").arg("-Werror");
        cmd.arg("-I").arg(&src);
        for d in defines {
            cmd.arg(format!("-D{d}"));
        }
        cmd.arg(src.join(file)).arg("-o").arg(out.join(format!("{name}.spv")));
        let status = cmd.status().unwrap_or_else(|e| {
            panic!(
                "cannot run `{glslc}` ({e}): the Vulkan shaders need the GLSL compiler. \
                 Install the `glslc` package (apt-get install glslc, or run scripts/setup.sh), \
                 or point GLSLC at a glslc binary"
            )
        });
        assert!(status.success(), "glslc failed on shaders/{file} ({name}); see the messages above");
    }
}
