#!/usr/bin/env python3
"""Reference fixtures for flashnext's tokenizer and chat template (tests/tokenizer.rs,
tests/chat_template.rs), made with Hugging Face transformers 5.23.0 / tokenizers.

Usage (from the repository root; the venv of tools/reference/requirements.txt, e.g. /opt/refvenv):

    /opt/refvenv/bin/python tools/reference/make_tokenizer_fixtures.py --dir tests/fixtures/tokenizer

Input (committed, copied unchanged from llama.cpp's `models/`, see the README there):
  ggml-vocab-qwen35.gguf (+ .inp/.out test vectors), Qwen3.5-4B.jinja.
Output (deterministic, overwritten):
  vectors.json   llama.cpp's test vectors with the ids transformers gives for each
  corpus.json    our own corpus: ids with and without special-token parsing, decodes
  pieces.json    a checksum over every token's piece and single-token decode
  chat.json      conversations rendered by transformers' apply_chat_template

How the reference tokenizer is built: transformers cannot load a vocab-only GGUF for
`tokenizer.ggml.pre = qwen35` (its GGUF integration has no Qwen3.5 tokenizer), so this
script builds transformers' own `Qwen3_5Tokenizer` class (tokenization_qwen3_5.py: BPE,
NFC normalizer, the Qwen3.5 split regex, ByteLevel pre-tokenizer and decoder) from the
GGUF arrays: the vocab is every NORMAL (type 1) token, the merges are
`tokenizer.ggml.merges` split at the space, and the added tokens are the CONTROL (type 3,
special=True) and USER_DEFINED (type 4, special=False) tokens in id order, all with
normalized=False (as in Qwen's tokenizer.json). The USER_DEFINED tokens of this vocabulary
are the `[PAD<id>]` fillers an older llama.cpp conversion wrote; llama.cpp matches them in
text like any non-special added token, and so does this reference. UNUSED (type 5) fillers
would not be tokens of it. The script checks every id.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import unicodedata
from pathlib import Path

import gguf
import transformers
from tokenizers import AddedToken
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

EXPECTED_TRANSFORMERS = "5.23.0"
SEP = "\n__ggml_vocab_test__\n"


def fnv1a64(chunks) -> str:
    h = 0xCBF29CE484222325
    for chunk in chunks:
        for b in chunk:
            h ^= b
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


def piece_bytes(token: str) -> bytes:
    """The ByteLevel decoder's rule: map every char back to its byte, or the raw UTF-8 if any can't be."""
    try:
        return bytes(BYTE_DECODER[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def load_gguf(path: Path):
    r = gguf.GGUFReader(str(path))
    f = r.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    merges = f["tokenizer.ggml.merges"].contents()
    ids = {}
    for k in ("bos", "eos", "padding", "unknown"):
        key = f"tokenizer.ggml.{k}_token_id"
        ids[k] = int(f[key].contents()) if key in f else None
    template = f["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in f else None
    return tokens, types, merges, ids, template


def is_filler(i: int, tok: str, ty: int) -> bool:
    return ty == 5


def build_tokenizer(tokens, types, merges, ids) -> Qwen3_5Tokenizer:
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 1}
    pairs = [tuple(m.split(" ")) for m in merges]
    assert all(len(p) == 2 for p in pairs)
    name = lambda k: tokens[ids[k]] if ids[k] is not None else None  # noqa: E731
    tok = Qwen3_5Tokenizer(
        vocab=vocab,
        merges=pairs,
        unk_token=name("unknown"),
        bos_token=name("bos"),
        eos_token=name("eos"),
        pad_token=name("padding"),
    )
    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (3, 4) and not is_filler(i, t, ty):
            added.append((i, AddedToken(t, special=(ty == 3), normalized=False)))
    for i, a in added:
        if a.special:
            tok.add_special_tokens({"additional_special_tokens": [a]}, replace_extra_special_tokens=False)
        else:
            tok.add_tokens([a])
    for i, a in added:
        got = tok.convert_tokens_to_ids(a.content)
        assert got == i, f"added token {a.content!r}: id {got}, GGUF says {i}"
    for t, i in list(vocab.items())[:1000]:
        assert tok.convert_tokens_to_ids(t) == i
    return tok


def encode(tok, text: str, parse_special: bool) -> list[int]:
    return tok.encode(text, add_special_tokens=False, split_special_tokens=not parse_special)


def decode(tok, ids, skip_special: bool) -> str:
    return tok.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------------------------
# corpus


def corpus() -> list[str]:
    c: list[str] = []
    # code
    c += [
        "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
        "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}\n",
        "#include <vector>\nint main(){std::vector<int> v{1,2,3};for(auto&x:v)x<<=2;return v[0]!=4;}",
        '{"key": [1, 2.5, -3e10, true, null], "nested": {"a": "b\\n"}}',
        "<div class=\"x\">&nbsp;&lt;tag&gt;</div>\r\n<br/>",
        "echo $((1+2)) && ls -la ~/.config | grep -E '^d' >> /tmp/out.txt 2>&1",
        "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
        "    \t    mixed indentation\n\t\t    more\n",
        "x+=1;y-=2;z*=3;w/=4;a%=5;b**=6;c//=7;d&&=e||f??g",
        "// comment\n/* block\n   comment */\n#define MAX(a,b) ((a)>(b)?(a):(b))",
        "re.compile(r'(?i:\\'s|\\'t)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+')",
    ]
    # CJK
    c += [
        "你好，世界！今天天气很好。",
        "日本語のテキストとカタカナ、ひらがな、漢字。",
        "한국어 텍스트입니다. 안녕하세요!",
        "中文English混合Text测试123数字",
        "「引用」『二重』【括弧】〈山〉《書》",
        "ｆｕｌｌｗｉｄｔｈ　ＡＢＣ　１２３",
    ]
    # emoji
    c += [
        "👍🏽 thumbs up, 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 🇯🇵🇺🇸 flags",
        "1️⃣ 2️⃣ #️⃣ keycaps ❤️ ☺︎ ☺️",
        "🦙🦙🦙 llamas 🐪",
        "emoji at end 😀",
        "😀😃😄😁😆😅🤣😂🙂🙃😉😊😇",
    ]
    # whitespace runs
    c += [" " * n for n in (1, 2, 3, 4, 7, 8, 15, 16, 31, 64)]
    c += [
        "a" + " " * 10 + "b",
        "trailing   ",
        "   leading",
        "\n" * 5,
        " \n \n  \n",
        "\t\t\t",
        "\r\n\r\n",
        "a\r\nb\rc\nd",
        "\n\n\n    indented after blank lines",
        "word \n\n next",
        "x\t \t y",
        "\u3000\u3000ideographic spaces\u3000",
        "nbsp\u00a0\u00a0nbsp",
        "thin\u2009space and\u202fnarrow",
        "zero\u200bwidth\u200cnon\u200djoiner",
        "line\u2028separator\u2029para",
        "nel\u0085next",
        "info\x1cseps\x1d\x1e\x1f",
        "vtab\x0bformfeed\x0c",
        "ogham\u1680space en\u2002em\u2003",
        "mongolian\u180evowel",
        "  \u00a0 \u3000 mixed  \u2003 ",
    ]
    # numbers
    c += [
        "1234567890",
        "3.14159265358979",
        "1,000,000 and 1.000.000",
        "-42 +17 0x1F 0b1010 1e-9",
        "२०२४ and ١٢٣ and ๑๒๓",
        "Ⅻ ⅷ ½ ¾ ² ³ ⁴ ₅",
        "１２３４５",
        "v1.2.3-rc.4+build.5",
        "2024-01-15T12:34:56Z",
        "ied 4 ½ months",
    ]
    # mixed scripts
    c += [
        "Hello世界мирمرحبا",
        "مرحبا بالعالم! كيف حالك؟",
        "नमस्ते दुनिया, क्या हाल है?",
        "สวัสดีครับ ภาษาไทย",
        "Ελληνικά κείμενα και ΚΕΦΑΛΑΙΑ",
        "Привет, как дела? ЁЁЁ ёлка",
        "ქართული ენა",
        "Հայերեն լեզու",
        "ትግርኛ ኣማርኛ",
        "ᏣᎳᎩ ᎦᏬᏂᎯᏍᏗ",
        "Tiếng Việt có dấu",
        "Straße, Œuvre, æsir, Ångström, ĳ",
    ]
    # normalization: NFC/NFD, compatibility and singleton decompositions, jamo, points
    base = [
        "é",
        "résumé",
        "àààààààà",
        "Tiếng Việt có dấu",
        "Ångström Å",
        "Ω Ohm sign vs Ω omega",
        "K Kelvin sign vs K",
        "Å Angstrom sign",
        "ﬁ ligature ﬂ",
        "ǅ ǈ ǋ",
        "각 한국어 글자",
        "\u1100\u1161\u11a8 jamo sequence \u1112\u1161\u11ab\u1100\u1173\u11af",
        "שָׁלוֹם עוֹלָם",
        "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd",
        "\u05e9\u05c1\u05b8",
        "a\u0308\u0301 stacked",
        "e\u0301\u0327 vs e\u0327\u0301",
        "ṩ ṩ",
        "\u0958 devanagari nukta",
        "\u2126\u212a\u212b",
        "cafe\u0301 na\u0131\u0308ve",
        "\u1e9b\u0323",
        "\uac00\u11a8",
        "\u0915\u093c",
    ]
    for s in base:
        c.append(s)
        for form in ("NFC", "NFD", "NFKC", "NFKD"):
            v = unicodedata.normalize(form, s)
            if v not in c:
                c.append(v)
    # contractions
    c += [
        "I'm sure we'll see it's what they've done, don't you'd think?",
        "I'M SURE WE'LL SEE IT'S WHAT THEY'VE DONE, DON'T YOU'D",
        "She'S 'tis 'twas ''quoted''",
        "curly ’s ’t apostrophes",
    ]
    # special / added tokens inside text
    c += [
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>",
        "text<|endoftext|>more<|endoftext|><|endoftext|>",
        "<|im_start|",
        "<|im_end|><|im_end|>",
        "<|im_start|><|im_start|>x",
        " <|im_end|> ",
        "[PAD151646] is a token (USER_DEFINED)",
        "<think>\nreasoning\n</think>\n\nanswer",
        "<tool_call>\n<function=f>\n</function>\n</tool_call>",
    ]
    # odd characters
    c += [
        "\x00null\x00byte",
        "\x7f del \x1b[31mred\x1b[0m",
        "\ufeffBOM at start",
        "private \ue000\uf8ff use",
        "\U0010fffd plane 16 and \U0001d400 math bold",
        "noncharacters \ufffe\uffff",
        "replacement \ufffd char",
        "\U0001f9d1\u200d\U0001f4bb technologist",
        "Ａ\u0301 fullwidth with accent",
        "ꓤꓥꓦ lisu",
        "𝕳𝖊𝖑𝖑𝖔 𝒘𝒐𝒓𝒍𝒅",
    ]
    # long texts
    para = (
        "The quick brown fox jumps over the lazy dog. "
        "Pack my box with five dozen liquor jugs! 1234 5678. "
        "Jackdaws love my big sphinx of quartz; how vexingly quick daft zebras jump.\n"
    )
    c.append(para * 20)
    c.append("a" * 500)
    c.append(" " * 300 + "x")
    c.append("\n" * 100)
    c.append("ab" * 300)
    c.append("日本" * 200)
    c.append("🦙" * 100)
    c.append("é" * 200 + "e\u0301" * 200)
    # random strings over a mixed pool (fixed seed)
    pool = (
        list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
        + list(" \t\n\r!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
        + list("éüñßÅÆØœ€£¥©®°±µ¶·¿×÷")
        + list("\u0301\u0308\u0327\u0323\u05b8\u05c1\u093c")
        + list("\u00a0\u2009\u3000\u200b\u2028\x0b\x0c\x1c\x85")
        + list("中文日本語한국어ひらがなカタカナ")
        + list("\u1100\u1161\u11a8\u1112\u11ab")
        + list("\u2126\u212a\u212b\ufb01")
        + list("٠١٢३४५١٢٣Ⅻ½²")
        + ["😀", "🦙", "👍", "🏽", "\u200d", "\ufe0f", "🇯", "🇵"]
        + list("абвгдАБВГД αβγδ שלום مرحبا")
        + ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
        + ["    ", "\n\n", " \n", "  "]
    )
    rng = random.Random(20261101)
    for _ in range(300):
        n = rng.randint(1, 40)
        c.append("".join(rng.choice(pool) for _ in range(n)))
    seen = set()
    out = []
    for s in c:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# --------------------------------------------------------------------------------------------
# chat conversations

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city. Ünïcödé ok; quotes \"x\" and \\ too.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "top_k": {"type": "integer", "default": 5}},
                "required": ["query"],
            },
        },
    },
]

TOOL_CALL_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "arguments": {
            "city": "Paris",
            "unit": "celsius",
            "days": 3,
            "detailed": True,
            "ratio": 2.5,
            "big": 1e20,
            "tiny": 1.5e-7,
            "nothing": None,
            "tags": ["a", "b", 1, False],
            "nested": {"x": "ümlaut", "y": [1.0, {"z": None}]},
        },
    },
}
TOOL_CALL_SEARCH = {"type": "function", "function": {"name": "search", "arguments": {"query": "météo 東京"}}}

SYS = {"role": "system", "content": "You are a helpful assistant."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "The capital of France is Paris."}
A1R = {"role": "assistant", "content": "The capital of France is Paris.", "reasoning_content": "Easy: Paris."}
A1T = {
    "role": "assistant",
    "content": "<think>\nThe user asks about France.\nIt is Paris.\n</think>\n\nThe capital of France is Paris.",
}
U2 = {"role": "user", "content": "  And of Japan?  \n"}


def conversations():
    conv = []

    def add(name, messages, tools=None, add_generation_prompt=True, enable_thinking=True, template="qwen35"):
        conv.append(
            dict(
                name=name,
                template=template,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
            )
        )

    for agp in (True, False):
        for think in (True, False):
            add(f"system_user_agp{int(agp)}_think{int(think)}", [SYS, U1], None, agp, think)
    add("user_only", [U1])
    add("multi_turn_plain", [SYS, U1, A1, U2])
    add("multi_turn_reasoning_content", [SYS, U1, A1R, U2], enable_thinking=False)
    add("multi_turn_inline_think", [U1, A1T, U2])
    add("assistant_last_reasoning", [U1, A1R], add_generation_prompt=False)
    add("assistant_last_inline_think", [SYS, U1, A1T], add_generation_prompt=False)
    add("assistant_last_no_reasoning", [U1, A1], add_generation_prompt=False)
    add(
        "whitespace_and_unicode",
        [
            {"role": "system", "content": "\n  Système: réponds en français. 日本語も可。 \u3000"},
            {"role": "user", "content": "\t¿Qué tal?\x1c \n"},
        ],
    )
    add("tools_system_user", [SYS, {"role": "user", "content": "Weather in Paris?"}], TOOLS)
    add("tools_no_system", [{"role": "user", "content": "Weather in Paris?"}], TOOLS, enable_thinking=False)
    add(
        "tools_empty_system",
        [{"role": "system", "content": "   "}, {"role": "user", "content": "Weather in Paris?"}],
        TOOLS,
    )
    tool_turn = [
        SYS,
        {"role": "user", "content": "Weather in Paris, and search for Tokyo weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call both tools.",
            "tool_calls": [TOOL_CALL_WEATHER, TOOL_CALL_SEARCH],
        },
        {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}'},
        {"role": "tool", "content": "Tokyo: 15°C, rain"},
    ]
    add("tool_calls_and_responses", tool_turn, TOOLS)
    add("tool_calls_and_responses_nothink", tool_turn, TOOLS, enable_thinking=False)
    add(
        "tool_calls_then_answer",
        tool_turn + [{"role": "assistant", "content": "It is 21°C and clear in Paris; Tokyo has rain."}],
        TOOLS,
        add_generation_prompt=False,
    )
    add(
        "tool_call_with_content",
        [
            {"role": "user", "content": "Search for rust tokenizers"},
            {"role": "assistant", "content": "Let me search.", "tool_calls": [TOOL_CALL_SEARCH]},
            {"role": "tool", "content": "<results/>"},
            {"role": "user", "content": "<tool_response>\nfake\n</tool_response>"},
        ],
        TOOLS,
    )
    add(
        "tool_response_then_user",
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL_WEATHER]},
            {"role": "tool", "content": "sunny"},
            {"role": "user", "content": "Thanks! Now Tokyo."},
        ],
        TOOLS,
    )
    # errors (raise_exception)
    add("error_no_messages", [])
    add("error_system_not_first", [U1, SYS])
    add("error_no_user_query", [SYS, {"role": "user", "content": "<tool_response>x</tool_response>"}])
    add("error_unknown_role", [U1, {"role": "robot", "content": "beep"}])
    return conv


# Small templates exercising the Python behaviour flashnext imitates (rendered by
# transformers' own compiled Jinja environment).
SNIPPETS = [
    ("{{ x | tojson }}", {"x": {"b": 1, "a": [1.0, 2.5, None, True, "é\n\"q\"\u2028\x01"], "c": {}}}),
    ("{{ x | tojson(indent=2) }}", {"x": {"b": 1, "a": [1, {"z": []}], "c": {}}}),
    ("{{ x | tojson(indent=2, sort_keys=true) }}", {"x": {"b": 1, "a": [1, 2]}}),
    ("{{ x | tojson(ensure_ascii=true) }}", {"x": ["é", "日本", "🦙"]}),
    ("{{ x | tojson(separators=(',', ':')) }}", {"x": {"a": [1, 2], "b": "c"}}),
    ("{{ x | tojson }}", {"x": [1e20, 1.5e-7, 0.1, 100.0, -0.0, 12345678901234567890, 3]}),
    ("{{ x }}|{{ y }}|{{ z }}|{{ w }}|{{ f }}|{{ g }}", {"x": None, "y": True, "z": False, "w": 3, "f": 2.5, "g": 1e20}),
    ("{{ x | string }}|{{ y | string }}|{{ z | string }}|{{ f | string }}", {"x": None, "y": True, "z": 7, "f": 1.0}),
    ("{{ d }}|{{ l }}", {"d": {"a": 1, "b": [True, None, "it's"]}, "l": ["x", 'say "hi"', 1.5]}),
    ("[{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}][{{ s | trim }}]", {"s": " \x1c\u3000 a b \x1f\n"}),
    ("{{ s.split() }}|{{ s.split(',') }}|{{ s.split(',', 1) }}", {"s": " a,b \x1c c,d "}),
    ("{{ s.strip('xy') }}|{{ s.lstrip('x') }}|{{ s.rstrip('y') }}", {"s": "xxhixyy"}),
    ("{{ s.startswith('ab') }}{{ s.endswith('yz') }}{{ s.upper() }}{{ s.lower() }}{{ s.replace('b', 'B') }}", {"s": "abcXyz"}),
    ("{% for m in xs[::-1] %}{{ m }}{% if loop.last %}.{% endif %}{% endfor %}", {"xs": [1, 2, 3]}),
    ("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}", {"xs": [1, 2, 3, 4, 5]}),
    ("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}", {"xs": [1, 2, 3]}),
    ("{% for k, v in d | items %}{{ k }}={{ v }};{% endfor %}", {"d": {"z": 1, "a": None, "m": [1]}}),
    ("{{ t is false }}{{ f is false }}{{ u is defined }}{{ n is none }}{{ s is string }}{{ l is iterable }}{{ d is mapping }}", {"t": True, "f": False, "n": None, "s": "x", "l": [1], "d": {}}),
    ("{%- if true %}\n    a\n{%- endif %}\n  {% if true %}\n  b\n  {% endif %}\nc\n", {}),
    ("{% for x in xs %}{{ loop.index0 }}{{ loop.previtem }}{{ loop.nextitem }},{% endfor %}", {"xs": ["a", "b"]}),
    ("{{ raise_exception('bad input: ' ~ x) }}", {"x": 3}),
    ("{{ bos_token }}{{ messages | length }}", {"bos_token": "<s>", "messages": [1, 2]}),
]


def render_snippets():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    out = []
    for src, ctx in SNIPPETS:
        try:
            res = {"output": _compile_jinja_template(src).render(**ctx)}
        except Exception as e:
            res = {"error": str(e)}
        # JSON text keeps the key order (the Rust tests' JSON reader would sort keys).
        out.append({"template": src, "context_json": json.dumps(ctx, ensure_ascii=False), **res})
    return out


def with_json_text(c):
    """The conversation with its messages and tools also as JSON text, which keeps the key order
    (the Rust tests' JSON reader sorts keys): `messages_json`, `tools_json`, and per message the
    fields of flashnext's `fnx_chat_message` (`c_messages`; `tool_calls_json_string_args` has each
    call's arguments as a JSON string, OpenAI style)."""
    dumps = lambda x: json.dumps(x, ensure_ascii=False)  # noqa: E731
    c_messages = []
    for m in c["messages"]:
        cm = {k: m.get(k) for k in ("role", "content", "reasoning_content")}
        calls = m.get("tool_calls")
        cm["tool_calls_json"] = dumps(calls) if calls is not None else None
        if calls is not None:
            as_str = [
                {**tc, "function": {**tc["function"], "arguments": dumps(tc["function"]["arguments"])}} for tc in calls
            ]
            cm["tool_calls_json_string_args"] = dumps(as_str)
        c_messages.append(cm)
    return {
        **c,
        "messages_json": dumps(c["messages"]),
        "tools_json": dumps(c["tools"]) if c["tools"] is not None else None,
        "c_messages": c_messages,
    }


def render(tok, c, templates):
    try:
        out = tok.apply_chat_template(
            c["messages"],
            tools=c["tools"],
            chat_template=templates[c["template"]],
            add_generation_prompt=c["add_generation_prompt"],
            enable_thinking=c["enable_thinking"],
            tokenize=False,
        )
        return {"output": out}
    except Exception as e:  # jinja2 TemplateError from raise_exception
        return {"error": str(e)}


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="tests/fixtures/tokenizer", type=Path)
    args = ap.parse_args()
    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        print(f"need transformers {EXPECTED_TRANSFORMERS}, have {transformers.__version__}", file=sys.stderr)
        return 1
    d: Path = args.dir
    tokens, types, merges, ids, gguf_template = load_gguf(d / "ggml-vocab-qwen35.gguf")
    tok = build_tokenizer(tokens, types, merges, ids)

    # 1. llama.cpp's vectors
    inp = (d / "ggml-vocab-qwen35.gguf.inp").read_text(encoding="utf-8").split(SEP)
    assert inp[-1] == ""
    inp = inp[:-1]
    out_lines = (d / "ggml-vocab-qwen35.gguf.out").read_text(encoding="utf-8").split("\n")
    assert out_lines[-1] == ""
    out_lines = out_lines[:-1]
    assert len(inp) == len(out_lines), (len(inp), len(out_lines))
    vectors = []
    n_diff = 0
    for i, (text, line) in enumerate(zip(inp, out_lines)):
        llama = [int(x) for x in line.split()]
        ref = encode(tok, text, True)
        if ref != llama:
            n_diff += 1
            assert unicodedata.normalize("NFC", text) != text, f"case {i} differs but is NFC: {text!r}"
        vectors.append({"index": i, "text": text, "ids": ref, "llama_cpp": llama, "nfc": unicodedata.is_normalized("NFC", text)})
    print(f"vectors: {len(vectors)} cases, {n_diff} differ from llama.cpp's .out (all non-NFC)")

    # 2. corpus
    entries = []
    for text in corpus():
        ids_p = encode(tok, text, True)
        ids_s = encode(tok, text, False)
        entries.append(
            {
                "text": text,
                "ids": ids_p,
                "ids_no_special": ids_s,
                "decoded": decode(tok, ids_p, False),
                "decoded_skip_special": decode(tok, ids_p, True),
            }
        )
    # random id sequences (pieces that split UTF-8 sequences, special tokens in between)
    rng = random.Random(7)
    n = len(tokens)
    specials = [i for i, ty in enumerate(types) if ty == 3]
    multibyte = [i for i, t in enumerate(tokens) if types[i] == 1 and any(0x80 <= b for b in piece_bytes(t))]
    decode_cases = []
    for _ in range(200):
        k = rng.randint(1, 12)
        seq = []
        for _ in range(k):
            r = rng.random()
            if r < 0.1:
                seq.append(rng.choice(specials))
            elif r < 0.6:
                seq.append(rng.choice(multibyte))
            else:
                seq.append(rng.randrange(n))
        decode_cases.append({"ids": seq, "decoded": decode(tok, seq, False), "decoded_skip_special": decode(tok, seq, True)})
    print(f"corpus: {len(entries)} texts, {len(decode_cases)} random id sequences")

    # 3. every token: its raw piece and its single-token decode
    sep = b"\xff"
    pieces = []
    singles = []
    singles_skip = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        pieces.append((b"" if is_filler(i, t, ty) else piece_bytes(t)) + sep)
        singles.append(decode(tok, [i], False).encode("utf-8") + sep)
        singles_skip.append(decode(tok, [i], True).encode("utf-8") + sep)
    piece_info = {
        "n_tokens": n,
        "fnv1a64_pieces": fnv1a64(pieces),
        "fnv1a64_single_decode": fnv1a64(singles),
        "fnv1a64_single_decode_skip_special": fnv1a64(singles_skip),
        "separator": "each piece/string is followed by the byte 0xff; FNV-1a 64 over all bytes",
        "samples": {str(i): decode(tok, [i], False) for i in list(range(0, n, 997)) + specials},
    }

    # 4. chat
    templates = {"qwen35": (d / "Qwen3.5-4B.jinja").read_text(encoding="utf-8"), "gguf": gguf_template}
    chats = []
    convs = conversations()
    convs += [dict(c, name="gguf_" + c["name"], template="gguf") for c in conversations()[:6]]
    for c in convs:
        chats.append({**with_json_text(c), **render(tok, c, templates)})
    n_err = sum("error" in c for c in chats)
    print(f"chat: {len(chats)} conversations ({n_err} template errors)")
    special_tokens = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}

    def dump(name, obj):
        (d / name).write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")

    meta = {
        "generator": "tools/reference/make_tokenizer_fixtures.py",
        "transformers": transformers.__version__,
        "tokenizers": __import__("tokenizers").__version__,
    }
    dump("vectors.json", {**meta, "cases": vectors})
    dump("corpus.json", {**meta, "texts": entries, "decode": decode_cases})
    dump("pieces.json", {**meta, **piece_info})
    dump("chat.json", {**meta, "special_tokens": special_tokens, "conversations": chats, "snippets": render_snippets()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
