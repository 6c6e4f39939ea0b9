"""The resident decode session: Qwen3 weights and a fixed-capacity KV cache held for a whole
generation, the cache written in place one slot per token, its cost known before the first one.

``ResidentSession`` is the one Python face of every backend (``cpp/include/algenta/session.hpp``).
The CPU engine (float32, OpenMP) is the reference for the CUDA backend and a fast engine in its
own right. ``device="cuda"`` runs the CUDA engine (cuda/session_cuda.cu) where the build has it
(``-Ccmake.define.ALGENTA_GPU=ON``, or ``ALGENTA_CUDA_EMU=ON`` where its kernels run on the CPU
emulator) and the host a usable device, and refuses with 604/605 otherwise; ``device="auto"``
picks it when it can run. Greedy ``generate`` takes the argmax in the engine (on CUDA, on the
device, copying back one id per token instead of the logits).

Two limits, both fixed when the session opens:

- ``max_ctx``: what the caller asked for. ``generate`` checks
  ``residentk_context_check(len(prompt), n_new, max_ctx)`` before its first token and refuses a
  run that would not fit (606) with the session untouched.
- ``capacity``: ``resident_bucket_ctx(max_ctx)``, the KV positions actually allocated (the next
  power of two, at least 512). ``prefill`` and ``step`` refuse (606) only past it.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Mapping

import numpy as np

from .. import _core
from .._convert import I64_MAX, I64_MIN, as_i64_clamped
from ..errors import ResidentError
from .config import CONFIG_KEYS, ResidentConfig, make_config  # noqa: F401 (re-exported)
from .contract import RESIDENT_KV_FORMATS, RESIDENT_WEIGHT_FORMATS, residentk_footprint
from .weights import engine_tensor, expected_shapes, random_weights  # noqa: F401 (re-exported)
from .weights import EMBED as _EMBED
from .weights import HEAD as _HEAD
from .weights import head_differs, warn_untied_head

_c = _core.residentk

WEIGHT_FORMATS = RESIDENT_WEIGHT_FORMATS  # the core's names, in its order
KV_FORMATS = RESIDENT_KV_FORMATS


def _open_engine(cfg: ResidentConfig, max_ctx: int, device: str, weights: str = "f32",
                 kv: str = "f32", slots: int = 1):
    """The engine of ``device``, its arguments converted: the core checks every value (the shape,
    the scalars, max_ctx, slots, the format names) and refuses device='cuda' where it cannot run
    (604 without a CUDA backend, 605 without a usable device)."""
    if device not in ("cpu", "cuda", "auto"):  # which factory to call: the one choice made here
        raise ResidentError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}", 601)
    if device == "auto":  # every weight format but q4_0 (CPU only so far) runs on either engine
        device = "cuda" if weights != "q4_0" and _core.session.cuda_backend()["usable"] else "cpu"
    # A max_ctx past int64 is clamped to int64's end: the core refuses it as too large (602).
    max_ctx = as_i64_clamped(max_ctx, "max_ctx")
    slots = as_i64_clamped(slots, "slots")
    # A format is a name; anything else names no format, and the core refuses it as one (601).
    weights, kv = (f if isinstance(f, str) else repr(f) for f in (weights, kv))
    dims = (cfg.d_model, cfg.h_q, cfg.h_kv, cfg.d_head, cfg.d_ff, cfg.n_layers, cfg.vocab,
            cfg.rms_eps, cfg.rope_theta, cfg.tie_word_embeddings, max_ctx)
    factory = _core.session.cpu_session if device == "cpu" else _core.session.cuda_session
    return factory(*dims, weights=weights, kv=kv, slots=slots, family=dict(cfg.family))


def _index(value, what: str) -> int:
    """A slot or a position count: an int (TypeError otherwise), clamped to int64, whose value
    the core checks."""
    return as_i64_clamped(value, what)


def _out_of_vocab(what: str, token, vocab: int) -> ResidentError:
    return ResidentError(f"{what}: token id {token} is outside the vocabulary [0, {vocab})", 601)


def _token(token_id, vocab: int, what: str) -> int:
    """One token id as an int64 for the core, which checks it against the vocabulary. An id past
    int64 has no int64 form: refused here (601), as the caller wrote it, never clamped."""
    if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(token_id).__name__}")
    if not I64_MIN <= token_id <= I64_MAX:
        raise _out_of_vocab(what, int(token_id), vocab)
    return int(token_id)


def _token_ids(ids, vocab: int, what: str) -> np.ndarray:
    """ids as C-contiguous int64 for the core, which checks each against the vocabulary; an id
    past int64 is refused here (601) as the caller wrote it, never wrapped (see _token)."""
    try:
        a = np.asarray(ids)
    except ValueError:  # a ragged nest of lists
        raise TypeError(f"{what} must be a 1-D sequence of integer token ids") from None
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise TypeError(f"{what} must be a 1-D sequence of integer token ids")
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype == object:  # Python ints past uint64 (or not ints at all)
        return np.array([_token(v, vocab, what) for v in a.tolist()], dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{what} must be a 1-D sequence of integer token ids, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize == 8:
        past = a > I64_MAX
        if past.any():
            raise _out_of_vocab(what, int(a[past][0]), vocab)
    return np.ascontiguousarray(a, dtype=np.int64)


# What a write from generate()'s on_token is refused with (the core's SessionSealed, a
# RuntimeError: "<call>() " and this).
_ON_TOKEN = ("called from generate()'s on_token on the same session: it would rewrite the KV "
             "cache that generate is decoding from")


def _sampler(temperature, top_k, top_p, seed, vocab):
    """logits -> id. Greedy at temperature 0 (first maximum, as torch.argmax); otherwise softmax
    of logits / temperature in float64, restricted to the top_k largest and then to the smallest
    prefix of the descending order whose mass reaches top_p (transformers' order of warpers)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError("temperature must be a number")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise ResidentError(f"temperature must be finite and >= 0, got {temperature}", 609)
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError("top_k must be an int or None")
        if top_k < 1:
            raise ResidentError(f"top_k must be >= 1 (or None for no limit), got {top_k}", 601)
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
            raise TypeError("top_p must be a number or None")
        if not (0.0 < float(top_p) <= 1.0):
            raise ResidentError(f"top_p must lie in (0, 1] (or None for no limit), got {top_p}",
                                609)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        if seed < 0:
            raise ResidentError(f"seed must be >= 0 (numpy's generators take no negative "
                                f"seed), got {seed}", 601)
    if temperature == 0.0:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(seed)

    def pick(logits):
        # Shift by the maximum before dividing: z - max <= 0, so at any temperature > 0 (a
        # subnormal one too) the quotient is finite or -inf and exp never sees inf - inf. Tiny
        # temperatures thus sample uniformly among the maxima, the limit of the softmax.
        z = logits.astype(np.float64)
        if not np.isfinite(z).all():
            raise ResidentError("the logits hold NaN or infinity: nothing to sample from", 609)
        order = np.argsort(-z, kind="stable")
        if top_k is not None:
            order = order[: min(int(top_k), vocab)]
        zs = z[order]
        with np.errstate(over="ignore", under="ignore"):
            p = np.exp((zs - zs[0]) / temperature)
        p /= p.sum()  # p[0] == 1: the sum is >= 1
        if top_p is not None:
            before = np.cumsum(p) - p
            keep = before < float(top_p)
            order, p = order[keep], p[keep]
            p /= p.sum()
        k = np.searchsorted(np.cumsum(p), rng.random(), side="right")
        return int(order[min(k, len(p) - 1)])

    return pick


class ResidentSession:
    """A Qwen3 decode session whose weights and KV cache stay resident for its whole life.

    ``ResidentSession(config, tensors, *, max_ctx=512, device="cpu", weights="f32")``: config a
    mapping with CONFIG_KEYS, tensors a mapping (or iterable of pairs) of HuggingFace tensor names
    to arrays or torch tensors (a transformers model's ``state_dict()`` works as is), each
    shape-checked (607 naming the tensor) and converted as it arrives; floating-point data only
    (an integer, bool or complex tensor is a TypeError). With tied embeddings the embedding table
    is the head and a shipped ``lm_head.weight`` equal to it is skipped; one that differs is kept
    as a separate head with a ResidentWarning, as transformers keeps it (a stream of pairs, which
    cannot be looked ahead in, is refused then, 607).

    A session holds ``slots`` sequences (default 1), each its own KV region of ``capacity``
    positions, allocated when the session opens. The calls take ``slot=`` (default 0);
    ``step_batch`` advances several slots in one step, reading the weights once for all of
    them, each sequence's logits bit-identical to what it would get alone; ``truncate`` and
    ``copy_prefix`` keep or share a cached prefix (``algenta.residentk.batch`` schedules
    requests over the slots; ``algenta serve`` puts an HTTP API in front of it). Both engines
    hold several; the CUDA engine's session of several slots prefills through decode's own
    kernels, so a prompt's bits do not depend on how it was split or who else ran (see README).

    A session may be shared between threads: every call, and the whole of ``generate`` (on
    slot 0), owns it while it runs, and ``hold()`` owns it for a caller's own block of calls.

    ``weights`` is how the weight matrices are held resident: "f32", "bf16", "f16" (round to
    nearest even; a value past float16's 65504 is refused, 609), "int8" (per row, blocks of 32
    with one float32 scale each, amax / 127) or "q4_0" (llama.cpp's Q4_0: blocks of 32 four-bit
    codes with one float16 scale, by ggml's rule; CPU engine only so far, 604 on CUDA). A
    bfloat16 checkpoint held as "bf16" keeps its bits. Norms, activations and RoPE are float32
    in every format. Every other format runs on both engines, which multiply the same values
    (bf16 activations for bf16 weights, int8 blocks for int8 and q4_0: see README).

    ``kv`` is how the KV cache holds keys and values: "f32", or "bf16" / "f16" (half the
    memory: each value rounded to nearest even once, when its position is written; a float16
    value past 65504 becomes infinity, as in a float16 model). Attention widens them and
    accumulates in float32.
    """

    def __init__(self, config, tensors, *, max_ctx: int = 512, device: str = "cpu",
                 weights: str = "f32", kv: str = "f32", slots: int = 1):
        self._open(make_config(config), tensors, max_ctx, device, weights, kv, check_head=True,
                   slots=slots)

    def _open(self, cfg, tensors, max_ctx, device, weights, kv, check_head, slots=1):
        """check_head=False where the caller knows no conflicting lm_head.weight comes (the
        loader decided the tie from the files; random weights have none), so the stream's
        embedding table is not held for the comparison."""
        tied = cfg.tie_word_embeddings
        if tied and check_head and isinstance(tensors, Mapping) and _HEAD in tensors \
                and _EMBED in tensors and head_differs(tensors[_HEAD], tensors[_EMBED]):
            cfg = ResidentConfig(**{**dict(cfg), "tie_word_embeddings": False})
            tied = False
            warn_untied_head("the tensors given hold", stacklevel=3)
        self._config = cfg
        # The engine allocates its resident buffers (the KV cache at capacity) up front, so
        # streaming a checkpoint in costs one tensor on top of them, never a second model.
        self._engine = _open_engine(cfg, max_ctx, device, weights, kv, slots)
        self._device = self._engine.device
        self._weights = weights
        self._kv = kv
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        # A stream of pairs cannot be looked ahead in: with a tied config, the first of the
        # embedding table and a shipped head is kept (a reference) to compare with the second.
        streamed = tied and check_head and not isinstance(tensors, Mapping)
        first = {}
        for name, arr in pairs:
            if not isinstance(name, str):
                raise TypeError(f"weight names must be str, got {type(name).__name__}")
            if streamed and name in (_HEAD, _EMBED):
                other = first.pop(_EMBED if name == _HEAD else _HEAD, None)
                if other is None:
                    first[name] = arr
                elif head_differs(*((arr, other) if name == _HEAD else (other, arr))):
                    raise ResidentError(
                        "config ties the word embeddings but the lm_head.weight given differs "
                        "from model.embed_tokens.weight; transformers then keeps the two apart, "
                        "which a session fed a stream cannot do after it opened: pass the "
                        "tensors as a mapping, or a config with tie_word_embeddings false", 607)
            if name == _HEAD and tied:
                continue  # tied: the embedding table is the head, loaded once
            self._engine.set_weight(name, *engine_tensor(arr, name))
        missing = self._engine.missing_weights()
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ResidentError(f"weight '{missing[0]}' is missing{more}", 607)

    @classmethod
    def random(cls, d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab, *, max_ctx=512,
               device="cpu", seed=0, rms_eps=1e-6, rope_theta=1_000_000.0,
               tie_word_embeddings=True, weights="f32", kv="f32", slots=1, family=None):
        """A session over reproducible random weights (see random_weights): benchmarks, tests.
        ``family``: a ResidentConfig family dict (``{"arch": "llama"}``, ...; None: Qwen3)."""
        cfg = make_config(dict(d_model=d_model, h_q=h_q, h_kv=h_kv, d_head=d_head, d_ff=d_ff,
                               n_layers=n_layers, vocab=vocab, rms_eps=rms_eps,
                               rope_theta=rope_theta, tie_word_embeddings=tie_word_embeddings,
                               family=family or {}))
        self = cls.__new__(cls)
        self._open(cfg, random_weights(cfg, seed), max_ctx, device, weights, kv, check_head=False,
                   slots=slots)
        return self

    @classmethod
    def from_pretrained(cls, path, *, max_ctx: int = 512, device: str = "cpu", progress=None,
                        weights: str | None = None, kv: str = "f32", slots: int = 1):
        """A HuggingFace checkpoint directory of a family the session computes (Qwen3, Llama,
        Qwen2, Mistral, Gemma 2, Gemma 3 text) (config.json + model.safetensors or a sharded
        index), or a llama.cpp GGUF file (Qwen3, Qwen2, Llama; see algenta.residentk.gguf_model),
        streamed tensor by tensor into the engine. Every header is checked against the config
        before the session allocates anything (see algenta.residentk.loader).

        weights: None holds a directory's matrices as "f32" and a GGUF file's as they are
        stored ("f32", "f16", "bf16", or "int8" for Q8_0); a file of 4-bit or mixed types needs
        one named (607 says so).

        progress: None shows a progress line when stderr is a terminal; True/False force it; a
        callable receives (bytes_done, bytes_total) after each tensor."""
        from .gguf_model import is_gguf, open_gguf
        from .loader import open_checkpoint

        if is_gguf(path):
            ck = open_gguf(path)
            weights = ck.check_format(weights)
        else:
            ck = open_checkpoint(path)  # decides the tie as transformers does (see there)
            weights = "f32" if weights is None else weights
        self = cls.__new__(cls)
        self._open(ck.config, ck.tensors(progress), max_ctx, device, weights, kv,
                   check_head=False, slots=slots)
        return self

    # -- properties -------------------------------------------------------------------------
    config = property(lambda self: self._config, doc="The ResidentConfig this session holds.")
    device = property(lambda self: self._device, doc="'cpu' or 'cuda'.")
    weights = property(lambda self: self._weights,
                       doc="How the weight matrices are held: 'f32', 'bf16', 'f16' or 'int8'.")
    kv = property(lambda self: self._kv,
                  doc="How the KV cache holds keys and values: 'f32', 'bf16' or 'f16'.")
    position = property(lambda self: self._engine.position, doc="Tokens in the KV cache.")
    max_ctx = property(lambda self: self._engine.max_ctx,
                       doc="The capacity the caller asked for (what the context check uses).")
    capacity = property(lambda self: self._engine.capacity,
                        doc="resident_bucket_ctx(max_ctx): KV positions allocated per slot.")
    slots = property(lambda self: self._engine.slots,
                     doc="Sequences the session holds, each its own KV region of capacity.")
    @property
    def resident_bytes(self) -> int:
        """Bytes this session holds resident: the weights in its format and one KV cache at
        ``capacity`` in its format per slot, by the contract ``algenta plan --weights --kv
        --slots`` uses (``weight_bytes + slots * kv_bytes`` of ``residentk_footprint``);
        scratch buffers are not counted."""
        c = self._config
        fp = residentk_footprint(c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers, c.vocab,
                                 self.capacity, tied=c.tie_word_embeddings, check_tier=False,
                                 format=self._weights, kv_format=self._kv, family=c.family)
        return int(fp["weight_bytes"]) + self.slots * int(fp["kv_bytes"])

    dispatches_per_token = property(
        lambda self: self._engine.dispatches_per_token,
        doc="Parallel stages the last decode step ran, counted by the engine (0 before one); "
            "residentk_dispatch_budget(n_layers) on the standard path.")

    def __repr__(self):
        c = self._config
        return (f"ResidentSession(device={self._device!r}, weights={self._weights!r}, "
                f"kv={self._kv!r}, slots={self.slots}, "
                f"d_model={c.d_model}, "
                f"n_layers={c.n_layers}, vocab={c.vocab}, max_ctx={self.max_ctx}, "
                f"capacity={self.capacity}, position={self.position})")

    # -- sharing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self):
        """Own the session for a block of calls: ``with s.hold(): s.reset(); s.prefill(a); ...``.

        The session holds one sequence, so a caller's own sequence of prefill/step/reset calls
        is only its own while no other thread's call can land between them. ``generate`` holds
        the session for its whole run by itself; every call blocks while another thread holds
        it. Reentrant: the holding thread may call any method inside the block (except from
        ``generate``'s ``on_token``, which is refused: it would rewrite the cache that run is
        decoding from). The lock is the engine's own, the one every call takes."""
        eng = self._engine
        eng.lock()  # waits with the GIL released
        try:
            yield self
        finally:
            eng.unlock()

    # -- decoding -----------------------------------------------------------------------------
    # Each call converts its arguments' types and hands them to the engine, which checks every
    # value (slots, token ids, lengths, positions, capacity) before any work.
    def prefill(self, token_ids, *, slot: int = 0) -> np.ndarray:
        """Append token_ids at the slot's position; the last one's logits, float32 [vocab]."""
        return self._engine.prefill_slot(
            _index(slot, "prefill: slot"),
            _token_ids(token_ids, self._config.vocab, "prefill token_ids"))

    def step(self, token_id, *, slot: int = 0) -> np.ndarray:
        """Append one token to the slot; its logits, float32 [vocab]. 606 past capacity."""
        slot = _index(slot, "step: slot")
        token_id = _token(token_id, self._config.vocab, "step token_id")
        if slot == 0:
            return self._engine.step(token_id)
        return self._engine.step_slots(np.array([slot], np.int64),
                                       np.array([token_id], np.int64))[0]

    def step_batch(self, slots, token_ids) -> np.ndarray:
        """One decode step of several sequences: slot ``slots[b]`` appends ``token_ids[b]``;
        logits float32 [len(slots), vocab]. The weights are read once for all of them, and each
        row is bit-identical to what ``step(token_ids[b], slot=slots[b])`` alone would give.
        A slot named twice, or outside [0, slots), is refused (601) before any work; 606 when
        any of them is full."""
        sl = np.array([_index(x, "step_batch: slot") for x in slots], np.int64)
        ids = np.array([_token(t, self._config.vocab, "step_batch token_id") for t in token_ids],
                       np.int64)
        return self._engine.step_slots(sl, ids)

    def slot_position(self, slot: int) -> int:
        """Tokens in the slot's KV cache."""
        return self._engine.slot_position(_index(slot, "slot_position: slot"))

    def truncate(self, n: int, *, slot: int = 0) -> None:
        """Rewind the slot to position n, keeping its first n tokens cached (601 past its
        position)."""
        self._engine.truncate_slot(_index(slot, "truncate: slot"), _index(n, "truncate: n"))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot dst takes the first n cached positions of slot src (their exact bits) and is
        left at position n: a prompt that starts with a prefix another slot holds skips its
        prefill. 601 when n exceeds src's position or src == dst."""
        self._engine.copy_prefix(_index(src, "copy_prefix: src"), _index(dst, "copy_prefix: dst"),
                                 _index(n, "copy_prefix: n"))

    def reset(self, *, slot: int = 0) -> None:
        """Rewind the slot to position 0; the KV cache is kept, not reallocated."""
        slot = _index(slot, "reset: slot")
        if slot == 0:
            self._engine.reset()
        else:
            self._engine.truncate_slot(slot, 0)

    def _prompt(self, prompt_ids, what: str) -> np.ndarray:
        """prompt_ids converted, and checked against the vocabulary by the engine's own check
        before anything changes: for a request whose first engine call comes later (generate
        rewinds first; a scheduler queues it)."""
        ids = _token_ids(prompt_ids, self._config.vocab, what)
        self._engine.check_tokens(ids, what)
        return ids

    def generate(self, prompt_ids, n_new, *, temperature=0.0, top_k=None, top_p=None, seed=None,
                 stop_ids=(), on_token=None) -> list:
        """n_new ids after prompt_ids, decoded from position 0 (the session is reset first).

        Greedy at temperature 0; otherwise sampled with numpy's default_rng(seed), so a seed
        reproduces a run. Stops early after producing an id in stop_ids (that id included).
        on_token(id) is called as each id is produced. Before any of it,
        residentk_context_check(len(prompt_ids), n_new, max_ctx) must pass (606 otherwise) and
        every argument is validated: a refusal leaves the session untouched.

        The whole run holds the session (see hold()): threads sharing one session each get
        their own sequence, one run after another, never tokens decoded from another's cache.
        """
        ids = self._prompt(prompt_ids, "prompt_ids")
        if ids.size == 0:
            raise ResidentError("prompt_ids is empty: generate needs at least one prompt token",
                                601)
        if isinstance(n_new, bool) or not isinstance(n_new, numbers.Integral):
            raise TypeError(f"n_new must be an int, got {type(n_new).__name__}")
        if n_new < 0:
            raise ResidentError(f"n_new must be >= 0, got {n_new}", 601)
        st = _c.residentk_context_check(int(ids.size), as_i64_clamped(n_new, "n_new"),
                                        self.max_ctx)
        if st != _c.RESIDENT_OK:
            raise ResidentError(
                f"a prompt of {ids.size} tokens plus {n_new} new ones does not fit "
                f"max_ctx={self.max_ctx}", st)
        pick = _sampler(temperature, top_k, top_p, seed, self._config.vocab)
        stop = {int(s) for s in stop_ids}
        if on_token is not None and not callable(on_token):
            raise TypeError("on_token must be callable")
        with self.hold():
            return self._decode(ids, int(n_new), pick, float(temperature) == 0.0, stop,
                                on_token)

    def _decode(self, ids, n_new, pick, greedy, stop, on_token) -> list:
        eng = self._engine

        def emit(t):
            # on_token runs while this run holds the session: sealed, the engine refuses its
            # writes (and hold, generate) instead of letting them rewrite the cache decoded from.
            eng.seal(_ON_TOKEN)
            try:
                on_token(t)
            finally:
                eng.seal("")

        eng.reset()
        out = []
        if n_new == 0:
            return out
        logits = eng.prefill(ids)
        # Greedy: the engine forms the argmax (numpy.argmax's order) where the logits are, so on
        # CUDA one id comes back per token instead of vocab logits.
        nxt = None
        for i in range(n_new):
            t = pick(logits) if nxt is None else nxt
            out.append(t)
            if on_token is not None:
                emit(t)
            if t in stop or i + 1 == n_new:
                break
            if greedy:
                nxt = eng.step_greedy(t)
            else:
                logits = eng.step(t)
        return out


