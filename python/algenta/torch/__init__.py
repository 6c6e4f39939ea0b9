"""algenta.torch: the fused linear + cross-entropy loss as a PyTorch op.

``linear_cross_entropy(input, linear_weight, target)`` takes the keywords of PyTorch's own
``F.linear_cross_entropy`` (``linear_bias``, ``weight`` for class weights, ``reduction``,
``ignore_index``, ``label_smoothing``) and equals ``F.cross_entropy(F.linear(input,
linear_weight, linear_bias), target, ...)`` and its gradients, computed by the C++ core a chunk
of tokens at a time: the ``[n_tok, vocab]`` logits never exist, in the forward or the backward.
Beyond PyTorch's options, keyword-only: ``softcap`` (Gemma 2's logit soft cap), ``temperature``
(divides the logits: log-probabilities at a sampling temperature), the z-loss
(``lse_square_scale``, its term returned with ``return_z_loss``), next-token ``shift``, the
per-token ``lse`` as a differentiable output (``return_lse``) and token accuracy
(``return_accuracy``). ``vocab_parallel_linear_cross_entropy`` is the same loss when the rows of
the head are sharded over the ranks of a ``torch.distributed`` group.
``linear_distillation_loss`` distills a student head against a teacher head (KL, reverse KL,
JSD) with the same chunking: neither head's logits ever exist in full;
``vocab_parallel_linear_distillation_loss`` with both heads' rows sharded over ranks.

The op is registered with ``torch.library`` (``algenta::lce_fwd`` and ``algenta::lce_grad``, each
with a fake implementation, autograd registered), so ``torch.compile(fullgraph=True)`` keeps it
in the graph. float32, float64, bfloat16 and float16 tensors are accepted; half precision
computes in float32 (inputs widened as the core packs them, never copied), returns a float32 loss
and gradients in the input dtype. Under ``torch.autocast`` the inputs are cast to the autocast
dtype first, as ``F.linear`` is, and the loss is float32, as ``F.cross_entropy``'s under autocast.

Tensors go to the core as zero-copy NumPy views; a non-contiguous tensor is made contiguous once.
The gradients the core returns become tensors without a copy.

Limits: CPU tensors, and CUDA tensors where the build has the CUDA backend (a tensor is never
moved between devices behind the caller's back; the distillation losses take CPU tensors only);
class-index targets only (no probability targets); double backward is not supported. Inputs the
core refuses (NaN/inf, targets out of range, empty or oversized shapes, a negative soft cap) raise
``algenta.LossError`` with its status.

This module imports torch; ``import algenta`` does not import it. Its parts: ``_checks`` (the
argument checks), ``_bridge`` (tensors to and from the core), ``_ops`` (the registered ops,
autograd, ``linear_cross_entropy``), ``_seed`` (the seed's materialized kernels on tensors),
``_vocab_parallel`` (the sharded head), ``_distill`` (distillation).
"""

from __future__ import annotations

from ._distill import LinearDistillationOutput, linear_distillation_loss
from ._ops import LinearCrossEntropyLoss, LinearCrossEntropyOutput, linear_cross_entropy
from ._seed import CEAccumulator, ce_from_logits, ce_grad_logits
from ._vocab_parallel import (vocab_parallel_linear_cross_entropy,
                              vocab_parallel_linear_distillation_loss)

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "LinearCrossEntropyOutput",
           "vocab_parallel_linear_cross_entropy", "ce_from_logits", "ce_grad_logits",
           "CEAccumulator", "linear_distillation_loss", "LinearDistillationOutput",
           "vocab_parallel_linear_distillation_loss"]
