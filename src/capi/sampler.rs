//! `fnx_sampler`: turns logits into a token (penalties, temperature,
//! top-k, top-p, min-p, seeded draw); see `crate::sampling` for the exact chain.
//! An optional constraint (`fnx_sampler_set_constraint`, structured output)
//! masks the tokens its grammar forbids before the chain; see `crate::constraint`.

use super::handle::{lease, Lease};
use super::{
    fail, fnx_model, fnx_status, guard, non_null, Failure, FNX_CONSTRAINT_JSON_SCHEMA, FNX_CONSTRAINT_LARK,
    FNX_CONSTRAINT_NONE, FNX_CONSTRAINT_REGEX, FNX_ERR_INVALID_ARGUMENT,
};
use crate::constraint::{Constraint, ConstraintKind};
use crate::sampling::{Sampler, SamplerParams, PRESETS, RANDOM_SEED};
use std::ffi::{c_char, CStr};

/// `fnx_sampler_params.seed` value asking for a random seed.
pub const FNX_SEED_RANDOM: u64 = 0xFFFF_FFFF_FFFF_FFFF;

/// Settings of a sampler. Get them from `fnx_sampler_params_default()` or
/// `fnx_sampler_params_preset()` and change what you need. The chain runs:
/// repetition penalty, presence/frequency penalties, temperature, top-k,
/// top-p, min-p, then a seeded draw.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fnx_sampler_params {
    /// `sizeof(fnx_sampler_params)` as the caller compiled it (set by the functions above).
    pub struct_size: u32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: i32,
    /// Seed of the draw; `FNX_SEED_RANDOM` picks one. The same seed and the
    /// same logits give the same tokens.
    pub seed: u64,
    /// 0 = greedy (always the most likely token); otherwise > 0.
    pub temperature: f32,
    /// Nucleus: keep the most likely tokens until their probability reaches
    /// `top_p`, in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely one, in [0, 1]; 0 = off.
    pub min_p: f32,
    /// Divides positive logits / multiplies negative logits of recently
    /// accepted tokens, > 0; 1 = off.
    pub repetition_penalty: f32,
    /// How many of the last accepted tokens `repetition_penalty` covers; 0 = off, -1 = all.
    pub penalty_last_n: i32,
    /// Subtracted once from the logit of every token accepted so far (OpenAI); 0 = off.
    pub presence_penalty: f32,
    /// Subtracted per occurrence of every token accepted so far (OpenAI); 0 = off.
    pub frequency_penalty: f32,
}

/// A sampler (opaque): the settings, the random generator and the accepted
/// tokens. Use from one thread at a time; free with `fnx_sampler_free`.
pub struct fnx_sampler {
    pub(crate) sampler: Sampler,
}

impl fnx_sampler {
    /// Takes a sampler handle for the call (refused unless it is a live
    /// sampler handle not in use by another call).
    pub(crate) fn from_ptr(p: *mut fnx_sampler, func: &str) -> Result<Lease<fnx_sampler>, Failure> {
        lease(p, func)
    }
}

fn to_c(p: &SamplerParams) -> fnx_sampler_params {
    fnx_sampler_params {
        struct_size: std::mem::size_of::<fnx_sampler_params>() as u32,
        top_k: p.top_k.min(i32::MAX as usize) as i32,
        seed: if p.seed == RANDOM_SEED {
            FNX_SEED_RANDOM
        } else {
            p.seed
        },
        temperature: p.temperature,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        penalty_last_n: if p.penalty_last_n == usize::MAX {
            -1
        } else {
            p.penalty_last_n.min(i32::MAX as usize) as i32
        },
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
    }
}

fn from_c(p: &fnx_sampler_params, func: &str) -> Result<SamplerParams, Failure> {
    if p.struct_size as usize != std::mem::size_of::<fnx_sampler_params>() {
        return Err(fail(
            FNX_ERR_INVALID_ARGUMENT,
            format!(
                "{func}: params.struct_size is {}, expected {} (initialise it with fnx_sampler_params_default)",
                p.struct_size,
                std::mem::size_of::<fnx_sampler_params>()
            ),
        ));
    }
    let top_k = usize::try_from(p.top_k).map_err(|_| {
        fail(
            FNX_ERR_INVALID_ARGUMENT,
            format!("{func}: top_k {} must be >= 0 (0 = off)", p.top_k),
        )
    })?;
    let penalty_last_n = match p.penalty_last_n {
        -1 => usize::MAX,
        n => usize::try_from(n).map_err(|_| {
            fail(
                FNX_ERR_INVALID_ARGUMENT,
                format!("{func}: penalty_last_n {n} must be >= -1 (-1 = all, 0 = off)"),
            )
        })?,
    };
    let params = SamplerParams {
        seed: p.seed,
        temperature: p.temperature,
        top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        penalty_last_n,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
    };
    params
        .validate()
        .map_err(|e| fail(FNX_ERR_INVALID_ARGUMENT, format!("{func}: {e}")))?;
    Ok(params)
}

/// Settings that leave the model's distribution as it is: temperature 1,
/// no truncation, no penalties, random seed.
#[no_mangle]
pub extern "C" fn fnx_sampler_params_default() -> fnx_sampler_params {
    to_c(&SamplerParams::default())
}

/// Fills `*out` with a named preset: `"thinking"` (temperature 1.0, top-p
/// 0.95, top-k 20, min-p 0), `"instruct"` (temperature 0.7, top-p 0.8, top-k
/// 20, min-p 0, presence penalty 1.5) or `"greedy"`. Unnamed fields get the
/// defaults (random seed). `FNX_ERR_INVALID_ARGUMENT` for other names.
///
/// # Safety
/// `name` must be NULL or NUL-terminated; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_sampler_params_preset(
    name: *const c_char,
    out: *mut fnx_sampler_params,
) -> fnx_status {
    guard(
        || {
            non_null!(name, "fnx_sampler_params_preset", "name");
            non_null!(out, "fnx_sampler_params_preset", "out");
            // SAFETY: non-NULL and NUL-terminated per the contract.
            let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
            let p = SamplerParams::preset(&name).ok_or_else(|| {
                fail(
                    FNX_ERR_INVALID_ARGUMENT,
                    format!(
                        "fnx_sampler_params_preset: unknown preset {name:?} (known: {})",
                        PRESETS.join(", ")
                    ),
                )
            })?;
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out = to_c(&p) };
            Ok(())
        },
        || {},
    )
}

/// Creates a sampler. `params` may be NULL for the defaults; out-of-range
/// settings give `FNX_ERR_INVALID_ARGUMENT` naming the field.
///
/// # Safety
/// `params` must be NULL or a valid `fnx_sampler_params`; `out_sampler` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_sampler_new(
    params: *const fnx_sampler_params,
    out_sampler: *mut *mut fnx_sampler,
) -> fnx_status {
    guard(
        || {
            non_null!(out_sampler, "fnx_sampler_new", "out_sampler");
            // SAFETY: non-NULL per the check; the caller promises a valid struct.
            let p = if params.is_null() {
                fnx_sampler_params_default()
            } else {
                unsafe { *params }
            };
            let sampler = Sampler::new(from_c(&p, "fnx_sampler_new")?)?;
            let handle = Box::new(fnx_sampler { sampler });
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out_sampler = super::handle::insert(handle) };
            Ok(())
        },
        || {},
    )
}

/// Draws a token from `n` logits (any source; index = token id) into
/// `*out_token`. Advances the random generator; does not accept the token
/// (call `fnx_sampler_accept` for the penalties to see it). Logits of
/// -INFINITY are never drawn; NaN or +INFINITY give `FNX_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `sampler` NULL or a live handle; `logits` NULL or `n` readable floats;
/// `out_token` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_sampler_sample(
    sampler: *mut fnx_sampler,
    logits: *const f32,
    n: usize,
    out_token: *mut i32,
) -> fnx_status {
    guard(
        || {
            non_null!(sampler, "fnx_sampler_sample", "sampler");
            non_null!(logits, "fnx_sampler_sample", "logits");
            non_null!(out_token, "fnx_sampler_sample", "out_token");
            let mut s = fnx_sampler::from_ptr(sampler, "fnx_sampler_sample")?;
            if n == 0 || n > i32::MAX as usize {
                return Err(fail(
                    FNX_ERR_INVALID_ARGUMENT,
                    format!("fnx_sampler_sample: n is {n}, expected 1..=INT32_MAX"),
                ));
            }
            // SAFETY: `n` readable floats per the contract.
            let l = unsafe { std::slice::from_raw_parts(logits, n) };
            let t = s
                .sampler
                .sample(l)
                .map_err(|e| fail(FNX_ERR_INVALID_ARGUMENT, format!("fnx_sampler_sample: {e}")))?;
            // SAFETY: checked non-NULL; written only on success.
            unsafe { *out_token = t as i32 };
            Ok(())
        },
        || {},
    )
}

/// Records `token` as part of the text, for the repetition, presence and
/// frequency penalties. `fnx_generate` accepts the tokens it generates.
///
/// # Safety
/// `sampler` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn fnx_sampler_accept(sampler: *mut fnx_sampler, token: i32) -> fnx_status {
    guard(
        || {
            non_null!(sampler, "fnx_sampler_accept", "sampler");
            let mut s = fnx_sampler::from_ptr(sampler, "fnx_sampler_accept")?;
            let t = u32::try_from(token).map_err(|_| {
                fail(
                    super::FNX_ERR_TOKEN_OUT_OF_RANGE,
                    format!("fnx_sampler_accept: token {token} is negative"),
                )
            })?;
            s.sampler.accept(t);
            Ok(())
        },
        || {},
    )
}

/// Forgets the accepted tokens and restarts the random generator from the
/// seed (a random seed drawn at creation is kept): the same logits then give
/// the same tokens again.
///
/// # Safety
/// `sampler` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn fnx_sampler_reset(sampler: *mut fnx_sampler) -> fnx_status {
    guard(
        || {
            non_null!(sampler, "fnx_sampler_reset", "sampler");
            let mut s = fnx_sampler::from_ptr(sampler, "fnx_sampler_reset")?;
            s.sampler.reset();
            Ok(())
        },
        || {},
    )
}

/// Sets the grammar the sampler's tokens must follow (structured output), or
/// removes it. `kind` is `FNX_CONSTRAINT_JSON_SCHEMA` (`text` is a JSON
/// Schema), `FNX_CONSTRAINT_REGEX` (a regular expression the whole output
/// matches) or `FNX_CONSTRAINT_LARK` (a Lark grammar, start rule `start`),
/// compiled for `model`'s vocabulary; or `FNX_CONSTRAINT_NONE`, which
/// removes the constraint (`model` and `text` may then be NULL).
///
/// From then on `fnx_sampler_sample` (greedy ones too) never draws a token
/// the grammar forbids: their logits count as -INFINITY before the rest of
/// the chain, so temperature and top-p renormalise over the allowed tokens.
/// `fnx_sampler_accept` advances the grammar (accepting a token it forbids
/// makes later draws fail with `FNX_ERR_INVALID_ARGUMENT` until
/// `fnx_sampler_reset`); `fnx_sampler_reset` restarts it; `fnx_generate`
/// stops once the grammar is complete. Once complete, only the model's
/// end-of-sequence tokens are allowed. The first constraint for a model
/// builds a trie of its vocabulary (once per model).
///
/// A bad schema, regex or grammar (or `text` that is not UTF-8) is
/// `FNX_ERR_INVALID_ARGUMENT` with the compiler's message; an unknown `kind`
/// too. On any error the sampler is unchanged.
///
/// # Safety
/// `sampler` NULL or a live handle; `model` NULL or a live handle; `text`
/// NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn fnx_sampler_set_constraint(
    sampler: *mut fnx_sampler,
    model: *const fnx_model,
    kind: i32,
    text: *const c_char,
) -> fnx_status {
    const F: &str = "fnx_sampler_set_constraint";
    guard(
        || {
            non_null!(sampler, "fnx_sampler_set_constraint", "sampler");
            let kind = match kind {
                FNX_CONSTRAINT_NONE => None,
                FNX_CONSTRAINT_JSON_SCHEMA => Some(ConstraintKind::JsonSchema),
                FNX_CONSTRAINT_REGEX => Some(ConstraintKind::Regex),
                FNX_CONSTRAINT_LARK => Some(ConstraintKind::Lark),
                k => {
                    return Err(fail(
                        FNX_ERR_INVALID_ARGUMENT,
                        format!("{F}: kind {k} is not an FNX_CONSTRAINT_* value (0 to 3)"),
                    ))
                }
            };
            let mut s = fnx_sampler::from_ptr(sampler, F)?;
            let constraint = match kind {
                None => None,
                Some(kind) => {
                    non_null!(model, "fnx_sampler_set_constraint", "model");
                    non_null!(text, "fnx_sampler_set_constraint", "text");
                    let m = fnx_model::from_ptr(model, F)?;
                    // SAFETY: non-NULL and NUL-terminated per the contract.
                    let bytes = unsafe { CStr::from_ptr(text) }.to_bytes();
                    let text = std::str::from_utf8(bytes).map_err(|e| {
                        fail(
                            FNX_ERR_INVALID_ARGUMENT,
                            format!("{F}: text is not valid UTF-8 (bad byte at offset {})", e.valid_up_to()),
                        )
                    })?;
                    let in_f = |e: crate::error::Error| {
                        let f = Failure::from(e);
                        Failure(f.0, format!("{F}: {}", f.1))
                    };
                    let tokenizer = m.tokenizer.get(&m.model).map_err(in_f)?;
                    Some(Constraint::new(tokenizer, kind, text).map_err(in_f)?)
                }
            };
            // Only now, with everything checked and compiled, is the sampler changed.
            s.sampler.set_constraint(constraint);
            Ok(())
        },
        || {},
    )
}

/// Frees a sampler (NULL is ignored).
///
/// # Safety
/// `sampler` must be NULL or a handle from `fnx_sampler_new` not yet freed.
#[no_mangle]
pub unsafe extern "C" fn fnx_sampler_free(sampler: *mut fnx_sampler) {
    if sampler.is_null() {
        return;
    }
    let _ = guard(
        || {
            drop(super::handle::remove(sampler, "fnx_sampler_free")?);
            Ok(())
        },
        || {},
    );
}
