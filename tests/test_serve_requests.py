"""``algenta serve`` against what a careless or hostile client sends: every request field
honoured or refused by name, malformed bodies, slow and vanishing clients, stop strings that
would stall the event loop, shutdown with streams open, and the command's own arguments."""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_serve import (DIMS, KEY, TEMPLATE, WORDS, Live, capture_jobs,  # noqa: E402
                        random_session, sse, sse_chunks, text_of, word_tokenizer)

from algenta.residentk.batch import Scheduler  # noqa: E402
from algenta.residentk.session import ResidentSession  # noqa: E402
from algenta.serve import TextStream, build_app  # noqa: E402


def serve(eos_ids=(60,), **kw):
    session = random_session(2, max_ctx=64)
    sched = Scheduler(session, max_queue=0)
    app = build_app(sched, word_tokenizer(), model_name="tiny", eos_ids=list(eos_ids),
                    chat_template=TEMPLATE, api_key=KEY, **kw)
    srv = Live(app)
    srv.sched, srv.session = sched, session
    return srv


@pytest.fixture(scope="module")
def live():
    srv = serve(body_timeout=0.5)
    yield srv
    srv.stop()


OK = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w3"}], "max_tokens": 2,
        "temperature": 0}


def test_every_field_is_honoured_or_refused_by_name(live):
    refused = [  # (endpoint body, the field the 400 names)
        ({**OK, "presence_penalty": 99}, "presence_penalty"),
        ({**OK, "frequency_penalty": -2.5}, "frequency_penalty"),
        ({**OK, "repetition_penalty": 0}, "repetition_penalty"),
        ({**OK, "min_p": 1.5}, "min_p"),
        ({**OK, "logit_bias": {"999": 1}}, "logit_bias"),
        ({**OK, "logit_bias": {"5": 101}}, "logit_bias"),
        ({**OK, "logit_bias": {"x": 1}}, "logit_bias"),
        ({**OK, "stop_token_ids": [61]}, "stop_token_ids"),
        ({**OK, "best_of": 2}, "best_of"),
        ({**OK, "suffix": "w3"}, "suffix"),
        ({**OK, "n": 2}, "n"),  # n > 1 at temperature 0: n equal choices
        ({**OK, "n": 17, "temperature": 1}, "n"),
        ({**OK, "frobnicate": 1}, "frobnicate"),  # unknown: OpenAI refuses it too
        ({**OK, "messages": []}, "messages"),  # a chat field on completions
        ({**OK, "stream_options": {"include_usage": True}}, "stream_options"),  # not streamed
        ({**CHAT, "response_format": {"type": "bogus"}}, "response_format"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({**CHAT, "tool_choice": "auto"}, "tool_choice"),  # without tools
        ({**CHAT, "functions": [{"name": "f"}]}, "functions"),
        ({**CHAT, "function_call": "auto"}, "function_call"),
        ({**CHAT, "echo": True}, "echo"),  # a completions field on chat
        ({**OK, "logprobs": 21}, "logprobs"),
        ({**OK, "logprobs": True}, "logprobs"),  # completions: a count, not a flag
        ({**OK, "echo": True, "stream": True}, "echo"),
        ({**OK, "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({**CHAT, "logprobs": 1}, "logprobs"),  # chat: a flag
    ]
    for body, name in refused:
        path = "/v1/chat/completions" if "messages" in body and "prompt" not in body \
            else "/v1/completions"
        st, _, r = live.json("POST", path, body)
        assert st == 400 and r["error"]["param"] == name, (body, r)
        assert name in r["error"]["message"]
    accepted = [  # neutral values, informational fields, null as absence
        ({**OK, "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "logprobs": None,
          "echo": False, "logit_bias": {}, "user": "u", "stream": None}, "/v1/completions"),
        ({**CHAT, "response_format": {"type": "text"}, "metadata": {"k": "v"}, "store": False,
          "logprobs": False, "tool_choice": None, "parallel_tool_calls": True},
         "/v1/chat/completions"),
    ]
    for body, path in accepted:
        st, _, r = live.json("POST", path, body)
        assert st == 200, (body, r)
    # max_completion_tokens null beside max_tokens: the one given counts
    st, _, r = live.json("POST", "/v1/completions", {**OK, "max_completion_tokens": None,
                                                     "max_tokens": 3, "temperature": 0})
    assert st == 200 and r["usage"]["completion_tokens"] <= 3
    st, _, r = live.json("GET", "/v1/completions")
    assert st == 405 and r["error"]["type"] == "invalid_request_error"


def test_malformed_bodies_are_400s_not_500s(live):
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    st, _, r = live.json("POST", "/v1/completions", raw=deep)
    assert st in (400, 413) and r["error"]["type"] == "invalid_request_error"
    for raw, param in [(b'{"model": "tiny", "prompt": "w3 \\ud800 w4"}', "prompt"),
                       (b'{"model": "tiny", "messages": [{"role": "user", "content": '
                        b'"\\udfff"}]}', "messages")]:
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        st, _, r = live.json("POST", path, raw=raw)
        assert st == 400 and r["error"]["param"] == param, r
    assert live.json("POST", "/v1/completions", OK)[0] == 200


def test_deep_nesting_is_a_400_under_a_large_body_limit():
    srv = serve(max_body=1 << 20)
    try:
        deep = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        st, _, r = srv.json("POST", "/v1/completions", raw=deep)
        assert st == 400 and "nested too deeply" in r["error"]["message"]
    finally:
        srv.stop()


def raw_request(port, head: bytes, body: bytes):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(head + body)
    return s


def test_slow_and_vanishing_bodies(live, caplog):
    body = json.dumps(OK).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    # a body that never completes: 408 once body_timeout (0.5 s here) has passed
    s = raw_request(live.port, head, body[:10])
    t0 = time.monotonic()
    reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 5
    s.close()
    # a client leaving mid-body: one log line, no traceback, and the server serves on
    with caplog.at_level(logging.WARNING):
        s = raw_request(live.port, head, body[:10])
        time.sleep(0.05)  # let the server start reading the body before the client leaves
        s.close()
        deadline = time.time() + 5
        while not any("disconnected while sending" in r.message for r in caplog.records) \
                and time.time() < deadline:
            time.sleep(0.01)
    mine = [r for r in caplog.records if "disconnected while sending" in r.message]
    assert len(mine) == 1 and not any(r.exc_info for r in caplog.records)
    assert live.json("POST", "/v1/completions", OK)[0] == 200


def test_a_client_leaving_a_plain_request_frees_its_slot(live, monkeypatch):
    jobs = capture_jobs(live.sched, monkeypatch)
    with live.session.hold():  # no step can run until the client has gone
        body = json.dumps({**OK, "max_tokens": 50}).encode()
        s = raw_request(live.port, (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode(), body)
        deadline = time.time() + 20
        while not jobs and time.time() < deadline:
            time.sleep(0.01)
        s.shutdown(socket.SHUT_RDWR)
        s.close()
        while not (jobs and jobs[0].cancelled) and time.time() < deadline:
            time.sleep(0.01)
        assert jobs[0].cancelled  # noticed before any token was produced
    while live.sched.load()["active"] and time.time() < deadline:
        time.sleep(0.01)
    assert live.sched.load()["active"] == 0 and len(jobs[0].generated) < 50


def test_the_eos_token_ends_the_text_without_appearing_in_it():
    first = random_session(1).generate([5, 9], 1)[0]  # greedy's first token, made the eos
    srv = serve(eos_ids=[first])
    try:
        st, _, r = srv.json("POST", "/v1/completions", {
            "model": "tiny", "prompt": "w5 w9", "max_tokens": 5, "temperature": 0})
        assert st == 200 and r["choices"][0]["text"] == ""
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == 1
    finally:
        srv.stop()


@pytest.mark.python_only
def test_stop_strings_match_like_a_plain_search():
    # the automata against str.find over random words, stop strings that overlap themselves
    rng = random.Random(7)
    tk = word_tokenizer()
    for _ in range(200):
        ids = [rng.choice([1, 2, 3, 11, 12]) for _ in range(rng.randint(1, 30))]
        stops = [" ".join(WORDS[rng.choice([1, 2, 3, 11, 12])] for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 4))]
        full = text_of(ids)
        cuts = [full.find(s) for s in stops if full.find(s) >= 0]
        ts = TextStream(tk, stops)
        got, stopped = "", False
        for t in ids:
            piece, stopped = ts.push(t)
            got += piece
            if stopped:
                break
        if not stopped:
            got += ts.finish()
        assert got == (full[:min(cuts)] if cuts else full), (ids, stops)


@pytest.mark.python_only
def test_long_stop_strings_cost_time_in_the_new_text_only():
    # Four 12,000-character stop strings that keep almost matching: a rescan per token of
    # the held-back tail costs O(stop length^2) each (seconds a token); the automata cost
    # the token's own characters. Timed against the same tokens with no stop strings.
    tk = word_tokenizer()
    ids = [1] * 400
    stops = [" ".join(["w1"] * 4000) + f" w{k}" for k in range(2, 6)]  # 12,002 characters each

    def run(stops):
        t0 = time.perf_counter()
        ts = TextStream(tk, stops)
        out = "".join(ts.push(t)[0] for t in ids) + ts.finish()
        return time.perf_counter() - t0, out

    plain_s, plain = min(run([]) for _ in range(3))
    held_s, held = min(run(stops) for _ in range(3))
    assert held == plain  # never matched: everything comes out at the end
    assert held_s < 10 * plain_s + 0.5, (held_s, plain_s)


def test_shutdown_ends_every_open_stream_with_a_final_event(monkeypatch):
    srv = serve()
    jobs = capture_jobs(srv.sched, monkeypatch)
    try:
        with srv.session.hold():  # the job cannot finish before the shutdown
            c, r = sse(srv, {**CHAT, "max_tokens": 40, "stream": True})
            assert r.read(6) == b"data: "
            # what `algenta serve` does when --grace runs out (close waits for the worker,
            # which waits for this hold: so on a thread)
            closer = threading.Thread(target=srv.sched.close, kwargs={"cancel": True})
            closer.start()
            deadline = time.time() + 20
            while not (jobs and jobs[0].cancelled) and time.time() < deadline:
                time.sleep(0.01)
            assert jobs[0].cancelled  # even while the worker was placing it
        closer.join(20)
        rest = r.read().decode()
        events = [e for e in rest.split("\n\n") if e.strip()]
        last = json.loads(events[-1].split("data: ", 1)[1])
        assert "shutting down" in last["error"]["message"]
    finally:
        srv.stop()


@pytest.mark.slow
def test_the_commands_arguments_are_refused_in_one_line(tmp_path):
    from test_residentk_loader import make_ckpt

    make_ckpt(tmp_path)
    word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    cmd = [sys.executable, "-m", "algenta", "serve", "--model", str(tmp_path)]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        for extra, says in [(["--port", "99999"], "[0, 65535]"),
                            (["--api-key", ""], "API key is empty"),
                            (["--grace", "-1"], "--grace"),
                            (["--port", str(busy.getsockname()[1])], "cannot listen")]:
            p = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=120)
            assert p.returncode == 2 and says in p.stderr, (extra, p.stderr)
            assert "Traceback" not in p.stderr and "algenta serve: '" not in p.stderr
    (tmp_path / "tokenizer.json").unlink()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--ids" not in p.stderr and "tokenizer.json" in p.stderr


def log_softmax(logits):
    x = np.asarray(logits, np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_logprobs_of_generated_and_echoed_tokens_are_the_models_own(live):
    prompt = [5, 9, 1, 33]
    solo = random_session(1)
    want = solo.generate(prompt, 4, stop_ids=[60])
    solo.reset()
    rows = [log_softmax(solo.prefill([t])) for t in prompt + want[:-1]]  # position by position
    st, _, r = live.json("POST", "/v1/completions", {**OK, "prompt": prompt, "max_tokens": 4,
                                                     "logprobs": 3, "echo": True})
    assert st == 200, r
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == text_of(prompt) + text_of([t for t in want if t != 60])
    seq = prompt + want
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # the served values are the float64 log-softmax of the session's own float32 logits
    assert lp["token_logprobs"][1:] == [rows[i][seq[i + 1]] for i in range(len(seq) - 1)]
    for i, top in enumerate(lp["top_logprobs"][1:]):
        order = np.argsort(-rows[i], kind="stable")[:3]
        assert top == {WORDS[k]: rows[i][k] for k in order}
    assert len(lp["tokens"]) == len(lp["text_offset"]) == len(seq)
    # greedy: the chosen token is the most likely; the prompt alone scored with max_tokens 0
    st, _, r0 = live.json("POST", "/v1/completions", {**OK, "prompt": prompt, "max_tokens": 0,
                                                      "logprobs": 0, "echo": True})
    assert st == 200 and r0["choices"][0]["text"] == text_of(prompt)
    assert r0["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:4]
    assert r0["usage"]["completion_tokens"] == 0


def test_chat_logprobs_streamed_and_not_agree(live):
    body = {**CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, "temperature": 0.7,
            "seed": 3}
    st, _, whole = live.json("POST", "/v1/chat/completions", body)
    assert st == 200, whole
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"]
    for e in content:
        assert len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode())
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["logprob"] <= e["top_logprobs"][0]["logprob"]  # sampled: not always the top
    streamed = [x for e in sse_chunks(live, {**body, "stream": True}) for ch in e["choices"]
                if ch["logprobs"] for x in ch["logprobs"]["content"]]
    assert streamed == content


@pytest.mark.slow
def test_echoed_logprobs_match_transformers_float32(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_residentk_loader import make_ckpt

    make_ckpt(tmp_path)
    session = ResidentSession.from_pretrained(tmp_path, max_ctx=64, progress=False)
    sched = Scheduler(session)
    srv = Live(build_app(sched, word_tokenizer(), model_name="m", api_key=KEY))
    try:
        prompt = [3, 17, 42, 8, 8, 29, 51, 2]
        st, _, r = srv.json("POST", "/v1/completions", {"model": "m", "prompt": prompt,
                                                        "max_tokens": 0, "logprobs": 0,
                                                        "echo": True})
        assert st == 200, r
        got = r["choices"][0]["logprobs"]["token_logprobs"]
    finally:
        srv.stop()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), prompt[1:]].tolist()
    assert got[0] is None
    assert np.max(np.abs(np.array(got[1:]) - np.array(want))) < 1e-4


def test_n_choices_are_each_what_their_seed_gives_alone(live):
    prompt = [7, 2, 40]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 2.0, "seed": 21,
            "n": 2}
    before = live.sched.load()["stats"]
    st, _, r = live.json("POST", "/v1/completions", body)
    assert st == 200, r
    after = live.sched.load()["stats"]
    # the prompt prefilled once: the second choice copied all but its last token
    assert after["prefill_tokens"] - before["prefill_tokens"] == 3 + 1
    assert after["reused_tokens"] - before["reused_tokens"] == 2
    solo = random_session(1)

    def alone(n_tokens):  # choice i samples with seed + i * 0x9e3779b97f4a7c15 (mod 2^64)
        out = []
        for i in range(2):
            solo.reset()
            ids = solo.generate(prompt, n_tokens, temperature=2.0,
                                seed=(21 + i * 0x9E3779B97F4A7C15) % (1 << 64), stop_ids=[60])
            out.append(text_of([t for t in ids if t != 60]))
        return out

    def streamed(extra):  # each choice's text and finish_reason, from chunks naming its index
        got, reasons = ["", ""], [None, None]
        for e in sse_chunks(live, {**body, "stream": True, **extra}, "/v1/completions"):
            for ch in e["choices"]:
                got[ch["index"]] += ch["text"]
                reasons[ch["index"]] = ch["finish_reason"] or reasons[ch["index"]]
        return got, reasons

    want = alone(8)
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == want and want[0] != want[1]
    assert r["usage"]["prompt_tokens"] == 3 and r["usage"]["completion_tokens"] == 16
    got, reasons = streamed({})  # streamed: the same choices, each with its finish_reason
    assert got == want and None not in reasons
    # a stop string ending one choice early leaves the other running (its job's "cancelled"
    # is not the stream's end): 40 tokens, so the other is still decoding when it comes
    want = alone(40)
    assert "w25" in want[0][:40] and "w25" not in want[1]
    got, reasons = streamed({"stop": "w25", "max_tokens": 40})
    assert reasons == ["stop", "length"]
    assert got == [want[0][:want[0].index("w25")], want[1]]
    # more choices than slots and queue: refused whole, nothing left running
    st, _, r = live.json("POST", "/v1/completions", {**body, "n": 3})
    assert st == 429
    deadline = time.time() + 10
    while live.sched.load()["active"] and time.time() < deadline:
        time.sleep(0.01)
    assert live.sched.load()["active"] == 0


def test_penalties_bias_and_min_p_against_their_formulas(live):
    prompt = [7, 2, 40]  # greedy repeats w40, by a margin of about 4 over the next
    solo = random_session(1)

    def greedy(adjust, n=8):  # the reference: the session's logits changed by the formula
        solo.reset()
        out, logits = [], solo.prefill(prompt)
        for _ in range(n):
            x = adjust(np.asarray(logits, np.float64), out)
            out.append(int(np.argmax(x)))
            logits = solo.step(out[-1])
        return out

    def pres_freq(x, out):  # OpenAI's: the output's counts only
        c = np.bincount(np.array(out, np.int64), minlength=x.size)
        return x - c * 1.5 - (c > 0) * 2.0

    def repetition(x, out):  # transformers': prompt and output, / a positive logit, * a negative
        seen = np.zeros(x.size, bool)
        seen[prompt + out] = True
        x[seen] = np.where(x[seen] > 0, x[seen] / 1.5, x[seen] * 1.5)
        return x

    for extra, adjust in [({"presence_penalty": 2.0, "frequency_penalty": 1.5}, pres_freq),
                          ({"repetition_penalty": 1.5}, repetition)]:
        want = greedy(adjust)
        assert want != greedy(lambda x, out: x)  # the penalty changes this output
        st, _, r = live.json("POST", "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})
        assert st == 200 and r["choices"][0]["text"] == text_of(want), (extra, r)
    # a +100 bias makes its token every choice; as a stop token id it ends the output unseen
    st, _, r = live.json("POST", "/v1/completions", {**OK, "max_tokens": 3,
                                                     "logit_bias": {"17": 100}})
    assert r["choices"][0]["text"] == "w17 w17 w17"
    st, _, r = live.json("POST", "/v1/completions", {**OK, "max_tokens": 3,
                                                     "logit_bias": {"17": 100},
                                                     "stop_token_ids": [17]})
    assert r["choices"][0]["text"] == "" and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == 1
    # min_p: sampled with the session's own sampler over the logits the rule leaves
    from algenta.residentk.session import _sampler

    pick = _sampler(1.5, None, None, 4, DIMS["vocab"])
    solo.reset()
    out, logits = [], solo.prefill(prompt)
    for _ in range(8):
        x = np.asarray(logits, np.float64).copy()
        p = np.exp((x - x.max()) / 1.5)
        x[p < 0.3 * p.max()] = np.finfo(np.float64).min
        out.append(pick(x))
        logits = solo.step(out[-1])
    st, _, r = live.json("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 1.5, "seed": 4,
        "min_p": 0.3})
    assert r["choices"][0]["text"] == text_of([t for t in out if t != 60])


def test_metrics_count_requests_tokens_and_latencies():
    parser = pytest.importorskip("prometheus_client.parser")
    srv = serve()
    try:
        def scrape():
            st, h, data = srv.request("GET", "/metrics", key=None)  # open, like /health
            assert st == 200 and h["content-type"].startswith("text/plain")
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in parser.text_string_to_metric_families(data.decode())
                    for s in f.samples}

        before = scrape()
        assert before[("algenta_slots", ())] == 2 and before[("algenta_slots_in_use", ())] == 0
        for _ in range(3):
            assert srv.json("POST", "/v1/completions", {**OK, "max_tokens": 4})[0] == 200
        assert srv.json("POST", "/v1/completions", {**OK, "n": 99})[0] == 400
        assert srv.json("GET", "/nowhere")[0] == 404
        m = scrape()
        assert m[("algenta_requests_total", (("route", "/v1/completions"),
                                             ("status", "200")))] == 3
        assert m[("algenta_requests_total", (("route", "/v1/completions"),
                                             ("status", "400")))] == 1
        assert m[("algenta_requests_total", (("route", "unmatched"), ("status", "404")))] == 1
        assert m[("algenta_prompt_tokens_total", ())] == 3 * 2
        assert m[("algenta_generation_tokens_total", ())] == 3 * 4
        assert m[("algenta_time_to_first_token_seconds_count", ())] == 3
        assert m[("algenta_inter_token_latency_seconds_count", ())] == 3 * 3
        assert m[("algenta_model_info", (("model", "tiny"),))] == 1
    finally:
        srv.stop()


def json_server(template=TEMPLATE):
    """A byte-level BPE tokenizer that can spell JSON, over a random session of its vocabulary;
    its id 0 is the eos."""
    tokenizers = pytest.importorskip("tokenizers")
    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    tk.train_from_iterator(['{"name": "Ann", "age": 31, "tags": ["a", "b"]}'] * 20,
                           tokenizers.trainers.BpeTrainer(
                               vocab_size=300, special_tokens=["<eos>"],
                               initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    session = ResidentSession.random(d_model=48, h_q=4, h_kv=2, d_head=16, d_ff=96, n_layers=2,
                                     vocab=tk.get_vocab_size(), slots=2, seed=5, max_ctx=256)
    sched = Scheduler(session, max_queue=4)
    srv = Live(build_app(sched, tk, model_name="tiny", eos_ids=[0], api_key=KEY,
                         chat_template=template))
    srv.sched, srv.session = sched, session
    return srv


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["a", "b"]}}}}


def test_structured_output_is_valid_json_of_the_schema_from_a_random_model():
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    srv = json_server()
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                      "strict": True}}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Ann"}],
                "max_tokens": 100, "temperature": 1.0, "seed": 1, "n": 2,
                "response_format": fmt}
        st, _, r = srv.json("POST", "/v1/chat/completions", body)
        assert st == 200, r
        for ch in r["choices"]:  # a random model's sampling, held to the schema
            assert ch["finish_reason"] == "stop"
            jsonschema.validate(json.loads(ch["message"]["content"]), PERSON)
        st, _, r = srv.json("POST", "/v1/chat/completions", {
            **body, "n": 1, "temperature": 0, "response_format": {"type": "json_object"}})
        assert st == 200
        if r["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
        for bad in [{"type": "json_schema", "json_schema": {"name": "x",
                                                            "schema": {"type": "bogus"}}},
                    {"type": "json_schema"}, {"type": "xml"}, "json"]:
            st, _, r = srv.json("POST", "/v1/chat/completions", {**body, "response_format": bad})
            assert st == 400 and r["error"]["param"] == "response_format", (bad, r)
        # one sequence's mask never changes another's bits: a plain request beside a
        # constrained one decodes as alone
        plain = {"model": "tiny", "prompt": "Ann is", "max_tokens": 12, "temperature": 0}
        alone = srv.json("POST", "/v1/completions", plain)[2]["choices"][0]["text"]
        got = {}
        threads = [threading.Thread(target=lambda: got.setdefault("c", srv.json(
                       "POST", "/v1/chat/completions", {**body, "n": 1}))),
                   threading.Thread(target=lambda: got.setdefault("p", srv.json(
                       "POST", "/v1/completions", plain)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got["p"][2]["choices"][0]["text"] == alone and got["c"][0] == 200
    finally:
        srv.stop()


HERMES = ("{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>"
          "{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<tool_response>"
          "{{ m.content }}</tool_response>{%- elif m.tool_calls %}{% for c in m.tool_calls %}"
          "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{%- else %}{{ m.role }}: "
          "{{ m.content }} {% endif %}{% endfor %}assistant:")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 8}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "properties": {}}}}


def test_tool_calls_required_named_streamed_and_answered():
    pytest.importorskip("llguidance")
    srv = json_server(HERMES)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Oslo?"}],
                "max_tokens": 150, "temperature": 1.0, "seed": 3, "tools": [WEATHER, TIME],
                "tool_choice": "required"}
        st, _, r = srv.json("POST", "/v1/chat/completions", body)
        assert st == 200, r
        ch = r["choices"][0]
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
        (call,) = ch["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in ("get_weather", "get_time")
        args = json.loads(call["function"]["arguments"])
        assert set(args) == ({"city"} if call["function"]["name"] == "get_weather" else set())
        # the tools are in the prompt: it is longer than without them
        plain = srv.json("POST", "/v1/chat/completions", {**body, "tools": None,
                                                          "tool_choice": None})[2]
        assert r["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
        named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
        st, _, r = srv.json("POST", "/v1/chat/completions", named)
        assert [c["function"]["name"] for c in r["choices"][0]["message"]["tool_calls"]] == \
            ["get_time"]
        # streamed: the call as one delta, then finish_reason tool_calls
        chunks = [e["choices"][0] for e in sse_chunks(srv, {**named, "stream": True})]
        deltas = [d["delta"]["tool_calls"] for d in chunks if "tool_calls" in d["delta"]]
        assert chunks[-1]["finish_reason"] == "tool_calls"
        assert len(deltas) == 1 and deltas[0][0]["function"]["name"] == "get_time"
        assert deltas[0][0]["index"] == 0
        # the tool's result as the next request's message
        follow = {"model": "tiny", "max_tokens": 5, "temperature": 0, "tools": [WEATHER],
                  "messages": [{"role": "user", "content": "Oslo?"},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": "call_1", "type": "function", "function": {
                                       "name": "get_weather",
                                       "arguments": '{"city": "Oslo"}'}}]},
                               {"role": "tool", "tool_call_id": "call_1", "content": "7 C"}]}
        assert srv.json("POST", "/v1/chat/completions", follow)[0] == 200
        for bad, param in [({**body, "tool_choice": {"type": "function",
                                                     "function": {"name": "nope"}}},
                            "tool_choice"),
                           ({**body, "tools": [{"type": "function", "function": {
                               "name": "bad name"}}]}, "tools"),
                           ({**body, "tools": [WEATHER, WEATHER]}, "tools"),
                           ({**body, "response_format": {"type": "json_object"}},
                            "response_format")]:
            st, _, r = srv.json("POST", "/v1/chat/completions", bad)
            assert st == 400 and r["error"]["param"] == param, (bad, r)
    finally:
        srv.stop()
    # a template that writes no tool-call format: tools are refused, not ignored
    srv = json_server()
    try:
        st, _, r = srv.json("POST", "/v1/chat/completions", {**body, "tool_choice": "auto"})
        assert st == 400 and r["error"]["param"] == "tools"
    finally:
        srv.stop()


@pytest.mark.python_only
def test_tool_calls_are_parsed_in_each_familys_format():
    from algenta.serve_tools import parse_calls

    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse_calls("hermes", text)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == \
        ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parse_calls("hermes", "<tool_call>{not json}</tool_call>") == \
        ("<tool_call>{not json}</tool_call>", [])
    content, calls = parse_calls("llama3_json", ' {"name": "f", "parameters": {"x": 1}}')
    assert content is None and calls[0]["function"]["arguments"] == '{"x": 1}'
    assert parse_calls("llama3_json", "plain text") == ("plain text", [])


@pytest.mark.python_only
def test_think_text_is_split_from_the_content_however_it_is_cut():
    from algenta.serve_text import ThinkSplit

    rng = random.Random(3)
    for text, opened, want in [
            ("<think>step one</think>\n\nThe answer.", False, ("step one", "The answer.")),
            ("step one</think>\n\nThe answer.", True, ("step one", "The answer.")),
            ("Just text <think> inside", False, ("", "Just text <think> inside")),
            ("<think>cut by max_tokens", False, ("cut by max_tokens", "")),
            ("<thi", False, ("", "<thi")),
            ("", True, ("", ""))]:
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            sp = ThinkSplit(opened)
            parts = [p for piece in pieces for p in sp.push(piece)] + sp.finish()
            got = ("".join(t for k, t in parts if k == "reasoning"),
                   "".join(t for k, t in parts if k == "content"))
            assert got == want, (text, pieces, got)


def test_a_thinking_templates_reasoning_comes_apart_streamed_and_not():
    session = random_session(1, max_ctx=64)
    srv = Live(build_app(Scheduler(session), word_tokenizer(), model_name="tiny", api_key=KEY,
                         chat_template=TEMPLATE.replace("w3{% endif %}",
                                                        "w3 <think>{% endif %}")))
    try:
        body = {**CHAT, "max_tokens": 6}
        st, _, r = srv.json("POST", "/v1/chat/completions", body)
        msg = r["choices"][0]["message"]
        # the template opened <think> and this model never closes it: all reasoning
        assert st == 200 and msg["content"] == "" and len(msg["reasoning_content"].split()) == 6
        deltas = [e["choices"][0]["delta"] for e in sse_chunks(srv, {**body, "stream": True})]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == \
            msg["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == ""
    finally:
        srv.stop()


@pytest.mark.slow
def test_the_openai_client_gets_logprobs_choices_schemas_tools_and_refusals():
    openai = pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    srv = json_server(HERMES)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key=KEY,
                               max_retries=0)
        msgs = [{"role": "user", "content": "Ann"}]
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, n=2,
                                           temperature=1.0, seed=5, logprobs=True,
                                           top_logprobs=2)
        assert [c.index for c in r.choices] == [0, 1]
        assert sum(len(c.logprobs.content) for c in r.choices) == r.usage.completion_tokens
        assert all(len(e.top_logprobs) == 2 for c in r.choices for e in c.logprobs.content)
        r = client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=100, temperature=1.0, seed=2,
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=150,
                                           temperature=1.0, seed=3, tools=[WEATHER],
                                           tool_choice="required")
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and "city" in json.loads(
            call.function.arguments)
        stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=150,
                                                temperature=1.0, seed=3, tools=[WEATHER],
                                                tool_choice="required", stream=True)
        deltas = [d for ch in stream for d in (ch.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas] == ["get_weather"]
        assert deltas[0].function.arguments == call.function.arguments  # same seed, same call
        r = client.completions.create(model="tiny", prompt="Ann is", max_tokens=3, logprobs=2,
                                      echo=True, temperature=0)
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.top_logprobs)
        for kw, name in [({"presence_penalty": 9}, "presence_penalty"),
                         ({"extra_body": {"best_of": 3}}, "best_of"),
                         ({"extra_body": {"frobnicate": 1}}, "frobnicate")]:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, **kw)
            assert e.value.body["param"] == name
    finally:
        srv.stop()
