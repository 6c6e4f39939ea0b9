"""The text side of ``algenta serve``: generated ids to text as it becomes final (stop strings
held back and cut by automata), and OpenAI's ``logprobs`` objects of a choice or a chunk."""

from __future__ import annotations


class _StopMatcher:
    """One stop string's Knuth-Morris-Pratt automaton. Fed the output a piece at a time, it
    knows the longest prefix of the stop string the output ends with (``state``), so a new
    character costs amortized O(1) however long the output and the stop string are: a
    rescan of the held-back text per token would cost O(stop length^2) each, on the event loop
    that serves everyone."""

    def __init__(self, stop: str):
        self.stop = stop
        fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self.fail = fail
        self.state = 0

    def feed(self, piece: str):
        """Index in `piece` where a match ends (exclusive), or None (the state advanced)."""
        s, fail, k, n = self.stop, self.fail, self.state, len(self.stop)
        for j, ch in enumerate(piece):
            while k and ch != s[k]:
                k = fail[k - 1]
            if ch == s[k]:
                k += 1
                if k == n:
                    self.state = k
                    return j + 1
        self.state = k
        return None


class TextStream:
    """Generated ids -> text as it becomes final. A byte-level token can end mid-character
    (decoded as U+FFFD until the next completes it), and text that could be the start of a
    stop string is held back until it is known not to be one. ``push`` returns (new text,
    stopped); after a stop string nothing more is emitted and the text ends before it. Each
    token costs time in its own text only: decoding a window of the last ids, and one
    automaton step a character per stop string."""

    def __init__(self, tokenizer, stops=()):
        self.tok = tokenizer
        self.matchers = [_StopMatcher(s) for s in stops if s]
        self.ids = []
        self.stopped = False
        self.parts = []      # the text already returned, in pieces
        self.pending = ""    # text held back: it may begin a stop string
        # Incremental decoding: only the ids from `prefix` on are decoded per token, and the
        # text they gave up to `read` is the part already appended (decoding a window with one
        # token of left context keeps a word's leading space; a whole-sequence decode per
        # token would cost O(n) each).
        self.prefix = self.read = 0

    @property
    def text(self) -> str:
        """Everything decoded so far (returned and held back); O(n), not for the hot path."""
        return "".join(self.parts) + self.pending

    def push(self, token_id: int):
        if self.stopped:
            return "", True
        self.ids.append(int(token_id))
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if now.endswith("\ufffd") or len(now) <= len(before) or not now.startswith(before):
            return "", False  # mid-character, or nothing visible yet
        self.prefix, self.read = self.read, len(self.ids)
        piece = now[len(before):]
        tail = self.pending + piece
        cut = None  # where the earliest stop string found in this piece begins, in `tail`
        for m in self.matchers:
            end = m.feed(piece)
            if end is not None:
                start = len(self.pending) + end - len(m.stop)
                cut = start if cut is None else min(cut, start)
        if cut is not None:
            self.stopped = True
            return self._take(tail, max(cut, 0)), True
        hold = max((m.state for m in self.matchers), default=0)
        return self._take(tail, len(tail) - hold), False

    def finish(self) -> str:
        """What is left once no more tokens come: the held-back tail, and any text the last
        ids gave (the whole sequence decoded once more); nothing after a stop string."""
        if self.stopped:
            return ""
        sent = "".join(self.parts)
        full = self.tok.decode(self.ids)
        tail = full[len(sent):] if full.startswith(sent) else self.pending
        cut = None
        for m in self.matchers:  # once per request: a plain search of the short tail
            i = tail.find(m.stop)
            if i >= 0 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            self.stopped = True
        return self._take(tail, len(tail) if cut is None else cut)

    def _take(self, tail: str, n: int) -> str:
        out, self.pending = tail[:n], tail[n:]
        if out:
            self.parts.append(out)
        return out


def token_strings(tok, ids, before=None) -> list:
    """Each id's text as it reads in the decoded sequence (a word's leading space kept): the
    decode of the id with its left neighbour, less the neighbour's own."""
    out = []
    for t in ids:
        if before is None:
            out.append(tok.decode([t]))
        else:
            a, b = tok.decode([before]), tok.decode([before, t])
            out.append(b[len(a):] if b.startswith(a) else tok.decode([t]))
        before = t
    return out


def logprobs_object(tok, entries, *, chat: bool, before=None, offset=0):
    """OpenAI's ``logprobs`` of a choice (or a chunk) from ``[(id, (logprob, top) or None)]``:
    completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``, or
    chat's ``content`` list."""
    strings = token_strings(tok, [t for t, _ in entries], before)
    if chat:
        def alt(i, lp):
            s = tok.decode([i])
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [{"token": s, "logprob": info[0], "bytes": list(s.encode("utf-8")),
                             "top_logprobs": [alt(i, lp) for i, lp in info[1]]}
                            for s, (_, info) in zip(strings, entries)]}
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": strings,
            "token_logprobs": [None if info is None else info[0] for _, info in entries],
            "top_logprobs": [None if info is None else {tok.decode([i]): lp for i, lp in info[1]}
                             for _, info in entries],
            "text_offset": offsets}


class ThinkSplit:
    """A thinking model's output split, as it streams, into reasoning (between ``<think>`` and
    ``</think>``) and content. The reasoning opens where the chat template opened it (the
    prompt ends with ``<think>``) or where the model does (its first text). A marker split
    across pieces is held back until decided; the blank lines after ``</think>`` are dropped.
    ``push`` and ``finish`` return ``[(kind, text)]``, kind "reasoning" or "content"."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, opened: bool):
        self.state = "in" if opened else "start"
        self.buf = ""

    def push(self, piece: str) -> list:
        self.buf += piece
        out = []
        while True:
            if self.state == "start":  # does the output open a <think>?
                s = self.buf.lstrip()
                if len(s) < len(self.OPEN) and self.OPEN.startswith(s):
                    return out
                if s.startswith(self.OPEN):
                    self.buf, self.state = s[len(self.OPEN):], "in"
                else:
                    self.state = "out"
            elif self.state == "in":
                i = self.buf.find(self.CLOSE)
                if i >= 0:
                    if i:
                        out.append(("reasoning", self.buf[:i]))
                    self.buf, self.state = self.buf[i + len(self.CLOSE):], "after"
                    continue
                keep = next((k for k in range(min(len(self.CLOSE) - 1, len(self.buf)), 0, -1)
                             if self.buf.endswith(self.CLOSE[:k])), 0)
                if len(self.buf) > keep:
                    out.append(("reasoning", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            elif self.state == "after":  # the blank lines after </think>
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.state = "out"
            else:
                if self.buf:
                    out.append(("content", self.buf))
                    self.buf = ""
                return out

    def finish(self) -> list:
        kind = "reasoning" if self.state == "in" else "content"
        text, self.buf = self.buf, ""
        if self.state in ("start", "after"):
            text = text.lstrip() if self.state == "after" else text
        return [(kind, text)] if text else []
