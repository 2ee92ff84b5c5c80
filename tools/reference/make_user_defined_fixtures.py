#!/usr/bin/env python3
"""Reference ids for USER_DEFINED tokens (GGUF token type 4), made with the Hugging Face
`tokenizers` package alone (no transformers), for tests/tokenizer.rs.

Usage (from the repository root; `pip install tokenizers==0.23.3 gguf`):

    python3 tools/reference/make_user_defined_fixtures.py --dir tests/fixtures/tokenizer

Input: ggml-vocab-qwen35.gguf (committed, see the README there). Output (deterministic,
overwritten): user_defined.json.

A GGUF describes added tokens by type: CONTROL (3) tokens are Hugging Face's special added
tokens, USER_DEFINED (4) tokens its non-special added tokens (llama.cpp's converter writes
type 4 for an added token with `special: false`, such as `<think>` and `<tool_call>` in
Qwen3 vocabularies, and older conversions wrote it for vocabulary padding `[PAD<id>]`).
Hugging Face splits every added token out of the raw text before normalization, leftmost
longest first; with `split_special_tokens` (special tokens not parsed) it leaves the special
ones as text but still splits the non-special ones. llama.cpp matches USER_DEFINED tokens
whether or not it parses special tokens too.

The reference tokenizer is the `tokenizer.json` a Qwen3.5 checkpoint ships (BPE over the
NORMAL tokens and `tokenizer.ggml.merges`, NFC normalizer, the Qwen3.5 split regex, ByteLevel
pre-tokenizer and decoder), with one `added_tokens` entry per CONTROL (special) and
USER_DEFINED (not special) token of the GGUF, at its GGUF id, `normalized: false` as in Qwen's
files. UNUSED (5) tokens are not tokens of it. Two vocabularies:

* `qwen35`: the GGUF as it is (its USER_DEFINED tokens are the 290 `[PAD<id>]` fillers);
* `qwen3_added`: the same with some ids rewritten (listed in `edits`, applied to
  `tokenizer.ggml.tokens` / `token_type` by the Rust test too): the Qwen3 added tokens at
  their Qwen3 ids, typed as llama.cpp's converter types them, and a few made-up tokens for the
  corner cases (prefixes and overlaps of other added tokens, spaces, non-ASCII text, a
  CONTROL token that does not look special, an UNUSED filler).

For each test string: the ids with special tokens parsed and not, and the decodes of those
ids with and without skipping special tokens; for every edited id its single-token decode.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import tokenizers
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

EXPECTED_TOKENIZERS = "0.23.3"

# transformers' tokenization_qwen3_5.PRETOKENIZE_REGEX (= flashnext's QWEN35_PRETOKENIZE_REGEX).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# (id, text, type): Qwen3's added tokens from 151646 on. Types as llama.cpp's converter writes
# them: `special: true` or looking special (`<|...|>`) is CONTROL, the rest USER_DEFINED.
QWEN3_ADDED = [
    (151646, "<|object_ref_start|>", CONTROL),
    (151647, "<|object_ref_end|>", CONTROL),
    (151648, "<|box_start|>", CONTROL),
    (151649, "<|box_end|>", CONTROL),
    (151650, "<|quad_start|>", CONTROL),
    (151651, "<|quad_end|>", CONTROL),
    (151652, "<|vision_start|>", CONTROL),
    (151653, "<|vision_end|>", CONTROL),
    (151654, "<|vision_pad|>", CONTROL),
    (151655, "<|image_pad|>", CONTROL),
    (151656, "<|video_pad|>", CONTROL),
    (151657, "<tool_call>", USER_DEFINED),
    (151658, "</tool_call>", USER_DEFINED),
    (151659, "<|fim_prefix|>", CONTROL),
    (151660, "<|fim_middle|>", CONTROL),
    (151661, "<|fim_suffix|>", CONTROL),
    (151662, "<|fim_pad|>", CONTROL),
    (151663, "<|repo_name|>", CONTROL),
    (151664, "<|file_sep|>", CONTROL),
    (151665, "<tool_response>", USER_DEFINED),
    (151666, "</tool_response>", USER_DEFINED),
    (151667, "<think>", USER_DEFINED),
    (151668, "</think>", USER_DEFINED),
]
# Made-up tokens for the corner cases.
CORNER_CASES = [
    (151669, "<tool", USER_DEFINED),  # a prefix of <tool_call>: the longest match wins
    (151670, "<|im", USER_DEFINED),  # a prefix of the CONTROL <|im_start|>
    (151671, " world", USER_DEFINED),  # a space (not a byte-level character): decodes as written
    (151672, "café", USER_DEFINED),  # é is a byte-level character: the ByteLevel decoder maps it to 0xE9
    (151673, "<思考>", USER_DEFINED),  # not byte-level characters: decodes as written
    (151674, "[CTRL]", CONTROL),  # CONTROL without the look of a special token
    (151675, "[CTRL]+", USER_DEFINED),  # a USER_DEFINED token extending a CONTROL one
    (151676, "e\u0301", USER_DEFINED),  # not NFC: matched in the raw text only
    (151935, "<never>", UNUSED),  # a filler: not a token, never produced
]

TEXTS_BOTH = [
    "[PAD151646]",
    "[PAD151700] is a token",
    "x[PAD151700]y",
    "[PAD151690][PAD151691]",
    " [PAD151935] ",
    "[PAD151690",
    "[PAD1516900]",
    "[PAD151690]]",
    "[[PAD151690]",
    "[pad151690]",
    "[PAD151936]",
    "[PAD0]",
    "<|im_start|>user\n[PAD151700]<|im_end|>",
    "<|endoftext|>[PAD151800]<|endoftext|>",
    "\n\n[PAD151700]\n\n",
    "[PAD151700]\u00e9e\u0301",
]
TEXTS_ADDED = [
    "<think>\nreasoning\n</think>\n\nanswer",
    "<|im_start|>assistant\n<think>\n\n</think>\n\nHi!<|im_end|>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<tool_response>\nsunny\n</tool_response>",
    "<tool_x <tool <tool_call",
    "<tool_call><tool_call></tool_call>",
    "<|im_start|>",
    "<|im_end|>",
    "<|im",
    "<|im_start",
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "hello world",
    "helloworld world world",
    "café au lait, cafe\u0301",
    "<思考>内容</思考>",
    "[CTRL]",
    "[CTRL]+ [CTRL] [CTRL]++",
    "e\u0301 and \u00e9",
    "<never>",
    "  <think>  \t</think>",
    "[PAD151700]<think>[PAD151701]",
]


def load_gguf(path: Path):
    f = gguf.GGUFReader(str(path)).fields
    tokens = list(f["tokenizer.ggml.tokens"].contents())
    types = [int(t) for t in f["tokenizer.ggml.token_type"].contents()]
    merges = list(f["tokenizer.ggml.merges"].contents())
    return tokens, types, merges


def build(tokens, types, merges) -> Tokenizer:
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == NORMAL}
    pairs = [tuple(m.split(" ")) for m in merges]
    assert all(len(p) == 2 for p in pairs)
    base = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
    base.normalizer = normalizers.NFC()
    base.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    base.decoder = decoders.ByteLevel()
    # The added tokens go in as tokenizer.json lists them: each with its id.
    spec = json.loads(base.to_str())
    spec["added_tokens"] = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": ty == CONTROL,
        }
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in (CONTROL, USER_DEFINED)
    ]
    tok = Tokenizer.from_str(json.dumps(spec))
    for a in spec["added_tokens"]:
        got = tok.token_to_id(a["content"])
        assert got == a["id"], f"added token {a['content']!r}: id {got}, GGUF says {a['id']}"
        assert tok.id_to_token(a["id"]) == a["content"]
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == UNUSED:
            assert tok.id_to_token(i) is None, f"filler {i} {t!r} is a token"
    for t, i in list(vocab.items())[:2000]:
        assert tok.token_to_id(t) == i
    return tok


def encode(tok: Tokenizer, text: str, parse_special: bool) -> list[int]:
    tok.encode_special_tokens = not parse_special
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = False


def decode(tok: Tokenizer, ids, skip_special: bool) -> str:
    return tok.decode(ids, skip_special_tokens=skip_special)


def cases(tok: Tokenizer, texts, edited_ids):
    out = []
    for text in texts:
        ids_p = encode(tok, text, True)
        ids_s = encode(tok, text, False)
        out.append(
            {
                "text": text,
                "ids": ids_p,
                "ids_no_special": ids_s,
                "decoded": decode(tok, ids_p, False),
                "decoded_skip_special": decode(tok, ids_p, True),
                "decoded_no_special": decode(tok, ids_s, False),
            }
        )
    singles = [
        {"id": i, "decoded": decode(tok, [i], False), "decoded_skip_special": decode(tok, [i], True)}
        for i in edited_ids
    ]
    return {"texts": out, "single_decode": singles}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="tests/fixtures/tokenizer", type=Path)
    args = ap.parse_args()
    if tokenizers.__version__ != EXPECTED_TOKENIZERS:
        print(f"need tokenizers {EXPECTED_TOKENIZERS}, have {tokenizers.__version__}", file=sys.stderr)
        return 1
    tokens, types, merges = load_gguf(args.dir / "ggml-vocab-qwen35.gguf")

    plain = build(tokens, types, merges)
    pads = [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == USER_DEFINED and t == f"[PAD{i}]"]
    assert len(pads) == 290, len(pads)
    qwen35 = cases(plain, TEXTS_BOTH, [151643, 151645, 151646, 151700, 151935])

    edits = QWEN3_ADDED + CORNER_CASES
    tokens2, types2 = list(tokens), list(types)
    for i, t, ty in edits:
        assert types[i] == USER_DEFINED and tokens[i] == f"[PAD{i}]", i
        tokens2[i], types2[i] = t, ty
    added = build(tokens2, types2, merges)
    qwen3_added = cases(added, TEXTS_BOTH + TEXTS_ADDED, [i for i, _, _ in edits])

    result = {
        "generator": "tools/reference/make_user_defined_fixtures.py",
        "tokenizers": tokenizers.__version__,
        "qwen35": qwen35,
        "qwen3_added": {"edits": [{"id": i, "text": t, "type": ty} for i, t, ty in edits], **qwen3_added},
    }
    path = args.dir / "user_defined.json"
    path.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    n = len(qwen35["texts"]) + len(qwen3_added["texts"])
    print(f"{path}: {n} texts over two vocabularies, {len(edits)} edited ids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
