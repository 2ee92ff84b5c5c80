//! A synthetic byte-level BPE tokenizer of the real vocabulary size, in the
//! layout of the Qwen3.5 tokenizer (`gpt2` model, `qwen35` pre-tokenizer):
//!
//! * ids 0..256: the 256 byte tokens (GPT-2 byte-to-unicode characters);
//! * then one token per merge up to the first special id (`vocab - 276`,
//!   248 044 in the real model): random merges of a short letter run (at
//!   most 3 letters) onto a `Ġ`-led word start or a letter run (at most 12
//!   characters in all), so English-like text tokenizes into multi-byte tokens;
//! * the special tokens at 248 044: `<|endoftext|>`, `<|im_start|>`,
//!   `<|im_end|>` (CONTROL) and `<think>`, `</think>`, `<tool_call>`,
//!   `</tool_call>` (USER_DEFINED); every remaining id is a `[PAD<id>]`
//!   filler (UNUSED), like llama.cpp's conversion of the padded vocabulary;
//! * eos is `<|im_end|>`, padding `<|endoftext|>` (the Qwen chat models'
//!   choice), no bos; a ChatML chat template.

use super::fill::Rng;
use crate::gguf::Value;
use std::collections::HashSet;

const T_INT32: u32 = 5;
const T_STRING: u32 = 8;
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
/// Longest merged token, and longest right part of a merge, in characters.
const MAX_TOKEN_CHARS: usize = 12;
const MAX_RIGHT_CHARS: usize = 3;

const SPECIALS: [(&str, i32); 7] = [
    ("<|endoftext|>", CONTROL),
    ("<|im_start|>", CONTROL),
    ("<|im_end|>", CONTROL),
    ("<think>", USER_DEFINED),
    ("</think>", USER_DEFINED),
    ("<tool_call>", USER_DEFINED),
    ("</tool_call>", USER_DEFINED),
];

const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + \
message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// GPT-2's byte-to-unicode character of byte `b`.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("valid char")
}

/// The `tokenizer.*` keys of a vocabulary of `vocab` ids whose first special
/// token is at `first_special`; `seed` picks the merges.
pub fn tokenizer_keys(vocab: usize, first_special: usize, seed: u64) -> Vec<(String, Value)> {
    assert!(
        first_special >= 256 && first_special + SPECIALS.len() <= vocab,
        "vocabulary too small"
    );
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut seen: HashSet<String> = tokens.iter().cloned().collect();
    // Right parts are short letter runs; left parts leave room for them, so no draw is too long.
    let mut short_letters: Vec<String> = (b'a'..=b'z')
        .chain(b'A'..=b'Z')
        .map(|b| char::from(b).to_string())
        .collect();
    let mut lefts: Vec<String> = short_letters.clone();
    lefts.push(byte_char(b' ').to_string());
    let mut merges = Vec::with_capacity(first_special - 256);
    let mut rng = Rng::new(seed);
    let pick = |rng: &mut Rng, v: &[String]| v[(rng.next() % v.len() as u64) as usize].clone();
    while tokens.len() < first_special {
        let (left, right) = (pick(&mut rng, &lefts), pick(&mut rng, &short_letters));
        let merged = format!("{left}{right}");
        if !seen.insert(merged.clone()) {
            continue;
        }
        merges.push(Value::String(format!("{left} {right}")));
        let len = merged.chars().count();
        if len <= MAX_TOKEN_CHARS - MAX_RIGHT_CHARS {
            lefts.push(merged.clone());
        }
        if len <= MAX_RIGHT_CHARS && !merged.starts_with(byte_char(b' ')) {
            short_letters.push(merged.clone());
        }
        tokens.push(merged);
    }
    let mut types = vec![NORMAL; first_special];
    for (s, ty) in SPECIALS {
        tokens.push(s.to_string());
        types.push(ty);
    }
    while tokens.len() < vocab {
        tokens.push(format!("[PAD{}]", tokens.len()));
        types.push(UNUSED);
    }
    let id = |i: usize| Value::U32((first_special + i) as u32);
    let k = |s: &str| format!("tokenizer.{s}");
    vec![
        (k("ggml.model"), Value::String("gpt2".into())),
        (k("ggml.pre"), Value::String("qwen35".into())),
        (
            k("ggml.tokens"),
            Value::Array(T_STRING, tokens.into_iter().map(Value::String).collect()),
        ),
        (
            k("ggml.token_type"),
            Value::Array(T_INT32, types.into_iter().map(Value::I32).collect()),
        ),
        (k("ggml.merges"), Value::Array(T_STRING, merges)),
        (k("ggml.eos_token_id"), id(2)),
        (k("ggml.padding_token_id"), id(0)),
        (k("ggml.add_bos_token"), Value::Bool(false)),
        (k("chat_template"), Value::String(CHAT_TEMPLATE.into())),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_chars_are_gpt2s() {
        assert_eq!(byte_char(b'A'), 'A');
        assert_eq!(byte_char(b' '), '\u{120}');
        assert_eq!(byte_char(b'\n'), '\u{10A}');
        assert_eq!(byte_char(0), '\u{100}');
        assert_eq!(byte_char(0xAD), '\u{143}');
    }
}
