"""The resident decode session: Qwen3 weights and a fixed-capacity KV cache held for a whole
generation, the cache written in place one slot per token, its cost known before the first one.

``ResidentSession`` is the one Python face of every backend (``cpp/include/algenta/session.hpp``).
The CPU engine (float32, OpenMP) is the reference for the CUDA backend and a fast engine in its
own right. ``device="cuda"`` runs the CUDA engine (cuda/session_cuda.cu) where the build has it
(``-Ccmake.define.ALGENTA_GPU=ON``) and the host a usable device, and refuses with 604/605
otherwise; ``device="auto"`` picks it when it can run. On CUDA, greedy ``generate`` takes the
argmax on the device and copies back one id per token.

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
from collections.abc import Iterable, Mapping

import numpy as np

from .. import _core
from .._records import record_type
from ..errors import ResidentError, ResidentUnavailableError

_c = _core.residentk

CONFIG_KEYS = ("d_model", "h_q", "h_kv", "d_head", "d_ff", "n_layers", "vocab", "rms_eps",
               "rope_theta", "tie_word_embeddings")
ResidentConfig = record_type(
    "ResidentConfig", CONFIG_KEYS,
    "The shape and scalars of a Qwen3 model as a resident session holds it (d_head need not "
    "equal d_model / h_q).")

_DEFAULTS = {"rms_eps": 1e-6, "rope_theta": 1_000_000.0, "tie_word_embeddings": True}
_INT_KEYS = CONFIG_KEYS[:7]


def make_config(config) -> ResidentConfig:
    """A ResidentConfig from a mapping with CONFIG_KEYS (rms_eps, rope_theta and
    tie_word_embeddings default to Qwen3's 1e-6, 1e6 and True)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping with keys {CONFIG_KEYS}, "
                        f"got {type(config).__name__}")
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise TypeError(f"unknown config keys {sorted(unknown)}; expected {CONFIG_KEYS}")
    items = {}
    for k in CONFIG_KEYS:
        if k not in config and k not in _DEFAULTS:
            raise TypeError(f"config is missing {k!r}")
        v = config.get(k, _DEFAULTS.get(k))
        if k in _INT_KEYS:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"config[{k!r}] must be an int, got {type(v).__name__}")
            v = int(v)
            if not -(2**63) <= v < 2**63:
                raise ResidentError(f"config[{k!r}] = {v} is past any dimension ceiling",
                                    601 if v < 0 else 602)
        elif k == "tie_word_embeddings":
            v = bool(v)
        else:
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"config[{k!r}] must be a number, got {type(v).__name__}")
            v = float(v)
        items[k] = v
    return ResidentConfig(**items)


def _resolve_device(device: str) -> str:
    if device not in ("cpu", "cuda", "auto"):
        raise ResidentError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}", 601)
    cuda_ok = _core.session.cuda_backend_compiled and _c.resident_available()
    if device == "auto":
        return "cuda" if cuda_ok else "cpu"
    if device == "cuda" and not cuda_ok:
        if not _c.resident_gpu_kernels_compiled():
            raise ResidentUnavailableError(
                "device='cuda': this binary was built without ALGENTA_GPU, so no CUDA kernels are "
                "compiled in; use device='cpu' or rebuild with -Ccmake.define.ALGENTA_GPU=ON", 604)
        if not _c.resident_available():
            raise ResidentUnavailableError(
                "device='cuda': CUDA kernels are compiled in but this host has no usable CUDA "
                "device; use device='cpu'", 605)
        raise ResidentUnavailableError(
            "device='cuda': this build has the CUDA probe but no CUDA session backend; use "
            "device='cpu'", 604)
    return device


def _open_engine(cfg: ResidentConfig, max_ctx: int, device: str):
    if isinstance(max_ctx, bool) or not isinstance(max_ctx, numbers.Integral):
        raise TypeError(f"max_ctx must be an int, got {type(max_ctx).__name__}")
    device = _resolve_device(device)
    if device == "cuda":
        return _core.session.cuda_session(
            cfg.d_model, cfg.h_q, cfg.h_kv, cfg.d_head, cfg.d_ff, cfg.n_layers, cfg.vocab,
            cfg.rms_eps, cfg.rope_theta, cfg.tie_word_embeddings, int(max_ctx))
    return _core.session.cpu_session(
        cfg.d_model, cfg.h_q, cfg.h_kv, cfg.d_head, cfg.d_ff, cfg.n_layers, cfg.vocab,
        cfg.rms_eps, cfg.rope_theta, cfg.tie_word_embeddings, int(max_ctx))


def expected_shapes(config) -> dict:
    """HF tensor name -> shape of every tensor a session with this config holds (the engine's
    own table, Session::weight_shape, is the final check; tests hold the two equal). Lets a
    loader compare a checkpoint with its config before the session allocates anything."""
    cfg = make_config(config)
    D, Hq, Hkv, Dh, F = cfg.d_model, cfg.h_q, cfg.h_kv, cfg.d_head, cfg.d_ff
    out = {"model.embed_tokens.weight": (cfg.vocab, D)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (Hq * Dh, D),
            p + "self_attn.k_proj.weight": (Hkv * Dh, D),
            p + "self_attn.v_proj.weight": (Hkv * Dh, D),
            p + "self_attn.q_norm.weight": (Dh,),
            p + "self_attn.k_norm.weight": (Dh,),
            p + "self_attn.o_proj.weight": (D, Hq * Dh),
            p + "post_attention_layernorm.weight": (D,),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        })
    out["model.norm.weight"] = (D,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab, D)
    return out


def random_weights(config, seed: int = 0) -> Iterable:
    """(HF name, float32 array) pairs of a reproducible random Qwen3 model, one tensor at a time
    (so a multi-GB benchmark model is never held twice). Projections are N(0, 1/fan_in), the
    embedding N(0, 1), norm weights 1 + N(0, 0.01): activations stay O(1) at any depth."""
    cfg = make_config(config)
    rng = np.random.default_rng(seed)
    D, Hq, Hkv, Dh, F = cfg.d_model, cfg.h_q, cfg.h_kv, cfg.d_head, cfg.d_ff

    def mat(rows, cols):
        a = rng.standard_normal((rows, cols), dtype=np.float32)
        a *= np.float32(1.0 / math.sqrt(cols))
        return a

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    yield "model.embed_tokens.weight", rng.standard_normal((cfg.vocab, D), dtype=np.float32)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(D)
        yield p + "self_attn.q_proj.weight", mat(Hq * Dh, D)
        yield p + "self_attn.k_proj.weight", mat(Hkv * Dh, D)
        yield p + "self_attn.v_proj.weight", mat(Hkv * Dh, D)
        yield p + "self_attn.q_norm.weight", norm(Dh)
        yield p + "self_attn.k_norm.weight", norm(Dh)
        yield p + "self_attn.o_proj.weight", mat(D, Hq * Dh)
        yield p + "post_attention_layernorm.weight", norm(D)
        yield p + "mlp.gate_proj.weight", mat(F, D)
        yield p + "mlp.up_proj.weight", mat(F, D)
        yield p + "mlp.down_proj.weight", mat(D, F)
    yield "model.norm.weight", norm(D)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", mat(cfg.vocab, D)


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

    ``ResidentSession(config, weights, *, max_ctx=512, device="cpu")``: config a mapping with
    CONFIG_KEYS, weights a mapping (or iterable of pairs) of HuggingFace tensor names to arrays
    or torch tensors (a transformers model's ``state_dict()`` works as is), each copied to float32
    and shape-checked (607 naming the tensor) as it arrives. With tied
    embeddings a shipped ``lm_head.weight`` is ignored: the embedding table is the head.
    """

    def __init__(self, config, weights, *, max_ctx: int = 512, device: str = "cpu"):
        self._open(config, max_ctx, device)
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        for name, arr in pairs:
            self._set(name, arr)
        self._check_complete()

    # -- construction helpers -------------------------------------------------------------
    def _open(self, config, max_ctx, device):
        # Allocates the resident buffers (weights zeroed, the KV cache at capacity) up front,
        # so streaming a checkpoint in costs one tensor on top of them, never a second model.
        self._config = make_config(config)
        self._engine = _open_engine(self._config, max_ctx, device)
        self._device = self._engine.device

    def _set(self, name, arr):
        if not isinstance(name, str):
            raise TypeError(f"weight names must be str, got {type(name).__name__}")
        if name == "lm_head.weight" and self._config.tie_word_embeddings:
            return
        if hasattr(arr, "detach") and hasattr(arr, "float"):  # a torch tensor (any dtype/device)
            arr = arr.detach().float().cpu().numpy()
        self._engine.set_weight(name, np.asarray(arr))

    def _set_bf16(self, name, bits):
        # bits: uint16 bfloat16 patterns, widened in the engine straight into its buffer.
        if name == "lm_head.weight" and self._config.tie_word_embeddings:
            return
        self._engine.set_weight_bf16(name, bits)

    def _check_complete(self):
        missing = self._engine.missing_weights()
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ResidentError(f"weight '{missing[0]}' is missing{more}", 607)

    @classmethod
    def random(cls, d_model, h_q, h_kv, d_head, d_ff, n_layers, vocab, *, max_ctx=512,
               device="cpu", seed=0, rms_eps=1e-6, rope_theta=1_000_000.0,
               tie_word_embeddings=True):
        """A session over reproducible random weights (see random_weights): benchmarks, tests."""
        cfg = make_config(dict(d_model=d_model, h_q=h_q, h_kv=h_kv, d_head=d_head, d_ff=d_ff,
                               n_layers=n_layers, vocab=vocab, rms_eps=rms_eps,
                               rope_theta=rope_theta, tie_word_embeddings=tie_word_embeddings))
        return cls(cfg, random_weights(cfg, seed), max_ctx=max_ctx, device=device)

    @classmethod
    def from_pretrained(cls, path, *, max_ctx: int = 512, device: str = "cpu", progress=None):
        """A HuggingFace Qwen3 checkpoint directory (config.json + model.safetensors or a sharded
        index), streamed tensor by tensor into float32. See algenta.residentk.loader."""
        from .loader import load_pretrained

        return load_pretrained(cls, path, max_ctx=max_ctx, device=device, progress=progress)

    # -- properties -------------------------------------------------------------------------
    config = property(lambda self: self._config, doc="The ResidentConfig this session holds.")
    device = property(lambda self: self._device, doc="'cpu' or 'cuda'.")
    position = property(lambda self: self._engine.position, doc="Tokens in the KV cache.")
    max_ctx = property(lambda self: self._engine.max_ctx,
                       doc="The capacity the caller asked for (what the context check uses).")
    capacity = property(lambda self: self._engine.capacity,
                        doc="resident_bucket_ctx(max_ctx): KV positions allocated.")
    dispatches_per_token = property(
        lambda self: self._engine.dispatches_per_token,
        doc="Parallel stages the last decode step ran, counted by the engine (0 before one); "
            "residentk_dispatch_budget(n_layers) on the standard path.")

    def __repr__(self):
        c = self._config
        return (f"ResidentSession(device={self._device!r}, d_model={c.d_model}, "
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
        # Greedy on CUDA: the head kernel forms the argmax (first maximum, as np.argmax) on the
        # device and one id comes back per token instead of vocab logits.
        device_greedy = self._device == "cuda" and float(temperature) == 0.0
        nxt = None
        for i in range(int(n_new)):
            t = pick(logits) if nxt is None else nxt
            out.append(t)
            if on_token is not None:
                on_token(t)
            if t in stop or i + 1 == n_new:
                break
            if device_greedy:
                nxt = _core.session.cuda_step_greedy(self._engine, t)
            else:
                logits = self._engine.step(t)
        return out
