"""Tests of the flashnext ctypes binding (stdlib unittest only).

Run from the repository with the library built:

    FLASHNEXT_LIB=target/debug python3 -m unittest discover -s bindings/python/tests

They use the repository's tiny model ``models/default.gguf`` (or the file
named by ``FLASHNEXT_TEST_MODEL``); it writes King James English but knows
nothing, so they check structure, determinism and consistency, never
particular words.
"""

import ctypes
import json
import os
import re
import sys
import threading
import unittest
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import flashnext  # noqa: E402
from flashnext import FlashnextError  # noqa: E402

REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
MODEL = os.environ.get("FLASHNEXT_TEST_MODEL") or os.path.join(REPO, "models", "default.gguf")
HEADER = os.path.join(REPO, "include", "flashnext.h")

HAS_TEXT = hasattr(flashnext.Model, "tokenize") and "fnx_tokenize" in flashnext._FUNCTIONS


def argmax(values):
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def header_text():
    with open(HEADER, encoding="utf-8") as f:
        return f.read()


class ModelCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = flashnext.Model(MODEL, n_threads=1)

    @classmethod
    def tearDownClass(cls):
        cls.model.close()


@unittest.skipUnless(os.path.exists(HEADER), "no include/flashnext.h next to the binding")
class TestHeaderCoverage(unittest.TestCase):
    def test_every_function_is_declared_and_exported(self):
        text = header_text()
        names = set(re.findall(r"^[A-Za-z_][\w \*]*?\b(fnx_\w+)\(", text, re.M))
        self.assertGreater(len(names), 30)
        missing = sorted(names - set(flashnext._FUNCTIONS))
        self.assertEqual(missing, [], "functions of flashnext.h the binding does not declare")
        unexported = sorted(n for n in names if not hasattr(flashnext._lib, n))
        self.assertEqual(unexported, [], "functions of flashnext.h the library does not export")
        self.assertEqual(flashnext._missing, set())

    def test_constants_match_the_header(self):
        defines = re.findall(r"^#define (FNX_\w+) (\d+)u?l{0,2}\s*$", header_text(), re.M)
        self.assertGreater(len(defines), 20)
        for name, value in defines:
            self.assertEqual(getattr(flashnext, name[len("FNX_"):]), int(value), name)

    def test_every_status_has_its_name(self):
        for name, value in re.findall(r"^#define (FNX_(?:OK|ERR_\w+)) (\d+)\s*$", header_text(), re.M):
            self.assertEqual(flashnext.status_name(int(value)), name)
        self.assertEqual(flashnext.status_name(10_000), "FNX_UNKNOWN_STATUS")

    def test_struct_fields_match_the_header(self):
        text = header_text()
        structs = re.findall(r"typedef struct (fnx_\w+) \{(.*?)\} \1;", text, re.S)
        self.assertGreaterEqual(len(structs), 3)
        for struct in structs:
            name, body = struct
            body = re.sub(r"//[^\n]*", "", body)
            fields = re.findall(r"(\w+);", body)
            ours = [f for f, _ in getattr(flashnext, name)._fields_]
            self.assertEqual(ours, fields, name)


class TestBasics(unittest.TestCase):
    def test_version(self):
        self.assertRegex(flashnext.version(), r"^\d+\.\d+\.\d+")
        self.assertEqual(flashnext.__version__, flashnext.version())
        self.assertTrue(os.path.exists(flashnext.library_path()))

    def test_struct_sizes_match_the_library(self):
        # The library fills struct_size with sizeof as it was compiled.
        self.assertEqual(
            flashnext._lib.fnx_load_params_default().struct_size, ctypes.sizeof(flashnext.fnx_load_params)
        )
        self.assertEqual(
            flashnext._lib.fnx_generate_params_default().struct_size, ctypes.sizeof(flashnext.fnx_generate_params)
        )
        self.assertEqual(
            flashnext._lib.fnx_sampler_params_default().struct_size, ctypes.sizeof(flashnext.fnx_sampler_params)
        )

    def test_error_carries_status_name_and_message(self):
        with self.assertRaises(FlashnextError) as cm:
            flashnext.Model(os.path.join(REPO, "no", "such", "model.gguf"))
        e = cm.exception
        self.assertEqual(e.status, flashnext.ERR_IO)
        self.assertEqual(e.name, "FNX_ERR_IO")
        self.assertIn("model.gguf", e.message)
        self.assertIn("FNX_ERR_IO", str(e))
        self.assertEqual(e.args, (e.status, e.name, e.message))

    def test_not_a_gguf_file(self):
        with self.assertRaises(FlashnextError) as cm:
            flashnext.Model(__file__)
        self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_FILE)

    def test_unavailable_backend(self):
        # No machine has a Vulkan device 99 (FNX_DEVICE wins over the params).
        old = {k: os.environ.pop(k, None) for k in ("FNX_BACKEND", "FNX_DEVICE")}
        os.environ["FNX_DEVICE"] = "99"
        try:
            with self.assertRaises(FlashnextError) as cm:
                flashnext.Model(MODEL, backend=flashnext.BACKEND_VULKAN)
            self.assertIn(cm.exception.status, (flashnext.ERR_BACKEND_UNAVAILABLE,))
        finally:
            for k, v in old.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v


class TestModel(unittest.TestCase):
    def test_context_manager_and_properties(self):
        with flashnext.Model(MODEL, n_threads=1) as m:
            self.assertEqual(m.vocab_size, 2048)
            self.assertEqual(m.n_layers, 4)
            self.assertEqual(m.hidden_size, 128)
            self.assertEqual(m.context_length, 1024)
            self.assertEqual(m.eos_token, 2047)
            self.assertIn("vocab=2048", repr(m))
        self.assertTrue(m.closed)
        with self.assertRaises(ValueError):
            m.vocab_size
        m.close()  # twice is fine

    def test_n_ctx_limits_states(self):
        with flashnext.Model(MODEL, n_ctx=4) as m:
            self.assertEqual(m.context_length, 4)
            s = m.new_state()
            s.decode_tokens([1, 2, 3, 4])
            with self.assertRaises(FlashnextError) as cm:
                s.decode(5)
            self.assertEqual(cm.exception.status, flashnext.ERR_CONTEXT_FULL)
            self.assertEqual(s.position, 4)

    def test_progress_callback(self):
        seen = []
        with flashnext.Model(MODEL, progress=seen.append):
            pass
        self.assertGreater(len(seen), 2)
        self.assertEqual(seen[0], 0.0)
        self.assertEqual(seen[-1], 1.0)
        self.assertEqual(seen, sorted(seen))

    def test_progress_cancels(self):
        with self.assertRaises(FlashnextError) as cm:
            flashnext.Model(MODEL, progress=lambda p: p < 0.5)
        self.assertEqual(cm.exception.status, flashnext.ERR_CANCELLED)

    def test_progress_exception_propagates(self):
        def boom(p):
            if p > 0.2:
                raise KeyError("from the progress callback")

        with self.assertRaises(KeyError):
            flashnext.Model(MODEL, progress=boom)

    def test_closed_model_freezes_its_states(self):
        m = flashnext.Model(MODEL)
        s = m.new_state()
        s.decode(1)
        m.close()
        with self.assertRaises(FlashnextError) as cm:
            s.decode(2)
        self.assertEqual(cm.exception.status, flashnext.ERR_MODEL_FREED)
        s.close()


class TestLog(unittest.TestCase):
    def test_log_callback_receives_the_load_message(self):
        got = []
        flashnext.set_log_callback(lambda level, msg: got.append((level, msg)))
        try:
            flashnext.Model(MODEL).close()
        finally:
            flashnext.set_log_callback(None)
        self.assertTrue(any(l == flashnext.LOG_INFO and "loaded" in m for l, m in got), got)
        got.clear()
        flashnext.Model(MODEL).close()
        self.assertEqual(got, [])

    def test_log_callback_exceptions_are_contained(self):
        def bad(level, msg):
            raise RuntimeError("ignored")

        flashnext.set_log_callback(bad)
        try:
            flashnext.Model(MODEL).close()
        finally:
            flashnext.set_log_callback(None)


class TestState(ModelCase):
    def test_decode_logits_position(self):
        s = self.model.new_state()
        self.assertEqual(s.position, 0)
        with self.assertRaises(FlashnextError) as cm:
            s.logits()
        self.assertEqual(cm.exception.status, flashnext.ERR_NO_LOGITS)
        s.decode(3)
        s.decode(14)
        self.assertEqual(s.position, 2)
        self.assertEqual(len(s), 2)
        a = s.logits()
        self.assertIsInstance(a, array)
        self.assertEqual(a.typecode, "f")
        self.assertEqual(len(a), self.model.vocab_size)
        lst = s.logits(as_list=True)
        self.assertIsInstance(lst, list)
        self.assertEqual(lst, a.tolist())
        self.assertTrue(all(v == v for v in lst))  # no NaN

    def test_decode_tokens_equals_one_by_one(self):
        a = self.model.new_state()
        for t in [5, 6, 7, 8]:
            a.decode(t)
        b = self.model.new_state()
        b.decode_tokens([5, 6, 7, 8])
        self.assertEqual(b.position, 4)
        self.assertEqual(a.logits(), b.logits())
        b.decode_tokens([])
        self.assertEqual(b.position, 4)

    def test_rewind_returns_to_an_earlier_position(self):
        with flashnext.Model(MODEL, n_threads=1, rewind_window=2) as m:
            s = m.new_state()
            s.decode_tokens([5, 6, 7])
            at3 = s.logits()
            s.decode_tokens([9, 9])
            self.assertEqual(s.rewind_floor, 3)
            s.rewind(3)
            self.assertEqual(s.position, 3)
            self.assertEqual(s.logits(), at3)
            with self.assertRaises(FlashnextError) as cm:
                s.rewind(2)
            self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_ARGUMENT)
            self.assertEqual(s.position, 3)
            s.decode_tokens([8, 8])
            t = m.new_state()
            t.decode_tokens([5, 6, 7, 8, 8])
            self.assertEqual(s.logits(), t.logits())

    def test_failures_leave_the_state_unchanged(self):
        s = self.model.new_state()
        s.decode_tokens([1, 2])
        before = s.logits()
        for bad in (self.model.vocab_size, -1):
            with self.assertRaises(FlashnextError) as cm:
                s.decode(bad)
            self.assertEqual(cm.exception.status, flashnext.ERR_TOKEN_OUT_OF_RANGE)
        with self.assertRaises(FlashnextError):
            s.decode_tokens([3, 4, 10_000])
        self.assertEqual(s.position, 2)
        self.assertEqual(s.logits(), before)
        with self.assertRaises(TypeError):
            s.decode_tokens([1.5])
        with self.assertRaises(OverflowError):
            s.decode(2**32 + 1)  # would wrap to token 1 in a plain ctypes call
        self.assertEqual(s.position, 2)

    def test_reset(self):
        s = self.model.new_state()
        s.decode_tokens([9, 8, 7])
        first = s.logits()
        s.reset()
        self.assertEqual(s.position, 0)
        s.decode_tokens([9, 8, 7])
        self.assertEqual(s.logits(), first)

    def test_save_and_load(self):
        s = self.model.new_state()
        s.decode_tokens([11, 12, 13])
        snap = s.save()
        self.assertIsInstance(snap, bytes)
        s.decode(14)
        after = s.logits()
        t = self.model.new_state()
        t.load(snap)
        self.assertEqual(t.position, 3)
        t.decode(14)
        self.assertEqual(t.logits(), after)
        s.load(bytearray(snap))
        self.assertEqual(s.position, 3)

    def test_corrupt_snapshot_is_refused(self):
        s = self.model.new_state()
        s.decode_tokens([1, 2, 3])
        snap = s.save()
        t = self.model.new_state()
        t.decode(4)
        for bad in (snap[: len(snap) // 2], b"not a snapshot", b""):
            with self.assertRaises(FlashnextError) as cm:
                t.load(bad)
            self.assertIn(cm.exception.status, (flashnext.ERR_SNAPSHOT_CORRUPT, flashnext.ERR_SNAPSHOT_MISMATCH))
        self.assertEqual(t.position, 1)

    def test_copy_is_independent(self):
        s = self.model.new_state()
        s.decode_tokens([21, 22])
        c = s.copy()
        self.assertEqual(c.logits(), s.logits())
        c.decode(23)
        self.assertEqual(s.position, 2)
        self.assertEqual(c.position, 3)
        s.decode(23)
        self.assertEqual(c.logits(), s.logits())
        c.close()
        self.assertTrue(c.closed)
        with self.assertRaises(ValueError):
            c.decode(1)

    def test_decode_batch_keeps_every_position(self):
        s = self.model.new_state()
        s.decode_batch([2, 3, 4, 5], all_logits=True)
        each = [s.logits_ith(i, as_list=True) for i in range(4)]
        self.assertEqual(each[3], s.logits(as_list=True))
        t = self.model.new_state()
        for i, tok in enumerate([2, 3, 4, 5]):
            t.decode(tok)
            self.assertEqual(t.logits(as_list=True), each[i])
        with self.assertRaises(FlashnextError) as cm:
            s.logits_ith(4)
        self.assertEqual(cm.exception.status, flashnext.ERR_NO_LOGITS)

    def test_abort_callback(self):
        # Micro-batches of one token: the callback is polled before each.
        model = flashnext.Model(MODEL, n_threads=1, micro_batch=1)
        self.addCleanup(model.close)
        s = model.new_state()
        s.decode(1)
        calls = []

        def abort():
            calls.append(1)
            return len(calls) > 2

        s.set_abort_callback(abort)
        with self.assertRaises(FlashnextError) as cm:
            s.decode_tokens([2, 3, 4, 5])
        self.assertEqual(cm.exception.status, flashnext.ERR_ABORTED)
        self.assertEqual(s.position, 1)
        s.set_abort_callback(None)
        s.decode_tokens([2, 3, 4, 5])
        self.assertEqual(s.position, 5)

    def test_abort_callback_exception_propagates(self):
        s = self.model.new_state()

        def abort():
            raise ZeroDivisionError("from the abort callback")

        s.set_abort_callback(abort)
        with self.assertRaises(ZeroDivisionError):
            s.decode(1)
        self.assertEqual(s.position, 0)
        # A copy has no abort callback.
        s.set_abort_callback(lambda: False)
        s.decode(1)
        c = s.copy()
        s.set_abort_callback(lambda: True)
        c.decode(2)
        with self.assertRaises(FlashnextError):
            s.decode(2)

    def test_states_decode_in_parallel(self):
        seqs = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
        expected = []
        for seq in seqs:
            s = self.model.new_state()
            s.decode_tokens(seq)
            expected.append(s.logits())
        results = [None] * len(seqs)
        errors = []

        def work(i):
            try:
                s = self.model.new_state()
                for t in seqs[i]:
                    s.decode(t)
                results[i] = s.logits()
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(results, expected)


class TestSampler(ModelCase):
    def test_presets(self):
        d = flashnext.sampler_params_default()
        self.assertEqual(d["temperature"], 1.0)
        self.assertEqual(d["seed"], flashnext.SEED_RANDOM)
        p = flashnext.sampler_params_preset("instruct")
        self.assertAlmostEqual(p["temperature"], 0.7, places=5)
        self.assertEqual(p["top_k"], 20)
        self.assertAlmostEqual(p["presence_penalty"], 1.5, places=5)
        self.assertEqual(flashnext.sampler_params_preset("greedy")["temperature"], 0.0)
        with self.assertRaises(FlashnextError) as cm:
            flashnext.sampler_params_preset("nonsense")
        self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_ARGUMENT)

    def test_settings_are_checked(self):
        with self.assertRaises(FlashnextError) as cm:
            flashnext.Sampler(temperature=-1.0)
        self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_ARGUMENT)
        self.assertIn("temperature", cm.exception.message)
        with self.assertRaises(TypeError):
            flashnext.Sampler(temprature=0.5)
        s = flashnext.Sampler("thinking", seed=5, top_k=3)
        self.assertEqual(s.params["seed"], 5)
        self.assertEqual(s.params["top_k"], 3)
        self.assertEqual(flashnext.Sampler(seed=None).params["seed"], flashnext.SEED_RANDOM)

    def test_greedy_is_argmax(self):
        st = self.model.new_state()
        st.decode_tokens([4, 5, 6])
        logits = st.logits()
        with flashnext.Sampler("greedy") as g:
            self.assertEqual(g.sample(logits), argmax(logits))
            self.assertEqual(g.sample(st), argmax(logits))
            self.assertEqual(g.sample(logits.tolist()), argmax(logits))
            self.assertEqual(g.sample(memoryview(logits)), argmax(logits))

    def test_seeded_sampling_is_reproducible(self):
        st = self.model.new_state()
        st.decode(1)
        logits = st.logits()
        a = flashnext.Sampler(seed=1234)
        b = flashnext.Sampler(seed=1234)
        xs = [a.sample(logits) for _ in range(20)]
        ys = [b.sample(logits) for _ in range(20)]
        self.assertEqual(xs, ys)
        self.assertGreater(len(set(xs)), 1)  # temperature 1 over the tiny model: not constant
        a.reset()
        self.assertEqual([a.sample(logits) for _ in range(20)], xs)

    def test_accept_and_errors(self):
        s = flashnext.Sampler("instruct", seed=3)
        s.accept(5)
        with self.assertRaises(FlashnextError) as cm:
            s.sample([0.0, float("nan"), 1.0])
        self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_ARGUMENT)
        self.assertEqual(s.sample([float("-inf"), 0.0, float("-inf")]), 1)
        s.close()
        with self.assertRaises(ValueError):
            s.sample([1.0])


@unittest.skipUnless(HAS_TEXT, "the library has no text functions")
class TestConstraint(ModelCase):
    SCHEMA = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }

    def test_generated_json_follows_the_schema(self):
        for seed in range(4):
            with flashnext.Sampler(seed=seed, temperature=1.0) as sampler:
                sampler.set_constraint(self.model, json_schema=self.SCHEMA)
                s = self.model.new_state()
                text = "".join(s.generate("And God said", sampler=sampler, max_tokens=200))
                n = s.position - len(self.model.tokenize("And God said"))
            self.assertLess(n, 200, text)  # ended by the grammar, not the limit
            value = json.loads(text)
            self.assertEqual(sorted(value), ["age", "name", "tags"])
            self.assertIsInstance(value["name"], str)
            self.assertLessEqual(len(value["name"]), 10)
            self.assertIsInstance(value["age"], int)
            self.assertTrue(0 <= value["age"] <= 120)
            self.assertTrue(1 <= len(value["tags"]) <= 3)
            self.assertTrue(set(value["tags"]) <= {"a", "b"})

    def test_regex_and_removal(self):
        with flashnext.Sampler(seed=1) as sampler:
            sampler.set_constraint(self.model, flashnext.CONSTRAINT_REGEX, "[0-9]{2}-[a-z]{3}")
            s = self.model.new_state()
            text = "".join(s.generate("And", sampler=sampler, max_tokens=50))
            self.assertRegex(text, r"\A[0-9]{2}-[a-z]{3}\Z")
            sampler.set_constraint(self.model)  # removes it
            sampler.reset()
            st = self.model.new_state()
            st.decode_tokens([4, 5, 6])
            logits = st.logits()
            with flashnext.Sampler(seed=1) as plain:
                self.assertEqual([sampler.sample(logits) for _ in range(10)], [plain.sample(logits) for _ in range(10)])

    def test_bad_grammars_are_refused(self):
        with flashnext.Sampler(seed=2) as sampler:
            for kwargs in ({"json_schema": '{"type": "nonsense"}'}, {"regex": "[0-9"}, {"lark": "start: nowhere"}):
                with self.assertRaises(FlashnextError) as cm:
                    sampler.set_constraint(self.model, **kwargs)
                self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_ARGUMENT)
                self.assertIn("invalid", cm.exception.message)
            with self.assertRaises(TypeError):
                sampler.set_constraint(self.model, regex="a", lark="b")


class TestGenerate(ModelCase):
    def greedy_reference(self, prompt, n):
        s = self.model.new_state()
        s.decode_tokens(prompt)
        out = []
        for _ in range(n):
            t = argmax(s.logits())
            out.append(t)
            s.decode(t)
        return out

    def test_greedy_generation_matches_argmax(self):
        prompt = [10, 20, 30]
        s = self.model.new_state()
        toks = s.generate_tokens(prompt, max_tokens=8, ignore_eos=True)
        self.assertEqual(toks, self.greedy_reference(prompt, 8))
        self.assertEqual(s.position, len(prompt) + 8)
        # Continue from the state's logits without a prompt.
        more = s.generate_tokens(max_tokens=2, ignore_eos=True)
        self.assertEqual(len(more), 2)
        self.assertEqual(s.position, len(prompt) + 10)

    def test_no_prompt_no_logits(self):
        s = self.model.new_state()
        with self.assertRaises(FlashnextError) as cm:
            s.generate_tokens(max_tokens=3)
        self.assertEqual(cm.exception.status, flashnext.ERR_NO_LOGITS)

    def test_stop_tokens_and_callback(self):
        prompt = [10, 20, 30]
        ref = self.greedy_reference(prompt, 8)
        s = self.model.new_state()
        toks = s.generate_tokens(prompt, max_tokens=8, stop_tokens=[ref[3]], ignore_eos=True)
        self.assertEqual(toks, ref[: ref.index(ref[3]) + 1])

        seen = []

        def on_token(tok, piece):
            self.assertIsInstance(piece, str)
            seen.append(tok)
            return len(seen) < 3

        s = self.model.new_state()
        toks = s.generate_tokens(prompt, max_tokens=8, ignore_eos=True, on_token=on_token)
        self.assertEqual(toks, ref[:3])
        self.assertEqual(seen, ref[:3])
        self.assertEqual(s.position, len(prompt) + 3)

    def test_callback_exception_propagates(self):
        s = self.model.new_state()

        def on_token(tok, piece):
            raise LookupError("from on_token")

        with self.assertRaises(LookupError):
            s.generate_tokens([1, 2], max_tokens=5, ignore_eos=True, on_token=on_token)
        # Generation stopped after the first token, which stays decoded.
        self.assertEqual(s.position, 3)

    def test_seeded_sampler_generation_is_reproducible(self):
        base = self.model.new_state()
        base.decode_tokens([7, 8, 9])
        runs = []
        for _ in range(2):
            s = base.copy()
            with flashnext.Sampler("thinking", seed=99) as sampler:
                runs.append(s.generate_tokens(max_tokens=10, sampler=sampler, ignore_eos=True))
        self.assertEqual(runs[0], runs[1])
        self.assertEqual(len(runs[0]), 10)

    def test_invalid_stop_string(self):
        s = self.model.new_state()
        with self.assertRaises(FlashnextError) as cm:
            s.generate_tokens([1], max_tokens=2, stop_strings=[""])
        self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_ARGUMENT)
        self.assertEqual(s.position, 0)

    def test_iterator_streams_pieces(self):
        prompt = [10, 20, 30]
        ref_state = self.model.new_state()
        ref_pieces = []
        ref = ref_state.generate_tokens(
            prompt, max_tokens=12, ignore_eos=True, on_token=lambda t, p: ref_pieces.append(p)
        )
        s = self.model.new_state()
        pieces = list(flashnext.generate(s, prompt, max_tokens=12, ignore_eos=True))
        self.assertEqual(pieces, ref_pieces)
        self.assertEqual(len(pieces), len(ref))
        self.assertTrue(all(isinstance(p, str) for p in pieces))
        self.assertEqual(s.position, ref_state.position)
        self.assertEqual(s.logits(), ref_state.logits())

    def test_iterator_stops_early_and_guards_the_state(self):
        s = self.model.new_state()
        it = s.generate([1, 2, 3], max_tokens=50, ignore_eos=True)
        self.assertEqual(s.position, 0)  # lazy: nothing before the first next()
        next(it)
        next(it)
        with self.assertRaises(RuntimeError):
            s.decode(1)  # busy while the iterator is suspended
        it.close()
        # Generation stopped after the two tokens seen.
        self.assertEqual(s.position, 5)
        s.decode(1)
        for i, _piece in enumerate(s.generate(max_tokens=50, ignore_eos=True)):
            if i == 3:
                break
        self.assertEqual(s.position, 10)

    def test_iterator_raises_errors(self):
        s = self.model.new_state()
        with self.assertRaises(FlashnextError) as cm:
            list(s.generate([1, 99999], max_tokens=3))
        self.assertEqual(cm.exception.status, flashnext.ERR_TOKEN_OUT_OF_RANGE)
        self.assertEqual(s.position, 0)
        with self.assertRaises(TypeError):
            s.generate([1], on_token=print)


class TestText(ModelCase):
    def test_tokenize_round_trip(self):
        m = self.model
        for text in ["Hello the world", "h\u00e9llo w\u00f6rld \u2713 \U0001F600", "", "  spaces\n\nand lines\t"]:
            ids = m.tokenize(text)
            self.assertTrue(all(0 <= t < m.vocab_size for t in ids))
            self.assertEqual(m.detokenize(ids), text)
            self.assertEqual(m.tokenize(text.encode("utf-8")), ids)
            self.assertEqual(b"".join(m.token_to_piece(t) for t in ids), text.encode("utf-8"))
        self.assertEqual(m.tokenize(""), [])
        self.assertEqual(m.detokenize([]), "")

    def test_end_of_generation_tokens(self):
        m = self.model
        ends = sorted(m.tokenize(t, parse_special=True)[0] for t in ["<|im_end|>", "<|endoftext|>"])
        self.assertEqual(sorted(m.end_of_generation_tokens()), ends)

    def test_special_tokens(self):
        m = self.model
        end = m.eos_token
        self.assertEqual(m.token_to_piece(end), b"<|im_end|>")
        self.assertEqual(m.token_to_piece(end, special=False), b"")
        plain = m.tokenize("Hi<|im_end|>")
        parsed = m.tokenize("Hi<|im_end|>", parse_special=True)
        self.assertNotIn(end, plain)
        self.assertEqual(parsed[-1], end)
        self.assertEqual(m.detokenize(parsed), "Hi<|im_end|>")
        self.assertEqual(m.detokenize(parsed, remove_special=True), "Hi")
        self.assertEqual(m.tokenize("Hi", add_special=True), m.tokenize("Hi"))  # Qwen adds no BOS

    def test_text_errors(self):
        m = self.model
        with self.assertRaises(FlashnextError) as cm:
            m.tokenize(b"\xff\xfe")
        self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_ARGUMENT)
        for call in (lambda: m.detokenize([1, m.vocab_size]), lambda: m.token_to_piece(-1)):
            with self.assertRaises(FlashnextError) as cm:
                call()
            self.assertEqual(cm.exception.status, flashnext.ERR_TOKEN_OUT_OF_RANGE)
        with self.assertRaises(TypeError):
            m.tokenize(42)

    def test_detokenizer_never_splits_a_character(self):
        m = self.model
        text = "a\U0001F600b\u00e9"
        ids = m.tokenize(text)
        with flashnext.Detokenizer(m) as d:
            parts = [d.push(t) for t in ids]
            self.assertEqual("".join(parts) + d.flush(), text)
            for p in parts:
                p.encode("utf-8")  # whole characters only
            self.assertIn("", parts)  # the emoji's first bytes waited
            # An unfinished character at the end becomes U+FFFD.
            emoji = m.tokenize("\U0001F600")
            self.assertGreater(len(emoji), 1)
            self.assertEqual(d.push(emoji[0]), "")
            self.assertEqual(d.flush(), "\ufffd")
            self.assertEqual(d.flush(), "")
            with self.assertRaises(FlashnextError):
                d.push(m.vocab_size)
        with self.assertRaises(ValueError):
            d.push(1)

    def test_chat_template(self):
        m = self.model
        conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
        text = m.apply_chat_template(conv)
        self.assertEqual(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        )
        self.assertEqual(
            m.apply_chat_template([("user", "Hi there")], add_generation_prompt=False),
            "<|im_start|>user\nHi there<|im_end|>\n",
        )
        self.assertEqual(m.apply_chat_template([], add_generation_prompt=False), "")
        ids = m.tokenize(text, parse_special=True)
        self.assertEqual(ids.count(m.eos_token), 2)
        # Tools and thinking flags reach the template (this simple one ignores them).
        self.assertEqual(
            m.apply_chat_template(conv, tools=[{"type": "function", "function": {"name": "f"}}], enable_thinking=False),
            text,
        )

    def test_chat_template_override_and_size_query(self):
        m = self.model
        long = m.apply_chat_template(
            [("user", "x")], template="{% for i in range(2000) %}{{ messages[0]['content'] }}{% endfor %}"
        )
        self.assertEqual(long, "x" * 2000)  # longer than the first buffer: retried with the size asked for
        with self.assertRaises(FlashnextError) as cm:
            m.apply_chat_template([("user", "x")], template="{% for %}")
        self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_ARGUMENT)
        with self.assertRaises(ValueError):
            m.apply_chat_template([{"content": "no role"}])

    def test_generate_from_a_chat_prompt(self):
        m = self.model
        prompt = m.apply_chat_template([("user", "Hello!")])
        s = m.new_state()
        pieces = []
        tokens = s.generate_tokens(
            prompt, max_tokens=16, sampler=flashnext.Sampler("instruct", seed=1), on_token=lambda t, p: pieces.append(p)
        )
        self.assertEqual(s.position, len(m.tokenize(prompt, parse_special=True)) + len(tokens))
        # The pieces are the tokens' text, whole characters at a time, without
        # special tokens (the <|im_end|> that may stop generation gives none);
        # a character left unfinished at the end is dropped.
        joined = "".join(pieces)
        expected = m.detokenize(tokens, remove_special=True)
        self.assertTrue(expected.startswith(joined), (joined, expected))
        self.assertEqual(expected[len(joined):].strip("\ufffd"), "")
        self.assertTrue(joined, "16 sampled tokens of the tiny model produced no text")

    def test_stop_string(self):
        m = self.model
        prompt = m.tokenize("The")
        ref = m.new_state()
        pieces = []
        tokens = ref.generate_tokens(prompt, max_tokens=20, ignore_eos=True, on_token=lambda t, p: pieces.append(p))
        text = "".join(pieces)
        stop = text.strip()[:2]
        if not stop:
            self.skipTest("the tiny model generated no text to stop on")
        s = m.new_state()
        got = s.generate_tokens(prompt, max_tokens=20, ignore_eos=True, stop_strings=[stop])
        self.assertLessEqual(len(got), 20)
        self.assertEqual(got, tokens[: len(got)])
        self.assertIn(stop, "".join(pieces[: len(got)]))
        self.assertNotIn(stop, "".join(pieces[: len(got) - 1]))


class TestJob(ModelCase):
    def drain(self, job):
        text = ""
        while not job.finished:
            text += job.poll()
        return text

    def test_job_gives_what_generate_gives(self):
        prompt = [10, 20, 30]
        ref = self.model.new_state()
        pieces = []
        tokens = ref.generate_tokens(prompt, max_tokens=16, ignore_eos=True, on_token=lambda t, p: pieces.append(p))
        s = self.model.new_state()
        with s.start(prompt, max_tokens=16, ignore_eos=True) as job:
            self.assertEqual(self.drain(job), "".join(pieces))
            self.assertEqual(job.wait(), len(tokens))
            self.assertEqual(job.n_tokens, len(tokens))
            self.assertEqual(job.poll(), "")
            self.assertTrue(job.finished)
        self.assertEqual(s.position, ref.position)
        self.assertEqual(s.logits(), ref.logits())

    @unittest.skipUnless(HAS_TEXT, "the library has no text functions")
    def test_text_prompt_with_a_sampler(self):
        text = self.model.apply_chat_template([("user", "Hello")])
        ids = self.model.tokenize(text, parse_special=True)
        ref = self.model.new_state()
        with flashnext.Sampler("instruct", seed=3) as sampler:
            want = ref.generate_tokens(ids, max_tokens=12, sampler=sampler)
        s = self.model.new_state()
        with flashnext.Sampler("instruct", seed=3) as sampler:
            job = s.start(text, max_tokens=12, sampler=sampler)
            self.assertEqual(job.wait(), len(want))
            job.close()
        self.assertEqual(s.position, ref.position)

    def test_cancel_busy_and_close(self):
        s = self.model.new_state()
        job = s.start([1, 2, 3], ignore_eos=True)
        with self.assertRaises(FlashnextError) as cm:
            s.decode(4)
        self.assertEqual(cm.exception.status, flashnext.ERR_BUSY)
        self.assertIn("generation job", cm.exception.message)
        job.cancel()
        with self.assertRaises(FlashnextError) as cm:
            job.wait()
        self.assertEqual(cm.exception.status, flashnext.ERR_CANCELLED)
        self.drain(job)
        job.close()
        with self.assertRaises(ValueError):
            job.poll()
        self.assertEqual(s.position, 0)
        s.decode(4)
        # Closing the state cancels and joins a job still running on it.
        s.reset()
        s.start([1, 2, 3], ignore_eos=True)
        s.close()
        self.assertTrue(s.closed)


class TestChatParse(unittest.TestCase):
    REPLY = (
        "Let me see.\n</think>\n\nSure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n{\"oops\"\n</tool_call>"
    )
    TOOLS = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}},
            },
        }
    ]

    def test_whole_reply(self):
        m = flashnext.chat_parse(self.REPLY, tools=self.TOOLS)
        self.assertEqual(m["role"], "assistant")
        self.assertEqual(m["content"], "Sure.")
        self.assertEqual(m["reasoning_content"], "Let me see.")
        call = m["tool_calls"][0]
        self.assertEqual((call["id"], call["type"], call["function"]["name"]), ("call_0", "function", "get_weather"))
        self.assertEqual(json.loads(call["function"]["arguments"]), {"city": "Paris", "days": 3})
        self.assertEqual(len(m["invalid_tool_calls"]), 1)
        self.assertIn("invalid JSON", m["invalid_tool_calls"][0]["error"])
        untyped = flashnext.chat_parse(self.REPLY)
        self.assertEqual(json.loads(untyped["tool_calls"][0]["function"]["arguments"])["days"], "3")
        with self.assertRaises(FlashnextError) as cm:
            flashnext.chat_parse(self.REPLY, tools="{")
        self.assertEqual(cm.exception.status, flashnext.ERR_INVALID_ARGUMENT)

    def test_streaming(self):
        with flashnext.ChatParser(in_reasoning=True) as p:
            segments = []
            for ch in self.REPLY:
                segments += p.push(ch)
            segments += p.finish()
            kinds = {}
            for kind, text in segments:
                kinds[kind] = kinds.get(kind, "") + text
            self.assertEqual(kinds[flashnext.CHAT_REASONING], "Let me see.\n")
            self.assertEqual(kinds[flashnext.CHAT_CONTENT].strip(), "Sure.")
            self.assertEqual(sum(1 for k, _ in segments if k == flashnext.CHAT_TOOL_CALL_END), 2)
            self.assertEqual(p.message(self.TOOLS), flashnext.chat_parse(self.REPLY, tools=self.TOOLS))


if __name__ == "__main__":
    unittest.main()
