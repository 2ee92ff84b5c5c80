//! Decoding several tokens at once and the generation loop (`fnx_generate`).

use super::state::{aborted, check, poison};
use super::{
    check_count, fail, fnx_sampler, fnx_state, fnx_status, guard, log, non_null, slice_arg, Failure,
    FNX_ERR_CONTEXT_FULL,
    FNX_ERR_INTERNAL, FNX_ERR_INVALID_ARGUMENT, FNX_ERR_NO_LOGITS, FNX_ERR_NULL_ARGUMENT, FNX_ERR_TOKEN_OUT_OF_RANGE,
    FNX_LOG_DEBUG,
};
use super::handle::Lease;
use crate::generate::{self, GenerateOptions, Generation, StopReason};
use crate::error::Error;
use crate::model::LogitsFor;
use std::ffi::{c_char, c_void, CStr};

/// Receives each generated token and its text: `piece_len` bytes at `piece`
/// (UTF-8 from the model's tokenizer, never a partial character: bytes of an
/// incomplete one come with a later token; empty for special tokens such as
/// `<|im_end|>` and when the file has no tokenizer; followed by a NUL; valid
/// during the call only). Return false to stop after this token. Calls it
/// makes on the state or the sampler that is generating are refused with
/// `FNX_ERR_BUSY` (and do nothing); other states and samplers may be used.
pub type fnx_token_callback = Option<
    unsafe extern "C" fn(
        token: i32,
        piece: *const c_char,
        piece_len: usize,
        user_data: *mut c_void,
    ) -> bool,
>;

/// Options for `fnx_generate`. Get defaults from `fnx_generate_params_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fnx_generate_params {
    /// `sizeof(fnx_generate_params)` as the caller compiled it (set by `fnx_generate_params_default`).
    pub struct_size: u32,
    /// Most tokens to generate; 0 = no limit (until a stop condition or a full context).
    pub max_tokens: u32,
    /// Chooses each token; NULL = greedy (the rule of a temperature-0
    /// sampler: NaN or +INFINITY logits are refused with
    /// `FNX_ERR_INVALID_ARGUMENT`). `fnx_generate` accepts every generated
    /// token into it (not the prompt) and does not reset it.
    pub sampler: *mut fnx_sampler,
    /// Token ids that stop generation (after being generated): `n_stop_tokens` of them.
    pub stop_tokens: *const i32,
    pub n_stop_tokens: usize,
    /// NUL-terminated UTF-8 strings (others are `FNX_ERR_INVALID_ARGUMENT`)
    /// that stop generation once the generated text
    /// contains one (checked after each token, across token boundaries; the
    /// token completing it is still passed to the callback): `n_stop_strings` of them.
    pub stop_strings: *const *const c_char,
    pub n_stop_strings: usize,
    /// false (the default): the model's end-of-sequence and end-of-turn
    /// tokens (from its tokenizer metadata) also stop generation.
    pub ignore_eos: bool,
}

/// Default generation options: greedy, no token limit, no stop strings,
/// stop at the model's end-of-sequence and end-of-turn tokens.
#[no_mangle]
pub extern "C" fn fnx_generate_params_default() -> fnx_generate_params {
    fnx_generate_params {
        struct_size: std::mem::size_of::<fnx_generate_params>() as u32,
        max_tokens: 0,
        sampler: std::ptr::null_mut(),
        stop_tokens: std::ptr::null(),
        n_stop_tokens: 0,
        stop_strings: std::ptr::null(),
        n_stop_strings: 0,
        ignore_eos: false,
    }
}

/// Reads `n` token ids at `tokens` (NULL is accepted when `n` is 0), refusing negative ones.
///
/// # Safety
/// `tokens` must be NULL or point to `n` readable ids.
pub(crate) unsafe fn token_ids(
    tokens: *const i32,
    n: usize,
    func: &str,
    what: &str,
) -> Result<Vec<u32>, Failure> {
    // SAFETY: `n` readable ids per the contract.
    let raw = unsafe { slice_arg(tokens, n, func, what) }?;
    raw.iter()
        .enumerate()
        .map(|(i, &t)| {
            u32::try_from(t).map_err(|_| {
                fail(
                    FNX_ERR_TOKEN_OUT_OF_RANGE,
                    format!("{func}: {what}[{i}] is {t}, a negative token id"),
                )
            })
        })
        .collect()
}

/// Refuses `n` tokens that are not a real array or do not fit in the
/// state's context, before any of them is read.
pub(crate) fn check_room(s: &fnx_state, tokens: *const i32, n: usize, func: &str, what: &str) -> Result<(), Failure> {
    if n == 0 {
        return Ok(());
    }
    if tokens.is_null() {
        return Err(fail(FNX_ERR_NULL_ARGUMENT, format!("{func}: {what} is NULL but its count is {n}")));
    }
    check_count::<i32>(n, func, what)?;
    check_fits(s, n, func)
}

/// Refuses `n` tokens that do not fit in the state's context.
pub(crate) fn check_fits(s: &fnx_state, n: usize, func: &str) -> Result<(), Failure> {
    let (pos, n_ctx) = (s.state.position(), s.state.model().n_ctx);
    let room = n_ctx.saturating_sub(pos);
    if n > room {
        return Err(fail(
            FNX_ERR_CONTEXT_FULL,
            format!("{func}: {n} tokens do not fit: {pos} positions decoded, context limit {n_ctx} ({room} left)"),
        ));
    }
    Ok(())
}

pub(crate) fn generate_failure(e: Error, func: &str) -> Failure {
    match e {
        Error::Aborted => aborted(func),
        Error::Internal(msg) => fail(
            FNX_ERR_INTERNAL,
            format!(
                "{func}: internal error (please report): {msg}{}; the state is as it was before the call",
                super::panic_location()
            ),
        ),
        e => {
            let Failure(status, msg) = Failure::from(e);
            Failure(status, format!("{func}: {msg}"))
        }
    }
}

/// Decodes `n` tokens in order, in passes of up to the model's micro-batch
/// (`fnx_load_params.micro_batch`); the logits are then the last token's.
/// Every token and the context room are checked before anything is decoded,
/// and any failure (including `FNX_ERR_ABORTED` from the abort callback,
/// polled before each pass and between its layers, and `FNX_ERR_INTERNAL`
/// when `n` > 1) leaves the
/// state as it was. `n` = 0 does nothing.
///
/// # Safety
/// `state` must be NULL or a live handle, not used by another thread
/// meanwhile; `tokens` NULL or `n` readable ids.
#[no_mangle]
pub unsafe extern "C" fn fnx_decode_tokens(
    state: *mut fnx_state,
    tokens: *const i32,
    n: usize,
) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_decode_tokens", "state");
            let mut s = check(state, "fnx_decode_tokens")?;
            check_room(&s, tokens, n, "fnx_decode_tokens", "tokens")?;
            // SAFETY: per the contract.
            let ids = unsafe { token_ids(tokens, n, "fnx_decode_tokens", "tokens") }?;
            let mut abort = s.abort_fn();
            generate::decode_tokens(&mut s.state, &ids, &mut abort)
                .map_err(|e| generate_failure(e, "fnx_decode_tokens"))
        },
        // Only reached after a panic that was not rolled back.
        || poison(state),
    )
}

/// `fnx_decode_tokens`, and with `all_logits` true every position's logits
/// are kept: `fnx_get_logits_ith(state, i, ...)` then reads the logits after
/// the `i`-th token of this batch (`fnx_get_logits` the last one's either
/// way). They take `n` times the vocabulary's floats, held until the next
/// decoding call. Failures as `fnx_decode_tokens`, the state as it was.
///
/// # Safety
/// `state` must be NULL or a live handle, not used by another thread
/// meanwhile; `tokens` NULL or `n` readable ids.
#[no_mangle]
pub unsafe extern "C" fn fnx_decode_batch(state: *mut fnx_state, tokens: *const i32, n: usize, all_logits: bool) -> fnx_status {
    guard(
        || {
            non_null!(state, "fnx_decode_batch", "state");
            let mut s = check(state, "fnx_decode_batch")?;
            check_room(&s, tokens, n, "fnx_decode_batch", "tokens")?;
            // SAFETY: per the contract.
            let ids = unsafe { token_ids(tokens, n, "fnx_decode_batch", "tokens") }?;
            let mut abort = s.abort_fn();
            let which = if all_logits { LogitsFor::All } else { LogitsFor::Last };
            generate::decode_tokens_with(&mut s.state, &ids, which, &mut abort)
                .map(|_| ())
                .map_err(|e| generate_failure(e, "fnx_decode_batch"))
        },
        // Only reached after a panic that was not rolled back.
        || poison(state),
    )
}

/// Decodes `prompt` (`n_prompt` tokens; may be empty when the state already
/// has logits), then generates: picks a token (with `params->sampler`, or
/// greedily), passes it and its text to `on_token` (may be NULL), and
/// decodes it, until `max_tokens`, a stop token (by default including the
/// model's end-of-sequence and end-of-turn tokens), a stop string, `on_token` returning false,
/// a complete constraint (the sampler's grammar, `fnx_sampler_set_constraint`,
/// allows nothing more), or a full context. Every generated token, including the one that stopped
/// generation, is decoded into the state. `*out_n_generated` (may be NULL)
/// receives the number of generated tokens.
///
/// Arguments are checked before anything is decoded. On any failure,
/// including `FNX_ERR_ABORTED` (the abort callback is polled before every
/// generated token, and before every micro-batch of the prompt and between
/// its layers) and `FNX_ERR_INTERNAL` (a bug, caught part way), the state and the
/// sampler are as they were before the call; tokens already passed to
/// `on_token` are then not part of the state.
///
/// # Safety
/// `state` must be NULL or a live handle, not used by another thread
/// meanwhile; `prompt` NULL or `n_prompt` readable ids; `params` NULL or a
/// valid `fnx_generate_params` whose arrays hold the stated counts;
/// `out_n_generated` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn fnx_generate(
    state: *mut fnx_state,
    prompt: *const i32,
    n_prompt: usize,
    params: *const fnx_generate_params,
    on_token: fnx_token_callback,
    user_data: *mut c_void,
    out_n_generated: *mut usize,
) -> fnx_status {
    guard(
        || {
            const F: &str = "fnx_generate";
            non_null!(state, "fnx_generate", "state");
            let mut s = check(state, F)?;
            check_room(&s, prompt, n_prompt, F, "prompt")?;
            // SAFETY: per the contract.
            let prompt = unsafe { token_ids(prompt, n_prompt, F, "prompt") }?;
            // SAFETY: per the contract.
            let mut req = unsafe { request(&s, prompt, params, F) }?;
            let mut abort = s.abort_fn();
            let mut piece_buf: Vec<u8> = Vec::new();
            let mut emit = |token: u32, piece: &[u8]| -> bool {
                let Some(cb) = on_token else { return true };
                piece_buf.clear();
                piece_buf.extend_from_slice(piece);
                piece_buf.push(0);
                // SAFETY: the caller's callback; the buffer outlives the call and is NUL-terminated.
                super::outside(|| unsafe { cb(token as i32, piece_buf.as_ptr().cast(), piece.len(), user_data) })
            };
            let out = run(&mut s, &mut req, &mut abort, &mut emit).map_err(|e| generate_failure(e, F))?;
            if !out_n_generated.is_null() {
                // SAFETY: non-NULL and writable per the contract; written only on success.
                unsafe { *out_n_generated = out.tokens.len() };
            }
            Ok(())
        },
        // Only reached after a panic that was not rolled back.
        || poison(state),
    )
}

/// A generation request, checked: what `fnx_generate` and `fnx_job_start` read from their arguments.
pub(crate) struct Request {
    pub(crate) prompt: Vec<u32>,
    pub(crate) opts: GenerateOptions,
    /// Held (busy) as long as the request, like the state.
    pub(crate) sampler: Option<Lease<fnx_sampler>>,
}

/// Checks `params` (NULL: the defaults) for a generation on `s` from
/// `prompt`, whose room was checked, and reads everything they point to.
///
/// # Safety
/// `params` NULL or a valid `fnx_generate_params` whose arrays hold the stated counts.
pub(crate) unsafe fn request(
    s: &fnx_state,
    prompt: Vec<u32>,
    params: *const fnx_generate_params,
    func: &str,
) -> Result<Request, Failure> {
    let p = if params.is_null() {
        fnx_generate_params_default()
    } else {
        // SAFETY: non-NULL; the caller promises a valid struct.
        unsafe { *params }
    };
    if p.struct_size as usize != std::mem::size_of::<fnx_generate_params>() {
        return Err(fail(
            FNX_ERR_INVALID_ARGUMENT,
            format!(
                "{func}: params.struct_size is {}, expected {} (initialise it with fnx_generate_params_default)",
                p.struct_size,
                std::mem::size_of::<fnx_generate_params>()
            ),
        ));
    }
    // SAFETY: per the contract.
    let mut stop_tokens = unsafe { token_ids(p.stop_tokens, p.n_stop_tokens, func, "params.stop_tokens") }?;
    let mut stop_strings = Vec::new();
    // SAFETY: `n_stop_strings` readable pointers per the contract.
    let ptrs = unsafe { slice_arg(p.stop_strings, p.n_stop_strings, func, "params.stop_strings") }?;
    for (i, &sp) in ptrs.iter().enumerate() {
        if sp.is_null() {
            return Err(fail(FNX_ERR_NULL_ARGUMENT, format!("{func}: params.stop_strings[{i}] is NULL")));
        }
        // SAFETY: non-NULL and NUL-terminated per the contract.
        let bytes = unsafe { CStr::from_ptr(sp) }.to_bytes();
        if bytes.is_empty() {
            return Err(fail(FNX_ERR_INVALID_ARGUMENT, format!("{func}: params.stop_strings[{i}] is empty")));
        }
        if let Err(e) = std::str::from_utf8(bytes) {
            return Err(fail(
                FNX_ERR_INVALID_ARGUMENT,
                format!(
                    "{func}: params.stop_strings[{i}] is not valid UTF-8 (bad byte at offset {})",
                    e.valid_up_to()
                ),
            ));
        }
        stop_strings.push(bytes.to_vec());
    }
    let sampler = if p.sampler.is_null() { None } else { Some(fnx_sampler::from_ptr(p.sampler, func)?) };
    if prompt.is_empty() && s.state.logits().is_none() {
        return Err(fail(
            FNX_ERR_NO_LOGITS,
            format!("{func}: the prompt is empty and no token has been decoded yet: nothing to generate from"),
        ));
    }
    let model = s.state.model().clone();
    if !p.ignore_eos {
        stop_tokens.extend(crate::tokenizer::end_of_generation_tokens(&model, s.tokenizer.get(&model).ok()));
    }
    let opts = GenerateOptions { max_tokens: p.max_tokens as usize, stop_tokens, stop_strings };
    Ok(Request { prompt, opts, sampler })
}

/// Runs a checked request on `s`: `abort` is polled before every token,
/// `emit` gets every generated token and its text. On error the state and
/// the sampler are as they were.
pub(crate) fn run(
    s: &mut fnx_state,
    req: &mut Request,
    abort: &mut dyn FnMut() -> bool,
    emit: &mut dyn FnMut(u32, &[u8]) -> bool,
) -> Result<Generation, Error> {
    let model = s.state.model().clone();
    let tokenizer = s.tokenizer.clone();
    let mut detok = generate::model_text(tokenizer.get(&model).ok());
    let sampler = req.sampler.as_mut().map(|l| &mut l.sampler);
    let start = std::time::Instant::now();
    let out = generate::generate(&mut s.state, &req.prompt, sampler, &req.opts, &mut *detok, abort, emit)?;
    log(FNX_LOG_DEBUG, || {
        let secs = start.elapsed().as_secs_f64();
        let why = match out.stop {
            StopReason::MaxTokens => "max_tokens reached".to_string(),
            StopReason::StopToken(t) => format!("stop token {t}"),
            StopReason::StopString(i) => format!("stop string {i}"),
            StopReason::Callback => "the callback returned false".to_string(),
            StopReason::ContextFull => "the context is full".to_string(),
            StopReason::Constraint => "the constraint is complete".to_string(),
        };
        format!(
            "generated {} tokens after a {}-token prompt in {:.1} ms ({:.1} tokens/s); stopped: {why}",
            out.tokens.len(),
            req.prompt.len(),
            secs * 1e3,
            (req.prompt.len() + out.tokens.len()) as f64 / secs.max(1e-9)
        )
    });
    Ok(out)
}
