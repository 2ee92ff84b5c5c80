#!/usr/bin/env python3
"""Calibrates synthetic routing against the published LRU curve of the real model.

  python3 tools/routing/calibrate.py [--flashnext target/release/flashnext] [--work DIR] [--real-width]

The published figures (a routing trace of Qwen3.8-Flash-Next replayed through a
per-layer LRU cache, from a cold cache, about 300 tokens): 43.5 / 62.0 / 72.0 /
78.9 % at 93 / 186 / 279 / 372 slots per layer (and 85.0 % at 512, i.e. 15 %
first sightings).

1. Search: (skew, locality, memory) of the routing law that `flashnext replay
   --generate` draws from (the law `flashnext synth --route-*` builds into a
   model), scored by the largest gap to the four published points, among the
   laws where pinning each layer's most chosen experts (by a profile of the
   other windows) loses to LRU at every size, as published.
2. Model: a `--dims narrow` model (hidden 512, the real 512 experts, top 10)
   synthesised with the best values, decoded on the CPU with pseudo-random
   tokens (`bench --tokens random --save-trace`), its trace replayed in windows
   of 300 tokens from a fresh cache.
3. The same for the `real` preset (`--route-preset real`, what the engine
   ships), the default model (uniform routing, the worst case), and with
   --real-width one layer of the real shapes (hidden 2560) of each.

Prints every step's curve; the numbers in docs/BENCHMARKS.md ("Routing that
looks real") come from this script.
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile

TARGET = [43.5, 62.0, 72.0, 78.9]
SLOTS = "93,186,279,372,512"


def replay(fnx, source, work, extra=()):
    """LRU curve (93..512 slots), mean distinct experts in 300 tokens, the report."""
    out = os.path.join(work, "replay.json")
    cmd = [fnx, "replay", *source, "--slots", SLOTS, "--policy", "lru,pin-frequent", "--window", "300",
           "--json", out, *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        r = json.load(f)
    curve = [100 * x["hit_rate"] for x in r["results"] if x["policy"] == "lru"]
    mean_distinct = sum(r["distinct_per_layer"]) / len(r["distinct_per_layer"])
    return curve, mean_distinct, r


def pinning(r):
    return [100 * x["hit_rate"] for x in r["results"] if x["policy"] == "pin-frequent"]


def score(curve, r):
    """(largest gap, sum of squared gaps); infinite where pinning beats LRU at some size."""
    if any(p >= c for p, c in zip(pinning(r)[:4], curve[:4])):
        return float("inf"), float("inf")
    gaps = [abs(a - b) for a, b in zip(curve, TARGET)]
    return max(gaps), sum(g * g for g in gaps)


def law(fnx, work, skew, locality, memory, tokens, layers, seed=1):
    spec = f"zipf:{skew},locality:{locality},memory:{memory},tokens:{tokens},layers:{layers},seed:{seed}"
    return replay(fnx, ["--generate", spec], work)


def fmt(curve):
    return " / ".join(f"{x:.1f}" for x in curve)


def model_curve(fnx, work, name, synth_args, tokens):
    """Synthesises a model, decodes pseudo-random tokens, replays the trace."""
    model = os.path.join(work, f"{name}.gguf")
    trace = os.path.join(work, f"{name}.trace")
    subprocess.run([fnx, "synth", "-o", model, "-q", *synth_args], check=True, stderr=subprocess.DEVNULL)
    subprocess.run(
        [fnx, "bench", "-m", model, "--backend", "cpu", "--prompt", "a", "--tokens", "random",
         "--gen", str(tokens), "--warmup", "0", "--save-trace", trace],
        check=True, stdout=subprocess.DEVNULL)
    os.remove(model)
    # The one-token prompt is dropped: every replayed token is pseudo-random.
    return replay(fnx, [trace], work, ["--skip", "1"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashnext", default="target/release/flashnext")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--tokens", type=int, default=3000, help="tokens decoded per model (windows of 300)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the narrow models")
    ap.add_argument("--real-width", action="store_true", help="also one layer of the real shapes (4 GB, minutes)")
    ap.add_argument("--skip-search", action="store_true", help="only the models")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="fnx-routing-")
    os.makedirs(work, exist_ok=True)
    fnx = a.flashnext
    print(f"published LRU curve, 93/186/279/372 slots: {fmt(TARGET)} %", flush=True)

    if not a.skip_search:
        # Coarse grid on short draws, then a finer one around the best on longer draws.
        best = []
        for skew, loc, mem in itertools.product([0.0, 0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.5, 0.6],
                                                [4, 8, 12, 16, 24, 32]):
            c, _, r = law(fnx, work, skew, loc, mem, 1200, 4)
            best.append((score(c, r), skew, loc, mem))
        best.sort()
        (_, s0, l0, m0) = best[0]
        fine = []
        for skew, loc, mem in itertools.product(
                [max(0.0, s0 + d) for d in (-0.1, -0.05, 0.0, 0.05, 0.1)],
                [min(0.95, max(0.05, l0 + d)) for d in (-0.1, -0.05, 0.0, 0.05, 0.1)],
                sorted({max(1.5, m0 * f) for f in (0.7, 0.85, 1.0, 1.2, 1.4)})):
            c, d, r = law(fnx, work, round(skew, 3), round(loc, 3), round(mem, 2), 3000, 8)
            fine.append((score(c, r), round(skew, 3), round(loc, 3), round(mem, 2), c, d))
        fine.sort()
        print("best laws (largest gap, skew, locality, memory: LRU curve with 512 slots; distinct experts in 300 tokens):")
        for (gap, _), skew, loc, mem, c, d in fine[:5]:
            print(f"  gap {gap:4.1f}  zipf:{skew},locality:{loc},memory:{mem}:  {fmt(c)}  ({d:.0f} distinct)")
        # The model routes slightly more locally than the law (its vocabulary of 4096 repeats
        # a few tokens in 300): the three best laws on the model, then the best one's memory swept.
        narrow = ["--dims", "narrow", "--layers", str(a.layers), "--type", "q8_0", "--ple-rows", "65536"]

        def on_model(s, l, m):
            c, d, r = model_curve(fnx, work, "law", narrow + ["--route-skew", str(s), "--route-locality", str(l),
                                                              "--route-memory", str(m)], a.tokens)
            print(f"  narrow model, skew {s}, locality {l}, memory {m}: {fmt(c)}  ({d:.0f} distinct), "
                  f"largest gap {score(c, r)[0]:.1f}; pinning {fmt(pinning(r))}", flush=True)
            return score(c, r), s, l, m

        print("on the model:")
        tried = sorted(on_model(s, l, m) for _, s, l, m, _, _ in fine[:3])
        _, s, l, m = tried[0]
        tried += [on_model(s, l, round(m * f, 1)) for f in (0.8, 0.9, 1.1, 1.2)]
        _, s, l, m = min(tried)
        print(f"best on the model: --route-skew {s} --route-locality {l} --route-memory {m} "
              "(the real preset, 0.25 / 0.25 / 18, was picked from this sweep)", flush=True)

    narrow = ["--dims", "narrow", "--layers", str(a.layers), "--type", "q8_0", "--ple-rows", "65536"]
    print("the shipped preset and the worst case:")
    for name, extra in [("preset real", ["--route-preset", "real"]), ("uniform (default synth)", [])]:
        c, d, r = model_curve(fnx, work, name.split()[0], narrow + extra, a.tokens)
        per_layer = [f"{100 * x:.1f}" for x in r["results"][0]["per_layer"]]
        print(f"narrow model, {name}: {fmt(c)}  ({d:.0f} distinct); pinning {fmt(pinning(r))}; "
              f"93 slots per layer: {' '.join(per_layer)}", flush=True)
    if a.real_width:
        real = ["--dims", "real", "--layers", "1", "--type", "q8_0"]
        for name, extra in [("preset real", ["--route-preset", "real"]), ("uniform (default synth)", [])]:
            c, d, r = model_curve(fnx, work, "real-" + name.split()[0], real + extra, min(a.tokens, 600))
            print(f"real width, 1 layer, {name}: {fmt(c)}  ({d:.0f} distinct); pinning {fmt(pinning(r))}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
