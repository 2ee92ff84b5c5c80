"""ctypes binding of libflashnext, the embeddable Qwen3.8-Flash-Next engine.

Every function of ``include/flashnext.h`` is declared (``_FUNCTIONS``) with
its argument and result types; on top of them:

- :class:`Model`: a loaded GGUF model (context manager).
- :class:`State`: the decode state of one sequence (decode, logits,
  snapshots, copies, generation).
- :class:`Sampler`: a seeded sampler (presets or explicit settings).
- :class:`Detokenizer`: streaming token-to-text conversion.
- :func:`generate`: a generator of text pieces, fed by ``fnx_generate``'s
  callback.
- :class:`Job` (from :meth:`State.start`): a generation on the library's own
  thread, polled without blocking (``fnx_job_*``).
- :func:`chat_parse` and :class:`ChatParser`: a reply split into content,
  reasoning and tool calls (``fnx_chat_parse``, ``fnx_chat_parser_*``).

Failures raise :class:`FlashnextError` carrying the status code, its name and
``fnx_last_error()``'s message.

The library is found, in order, through the environment variable
``FLASHNEXT_LIB`` (the file, or the directory holding it), next to this
package, in the repository's ``target/release`` and ``target/debug``, and on
the system library path.
"""

import atexit
import ctypes
import ctypes.util
import json
import os
import queue
import sys
import threading
from array import array
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    byref,
    c_bool,
    c_char_p,
    c_float,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)

__all__ = [
    "FlashnextError",
    "Model",
    "State",
    "Sampler",
    "Detokenizer",
    "Job",
    "ChatParser",
    "chat_parse",
    "generate",
    "version",
    "status_name",
    "set_log_callback",
    "sampler_params_preset",
    "sampler_params_default",
    "library_path",
]

# --------------------------------------------------------------------------
# Constants (the #defines of flashnext.h, without the FNX_ prefix)
# --------------------------------------------------------------------------

BACKEND_AUTO = 0
BACKEND_CPU = 1
BACKEND_VULKAN = 2

LOG_ERROR = 1
LOG_WARN = 2
LOG_INFO = 3
LOG_DEBUG = 4

SEED_RANDOM = 18446744073709551615

CONSTRAINT_NONE = 0
CONSTRAINT_JSON_SCHEMA = 1
CONSTRAINT_REGEX = 2
CONSTRAINT_LARK = 3

CHAT_TEMPLATE_MAX_BYTES = 4194304

CHAT_NONE = 0
CHAT_CONTENT = 1
CHAT_REASONING = 2
CHAT_TOOL_CALL = 3
CHAT_TOOL_CALL_END = 4

OK = 0
ERR_NULL_ARGUMENT = 1
ERR_INVALID_ARGUMENT = 2
ERR_TOKEN_OUT_OF_RANGE = 3
ERR_CONTEXT_FULL = 4
ERR_BUFFER_TOO_SMALL = 5
ERR_IO = 6
ERR_INVALID_FILE = 7
ERR_INVALID_MODEL = 8
ERR_NO_LOGITS = 9
ERR_MODEL_FREED = 10
ERR_BACKEND_UNAVAILABLE = 11
ERR_OUT_OF_MEMORY = 12
ERR_INTERNAL = 13
ERR_STATE_INVALID = 14
ERR_INVALID_HANDLE = 15
ERR_CANCELLED = 16
ERR_ABORTED = 17
ERR_SNAPSHOT_MISMATCH = 18
ERR_SNAPSHOT_CORRUPT = 19
ERR_BUSY = 20

# --------------------------------------------------------------------------
# Finding the library
# --------------------------------------------------------------------------

if sys.platform == "darwin":
    _LIBNAME = "libflashnext.dylib"
elif sys.platform == "win32":
    _LIBNAME = "flashnext.dll"
else:
    _LIBNAME = "libflashnext.so"


def _candidates():
    env = os.environ.get("FLASHNEXT_LIB")
    if env:
        # An explicit choice: only this one.
        yield os.path.join(env, _LIBNAME) if os.path.isdir(env) else env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, _LIBNAME)
    root = os.path.normpath(os.path.join(here, "..", "..", ".."))
    for profile in ("release", "debug"):
        yield os.path.join(root, "target", profile, _LIBNAME)
    found = ctypes.util.find_library("flashnext")
    if found:
        yield found


def _load_library():
    tried = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
    raise ImportError(
        "flashnext: cannot find %s; set FLASHNEXT_LIB to the library or its directory "
        "(tried: %s)" % (_LIBNAME, ", ".join(tried) or "nothing")
    )


# --------------------------------------------------------------------------
# C types
# --------------------------------------------------------------------------


class _fnx_model(Structure):
    pass


class _fnx_state(Structure):
    pass


class _fnx_sampler(Structure):
    pass


class _fnx_detokenizer(Structure):
    pass


class _fnx_job(Structure):
    pass


class _fnx_chat_parser(Structure):
    pass


_ModelP = POINTER(_fnx_model)
_StateP = POINTER(_fnx_state)
_SamplerP = POINTER(_fnx_sampler)
_DetokenizerP = POINTER(_fnx_detokenizer)
_JobP = POINTER(_fnx_job)
_ChatParserP = POINTER(_fnx_chat_parser)

fnx_status = c_int32

fnx_token_callback = CFUNCTYPE(c_bool, c_int32, c_void_p, c_size_t, c_void_p)
fnx_progress_callback = CFUNCTYPE(c_bool, c_float, c_void_p)
fnx_log_callback = CFUNCTYPE(None, c_int32, c_char_p, c_void_p)
fnx_abort_callback = CFUNCTYPE(c_bool, c_void_p)


class fnx_load_params(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("n_threads", c_uint32),
        ("n_ctx", c_uint32),
        ("backend", c_int32),
        ("device_index", c_int32),
        ("vram_budget_mb", c_uint64),
        ("progress_callback", fnx_progress_callback),
        ("progress_user_data", c_void_p),
        ("expert_cache_slots", c_int32),
        ("rewind_window", c_uint32),
        ("routing_profile", c_char_p),
        ("spin_wait", c_int32),
        ("micro_batch", c_uint32),
    ]


class fnx_generate_params(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("max_tokens", c_uint32),
        ("sampler", _SamplerP),
        ("stop_tokens", POINTER(c_int32)),
        ("n_stop_tokens", c_size_t),
        ("stop_strings", POINTER(c_char_p)),
        ("n_stop_strings", c_size_t),
        ("ignore_eos", c_bool),
    ]


class fnx_sampler_params(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("top_k", c_int32),
        ("seed", c_uint64),
        ("temperature", c_float),
        ("top_p", c_float),
        ("min_p", c_float),
        ("repetition_penalty", c_float),
        ("penalty_last_n", c_int32),
        ("presence_penalty", c_float),
        ("frequency_penalty", c_float),
    ]


class fnx_chat_message(Structure):
    _fields_ = [
        ("role", c_char_p),
        ("content", c_char_p),
        ("reasoning_content", c_char_p),
        ("tool_calls_json", c_char_p),
    ]


_SAMPLER_FIELDS = [name for name, _ in fnx_sampler_params._fields_ if name != "struct_size"]

# Every function of flashnext.h: name -> (restype, argtypes).
_FUNCTIONS = {
    # errors and version
    "fnx_last_error": (c_char_p, []),
    "fnx_version": (c_char_p, []),
    "fnx_status_name": (c_char_p, [fnx_status]),
    "fnx_set_log_callback": (None, [fnx_log_callback, c_void_p]),
    # model
    "fnx_load_params_default": (fnx_load_params, []),
    "fnx_load": (fnx_status, [c_char_p, POINTER(fnx_load_params), POINTER(_ModelP)]),
    "fnx_free_model": (None, [_ModelP]),
    "fnx_model_vocab_size": (c_size_t, [_ModelP]),
    "fnx_model_context_length": (c_size_t, [_ModelP]),
    "fnx_model_n_layers": (c_size_t, [_ModelP]),
    "fnx_model_hidden_size": (c_size_t, [_ModelP]),
    "fnx_model_backend": (c_int32, [_ModelP]),
    "fnx_model_save_routing_profile": (fnx_status, [_ModelP, c_char_p]),
    "fnx_model_eos_token": (c_int64, [_ModelP]),
    # state
    "fnx_new_state": (fnx_status, [_ModelP, POINTER(_StateP)]),
    "fnx_free_state": (None, [_StateP]),
    "fnx_decode_token": (fnx_status, [_StateP, c_int32]),
    "fnx_decode_tokens": (fnx_status, [_StateP, POINTER(c_int32), c_size_t]),
    "fnx_get_logits": (fnx_status, [_StateP, POINTER(c_float), c_size_t]),
    "fnx_decode_batch": (fnx_status, [_StateP, POINTER(c_int32), c_size_t, c_bool]),
    "fnx_get_logits_ith": (fnx_status, [_StateP, c_size_t, POINTER(c_float), c_size_t]),
    "fnx_state_reset": (fnx_status, [_StateP]),
    "fnx_state_position": (c_size_t, [_StateP]),
    "fnx_state_rewind": (fnx_status, [_StateP, c_size_t]),
    "fnx_state_rewind_floor": (fnx_status, [_StateP, POINTER(c_size_t)]),
    "fnx_state_set_abort_callback": (fnx_status, [_StateP, fnx_abort_callback, c_void_p]),
    "fnx_state_copy": (fnx_status, [_StateP, POINTER(_StateP)]),
    "fnx_state_save_size": (fnx_status, [_StateP, POINTER(c_size_t)]),
    "fnx_state_save": (fnx_status, [_StateP, POINTER(c_uint8), c_size_t, POINTER(c_size_t)]),
    "fnx_state_load": (fnx_status, [_StateP, POINTER(c_uint8), c_size_t]),
    # sampler
    "fnx_sampler_params_default": (fnx_sampler_params, []),
    "fnx_sampler_params_preset": (fnx_status, [c_char_p, POINTER(fnx_sampler_params)]),
    "fnx_sampler_new": (fnx_status, [POINTER(fnx_sampler_params), POINTER(_SamplerP)]),
    "fnx_sampler_sample": (fnx_status, [_SamplerP, POINTER(c_float), c_size_t, POINTER(c_int32)]),
    "fnx_sampler_accept": (fnx_status, [_SamplerP, c_int32]),
    "fnx_sampler_reset": (fnx_status, [_SamplerP]),
    "fnx_sampler_set_constraint": (fnx_status, [_SamplerP, _ModelP, c_int32, c_char_p]),
    "fnx_sampler_free": (None, [_SamplerP]),
    # text
    "fnx_tokenize": (
        fnx_status,
        [_ModelP, c_char_p, c_size_t, c_bool, c_bool, POINTER(c_int32), c_size_t, POINTER(c_size_t)],
    ),
    "fnx_model_end_of_generation_tokens": (fnx_status, [_ModelP, POINTER(c_int32), c_size_t, POINTER(c_size_t)]),
    "fnx_token_to_piece": (fnx_status, [_ModelP, c_int32, c_bool, c_char_p, c_size_t, POINTER(c_size_t)]),
    "fnx_detokenize": (
        fnx_status,
        [_ModelP, POINTER(c_int32), c_size_t, c_bool, c_char_p, c_size_t, POINTER(c_size_t)],
    ),
    "fnx_detokenizer_new": (fnx_status, [_ModelP, POINTER(_DetokenizerP)]),
    "fnx_detokenizer_push": (fnx_status, [_DetokenizerP, c_int32, c_char_p, c_size_t, POINTER(c_size_t)]),
    "fnx_detokenizer_flush": (fnx_status, [_DetokenizerP, c_char_p, c_size_t, POINTER(c_size_t)]),
    "fnx_detokenizer_free": (None, [_DetokenizerP]),
    "fnx_apply_chat_template": (
        fnx_status,
        [
            _ModelP,
            c_char_p,
            POINTER(fnx_chat_message),
            c_size_t,
            c_char_p,
            c_bool,
            c_bool,
            c_char_p,
            c_size_t,
            POINTER(c_size_t),
        ],
    ),
    # generation
    "fnx_generate_params_default": (fnx_generate_params, []),
    "fnx_generate": (
        fnx_status,
        [
            _StateP,
            POINTER(c_int32),
            c_size_t,
            POINTER(fnx_generate_params),
            fnx_token_callback,
            c_void_p,
            POINTER(c_size_t),
        ],
    ),
    # jobs
    "fnx_job_start": (
        fnx_status,
        [_StateP, POINTER(c_int32), c_size_t, POINTER(fnx_generate_params), POINTER(_JobP)],
    ),
    "fnx_job_start_text": (
        fnx_status,
        [_StateP, c_char_p, c_size_t, c_bool, POINTER(fnx_generate_params), POINTER(_JobP)],
    ),
    "fnx_job_poll": (
        fnx_status,
        [_JobP, c_char_p, c_size_t, POINTER(c_size_t), POINTER(c_size_t), POINTER(c_bool)],
    ),
    "fnx_job_cancel": (fnx_status, [_JobP]),
    "fnx_job_wait": (fnx_status, [_JobP, POINTER(c_size_t)]),
    "fnx_job_free": (None, [_JobP]),
    # parsed replies
    "fnx_chat_parse": (
        fnx_status,
        [c_char_p, c_size_t, c_bool, c_char_p, c_char_p, c_size_t, POINTER(c_size_t)],
    ),
    "fnx_chat_parser_new": (fnx_status, [c_bool, POINTER(_ChatParserP)]),
    "fnx_chat_parser_push": (fnx_status, [_ChatParserP, c_char_p, c_size_t]),
    "fnx_chat_parser_finish": (fnx_status, [_ChatParserP]),
    "fnx_chat_parser_next": (
        fnx_status,
        [_ChatParserP, POINTER(c_int32), c_char_p, c_size_t, POINTER(c_size_t)],
    ),
    "fnx_chat_parser_message": (fnx_status, [_ChatParserP, c_char_p, c_char_p, c_size_t, POINTER(c_size_t)]),
    "fnx_chat_parser_free": (None, [_ChatParserP]),
}

_lib, _lib_path = _load_library()
_missing = set()
for _name, (_restype, _argtypes) in _FUNCTIONS.items():
    try:
        _f = getattr(_lib, _name)
    except AttributeError:
        _missing.add(_name)
        continue
    _f.restype = _restype
    _f.argtypes = _argtypes
del _name, _restype, _argtypes, _f


def _fn(name):
    """The C function `name`, or an error naming it when this library build lacks it."""
    if name in _missing:
        raise FlashnextError(
            ERR_INVALID_ARGUMENT,
            "FNX_ERR_INVALID_ARGUMENT",
            "%s is not exported by %s (an older library?)" % (name, _lib_path),
        )
    return getattr(_lib, name)


def library_path():
    """The path of the loaded libflashnext."""
    return _lib_path


def version():
    """The library version, e.g. "0.1.0"."""
    return _fn("fnx_version")().decode()


__version__ = version()


def status_name(status):
    """The constant name of a status code, e.g. "FNX_ERR_CONTEXT_FULL"."""
    return _fn("fnx_status_name")(status).decode()


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class FlashnextError(Exception):
    """A failed flashnext call: ``status`` (an ``ERR_*`` code), ``name``
    (e.g. "FNX_ERR_CONTEXT_FULL") and ``message`` (from ``fnx_last_error``)."""

    def __init__(self, status, name, message):
        super().__init__(status, name, message)
        self.status = status
        self.name = name
        self.message = message

    def __str__(self):
        return "%s: %s" % (self.name, self.message)


def _check(status):
    """Raises FlashnextError for a failed status. Must run on the thread that made the call."""
    if status != OK:
        message = (_lib.fnx_last_error() or b"").decode("utf-8", "replace")
        raise FlashnextError(status, status_name(status), message)


def _closed(what):
    return ValueError("the %s is closed" % what)


_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _i32(v, what):
    """`v` as a C int32 argument (ctypes would silently wrap a larger int)."""
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            v = v.__index__()
        except AttributeError:
            raise TypeError("%s must be an integer, not %r" % (what, type(v).__name__)) from None
    if not _I32_MIN <= v <= _I32_MAX:
        raise OverflowError("%s %d does not fit a 32-bit token id" % (what, v))
    return v


def _int32_array(values, what):
    values = [_i32(v, what) for v in values]
    return (c_int32 * len(values))(*values), len(values)


def _float_buffer(values):
    """A (ctypes float array, length) over `values` (array('f') without copying, or any sequence)."""
    if isinstance(values, State):
        values = values.logits()
    if isinstance(values, array) and values.typecode == "f":
        n = len(values)
        if n == 0:
            return (c_float * 0)(), 0
        return (c_float * n).from_buffer(values), n
    try:
        mv = memoryview(values)
    except TypeError:
        mv = None
    if mv is not None and mv.format == "f" and mv.ndim == 1 and mv.contiguous and not mv.readonly:
        return (c_float * len(mv)).from_buffer(mv), len(mv)
    values = list(values)
    return (c_float * len(values))(*values), len(values)


# --------------------------------------------------------------------------
# Log callback
# --------------------------------------------------------------------------

_log_callback_ref = None
_log_lock = threading.Lock()


def set_log_callback(callback):
    """Sends the library's log messages to ``callback(level, message)`` (level
    is one of the ``LOG_*`` constants); ``None`` silences them (the default).
    The callback may run on any thread that uses flashnext; exceptions it
    raises are ignored."""
    global _log_callback_ref
    with _log_lock:
        if callback is None:
            _fn("fnx_set_log_callback")(fnx_log_callback(), None)
            _log_callback_ref = None
            return

        def trampoline(level, message, _user_data):
            try:
                callback(level, (message or b"").decode("utf-8", "replace"))
            except BaseException:  # noqa: B902 - never let an exception reach C
                pass

        ref = fnx_log_callback(trampoline)
        _fn("fnx_set_log_callback")(ref, None)
        _log_callback_ref = ref


def _clear_log_callback_at_exit():
    try:
        if _log_callback_ref is not None:
            _lib.fnx_set_log_callback(fnx_log_callback(), None)
    except Exception:
        pass


atexit.register(_clear_log_callback_at_exit)

# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


class Model:
    """A loaded GGUF model. Use as a context manager, or call :meth:`close`.

    ``progress(fraction) -> bool|None`` is called as the load advances;
    returning False cancels it (``FlashnextError`` with ``ERR_CANCELLED``)."""

    def __init__(
        self,
        path,
        *,
        n_threads=0,
        n_ctx=0,
        backend=BACKEND_AUTO,
        device_index=0,
        vram_budget_mb=0,
        expert_cache_slots=-1,
        rewind_window=0,
        routing_profile=None,
        spin_wait=-1,
        progress=None,
        micro_batch=0,
    ):
        self._h = None
        params = _fn("fnx_load_params_default")()
        params.n_threads = n_threads
        params.n_ctx = n_ctx
        params.backend = backend
        params.device_index = device_index
        params.vram_budget_mb = vram_budget_mb
        params.expert_cache_slots = expert_cache_slots
        params.rewind_window = rewind_window
        params.micro_batch = micro_batch
        profile = None if routing_profile is None else os.fsencode(routing_profile)
        params.routing_profile = profile
        params.spin_wait = spin_wait
        raised = []
        if progress is not None:

            def on_progress(fraction, _user_data):
                if raised:
                    return False
                try:
                    return progress(fraction) is not False
                except BaseException as e:  # noqa: B902 - re-raised after fnx_load
                    raised.append(e)
                    return False

            cb = fnx_progress_callback(on_progress)
            params.progress_callback = cb
        out = _ModelP()
        status = _fn("fnx_load")(os.fsencode(path), byref(params), byref(out))
        if raised:
            raise raised[0]
        _check(status)
        self._h = out
        self.path = os.fspath(path)

    def _handle(self):
        if self._h is None:
            raise _closed("model")
        return self._h

    def close(self):
        """Frees the model. States made from it can then only be freed or reset."""
        h, self._h = self._h, None
        if h is not None:
            _lib.fnx_free_model(h)

    @property
    def closed(self):
        return self._h is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        if self._h is None:
            return "<flashnext.Model closed>"
        return "<flashnext.Model %r vocab=%d layers=%d ctx=%d>" % (
            self.path,
            self.vocab_size,
            self.n_layers,
            self.context_length,
        )

    @property
    def vocab_size(self):
        """Number of logits per token."""
        return _lib.fnx_model_vocab_size(self._handle())

    @property
    def context_length(self):
        """Most positions a state of this model can hold."""
        return _lib.fnx_model_context_length(self._handle())

    @property
    def n_layers(self):
        return _lib.fnx_model_n_layers(self._handle())

    @property
    def hidden_size(self):
        return _lib.fnx_model_hidden_size(self._handle())

    @property
    def backend(self):
        """BACKEND_CPU or BACKEND_VULKAN: where the model computes."""
        return _lib.fnx_model_backend(self._handle())

    def save_routing_profile(self, path):
        """Writes how often each layer chose each expert since the load (for a
        later load's ``routing_profile``); models with an expert cache only."""
        _check(_fn("fnx_model_save_routing_profile")(self._handle(), os.fsencode(path)))

    @property
    def eos_token(self):
        """The end-of-sequence token id, or None when the file names none."""
        t = _lib.fnx_model_eos_token(self._handle())
        return None if t < 0 else t

    def new_state(self):
        """A new, empty :class:`State` of this model."""
        return State(self)

    # tokenize, token_to_piece, detokenize and apply_chat_template are
    # defined in the "Text" section below.


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------


class State:
    """The decode state of one sequence. Use from one thread at a time."""

    def __init__(self, model, _handle=None):
        self.model = model
        self._h = None
        self._busy = False
        self._abort_ref = None
        self._abort_raised = []
        self._job = None
        if _handle is None:
            out = _StateP()
            _check(_fn("fnx_new_state")(model._handle(), byref(out)))
            _handle = out
        self._h = _handle
        self._vocab = model.vocab_size

    def _handle(self):
        if self._h is None:
            raise _closed("state")
        if self._busy:
            raise RuntimeError("the state is generating (an unfinished generate() iterator?); finish or close it first")
        return self._h

    def _call(self, func, *args):
        """Calls `func(handle, *args)`, re-raising an exception from the abort callback."""
        h = self._handle()
        del self._abort_raised[:]
        status = func(h, *args)
        if self._abort_raised:
            e = self._abort_raised[0]
            del self._abort_raised[:]
            raise e
        _check(status)

    def close(self):
        """Frees the state; a job still running on it is cancelled and joined first."""
        if self._job is not None:
            self._job.close()
        h, self._h = self._h, None
        if h is not None:
            _lib.fnx_free_state(h)
        self._abort_ref = None

    @property
    def closed(self):
        return self._h is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        if self._h is None:
            return "<flashnext.State closed>"
        return "<flashnext.State position=%d>" % self.position

    @property
    def position(self):
        """Number of tokens decoded so far (the next token's position)."""
        return _lib.fnx_state_position(self._handle())

    def __len__(self):
        return self.position

    def decode(self, token):
        """Decodes one token at the next position."""
        self._call(_fn("fnx_decode_token"), _i32(token, "token"))

    def decode_tokens(self, tokens):
        """Decodes a sequence of tokens (all or nothing)."""
        buf, n = _int32_array(tokens, "tokens")
        self._call(_fn("fnx_decode_tokens"), buf, n)

    def decode_batch(self, tokens, all_logits=False):
        """Decodes a sequence of tokens (all or nothing); with ``all_logits``
        every position's logits are kept for :meth:`logits_ith`."""
        buf, n = _int32_array(tokens, "tokens")
        self._call(_fn("fnx_decode_batch"), buf, n, bool(all_logits))

    def logits(self, as_list=False):
        """The last decoded token's logits as an ``array('f')`` (or a list)."""
        return self._logits(_fn("fnx_get_logits"), (), as_list)

    def logits_ith(self, i, as_list=False):
        """The logits after the ``i``-th token of the last decoding call."""
        return self._logits(_fn("fnx_get_logits_ith"), (i,), as_list)

    def _logits(self, func, args, as_list):
        h = self._handle()
        n = self._vocab
        out = array("f", bytes(4 * n))
        buf = (c_float * n).from_buffer(out)
        status = func(h, *args, buf, n)
        del buf
        _check(status)
        return out.tolist() if as_list else out

    def reset(self):
        """Forgets the sequence (position 0); also clears an unusable state."""
        self._call(_fn("fnx_state_reset"))

    def rewind(self, position):
        """Returns to ``position`` (from :attr:`rewind_floor` to :attr:`position`)
        without copying anything; later tokens are forgotten."""
        self._call(_fn("fnx_state_rewind"), position)

    @property
    def rewind_floor(self):
        """The earliest position :meth:`rewind` can return to now."""
        out = c_size_t()
        self._call(_fn("fnx_state_rewind_floor"), byref(out))
        return out.value

    def save(self):
        """A snapshot of the state as bytes (for :meth:`load`)."""
        h = self._handle()
        size = c_size_t()
        _check(_fn("fnx_state_save_size")(h, byref(size)))
        buf = (c_uint8 * size.value)()
        written = c_size_t()
        _check(_fn("fnx_state_save")(h, buf, size.value, byref(written)))
        return ctypes.string_at(buf, written.value)

    def load(self, snapshot):
        """Replaces the state's contents with a snapshot from :meth:`save`."""
        data = bytes(snapshot)
        buf = (c_uint8 * len(data)).from_buffer_copy(data)
        self._call(_fn("fnx_state_load"), buf, len(data))

    def copy(self):
        """An independent copy (same model, same sequence; no abort callback)."""
        out = _StateP()
        _check(_fn("fnx_state_copy")(self._handle(), byref(out)))
        return State(self.model, _handle=out)

    __copy__ = copy

    def set_abort_callback(self, callback):
        """``callback() -> bool`` is polled before every decoded token; True
        aborts the call (``ERR_ABORTED``, state unchanged). An exception it
        raises aborts too and is re-raised. None removes it."""
        if callback is None:
            self._call(_fn("fnx_state_set_abort_callback"), fnx_abort_callback(), None)
            self._abort_ref = None
            return
        raised = self._abort_raised

        def trampoline(_user_data):
            if raised:
                return True
            try:
                return bool(callback())
            except BaseException as e:  # noqa: B902 - re-raised by _call
                raised.append(e)
                return True

        ref = fnx_abort_callback(trampoline)
        self._call(_fn("fnx_state_set_abort_callback"), ref, None)
        self._abort_ref = ref

    def _prompt_ids(self, prompt):
        if isinstance(prompt, str):
            return self.model.tokenize(prompt, parse_special=True)
        return list(prompt)

    def generate_tokens(
        self,
        prompt=(),
        *,
        max_tokens=0,
        sampler=None,
        stop_tokens=(),
        stop_strings=(),
        ignore_eos=False,
        on_token=None,
    ):
        """Decodes ``prompt`` (token ids, or text tokenized with special
        tokens parsed), then generates until ``max_tokens`` (0 = no limit), a
        stop token (and the model's EOS unless ``ignore_eos``), a stop string,
        ``on_token(token, piece)`` returning False, or a full context. Returns
        the generated token ids. An exception raised by ``on_token`` stops
        generation and is re-raised (the tokens stay decoded)."""
        h = self._handle()
        prompt_buf, n_prompt = _int32_array(self._prompt_ids(prompt), "prompt")
        params = _fn("fnx_generate_params_default")()
        params.max_tokens = max_tokens
        if sampler is not None:
            params.sampler = sampler._handle()
        stop_buf, params.n_stop_tokens = _int32_array(stop_tokens, "stop_tokens")
        params.stop_tokens = stop_buf
        encoded = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in stop_strings]
        strings = (c_char_p * len(encoded))(*encoded)
        params.stop_strings = strings
        params.n_stop_strings = len(encoded)
        params.ignore_eos = ignore_eos

        tokens = []
        raised = []

        def trampoline(token, piece, piece_len, _user_data):
            tokens.append(token)
            if on_token is None:
                return True
            try:
                text = ctypes.string_at(piece, piece_len).decode("utf-8", "replace") if piece_len else ""
                return on_token(token, text) is not False
            except BaseException as e:  # noqa: B902 - re-raised after fnx_generate
                raised.append(e)
                return False

        cb = fnx_token_callback(trampoline)
        n_generated = c_size_t()
        del self._abort_raised[:]
        self._busy = True
        if sampler is not None:
            sampler._busy = True
        try:
            status = _fn("fnx_generate")(h, prompt_buf, n_prompt, byref(params), cb, None, byref(n_generated))
        finally:
            self._busy = False
            if sampler is not None:
                sampler._busy = False
        if self._abort_raised:
            e = self._abort_raised[0]
            del self._abort_raised[:]
            raise e
        _check(status)
        if raised:
            raise raised[0]
        assert len(tokens) == n_generated.value, (len(tokens), n_generated.value)
        return tokens

    def start(
        self,
        prompt=(),
        *,
        max_tokens=0,
        sampler=None,
        stop_tokens=(),
        stop_strings=(),
        ignore_eos=False,
        parse_special=True,
    ):
        """Starts generating on the library's own thread and returns a
        :class:`Job` at once (``fnx_job_start``): ``prompt`` is token ids, or
        text (tokenized by the library; ``parse_special`` turns special-token
        text such as ``<|im_start|>`` into those tokens). Options as for
        :meth:`generate_tokens`. While the job runs the state (and the
        sampler) are the job's: other calls on them raise ``ERR_BUSY``."""
        h = self._handle()
        params = _fn("fnx_generate_params_default")()
        params.max_tokens = max_tokens
        if sampler is not None:
            params.sampler = sampler._handle()
        stop_buf, params.n_stop_tokens = _int32_array(stop_tokens, "stop_tokens")
        params.stop_tokens = stop_buf
        encoded = [x.encode("utf-8") if isinstance(x, str) else bytes(x) for x in stop_strings]
        strings = (c_char_p * len(encoded))(*encoded)
        params.stop_strings = strings
        params.n_stop_strings = len(encoded)
        params.ignore_eos = ignore_eos
        out = _JobP()
        if isinstance(prompt, (str, bytes)):
            data = _text_bytes(prompt, "prompt")
            _check(_fn("fnx_job_start_text")(h, data, len(data), parse_special, byref(params), byref(out)))
        else:
            buf, n = _int32_array(prompt, "prompt")
            _check(_fn("fnx_job_start")(h, buf, n, byref(params), byref(out)))
        job = Job(out, self, sampler)
        self._job = job
        if sampler is not None:
            sampler._job = job
        return job

    def generate(self, prompt=(), **options):
        """Like :meth:`generate_tokens`, as an iterator of the generated text
        pieces (``str``), streamed from ``fnx_generate``'s callback. Stopping
        the iteration early (``break``, ``close()``) stops generation after
        the last token seen. While the iterator is unfinished the state (and
        the sampler) cannot be used otherwise."""
        if "on_token" in options:
            raise TypeError("generate() streams the pieces itself; use generate_tokens(on_token=...)")
        return _stream(self, prompt, options)


_PIECE, _DONE, _ERROR = 0, 1, 2


def _stream(state, prompt, options):
    # fnx_generate runs on a worker thread; each callback hands its piece to
    # this generator and waits for the consumer to ask for the next one, so
    # generation never runs ahead of the iteration.
    state._handle()  # fail early on a closed or busy state
    to_consumer = queue.Queue()
    to_worker = queue.Queue()

    def on_token(_token, piece):
        to_consumer.put((_PIECE, piece))
        return to_worker.get()

    def work():
        try:
            state.generate_tokens(prompt, on_token=on_token, **options)
            to_consumer.put((_DONE, None))
        except BaseException as e:  # noqa: B902 - handed to the consumer
            to_consumer.put((_ERROR, e))

    thread = threading.Thread(target=work, name="flashnext-generate", daemon=True)
    thread.start()
    waiting = False  # the worker waits for an answer to its last piece
    try:
        while True:
            kind, value = to_consumer.get()
            if kind == _PIECE:
                waiting = True
                yield value
                waiting = False
                to_worker.put(True)
            elif kind == _DONE:
                return
            else:
                raise value
    finally:
        if waiting:
            to_worker.put(False)
            while True:
                kind, _value = to_consumer.get()
                if kind != _PIECE:
                    break
                to_worker.put(False)
        thread.join()


def generate(state, prompt=(), **options):
    """Generates on ``state`` and yields the text pieces: see :meth:`State.generate`."""
    return state.generate(prompt, **options)


# --------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------


def _params_dict(p):
    return {name: getattr(p, name) for name in _SAMPLER_FIELDS}


def sampler_params_default():
    """The default sampler settings as a dict."""
    return _params_dict(_fn("fnx_sampler_params_default")())


def sampler_params_preset(name):
    """A named preset ("thinking", "instruct", "greedy") as a dict."""
    p = fnx_sampler_params()
    _check(_fn("fnx_sampler_params_preset")(name.encode(), byref(p)))
    return _params_dict(p)


class Sampler:
    """Chooses tokens from logits: ``Sampler("instruct", seed=42)`` or
    ``Sampler(temperature=0.8, top_k=40)``. Settings not given come from the
    preset (or the defaults); ``seed=None`` keeps a random seed."""

    def __init__(self, preset=None, **settings):
        self._h = None
        self._busy = False
        self._job = None
        if preset is None:
            p = _fn("fnx_sampler_params_default")()
        else:
            p = fnx_sampler_params()
            _check(_fn("fnx_sampler_params_preset")(preset.encode(), byref(p)))
        for name, value in settings.items():
            if name not in _SAMPLER_FIELDS:
                raise TypeError("unknown sampler setting %r (expected one of %s)" % (name, ", ".join(_SAMPLER_FIELDS)))
            if name == "seed" and value is None:
                value = SEED_RANDOM
            setattr(p, name, value)
        out = _SamplerP()
        _check(_fn("fnx_sampler_new")(byref(p), byref(out)))
        self._h = out
        self.params = _params_dict(p)

    def _handle(self):
        if self._h is None:
            raise _closed("sampler")
        if self._busy:
            raise RuntimeError("the sampler is in use by an unfinished generate() iterator")
        return self._h

    def close(self):
        """Frees the sampler; a job still running with it is cancelled and joined first."""
        if self._job is not None:
            self._job.close()
        h, self._h = self._h, None
        if h is not None:
            _lib.fnx_sampler_free(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def sample(self, logits):
        """Draws a token id from ``logits`` (an ``array('f')``, a sequence of
        floats, or a :class:`State`, whose current logits are used). Does not
        accept it."""
        buf, n = _float_buffer(logits)
        out = c_int32()
        status = _fn("fnx_sampler_sample")(self._handle(), buf, n, byref(out))
        del buf
        _check(status)
        return out.value

    def accept(self, token):
        """Records ``token`` for the repetition/presence/frequency penalties."""
        _check(_fn("fnx_sampler_accept")(self._handle(), _i32(token, "token")))

    def reset(self):
        """Forgets accepted tokens and restarts the generator (and the
        constraint's grammar) from the start."""
        _check(_fn("fnx_sampler_reset")(self._handle()))

    def set_constraint(self, model, kind=CONSTRAINT_NONE, text=None, *, json_schema=None, regex=None, lark=None):
        """Structured output: the sampled tokens follow a grammar compiled for
        ``model``'s vocabulary. Either ``kind`` (``CONSTRAINT_JSON_SCHEMA``,
        ``CONSTRAINT_REGEX``, ``CONSTRAINT_LARK``) and ``text``, or one of the
        keywords ``json_schema`` (a ``dict`` or JSON text), ``regex`` or
        ``lark``. ``CONSTRAINT_NONE`` (no arguments) removes the constraint.
        A bad schema or grammar raises :class:`FlashnextError`
        (``ERR_INVALID_ARGUMENT``) and leaves the sampler unchanged."""
        given = [(k, v) for k, v in ((CONSTRAINT_JSON_SCHEMA, json_schema), (CONSTRAINT_REGEX, regex), (CONSTRAINT_LARK, lark)) if v is not None]
        if len(given) > 1 or (given and (kind != CONSTRAINT_NONE or text is not None)):
            raise TypeError("set_constraint: give kind and text, or one of json_schema, regex, lark")
        if given:
            kind, text = given[0]
        if kind == CONSTRAINT_JSON_SCHEMA and not isinstance(text, (str, bytes)) and text is not None:
            text = json.dumps(text)
        if isinstance(text, str):
            text = text.encode("utf-8")
        m = None if model is None else model._handle()
        _check(_fn("fnx_sampler_set_constraint")(self._handle(), m, _i32(kind, "kind"), text))


# --------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------


def _sized_call(call, make_buffer, first_capacity):
    """Runs ``call(buffer, capacity, byref(out_len))`` with the C API's size
    query: on ERR_BUFFER_TOO_SMALL ``out_len`` holds the size needed, and the
    call is made again with that much room. Returns (buffer, length)."""
    capacity = max(int(first_capacity), 1)
    for _ in range(4):
        buf = make_buffer(capacity)
        n = c_size_t()
        status = call(buf, capacity, byref(n))
        if status == ERR_BUFFER_TOO_SMALL and n.value > capacity:
            capacity = n.value
            continue
        _check(status)
        return buf, n.value
    raise AssertionError("flashnext: the output size kept growing")  # pragma: no cover


def _text_bytes(text, what):
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError("%s must be str or bytes, not %r" % (what, type(text).__name__))


def _optional_json(value):
    if value is None:
        return None
    if isinstance(value, (bytes, str)):
        return _text_bytes(value, "JSON")
    return json.dumps(value).encode("utf-8")


def _tokenize(self, text, add_special=False, parse_special=False):
    """The token ids of ``text`` (str, or UTF-8 bytes). ``add_special`` adds
    the BOS/EOS tokens the model asks for (Qwen: none); ``parse_special`` turns
    special-token text such as ``<|im_start|>`` into those tokens (leave it
    off for untrusted text)."""
    data = _text_bytes(text, "text")
    h = self._handle()
    buf, n = _sized_call(
        lambda out, cap, n_out: _fn("fnx_tokenize")(h, data, len(data), add_special, parse_special, out, cap, n_out),
        lambda cap: (c_int32 * cap)(),
        len(data) + 8,
    )
    return buf[:n]


def _end_of_generation_tokens(self):
    """The tokens that end a reply (end of sequence, end of turn), for a
    decode loop of your own; ``generate`` stops on them by itself."""
    h = self._handle()
    buf, n = _sized_call(
        lambda out, cap, n_out: _fn("fnx_model_end_of_generation_tokens")(h, out, cap, n_out),
        lambda cap: (c_int32 * cap)(),
        4,
    )
    return buf[:n]


def _token_to_piece(self, token, special=True):
    """The bytes of one token (possibly part of a UTF-8 character); special
    tokens give their text only when ``special``."""
    h = self._handle()
    buf, n = _sized_call(
        lambda out, cap, n_out: _fn("fnx_token_to_piece")(h, _i32(token, "token"), special, out, cap, n_out),
        ctypes.create_string_buffer,
        32,
    )
    return buf.raw[:n]


def _detokenize(self, tokens, remove_special=False):
    """The text of ``tokens`` (invalid UTF-8 becomes U+FFFD);
    ``remove_special`` leaves special tokens out."""
    ids, count = _int32_array(tokens, "tokens")
    h = self._handle()
    buf, n = _sized_call(
        lambda out, cap, n_out: _fn("fnx_detokenize")(h, ids, count, remove_special, out, cap, n_out),
        ctypes.create_string_buffer,
        8 * count + 16,
    )
    return buf.raw[:n].decode("utf-8")


def _message(m, i):
    """(role, content, reasoning_content, tool_calls_json) of one message."""
    if isinstance(m, dict):
        role = m.get("role")
        content = m.get("content")
        reasoning = m.get("reasoning_content")
        tool_calls = m.get("tool_calls")
    else:
        role, content = m
        reasoning = tool_calls = None
    if role is None:
        raise ValueError("messages[%d] has no role" % i)
    return (
        _text_bytes(role, "role"),
        None if content is None else _text_bytes(content, "content"),
        None if reasoning is None else _text_bytes(reasoning, "reasoning_content"),
        _optional_json(tool_calls),
    )


def _apply_chat_template(
    self,
    messages,
    add_generation_prompt=True,
    *,
    tools=None,
    enable_thinking=True,
    template=None,
):
    """Renders a conversation with the model's chat template (or
    ``template``, Jinja source), like transformers' ``apply_chat_template``.
    ``messages``: dicts with "role", "content" and optionally
    "reasoning_content" and "tool_calls" (a list, or a JSON string), or
    (role, content) pairs. ``tools``: tool schemas (a list, or a JSON
    string). Returns the text (tokenize it with ``parse_special=True``)."""
    fields = [_message(m, i) for i, m in enumerate(messages)]
    arr = (fnx_chat_message * len(fields))(*[fnx_chat_message(*f) for f in fields])
    tools_json = _optional_json(tools)
    tmpl = None if template is None else _text_bytes(template, "template")
    h = self._handle()
    buf, n = _sized_call(
        lambda out, cap, n_out: _fn("fnx_apply_chat_template")(
            h, tmpl, arr, len(fields), tools_json, add_generation_prompt, enable_thinking, out, cap, n_out
        ),
        ctypes.create_string_buffer,
        # The buffer's size is also the most the C API lets the text take
        # (when it is above CHAT_TEMPLATE_MAX_BYTES): leave room.
        2 * (sum(len(f[1] or b"") for f in fields) + len(tools_json or b"")) + 256,
    )
    return buf.raw[:n].decode("utf-8")


Model.tokenize = _tokenize
Model.end_of_generation_tokens = _end_of_generation_tokens
Model.token_to_piece = _token_to_piece
Model.detokenize = _detokenize
Model.apply_chat_template = _apply_chat_template


class Detokenizer:
    """Turns a stream of tokens into text without splitting UTF-8
    characters: :meth:`push` returns the text completed by each token,
    :meth:`flush` what is left at the end (and starts a new stream).
    Special tokens are rendered. One thread at a time."""

    def __init__(self, model):
        self.model = model
        self._h = None
        out = _DetokenizerP()
        _check(_fn("fnx_detokenizer_new")(model._handle(), byref(out)))
        self._h = out

    def _handle(self):
        if self._h is None:
            raise _closed("detokenizer")
        return self._h

    def push(self, token):
        """Adds a token; returns the text now complete (possibly "")."""
        h = self._handle()
        buf, n = _sized_call(
            lambda out, cap, n_out: _fn("fnx_detokenizer_push")(h, _i32(token, "token"), out, cap, n_out),
            ctypes.create_string_buffer,
            64,
        )
        return buf.raw[:n].decode("utf-8")

    def flush(self):
        """Ends the stream: returns what was held back (an unfinished character as U+FFFD)."""
        h = self._handle()
        buf, n = _sized_call(
            lambda out, cap, n_out: _fn("fnx_detokenizer_flush")(h, out, cap, n_out),
            ctypes.create_string_buffer,
            16,
        )
        return buf.raw[:n].decode("utf-8")

    def close(self):
        h, self._h = self._h, None
        if h is not None:
            _lib.fnx_detokenizer_free(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------


class Job:
    """A generation running on the library's own thread (from
    :meth:`State.start`). :meth:`poll` never blocks; :meth:`cancel` stops it
    before its next token (the state then is as before the job);
    :meth:`wait` blocks until it ends. Closing it (or the state, or the
    sampler) cancels it if it still runs and waits for it."""

    def __init__(self, handle, state, sampler):
        self._h = handle
        self.state = state
        self.sampler = sampler
        self.finished = False
        self.n_tokens = 0

    def _handle(self):
        if self._h is None:
            raise _closed("job")
        return self._h

    def poll(self):
        """The text generated since the last poll ("" when nothing is new).
        Updates :attr:`finished` (the job ended and all its text was taken)
        and :attr:`n_tokens`."""
        h = self._handle()
        chunks = []
        cap = 4096
        buf = ctypes.create_string_buffer(cap)
        n, n_tokens, finished = c_size_t(), c_size_t(), c_bool()
        while True:
            _check(_fn("fnx_job_poll")(h, buf, cap, byref(n), byref(n_tokens), byref(finished)))
            chunks.append(buf.raw[: n.value])
            if n.value + 4 <= cap:
                break
        self.n_tokens = n_tokens.value
        self.finished = finished.value
        return b"".join(chunks).decode("utf-8")

    def cancel(self):
        """Asks the job to stop before its next token; returns at once."""
        _check(_fn("fnx_job_cancel")(self._handle()))

    def wait(self):
        """Blocks until the job ends; returns the number of generated tokens,
        or raises its failure (``ERR_CANCELLED`` after :meth:`cancel`)."""
        h = self._handle()
        n = c_size_t()
        _check(_fn("fnx_job_wait")(h, byref(n)))
        return n.value

    def close(self):
        """Frees the job, cancelling it and waiting for it if it still runs."""
        h, self._h = self._h, None
        if h is not None:
            _lib.fnx_job_free(h)
        for owner in (self.state, self.sampler):
            if owner is not None and owner._job is self:
                owner._job = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------
# Parsed replies
# --------------------------------------------------------------------------


def chat_parse(reply, in_reasoning=False, tools=None):
    """Splits a reply of a Qwen-family model into a dict in the shape of an
    OpenAI chat message: "content", "reasoning_content", "tool_calls"
    (``[{"id", "type": "function", "function": {"name", "arguments"}}]``,
    arguments a JSON string) and, when some could not be read,
    "invalid_tool_calls" (``[{"raw", "error"}]``). ``in_reasoning``: the
    prompt opened a think block. ``tools``: the tool schemas (a list or JSON
    text) that type the parameters."""
    data = _text_bytes(reply, "reply")
    tools_json = _optional_json(tools)
    buf, n = _sized_call(
        lambda out, cap, n_out: _fn("fnx_chat_parse")(data, len(data), in_reasoning, tools_json, out, cap, n_out),
        ctypes.create_string_buffer,
        len(data) + 256,
    )
    return json.loads(buf.raw[:n].decode("utf-8"))


class ChatParser:
    """Splits a reply into content, reasoning and tool calls as its pieces
    arrive: :meth:`push` returns ``(kind, text)`` pairs, kind one of
    ``CHAT_CONTENT``, ``CHAT_REASONING``, ``CHAT_TOOL_CALL``,
    ``CHAT_TOOL_CALL_END``; :meth:`message` the whole message as
    :func:`chat_parse` gives it."""

    def __init__(self, in_reasoning=False):
        self._h = None
        out = _ChatParserP()
        _check(_fn("fnx_chat_parser_new")(in_reasoning, byref(out)))
        self._h = out

    def _handle(self):
        if self._h is None:
            raise _closed("chat parser")
        return self._h

    def _take(self):
        h = self._handle()
        out = []
        while True:
            kind = c_int32()
            buf, n = _sized_call(
                lambda b, cap, n_out: _fn("fnx_chat_parser_next")(h, byref(kind), b, cap, n_out),
                ctypes.create_string_buffer,
                256,
            )
            if kind.value == CHAT_NONE:
                return out
            out.append((kind.value, buf.raw[:n].decode("utf-8")))

    def push(self, piece):
        """Adds a piece of the reply; returns the segments it completes."""
        data = _text_bytes(piece, "piece")
        _check(_fn("fnx_chat_parser_push")(self._handle(), data, len(data)))
        return self._take()

    def finish(self):
        """Ends the reply; returns the segments still held back."""
        _check(_fn("fnx_chat_parser_finish")(self._handle()))
        return self._take()

    def message(self, tools=None):
        """The message read so far, as :func:`chat_parse` gives it."""
        h = self._handle()
        tools_json = _optional_json(tools)
        buf, n = _sized_call(
            lambda out, cap, n_out: _fn("fnx_chat_parser_message")(h, tools_json, out, cap, n_out),
            ctypes.create_string_buffer,
            256,
        )
        return json.loads(buf.raw[:n].decode("utf-8"))

    def close(self):
        h, self._h = self._h, None
        if h is not None:
            _lib.fnx_chat_parser_free(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
