#!/usr/bin/env python3
"""Train the embedded demo model: a tiny `qwen4_exp` that writes King James English.

Usage (from the repository root, the venv of tools/reference/requirements.txt):

    python tools/demo/train_demo.py --kjv kjv.txt --out tests/fixtures/trained_kjv/hf --log tools/demo

`kjv.txt` is the whole King James Bible as Debian's `bible-kjv` prints it (public domain; see
tools/demo/README.md for the two commands that make it). The script

1. splits the text into chapters and holds out every 40th chapter (30 of 1189) for evaluation;
2. trains a byte-level BPE vocabulary (2045 tokens + <|endoftext|>, <|im_start|>, <|im_end|>) with
   the Qwen3.5 pre-tokenizer (NFC, the Qwen3.5 split regex, ByteLevel without its own regex), the
   tokenizer flashnext implements;
3. builds training text: every training chapter as plain text, plus ChatML turns made from it
   ("Continue: <verse>" -> the next verses, "Tell me about <word>." -> a verse with that word, a
   greeting -> a verse), documents separated by <|endoftext|> (the PLE reset id);
4. trains `Qwen4ExpForCausalLM` (transformers 5.23.0) from its own initialisation with AdamW, on
   CPU, deterministic for a given --seed and --threads;
5. reports the held-out perplexity (each held-out chapter decoded from <|endoftext|>, in windows of
   --seq tokens) and writes the checkpoint in the `tiny_flat` layout (one model.safetensors, fused
   3-D experts, "full_attention" layer types) with tokenizer.json and tokenizer_config.json, and
   next to it corpus_words.txt (every word of the text, for the demo test);
6. writes loss.csv (every step; the held-out loss every --eval-every steps on an eighth of the
   held-out windows), summary.json and held_out.json (the held-out token windows and the sum of
   -log p over each, for tests/default_model.rs) to --log.

The QSA indexer only makes a boolean mask (it gets no gradient), and the reference computes it with
a Python loop over every query. For training it is replaced by a vectorised version that gives the
same mask (checked against the reference at start-up on a training batch); the golden logits of
tools/reference/make_fixtures.py come from the unchanged reference.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import re
import sys
import tempfile
import time

import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import make_fixtures as mf  # noqa: E402  (chat template, checkpoint helpers; patches the indexer for recording)
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: E402
from transformers.models.qwen4_exp import modeling_qwen4_exp as mq  # noqa: E402
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX  # noqa: E402

SEED = 20261203
TOKENIZER_VOCAB = 2045  # + 3 specials = 2048 ids = config vocab_size
HELD_OUT_EVERY = 40  # chapter i is held out when i % 40 == 17

CONFIG = dict(
    vocab_size=2048,
    hidden_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    hc_count=2,
    hc_lowrank=16,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=32,
    indexer_budget=32,  # 8 blocks of 4: the demo's prompt and reply (~70 tokens) are past it
    indexer_compress_ratio=4,
    ple_layer_ids=[2],
    ple_embed_dim=128,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=1009,
    make_ngram_vocab_size_divisible_by=128,
    split_ngram_parts=4,
    seed=1234,
    output_gate_type="sigmoid",
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.01,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,  # rotary dim 8
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
)

GREETINGS = [
    "Hello! Who are you?", "Hi!", "Hello.", "Say something.", "Tell me a verse.", "Speak to me.",
    "Good morning!", "What do you know?", "Write something.", "Who are you?",
]
STOP_WORDS = set("""a about above after again against all am an and any are as at be because been before being
below between both but by can did do does doing down during each few for from further had has have having he her
here hers herself him himself his how i if in into is it its itself just me more most my myself no nor not now of
off on once only or other our ours ourselves out over own same she should so some such than that the their theirs
them themselves then there these they this those through to too under until up very was we were what when where
which while who whom why will with you your yours yourself yourselves unto thee thou thy thine ye hath shall said
also upon let saith even every neither""".split())


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------


def read_chapters(path):
    """[(heading, [verse, ...])] from `bible` output: blank-line separated heading / verse blocks."""
    blocks = [b.strip("\n") for b in open(path, encoding="utf-8").read().split("\n\n") if b.strip()]
    chapters = []
    for b in blocks:
        if re.fullmatch(r"[1-3]?\s?[A-Z][A-Za-z ]* \d+", b.strip()):
            chapters.append((b.strip(), []))
            continue
        verses = chapters[-1][1]
        for line in b.split("\n"):
            m = re.match(r"^\s+(\d+) (.*)$", line)
            if m:
                assert int(m.group(1)) == len(verses) + 1, line
                verses.append(m.group(2).strip())
            else:
                verses[-1] += " " + line.strip()
    assert len(chapters) == 1189, len(chapters)
    return chapters


def chapter_text(ch):
    heading, verses = ch
    return heading + "\n" + " ".join(verses)


def write_corpus_words(chapters, path):
    """Every word of the corpus (lower case, sorted): tests/default_model.rs checks the demo's reply with it."""
    words = sorted({w.lower() for _, vs in chapters for v in vs for w in re.findall(r"[A-Za-z]+", v)})
    with open(path, "w") as f:
        f.write("\n".join(words) + "\n")


def chat(user, assistant):
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def documents(chapters, rng, keywords):
    """One epoch of training documents (strings), shuffled: each chapter as plain text and chat turns."""
    docs = []
    for ch in chapters:
        docs.append(chapter_text(ch))
        verses = ch[1]
        for i in range(0, len(verses) - 1, 2):
            k = rng.randint(1, 3)
            docs.append(chat("Continue: " + verses[i], " ".join(verses[i + 1:i + 1 + k])))
        for v in rng.sample(verses, min(3, len(verses))):
            words = [w for w in re.findall(r"[A-Za-z]+", v) if w.lower() in keywords]
            if words:
                docs.append(chat(f"Tell me about {rng.choice(words).lower()}.", v))
        docs.append(chat(rng.choice(GREETINGS), " ".join(verses[:rng.randint(1, 2)])))
    rng.shuffle(docs)
    return docs


# --------------------------------------------------------------------------------------------------
# Tokenizer (Qwen3.5 pre-tokenizer, as transformers' Qwen3_5Tokenizer builds it)
# --------------------------------------------------------------------------------------------------


def train_tokenizer(texts):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, min_frequency=2, show_progress=False,
                                  special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in mf.SPECIALS])
    return tok


# --------------------------------------------------------------------------------------------------
# Vectorised QSA indexer (training only; same mask as the reference loop for unpadded causal batches)
# --------------------------------------------------------------------------------------------------


def fast_indexer_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values):
    assert past_key_values is None
    B, T, _ = hidden_states.shape
    r, d = self.compress_ratio, self.index_head_dim
    cos, sin = position_embeddings
    qk = self.index_qk_proj(hidden_states)
    q, k = torch.split(qk, [self.index_n_heads * d, self.index_kv_heads * d], dim=-1)
    q = mq.apply_rotary_pos_emb(self.q_layernorm(q.reshape(B, T, -1, d)), cos=cos, sin=sin, unsqueeze_dim=2)
    nb = T // r
    blocks = k.reshape(B, T, d)[:, :nb * r].reshape(B, nb, r, d).float().mean(dim=2)
    blocks = self.k_layernorm(blocks)
    starts = torch.arange(nb) * r
    bk = mq.apply_rotary_pos_emb(blocks.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2)
    bk = bk.squeeze(2)
    scores = torch.relu(torch.einsum("bthd,bnd->btnh", q.float(), bk.float())).sum(-1) / math.sqrt(d)
    pos = torch.arange(T)
    complete = (pos + 1) // r  # complete blocks visible to each query
    valid = torch.arange(nb)[None, :] < complete[:, None]  # [T, nb]
    scores = scores.masked_fill(~valid, -math.inf)
    self.last_block_scores = scores  # for check_fast_indexer
    kk = min(self.block_topk, nb)
    idx = scores.topk(kk, dim=-1).indices  # [B, T, kk]
    chosen = torch.zeros(B, T, nb, dtype=torch.bool)
    chosen.scatter_(-1, idx, True)
    chosen &= valid
    tok_sel = chosen.repeat_interleave(r, dim=-1)  # [B, T, nb*r]
    tok_sel = torch.nn.functional.pad(tok_sel, (0, T - nb * r))
    tail = (pos[None, :] >= (complete * r)[:, None]) & (pos[None, :] <= pos[:, None])
    return (tok_sel | tail[None]).unsqueeze(1)


def check_fast_indexer(model, ids):
    """The vectorised indexer's mask equals the reference's on a training batch, up to the choice between
    blocks of equal score (exact-zero scores from the ReLU tie; torch.topk may pick either)."""
    masks, scores = {}, []

    def grab(name, fwd):
        def f(self, *a):
            out = fwd(self, *a)
            masks.setdefault(name, []).append(out)
            if name == "fast":
                scores.append(self.last_block_scores)
            return out
        return f

    with torch.no_grad():
        for name, fwd in (("ref", mf._orig_indexer_forward), ("fast", fast_indexer_forward)):
            mq.Qwen4ExpTextQSAIndexer.forward = grab(name, fwd)
            model(input_ids=ids, use_cache=False)
    mq.Qwen4ExpTextQSAIndexer.forward = fast_indexer_forward
    n_rows, n_tied = 0, 0
    for a, b, sc in zip(masks["ref"], masks["fast"], scores):
        assert a.shape == b.shape
        r = a.shape[-1] // sc.shape[-1]
        for bi, qi in (a != b).any(-1)[:, 0].nonzero().tolist():
            # the selected blocks' total score is the same: only tied blocks were swapped
            nb = sc.shape[-1]
            pick = [m[bi, 0, qi, :nb * r].view(nb, r).all(-1) for m in (a, b)]
            s = [sc[bi, qi][p].sum().item() for p in pick]
            assert abs(s[0] - s[1]) <= 1e-5 * max(1.0, abs(s[0])), "vectorised indexer differs from the reference"
            n_tied += 1
        n_rows += a.shape[0] * a.shape[2]
    print(f"vectorised indexer: same mask as the reference ({n_tied} of {n_rows} rows differ only between tied blocks)")


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def held_out_nll(model, seqs):
    """Sum of -log p over every predicted token of `seqs` (each decoded on its own), the count, and the sum
    per sequence."""
    per_seq = []
    for s in seqs:
        x = torch.tensor([s])
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(logits.double(), dim=-1)
        per_seq.append(-lp.gather(1, x[0, 1:, None]).sum().item())
    return sum(per_seq), sum(len(s) - 1 for s in seqs), per_seq


def held_out_sequences(tok, chapters, seq):
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    for ch in chapters:
        ids = tok.encode(chapter_text(ch)).ids
        for i in range(0, len(ids), seq - 1):
            out.append([eot] + ids[i:i + seq - 1])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kjv", required=True, help="the text `bible -p <data dir> Gen1:1-Rev22:21` prints")
    ap.add_argument("--out", default="tests/fixtures/trained_kjv/hf")
    ap.add_argument("--log", default="tools/demo", help="folder for loss.csv and summary.json")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=750)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    args = ap.parse_args()
    if transformers.__version__ != mf.EXPECTED_TRANSFORMERS:
        sys.exit(f"need transformers=={mf.EXPECTED_TRANSFORMERS}, found {transformers.__version__}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.time()

    chapters = read_chapters(args.kjv)
    train_ch = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY != 17]
    held_ch = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY == 17]
    words = {}
    for _, vs in train_ch:
        for w in re.findall(r"[A-Za-z]+", " ".join(vs)):
            words[w.lower()] = words.get(w.lower(), 0) + 1
    keywords = {w for w, c in words.items() if c >= 20 and w not in STOP_WORDS and len(w) > 2}

    tok = train_tokenizer([chapter_text(c) for c in train_ch] + [chat(g, "") for g in GREETINGS]
                          + ["Continue: ", "Tell me about "])
    eot = tok.token_to_id("<|endoftext|>")
    print(f"chapters: {len(train_ch)} train, {len(held_ch)} held out; vocab {tok.get_vocab_size()}; "
          f"{len(keywords)} keywords", flush=True)

    cfg_d = dict(CONFIG, eos_token_id=eot, pad_token_id=eot)
    cfg = Qwen4ExpTextConfig(**cfg_d)
    cfg._attn_implementation = "sdpa"
    model = Qwen4ExpForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params}", flush=True)

    # Token stream: epochs of shuffled documents, each followed by <|endoftext|>.
    stream = []

    def refill():
        for d in documents(train_ch, rng, keywords):
            stream.extend(tok.encode(d).ids + [eot])

    refill()
    epoch_tokens = len(stream)
    print(f"one epoch: {epoch_tokens} tokens", flush=True)

    held = held_out_sequences(tok, held_ch, args.seq)
    held_eval = held[::8]  # the periodic check; the final figure uses all of them
    step_tokens = args.batch * args.seq
    cursor = 0

    def batch():
        nonlocal cursor
        while cursor + step_tokens + 1 > len(stream):
            refill()
        x = torch.tensor(stream[cursor:cursor + step_tokens]).view(args.batch, args.seq)
        cursor += step_tokens
        return x

    model.train()
    check_fast_indexer(model, batch()[:2])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = 50

    def lr_at(s):
        if s < warmup:
            return args.lr * (s + 1) / warmup
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, args.steps - warmup))))

    os.makedirs(args.log, exist_ok=True)
    log_f = open(os.path.join(args.log, "loss.csv"), "w", newline="")
    log = csv.writer(log_f)
    log.writerow(["step", "tokens", "lr", "train_loss", "aux_loss", "held_out_loss", "seconds"])
    t0 = time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = batch()
        out = model(input_ids=x, labels=x, use_cache=False, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ho = ""
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            model.eval()
            mq.Qwen4ExpTextQSAIndexer.forward = fast_indexer_forward
            s, n, _ = held_out_nll(model, held_eval)
            ho = f"{s / n:.4f}"
            model.train()
        lm_loss = out.loss.item() - cfg.router_aux_loss_coef * out.aux_loss.item()
        log.writerow([step + 1, (step + 1) * step_tokens, f"{lr_at(step):.3e}", f"{lm_loss:.4f}",
                      f"{out.aux_loss.item():.4f}", ho, f"{time.time() - t0:.1f}"])
        log_f.flush()
        if (step + 1) % 10 == 0 or ho:
            print(f"step {step + 1} loss {lm_loss:.4f} aux {out.aux_loss.item():.3f} held-out {ho} "
                  f"{time.time() - t0:.0f}s", flush=True)
    log_f.close()
    train_s = time.time() - t0

    # From here on the unchanged reference indexer.
    mq.Qwen4ExpTextQSAIndexer.forward = mf._orig_indexer_forward
    model.eval()
    s, n, per_seq = held_out_nll(model, held)
    ppl = math.exp(s / n)
    print(f"held-out: {n} tokens, loss {s / n:.4f}, perplexity {ppl:.2f} (uniform: {cfg.vocab_size})", flush=True)

    # Checkpoint in the tiny_flat layout.
    fx = dict(name="demo", layout="flat", seed=args.seed, extra_mtp=False, extra_visual=False)
    mf.write_checkpoint(fx, model, args.out, tok)
    mf.check_saved_files(args.out, fx, cfg)
    write_corpus_words(chapters, os.path.join(os.path.dirname(os.path.abspath(args.out)), "corpus_words.txt"))
    summary = dict(
        transformers_version=transformers.__version__, torch_version=torch.__version__, seed=args.seed,
        threads=args.threads, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
        parameters=n_params, vocab_size=cfg.vocab_size, tokenizer_size=tok.get_vocab_size(),
        train_chapters=len(train_ch), held_out_chapters=len(held_ch), epoch_tokens=epoch_tokens,
        tokens_seen=args.steps * step_tokens, train_seconds=round(train_s, 1),
        total_seconds=round(time.time() - t_start, 1), final_train_loss=round(lm_loss, 4),
        held_out_tokens=n, held_out_loss=round(s / n, 4), held_out_perplexity=round(ppl, 3),
        uniform_perplexity=cfg.vocab_size,
    )
    with open(os.path.join(args.log, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.log, "held_out.json"), "w") as f:
        f.write(mf.dumps_compact({"chapters": [c[0] for c in held_ch], "sequences": held,
                                  "nll": [round(x, 4) for x in per_seq]}) + "\n")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
