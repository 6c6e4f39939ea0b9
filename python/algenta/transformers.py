"""algenta.transformers: train HuggingFace causal LMs with the fused loss, no logits.

``apply_fused_loss(model)`` patches one ``*ForCausalLM`` instance in place (and returns it) so
that a training forward with ``labels`` computes the loss with
:func:`algenta.torch.linear_cross_entropy` from the final hidden states and ``lm_head.weight``
(and ``lm_head.bias`` where the head has one): the ``[batch, seq, vocab]`` logits, their float32
copy, their log-softmax and their gradient never exist. One line before ``Trainer``::

    model = algenta.transformers.apply_fused_loss(AutoModelForCausalLM.from_pretrained(...))

When the fused loss runs (every condition must hold; otherwise the stock forward runs, untouched):

- the model is in training mode (``model.train()``, as ``Trainer`` sets it for training steps);
- ``labels`` are given;
- ``logits_to_keep`` is the default ``0`` (all positions);
- ``model.loss_function`` is still transformers' ``ForCausalLMLoss`` and ``lm_head`` a plain
  ``nn.Linear`` without hooks (a head replaced after patching, e.g. wrapped by an adapter, would be
  bypassed: the stock forward runs instead, with a one-time warning).

So evaluation (``model.eval()``: ``Trainer.evaluate``/``predict`` and their ``compute_metrics``
need logits) and generation (no labels) are exactly the stock model.

The loss is transformers' ``ForCausalLMLoss``: position ``t`` of each sequence is scored against
``labels[..., t + 1]`` (the last position against nothing), ``-100`` (or the ``ignore_index``
keyword) counts for nothing; the mean over counted tokens, or, when ``num_items_in_batch`` is
passed (``Trainer`` does with gradient accumulation), the sum divided by ``num_items_in_batch``,
so accumulated steps give the stock loss and gradients. A ``shift_labels`` keyword (pre-shifted
labels, e.g. from padding-free collators) is scored without a further shift, as transformers does.
Gemma 2 and Gemma 3 apply ``config.final_logit_softcapping`` to the logits before the loss; the
fused loss applies the same cap inside the kernel.

The output is the stock ``CausalLMOutputWithPast`` with ``logits=None`` (so with
``return_dict=False`` the tuple has no logits element); pass ``return_logits=True`` to the forward
to get the stock logits as well (attached to the graph; the loss is still the fused one, but the
logits tensor then exists).

Numerics against the stock model: float32 models agree to float32 rounding (the kernel
accumulates in float32 with a fixed order, PyTorch in its own). The stock loss always casts the
logits to float32 first (``logits.float()``), also for a float64 model, whose stock loss is
therefore only float32-accurate; the fused loss of a float64 model is computed and returned in
float64. bfloat16/float16 models: the stock loss rounds the logits to the model dtype before
casting them up, the fused loss computes the logits in float32 from the half-precision hidden
states and weights; both return a float32 loss.

Limits: CPU and CUDA models (algenta.torch's devices; CUDA needs the ALGENTA_GPU build, else
the first fused forward raises LossUnavailableError 589); supported architectures are listed in ``SUPPORTED_ARCHITECTURES`` (their ``forward`` as
transformers 5.x defines it, checked against 5.24: a subclass overriding ``forward`` is refused);
a model whose ``forward`` is already replaced on the instance (accelerate hooks from
``device_map``, another patch) is refused. Mixture-of-experts variants, whose forward adds a
router loss, are not supported.

This module imports neither torch nor transformers until ``apply_fused_loss`` is called.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

__all__ = ["apply_fused_loss", "SUPPORTED_ARCHITECTURES"]

# Class name -> the config attribute holding the final-logit soft cap (None: the architecture
# has none). Each forward was read in transformers 5.24: base model, slice_logits_to_keep,
# lm_head, (soft cap), self.loss_function(logits, labels, vocab_size, **kwargs), nothing else.
_ARCHITECTURES = {
    "LlamaForCausalLM": None,
    "MistralForCausalLM": None,
    "Qwen2ForCausalLM": None,
    "Qwen3ForCausalLM": None,
    "GemmaForCausalLM": None,
    "Gemma2ForCausalLM": "final_logit_softcapping",
    "Gemma3ForCausalLM": "final_logit_softcapping",
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def _supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def _head_problem(head, nn) -> str | None:
    """Why the fused loss cannot stand in for ``head(hidden)``, or None when it can."""
    if not isinstance(head, nn.Linear):
        return f"lm_head is a {type(head).__name__}, not an nn.Linear"
    if type(head).forward is not nn.Linear.forward or "forward" in head.__dict__:
        # A quantized or adapter-wrapped head computes something else than x @ W^T + b.
        return f"lm_head ({type(head).__name__}) has its own forward"
    if head._forward_hooks or head._forward_pre_hooks:
        return "lm_head has forward hooks (they expect to see the logits)"
    return None


class _FusedLossForward:
    """The ``forward`` of a patched model instance (stored in the instance's ``__dict__``).

    It holds the model itself rather than closing over it, so ``copy.deepcopy`` of the model
    gives a copy whose forward belongs to the copy. ``__signature__`` is the stock one: Trainer
    drops dataset columns the signature lacks and decides from its ``**kwargs`` whether to pass
    ``num_items_in_batch``; generate() checks it for ``logits_to_keep``."""

    def __init__(self, model, arch: str, softcap_attr, chunk, causal_lm_loss, output_cls):
        self.model = model
        self.arch = arch
        self.softcap_attr = softcap_attr
        self.chunk = chunk
        self._causal_lm_loss = causal_lm_loss
        self._output_cls = output_cls
        self._output_fields = tuple(f.name for f in dataclasses.fields(output_cls)
                                    if f.name not in ("loss", "logits"))
        stock = inspect.signature(type(model).forward)
        params = list(stock.parameters.values())[1:]  # a bound forward has no `self`
        self.__signature__ = stock.replace(parameters=params)
        self._var_kw = next(p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD)
        self.__name__ = "forward"
        self.__qualname__ = f"{type(model).__qualname__}.forward"
        self.__doc__ = (f"{type(model).__name__}.forward with algenta's fused loss in training "
                        "mode (see algenta.transformers). Extra keyword: return_logits.")
        self._warned: set = set()

    def __repr__(self) -> str:
        return f"<fused-loss forward of {type(self.model).__name__} (chunk={self.chunk})>"

    def _stock(self, *args, **kwargs):
        return type(self.model).forward(self.model, *args, **kwargs)

    def _warn_once(self, key: str, why: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"algenta.transformers: {why}; this {type(self.model).__name__} runs "
                          "its stock forward (logits materialized) until that is undone",
                          RuntimeWarning, stacklevel=4)

    def _can_fuse(self) -> bool:
        import torch.nn as nn

        model = self.model
        if model.loss_function is not self._causal_lm_loss:
            self._warn_once("loss", "model.loss_function is no longer transformers' "
                                    "ForCausalLMLoss (the fused loss would replace it)")
            return False
        why = _head_problem(getattr(model, "lm_head", None), nn)
        if why is not None:
            self._warn_once("head", why)
            return False
        return True

    def __call__(self, *args, **kwargs):
        return_logits = bool(kwargs.pop("return_logits", False))
        if not self.model.training:
            return self._stock(*args, **kwargs)
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError:
            return self._stock(*args, **kwargs)  # for the stock forward's own error message
        a = bound.arguments
        keep = a.get("logits_to_keep", 0)
        if (a.get("labels") is None or isinstance(keep, bool) or not isinstance(keep, int)
                or keep != 0 or not self._can_fuse()):
            return self._stock(*args, **kwargs)
        return self._fused(dict(a), return_logits)

    def _fused(self, a: dict, return_logits: bool):
        import torch

        from . import torch as at

        model = self.model
        kwargs = dict(a.pop(self._var_kw, {}))
        labels = a.pop("labels")
        a.pop("logits_to_keep", None)
        # transformers' can_return_tuple: the keyword wins over the config, None means the config.
        return_dict = getattr(model.config, "return_dict", True)
        passed = kwargs.pop("return_dict", return_dict)
        if passed is not None:
            return_dict = passed
        # As the stock body: every keyword (num_items_in_batch included) goes to the base model,
        # which ignores what it does not use; only the named arguments the caller gave are passed,
        # so a deprecated name (past_key_values) reaches the base model's own renaming.
        outputs = model.model(**a, **kwargs)
        hidden = outputs.last_hidden_state  # (B, S, D)
        head = model.lm_head
        cap = getattr(model.config, self.softcap_attr, None) if self.softcap_attr else None

        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None:
            target, shift = labels, 1
        else:
            target, shift = shift_labels, 0
        lead = tuple(hidden.shape[:-1])
        target = target.to(hidden.device)
        if tuple(target.shape) != lead:
            # ForCausalLMLoss flattens pre-shifted labels; plain labels it shifts along their
            # last axis, which is the sequence axis only when they have the input's shape.
            if shift == 0 and target.numel() == hidden[..., 0].numel():
                target = target.reshape(lead)
            else:
                name = "shift_labels" if shift == 0 else "labels"
                raise ValueError(f"{name} have shape {tuple(target.shape)}, the final hidden "
                                 f"states {tuple(hidden.shape)}: one label per input position "
                                 f"is needed, shape {lead}")
        ignore_index = kwargs.get("ignore_index", -100)
        if shift and hidden.shape[-2] <= shift:
            # Sequences of one position score nothing: ForCausalLMLoss then averages over no
            # token (NaN loss, zero gradients) instead of refusing; so does the fused loss, with
            # every position ignored in place of a shift that leaves none.
            target, shift = torch.full_like(target, ignore_index), 0
        num_items = kwargs.get("num_items_in_batch")
        loss = at.linear_cross_entropy(
            hidden, head.weight, target, linear_bias=head.bias,
            ignore_index=ignore_index, shift=shift, softcap=cap,
            reduction="mean" if num_items is None else "sum", chunk=self.chunk)
        if num_items is not None:
            # transformers' fixed_cross_entropy: the sum over this micro-batch divided by the
            # counted labels of the whole accumulated batch.
            if torch.is_tensor(num_items):
                num_items = num_items.to(loss.device)
            loss = loss / num_items

        logits = None
        if return_logits:
            logits = head(hidden)
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
        out = self._output_cls(loss=loss, logits=logits,
                               **{f: getattr(outputs, f, None) for f in self._output_fields})
        return out if return_dict else out.to_tuple()


def _check_chunk(chunk, model) -> None:
    """The chunk is refused here, with the kernel's own status, not at the first training step:
    < 1 is 581, past int64 583, one whose chunk x vocab logits exceed the budget 587."""
    if chunk is None:
        return
    from .errors import LossError
    from .lossk.contract import LOSS_OK, loss_chunk_check, loss_status_name

    vocab = model.lm_head.weight.shape[0]
    st = loss_chunk_check(chunk, vocab)
    if st != LOSS_OK:
        raise LossError(f"chunk={chunk} refused for this model's vocabulary of {vocab}: "
                        f"{loss_status_name(st)}", st)


def apply_fused_loss(model, *, chunk=None):
    """Patches ``model`` (a supported ``*ForCausalLM`` instance) in place and returns it: its
    training forward with ``labels`` computes the loss with the fused linear + cross-entropy
    kernel and returns ``logits=None`` (``return_logits=True`` in the forward's keywords returns
    them too). Everything else (eval mode, no labels, generation) runs the stock forward.

    ``chunk``: tokens per pass of the kernel (None: the largest its logit budget admits); it
    bounds the temporary logits at ``chunk x vocab`` and changes no result by a single bit.
    Applying again to a patched model only updates ``chunk``.

    Raises ``TypeError`` for something that is not a transformers model, ``LossError`` (a
    ``ValueError``, with the kernel's status) for a chunk it would refuse, and ``ValueError`` for
    an unsupported architecture (the message names the supported ones), a subclass overriding
    ``forward``, a forward already replaced on the instance, a head that is not a plain
    ``nn.Linear`` without hooks, a replaced ``loss_function``, or a head on neither the CPU nor
    a CUDA device.
    """
    try:
        import torch
        import transformers
        from transformers.loss.loss_utils import ForCausalLMLoss
        from transformers.modeling_outputs import CausalLMOutputWithPast
    except ImportError as e:
        raise ImportError("algenta.transformers.apply_fused_loss needs torch and transformers "
                          f"installed ({e})") from e
    nn = torch.nn

    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)):
        raise TypeError(f"chunk must be an int or None, got {type(chunk).__name__}")
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError("apply_fused_loss takes a transformers model instance (one of "
                        f"{_supported_list()}), got {type(model).__name__}")

    existing = model.__dict__.get("forward")
    if isinstance(existing, _FusedLossForward):
        _check_chunk(chunk, model)
        existing.chunk = chunk
        return model
    if existing is not None:
        raise ValueError(f"this {type(model).__name__}'s forward is already replaced on the "
                         "instance (accelerate hooks from device_map/offloading, or another "
                         "patch); apply_fused_loss needs transformers' own forward")

    arch = None
    for name, softcap_attr in _ARCHITECTURES.items():
        cls = getattr(transformers, name, None)
        if cls is not None and isinstance(model, cls):
            if type(model).forward is not cls.forward:
                raise ValueError(f"{type(model).__name__} subclasses {name} but overrides "
                                 "forward: the fused loss would bypass that override")
            arch = name
            break
    if arch is None:
        raise ValueError(f"apply_fused_loss does not support {type(model).__name__}; supported "
                         f"architectures: {_supported_list()}")

    why = _head_problem(getattr(model, "lm_head", None), nn)
    if why is not None:
        raise ValueError(f"{why}: the fused loss reads lm_head.weight (and bias) directly, "
                         "so it would compute a different loss")
    if model.loss_function is not ForCausalLMLoss:
        raise ValueError("model.loss_function is not transformers' ForCausalLMLoss: the fused "
                         "loss would silently replace a custom loss")
    if not isinstance(getattr(model, "model", None), nn.Module):
        raise ValueError(f"{type(model).__name__} has no base model at .model")
    if model.lm_head.weight.device.type not in ("cpu", "cuda"):
        raise ValueError(f"lm_head.weight is on {model.lm_head.weight.device}; algenta.torch "
                         "computes on CPU and CUDA tensors")

    _check_chunk(chunk, model)
    model.forward = _FusedLossForward(model, arch, _ARCHITECTURES[arch], chunk, ForCausalLMLoss,
                                      CausalLMOutputWithPast)
    return model
