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

import math
import numbers
from collections.abc import Mapping

import numpy as np

from .. import _core
from ..errors import ResidentError, ResidentUnavailableError
from .config import CONFIG_KEYS, ResidentConfig, make_config  # noqa: F401 (re-exported)
from .contract import RESIDENT_WEIGHT_FORMATS, residentk_footprint
from .weights import engine_tensor, expected_shapes, random_weights  # noqa: F401 (re-exported)

_c = _core.residentk

WEIGHT_FORMATS = RESIDENT_WEIGHT_FORMATS  # the core's names, in its order


def _resolve_device(device: str, weights: str = "f32") -> str:
    if device not in ("cpu", "cuda", "auto"):
        raise ResidentError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}", 601)
    backend = _core.session.cuda_backend()
    if device == "auto":  # the CUDA engine holds float32 weights only
        return "cuda" if backend["usable"] and weights == "f32" else "cpu"
    if device == "cuda" and not backend["usable"]:
        if backend["kind"] == "none":
            raise ResidentUnavailableError(f"device='cuda': {backend['why']}", 604)
        raise ResidentUnavailableError(
            f"device='cuda': the CUDA backend is built in but this host has no usable CUDA "
            f"device ({backend['why']}); use device='cpu'", 605)
    return device


def _open_engine(cfg: ResidentConfig, max_ctx: int, device: str, weights: str = "f32"):
    if isinstance(max_ctx, bool) or not isinstance(max_ctx, numbers.Integral):
        raise TypeError(f"max_ctx must be an int, got {type(max_ctx).__name__}")
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    factory = (_core.session.cuda_session if _resolve_device(device, weights) == "cuda"
               else _core.session.cpu_session)
    return factory(cfg.d_model, cfg.h_q, cfg.h_kv, cfg.d_head, cfg.d_ff, cfg.n_layers, cfg.vocab,
                   cfg.rms_eps, cfg.rope_theta, cfg.tie_word_embeddings, int(max_ctx),
                   weights=weights)


def _token_ids(ids, vocab: int, what: str) -> np.ndarray:
    a = np.asarray(ids)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"{what} must be a 1-D sequence of integer token ids")
    a = a.astype(np.int64, copy=False)
    if a.size and (a.min() < 0 or a.max() >= vocab):
        bad = int(a[(a < 0) | (a >= vocab)][0])
        raise ResidentError(f"{what}: token id {bad} outside [0, {vocab})", 601)
    return np.ascontiguousarray(a)


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
            raise ResidentError(f"top_k must be >= 1, got {top_k}", 601)
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
            raise TypeError("top_p must be a number or None")
        if not (0.0 < float(top_p) <= 1.0):
            raise ResidentError(f"top_p must lie in (0, 1], got {top_p}", 609)
    if temperature == 0.0:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(seed)

    def pick(logits):
        z = logits.astype(np.float64) / temperature
        order = np.argsort(-z, kind="stable")
        if top_k is not None:
            order = order[: min(int(top_k), vocab)]
        zs = z[order]
        p = np.exp(zs - zs[0])
        p /= p.sum()
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
    shape-checked (607 naming the tensor) and converted as it arrives. With tied embeddings a
    shipped ``lm_head.weight`` is ignored: the embedding table is the head.

    ``weights`` is how the weight matrices are held resident: "f32", "bf16", "f16" (round to
    nearest even; a value past float16's 65504 is refused, 609) or "int8" (per row, blocks of 32
    with one float32 scale each, amax / 127). A bfloat16 checkpoint held as "bf16" keeps its bits.
    Norms, activations, RoPE and the KV cache are float32 in every format. The narrow formats run
    on the CPU engine (device="cuda" refuses them, 607).
    """

    def __init__(self, config, tensors, *, max_ctx: int = 512, device: str = "cpu",
                 weights: str = "f32"):
        # The engine allocates its resident buffers (the KV cache at capacity) up front, so
        # streaming a checkpoint in costs one tensor on top of them, never a second model.
        self._config = make_config(config)
        self._engine = _open_engine(self._config, max_ctx, device, weights)
        self._device = self._engine.device
        self._weights = weights
        tied = self._config.tie_word_embeddings
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        for name, arr in pairs:
            if not isinstance(name, str):
                raise TypeError(f"weight names must be str, got {type(name).__name__}")
            if name == "lm_head.weight" and tied:
                continue  # tied: the embedding table is the head, loaded once
            self._engine.set_weight(name, *engine_tensor(arr))
        missing = self._engine.missing_weights()
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ResidentError(f"weight '{missing[0]}' is missing{more}", 607)

    @classmethod
    def random(cls, d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab, *, max_ctx=512,
               device="cpu", seed=0, rms_eps=1e-6, rope_theta=1_000_000.0,
               tie_word_embeddings=True, weights="f32"):
        """A session over reproducible random weights (see random_weights): benchmarks, tests."""
        cfg = make_config(dict(d_model=d_model, h_q=h_q, h_kv=h_kv, d_head=d_head, d_ff=d_ff,
                               n_layers=n_layers, vocab=vocab, rms_eps=rms_eps,
                               rope_theta=rope_theta, tie_word_embeddings=tie_word_embeddings))
        return cls(cfg, random_weights(cfg, seed), max_ctx=max_ctx, device=device,
                   weights=weights)

    @classmethod
    def from_pretrained(cls, path, *, max_ctx: int = 512, device: str = "cpu", progress=None,
                        weights: str = "f32"):
        """A HuggingFace Qwen3 checkpoint directory (config.json + model.safetensors or a sharded
        index), streamed tensor by tensor into the engine. Every header is checked against
        config.json before the session allocates anything (see algenta.residentk.loader).

        progress: None shows a progress line when stderr is a terminal; True/False force it; a
        callable receives (bytes_done, bytes_total) after each tensor."""
        from .loader import open_checkpoint

        ck = open_checkpoint(path)
        return cls(ck.config, ck.tensors(progress), max_ctx=max_ctx, device=device,
                   weights=weights)

    # -- properties -------------------------------------------------------------------------
    config = property(lambda self: self._config, doc="The ResidentConfig this session holds.")
    device = property(lambda self: self._device, doc="'cpu' or 'cuda'.")
    weights = property(lambda self: self._weights,
                       doc="How the weight matrices are held: 'f32', 'bf16', 'f16' or 'int8'.")
    position = property(lambda self: self._engine.position, doc="Tokens in the KV cache.")
    max_ctx = property(lambda self: self._engine.max_ctx,
                       doc="The capacity the caller asked for (what the context check uses).")
    capacity = property(lambda self: self._engine.capacity,
                        doc="resident_bucket_ctx(max_ctx): KV positions allocated.")
    @property
    def resident_bytes(self) -> int:
        """Bytes this session holds resident: the weights in its format and the float32 KV cache
        at ``capacity``, by the contract ``algenta plan --weights`` uses
        (``residentk_footprint(...)["total_bytes"]``); scratch buffers are not counted."""
        c = self._config
        fp = residentk_footprint(c.d_model, c.h_q, c.h_kv, c.d_head, c.d_ff, c.n_layers, c.vocab,
                                 self.capacity, tied=c.tie_word_embeddings, check_tier=False,
                                 format=self._weights)
        return int(fp["total_bytes"])

    dispatches_per_token = property(
        lambda self: self._engine.dispatches_per_token,
        doc="Parallel stages the last decode step ran, counted by the engine (0 before one); "
            "residentk_dispatch_budget(n_layers) on the standard path.")

    def __repr__(self):
        c = self._config
        return (f"ResidentSession(device={self._device!r}, weights={self._weights!r}, "
                f"d_model={c.d_model}, "
                f"n_layers={c.n_layers}, vocab={c.vocab}, max_ctx={self.max_ctx}, "
                f"capacity={self.capacity}, position={self.position})")

    # -- decoding -----------------------------------------------------------------------------
    def prefill(self, token_ids) -> np.ndarray:
        """Append token_ids at the current position; the last one's logits, float32 [vocab]."""
        ids = _token_ids(token_ids, self._config.vocab, "prefill token_ids")
        if ids.size == 0:
            raise ResidentError("prefill needs at least one token", 601)
        return self._engine.prefill(ids)

    def step(self, token_id) -> np.ndarray:
        """Append one token; its logits, float32 [vocab]. 606 past capacity."""
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise TypeError(f"token_id must be an int, got {type(token_id).__name__}")
        return self._engine.step(int(token_id))

    def reset(self) -> None:
        """Rewind to position 0; the KV cache is kept, not reallocated."""
        self._engine.reset()

    def generate(self, prompt_ids, n_new, *, temperature=0.0, top_k=None, top_p=None, seed=None,
                 stop_ids=(), on_token=None) -> list:
        """n_new ids after prompt_ids, decoded from position 0 (the session is reset first).

        Greedy at temperature 0; otherwise sampled with numpy's default_rng(seed), so a seed
        reproduces a run. Stops early after producing an id in stop_ids (that id included).
        on_token(id) is called as each id is produced. Before any of it,
        residentk_context_check(len(prompt_ids), n_new, max_ctx) must pass (606 otherwise) and
        every argument is validated: a refusal leaves the session untouched.
        """
        ids = _token_ids(prompt_ids, self._config.vocab, "prompt_ids")
        if isinstance(n_new, bool) or not isinstance(n_new, numbers.Integral):
            raise TypeError(f"n_new must be an int, got {type(n_new).__name__}")
        st = _c.residentk_context_check(int(ids.size), int(n_new), self.max_ctx)
        if st != _c.RESIDENT_OK:
            raise ResidentError(
                f"a prompt of {ids.size} tokens plus {n_new} new ones does not fit "
                f"max_ctx={self.max_ctx}", st)
        pick = _sampler(temperature, top_k, top_p, seed, self._config.vocab)
        stop = {int(s) for s in stop_ids}
        if on_token is not None and not callable(on_token):
            raise TypeError("on_token must be callable")
        self.reset()
        out = []
        if n_new == 0:
            return out
        logits = self.prefill(ids)
        # Greedy: the engine forms the argmax (numpy.argmax's order) where the logits are, so on
        # CUDA one id comes back per token instead of vocab logits.
        greedy = float(temperature) == 0.0
        nxt = None
        for i in range(int(n_new)):
            t = pick(logits) if nxt is None else nxt
            out.append(t)
            if on_token is not None:
                on_token(t)
            if t in stop or i + 1 == n_new:
                break
            if greedy:
                nxt = self._engine.step_greedy(t)
            else:
                logits = self._engine.step(t)
        return out
