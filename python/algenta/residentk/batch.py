"""Continuous batching over a resident session's slots: many requests decoded together.

``Scheduler(session)`` owns a :class:`ResidentSession` opened with ``slots=N`` and runs one
worker thread. Requests are submitted from any thread (``submit``) and their tokens arrive as
events on the returned :class:`Job`. Each turn of the worker:

1. drops cancelled jobs (a client gone, a stop string seen) and frees their slots;
2. admits queued jobs into free slots, choosing for each the slot whose cached tokens share
   the longest prefix with its prompt, the free slot itself (``truncate``) or any other
   (``copy_prefix``), so a shared system prompt is prefilled once;
3. prefills at most ``prefill_chunk`` prompt tokens of the admitted jobs, so the sequences
   already decoding keep their pace while a long prompt comes in;
4. steps every decoding job at once (``step_batch``: the weights read once for all of them).

A job's tokens do not depend on the company it keeps: ``step_batch`` rows are bit-identical to
a lone step, a chunked prefill to a whole one, a copied prefix to a recomputed one, and each
job samples from its own generator (``seed``). So a request decodes the same alone or among
any others, whenever it joined.

Every engine call runs on the worker thread. Open the session on a thread that then ends
(``algenta serve`` does): libgomp keeps an OpenMP thread pool for every thread that ever ran a
parallel region, and once the pools hold more threads than there are cores it throttles their
spin-waits, so each parallel region of a step pays a futex wake-up (1.5-1.8x slower batched
steps measured on 2 cores when the session was loaded on the main thread).

Every refusal happens in ``submit``, before the job is queued: a prompt plus ``max_tokens``
past the slot capacity (606), a bad sampling argument, a full queue (:class:`QueueFull`).
"""

from __future__ import annotations

import collections
import math
import numbers
import queue
import threading
import time

import numpy as np

from .. import _core
from ..errors import ResidentError
from .session import ResidentSession, _sampler

_c = _core.residentk


class QueueFull(Exception):
    """Every slot is busy and the wait queue is at its bound: try again later."""


class Job:
    """One request's handle. Events, in order, from ``events()`` (blocking) or the
    ``on_event`` callback given to ``submit`` (called on the worker thread):
    ``("token", id)`` per generated id (``("token", id, (logprob, top))`` when log-probabilities
    were asked for: see :func:`token_logprobs`), then exactly one of ``("done", reason)`` with
    reason "stop" (a stop id), "length" (``max_tokens``) or "cancelled", or ``("error",
    exception)``. With ``echo``, ``("prompt_logprobs", [None, (logprob, top), ...])`` comes
    first: one entry per prompt token, the first having no context."""

    def __init__(self, prompt, max_tokens, pick, stop_ids, on_event, logprobs=None, echo=False):
        self.prompt = prompt  # int64 array
        self.max_tokens = max_tokens
        self.pick = pick
        self.stop_ids = stop_ids
        self.logprobs = logprobs  # None: off; k: the k most likely alternatives too
        self.echo = echo
        self.follows = None  # a job with the same prompt whose prefill this one copies
        self.penalties = None  # a Penalties, when any is asked for
        self.constraint = None  # a grammar: mask(logits) -> logits, advance(id) -> bool
        self.prompt_logprobs = [None]
        self.generated = []
        self.finish_reason = None
        self._on_event = on_event
        self._q = queue.SimpleQueue() if on_event is None else None
        self._cancel = threading.Event()
        # worker state
        self.slot = None
        self.fed = 0  # prompt tokens in the slot's cache
        self.pending = None  # the last generated id, not yet stepped

    def cancel(self) -> None:
        """Stop this job: its slot is freed at the worker's next turn (and ``("done",
        "cancelled")`` sent unless it already finished)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def events(self, timeout=None):
        """Yield the events until the final one (only without ``on_event``)."""
        if self._q is None:
            raise RuntimeError("this job reports through its on_event callback")
        while True:
            ev = self._q.get(timeout=timeout)
            yield ev
            if ev[0] in ("done", "error"):
                return

    def result(self, timeout=None) -> list:
        """The generated ids once the job ends; raises its error, if it had one."""
        for kind, val in self.events(timeout):
            if kind == "error":
                raise val
        return list(self.generated)

    def _emit(self, ev) -> None:
        if self._q is not None:
            self._q.put(ev)
            return
        try:
            self._on_event(ev)
        except Exception:  # a consumer's failure ends its own job, never the others'
            self._cancel.set()


def token_logprobs(logits, token: int, k: int):
    """(log-probability of ``token``, the ``k`` most likely ``(id, log-probability)`` pairs,
    most likely first, ties by id) under the model's own distribution: the log-softmax of the
    float32 logits, in float64. The raw distribution, before temperature, top-k and top-p (as
    vLLM's default ``raw_logprobs``): what evaluation scores and what a policy-gradient update
    compares with the trainer's log-probabilities. None for a non-finite value."""
    x = np.asarray(logits, np.float64)
    m = x.max()
    lse = m + math.log(np.exp(x - m).sum()) if np.isfinite(m) else math.nan

    def lp(i):
        v = x[i] - lse
        return float(v) if math.isfinite(v) else None

    top = []
    if k:
        idx = np.argpartition(-x, k - 1)[:k] if k < x.size else np.arange(x.size)
        top = [(int(i), lp(i)) for i in sorted(idx.tolist(), key=lambda i: (-x[i], i))]
    return lp(token), top


class Penalties:
    """A job's changes to its logits before sampling, each row on its own (so a batched step
    stays batch-invariant), in this order: ``logit_bias`` added (OpenAI's, [-100, 100] per
    id); ``repetition_penalty`` over every id of the prompt and the output (the CTRL paper's
    and transformers' rule: a positive logit divided by it, a negative one multiplied);
    ``frequency_penalty`` times an id's count in the output plus ``presence_penalty`` once it
    occurred (OpenAI's definition, the output only); then ``min_p``: ids whose probability at
    the sampling temperature is below min_p times the most likely's leave the draw (a logit
    below max + temperature * ln(min_p)). Log-probabilities stay the raw model's."""

    def __init__(self, vocab, prompt, *, logit_bias=None, repetition_penalty=1.0,
                 frequency_penalty=0.0, presence_penalty=0.0, min_p=0.0, temperature=1.0):
        self.bias = None
        if logit_bias:
            self.bias = np.zeros(vocab, np.float64)
            for k, v in logit_bias.items():
                self.bias[int(k)] = float(v)
        self.rep, self.freq, self.pres = repetition_penalty, frequency_penalty, presence_penalty
        self.counts = np.zeros(vocab, np.int64)  # the output's ids
        self.seen = np.zeros(vocab, bool)  # the prompt's and the output's
        self.seen[np.asarray(prompt, np.int64)] = True
        # min_p as a logit margin; at temperature 0 (greedy) it never removes the maximum
        self.margin = temperature * math.log(min_p) if min_p > 0 and temperature > 0 else None

    def __call__(self, logits) -> np.ndarray:
        x = np.asarray(logits, np.float64).copy()
        if self.bias is not None:
            x += self.bias
        if self.rep != 1.0:
            v = x[self.seen]
            x[self.seen] = np.where(v > 0, v / self.rep, v * self.rep)
        if self.freq or self.pres:
            x -= self.counts * self.freq + (self.counts > 0) * self.pres
        if self.margin is not None:
            # the lowest finite float, not -inf: the sampler refuses non-finite logits
            x[x < x.max() + self.margin] = np.finfo(np.float64).min
        return x

    def record(self, token: int) -> None:
        self.counts[token] += 1
        self.seen[token] = True


# Echoed prompts are prefilled a token at a time (each position's logits are needed): at most
# this many per worker turn, so the decoding jobs keep their pace.
ECHO_TOKENS_PER_TURN = 32


class Scheduler:
    """Continuous batching of requests over ``session``'s slots (see the module docstring).

    ``prefill_chunk``: the most prompt tokens prefilled per worker turn (a turn also steps
    every decoding job). ``max_queue``: jobs waiting for a slot beyond which ``submit`` raises
    :class:`QueueFull`."""

    def __init__(self, session: ResidentSession, *, prefill_chunk: int = 256,
                 max_queue: int = 64):
        if not isinstance(session, ResidentSession):
            raise TypeError("session must be a ResidentSession")
        for name, v, least in (("prefill_chunk", prefill_chunk, 1), ("max_queue", max_queue, 0)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < least:
                raise ResidentError(f"{name} must be an int >= {least}, got {v!r}", 601)
        self.session = session
        self.prefill_chunk = int(prefill_chunk)
        self.max_queue = int(max_queue)
        self._slots = session.slots
        self._cache = [[] for _ in range(self._slots)]  # token ids each slot's KV holds
        self._busy = [None] * self._slots  # the job in each slot
        self._waiting = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self._placing = []  # jobs taken from the queue, being placed in slots
        self._stop_now = False
        # counters since the scheduler started: decode steps and the sequences they carried,
        # prompt tokens prefilled and reused from a cache, jobs cancelled, and the seconds the
        # engine computed (prefills and steps): the rest of the wall time is the service's own
        self.stats = {"steps": 0, "step_rows": 0, "prefill_tokens": 0, "reused_tokens": 0,
                      "cancelled": 0, "engine_seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name="algenta-scheduler", daemon=True)
        self._thread.start()

    # -- submitting ---------------------------------------------------------------------------
    def submit(self, prompt_ids, max_tokens, *, temperature=0.0, top_k=None, top_p=None,
               seed=None, stop_ids=(), on_event=None, logprobs=None, echo=False,
               follows=None, logit_bias=None, repetition_penalty=1.0, frequency_penalty=0.0,
               presence_penalty=0.0, min_p=0.0, constraint=None) -> Job:
        """Queue a request; its events arrive on the returned Job. ``logprobs``: None, or k >= 0
        for each generated token's log-probability and its k most likely alternatives;
        ``echo``: the prompt's too (prefilled a token at a time, no cached prefix reused), and
        then max_tokens may be 0; ``follows``: an earlier job of the same prompt (another
        sample of one request), which this one waits for in the queue and whose prefilled
        prompt it copies instead of computing it again; ``logit_bias`` ({id: bias}),
        ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, ``min_p``: see
        :class:`Penalties`; ``constraint``: an object whose ``mask(logits)`` returns the
        logits with the ids it forbids made the lowest finite value, whose ``advance(id)``
        takes the sampled id (False: the id broke the grammar, the job fails) and whose
        ``finished()`` ends the job ("stop") once the grammar is complete, applied after the
        penalties, on this job's row alone. Refused before queueing:
        an empty prompt or an id outside the vocabulary (601), max_tokens < 1 (601), a prompt
        plus max_tokens past the session's max_ctx (606, both numbers named), a bad sampling
        argument, a closed scheduler (RuntimeError), a full queue (QueueFull)."""
        s = self.session
        ids = s._prompt(prompt_ids, "prompt_ids")  # converted and checked against the vocabulary
        if ids.size == 0:
            raise ResidentError("the prompt is empty: at least one token is needed", 601)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral):
            raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
        if max_tokens < (0 if echo else 1):
            raise ResidentError(f"max_tokens must be >= {0 if echo else 1}, got {max_tokens}",
                                601)
        if logprobs is not None and (isinstance(logprobs, bool) or
                                     not isinstance(logprobs, numbers.Integral) or
                                     not 0 <= logprobs <= 20):
            raise ResidentError(f"logprobs must be None or an int in [0, 20], got {logprobs!r}",
                                601)
        st = _c.residentk_context_check(int(ids.size), min(int(max_tokens), 2**62), s.max_ctx)
        if st != _c.RESIDENT_OK:
            raise ResidentError(
                f"a prompt of {ids.size} tokens plus max_tokens={max_tokens} exceeds a slot's "
                f"context of {s.max_ctx} positions", st)
        pick = _sampler(temperature, top_k, top_p, seed, s.config.vocab)
        if on_event is not None and not callable(on_event):
            raise TypeError("on_event must be callable")
        if follows is not None and (not isinstance(follows, Job) or
                                    not np.array_equal(follows.prompt, ids)):
            raise ValueError("follows must be a Job of the same prompt")
        job = Job(ids, int(max_tokens), pick, frozenset(int(t) for t in stop_ids), on_event,
                  None if logprobs is None else int(logprobs), bool(echo))
        job.follows = follows
        job.constraint = constraint
        vocab = s.config.vocab
        for name, v, lo, hi in (("repetition_penalty", repetition_penalty, 0.0, math.inf),
                                ("frequency_penalty", frequency_penalty, -2.0, 2.0),
                                ("presence_penalty", presence_penalty, -2.0, 2.0),
                                ("min_p", min_p, 0.0, 1.0)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not lo <= v <= hi or \
                    (name == "repetition_penalty" and v == 0):
                raise ResidentError(f"{name} must be a number in [{lo}, {hi}]"
                                    f"{' (not 0)' if lo == 0 and name != 'min_p' else ''}, got "
                                    f"{v!r}", 609)
        for k, v in (logit_bias or {}).items():
            if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k < vocab:
                raise ResidentError(f"logit_bias: token id {k!r} outside [0, {vocab})", 601)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -100 <= v <= 100:
                raise ResidentError(f"logit_bias: the bias of {k} must be a number in "
                                    f"[-100, 100], got {v!r}", 609)
        if logit_bias or repetition_penalty != 1 or frequency_penalty or presence_penalty or \
                min_p:
            job.penalties = Penalties(vocab, ids, logit_bias=logit_bias,
                                      repetition_penalty=float(repetition_penalty),
                                      frequency_penalty=float(frequency_penalty),
                                      presence_penalty=float(presence_penalty),
                                      min_p=float(min_p), temperature=float(temperature))
        with self._cv:
            if self._closing:
                raise RuntimeError("the scheduler is closed")
            free = sum(b is None for b in self._busy) - len(self._placing)
            if len(self._waiting) >= free + self.max_queue:
                raise QueueFull(f"all {self._slots} slots are busy and {len(self._waiting)} "
                                f"requests are waiting")
            self._waiting.append(job)
            self._cv.notify()
        return job

    def load(self) -> dict:
        """Slots in use and jobs waiting, now, and a copy of the counters (``stats``)."""
        with self._cv:
            return {"slots": self._slots,
                    "active": sum(b is not None for b in self._busy) + len(self._placing),
                    "waiting": len(self._waiting), "stats": dict(self.stats)}

    def close(self, *, cancel: bool = False, timeout=None) -> None:
        """Stop accepting; finish what runs (or cancel it), then stop the worker. With a
        timeout, what still runs when it passes is cancelled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._closing = True
            while self._waiting or self._placing or any(b is not None for b in self._busy):
                if cancel or (deadline is not None and time.monotonic() >= deadline):
                    for j in list(self._waiting) + self._placing + \
                            [b for b in self._busy if b is not None]:
                        j.cancel()
                self._cv.notify_all()
                self._cv.wait(0.05)
            self._stop_now = True
            self._cv.notify_all()
        self._thread.join()

    # -- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        # Only this thread changes _busy and the slots' caches. The lock guards the wait queue
        # and is never held across an engine call, so submit() and load() never wait on a step.
        while True:
            with self._cv:
                self._cv.notify_all()  # close() waits for the jobs to end
                while not self._stop_now and not self._waiting and \
                        all(b is None for b in self._busy):
                    self._cv.wait()
                if self._stop_now:
                    return
                for j in [j for j in self._waiting if j.cancelled]:
                    self._waiting.remove(j)
                    self._finish(j, "cancelled")
                free = sum(b is None for b in self._busy)
                admit = []
                for j in list(self._waiting):  # in order, but a follower after its leader's
                    if len(admit) == free:    # prefill, so that it copies it
                        break
                    lead = j.follows
                    if lead is None or lead.fed >= lead.prompt.size or \
                            lead.finish_reason is not None:
                        self._waiting.remove(j)
                        admit.append(j)
                self._placing = admit  # counted as busy by submit() until placed
            try:
                for j in self._busy:
                    if j is not None and j.cancelled:
                        self._finish(j, "cancelled")
                try:
                    self._admit(admit)
                finally:
                    self._placing = []
                self._prefill_some()
                self._decode()
            except Exception as e:  # an engine failure: fail the jobs it touched, keep serving
                self._fail_running(e)

    def _finish(self, job: Job, reason=None, error=None) -> None:
        if job.slot is not None:
            self._busy[job.slot] = None
            job.slot = None
        if job.finish_reason is None:
            job.finish_reason = reason or "error"
            if reason == "cancelled":
                self.stats["cancelled"] += 1
            job._emit(("error", error) if error is not None else ("done", reason))

    def _admit(self, jobs) -> None:
        """Place each job in a free slot: the one whose cache keeps the most of its prompt;
        a longer prefix any other slot holds is copied in."""
        s = self.session
        for job in jobs:
            if job.cancelled:
                self._finish(job, "cancelled")
                continue
            p = job.prompt.tolist()
            limit = len(p) - 1  # the last prompt token is always run: its logits are needed

            def shared(k):
                c, n = self._cache[k], 0
                for a, b in zip(c, p[:limit]):
                    if a != b:
                        break
                    n += 1
                return n

            dst = max((k for k in range(self._slots) if self._busy[k] is None), key=shared)
            src = max(range(self._slots), key=shared)
            n = 0 if job.echo else shared(dst)  # echo: every position's logits are needed
            try:
                if not job.echo and shared(src) > n:
                    n = shared(src)
                    s.copy_prefix(src, dst, n)
                    self._cache[dst] = list(self._cache[src][:n])
                else:
                    s.truncate(n, slot=dst)
                    del self._cache[dst][n:]
            except Exception as e:  # this job alone fails; the slot's cache is forgotten
                self._cache[dst] = []
                self._finish(job, error=e)
                continue
            self._busy[dst] = job
            job.slot, job.fed = dst, n
            self.stats["reused_tokens"] += n

    def _prefill_some(self) -> None:
        """Up to prefill_chunk prompt tokens, of the admitted jobs in slot order (the budget
        bounds how long the decoding jobs wait for their next step)."""
        budget = self.prefill_chunk
        for job in self._busy:
            if budget <= 0:
                return
            if job is None or job.fed >= job.prompt.size:
                continue
            end = min(job.prompt.size, job.fed + budget)
            if job.echo:
                end = min(end, job.fed + ECHO_TOKENS_PER_TURN)
            # echo: one position at a time, each one's logits scoring the next prompt token
            # (bit-identical to a chunked prefill: the session's split invariance)
            for a in (range(job.fed, end) if job.echo else [job.fed]):
                b = a + 1 if job.echo else end
                chunk = job.prompt[a:b]
                t0 = time.perf_counter()
                logits = self.session.prefill(chunk, slot=job.slot)
                self.stats["engine_seconds"] += time.perf_counter() - t0
                self._cache[job.slot].extend(chunk.tolist())
                if job.echo and b < job.prompt.size:
                    job.prompt_logprobs.append(
                        token_logprobs(logits, int(job.prompt[b]), job.logprobs or 0))
            self.stats["prefill_tokens"] += end - job.fed
            budget -= end - job.fed
            job.fed = end
            if end == job.prompt.size:
                if job.echo:
                    job._emit(("prompt_logprobs", job.prompt_logprobs))
                if job.max_tokens == 0:
                    self._finish(job, "length")
                else:
                    self._produce(job, logits)

    def _decode(self) -> None:
        rows = [j for j in self._busy if j is not None and j.pending is not None
                and not j.cancelled]
        if not rows:
            return
        t0 = time.perf_counter()
        logits = self.session.step_batch([j.slot for j in rows], [j.pending for j in rows])
        self.stats["engine_seconds"] += time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["step_rows"] += len(rows)
        for b, j in enumerate(rows):
            self._cache[j.slot].append(j.pending)
            j.pending = None
            self._produce(j, logits[b])

    def _produce(self, job: Job, logits) -> None:
        try:
            x = logits if job.penalties is None else job.penalties(logits)
            if job.constraint is not None:
                x = job.constraint.mask(x)
            t = job.pick(x)
            if job.constraint is not None and not job.constraint.advance(t):
                raise ResidentError(f"token {t} broke the output's grammar", 609)
        except Exception as e:  # NaN logits under sampling (609): this job alone fails
            self._finish(job, error=e)
            return
        if job.penalties is not None:
            job.penalties.record(t)
        job.generated.append(t)
        if job.logprobs is None:
            job._emit(("token", t))
        else:
            job._emit(("token", t, token_logprobs(logits, t, job.logprobs)))
        if t in job.stop_ids or (job.constraint is not None and job.constraint.finished()):
            self._finish(job, "stop")
        elif len(job.generated) >= job.max_tokens:
            self._finish(job, "length")
        else:
            job.pending = t

    def _fail_running(self, e: Exception) -> None:
        # A refused or failed engine call leaves every position where it was (the session's
        # contract), so the slots' caches still match what they hold; the jobs end with it.
        for j in list(self._busy):
            if j is not None:
                self._finish(j, error=e)
