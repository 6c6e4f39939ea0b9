"""Serving: the slot scheduler (continuous batching, prefix reuse, cancellation, its bounded
queue) and ``algenta serve``'s OpenAI-compatible HTTP API end to end, over a real uvicorn on a
loopback port: every answer checked against the session decoding the same prompt alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import http.client

import numpy as np
import pytest

from algenta import ResidentError
from algenta.residentk.batch import QueueFull, Scheduler
from algenta.residentk.session import ResidentSession

# The scheduler and the HTTP server over a session: host-side work, whatever order a block's
# threads run in.
pytestmark = pytest.mark.one_order


DIMS = dict(d_model=48, h_q=4, h_kv=2, d_head=16, d_ff=96, n_layers=2, vocab=61)


def random_session(slots, **kw):
    return ResidentSession.random(**DIMS, slots=slots, seed=5, **kw)


# ---- the scheduler --------------------------------------------------------------------------
@pytest.mark.parametrize("weights", ["f32", "int8"])
def test_jobs_decode_the_same_together_as_alone(weights, device):
    if device == "cuda" and weights == "f32":  # test_residentk_slots.py covers the formats
        pytest.skip("one weight format through the scheduler on the CUDA engine")
    rng = np.random.default_rng(2)
    system = list(rng.integers(0, DIMS["vocab"], 17))
    prompts = [system + list(rng.integers(0, DIMS["vocab"], k)) for k in (2, 9, 1, 30, 4, 6, 3)]
    args = [dict(temperature=0.0), dict(temperature=0.9, seed=1), dict(temperature=0.7, top_k=5,
            seed=2), dict(temperature=1.1, top_p=0.8, seed=3), dict(temperature=0.0),
            dict(temperature=0.5, seed=4), dict(temperature=0.0)]
    # alone: by itself in a session of slots (on the CUDA engine a session of one slot
    # prefills through GEMMs, to float32 rounding of these bits: test_residentk_slots.py)
    solo = random_session(2, weights=weights, device=device)
    want = [solo.generate(p, 10, **a) for p, a in zip(prompts, args)]
    sched = Scheduler(random_session(3, weights=weights, device=device), prefill_chunk=8)
    try:
        jobs = [sched.submit(p, 10, **a) for p, a in zip(prompts, args)]
        got = [j.result(timeout=60) for j in jobs]
    finally:
        sched.close()
    assert got == want
    assert sched.stats["reused_tokens"] >= 17 * 4  # the system prompt came from the cache
    assert sched.stats["step_rows"] > sched.stats["steps"]  # sequences stepped together


def test_stop_ids_cancel_and_the_bounded_queue():
    s = random_session(1)
    gate, entered = threading.Event(), threading.Event()

    def blocking(ev):  # holds the worker (and so the only slot) until the gate opens
        entered.set()
        gate.wait(30)

    sched = Scheduler(s, max_queue=1)
    try:
        first = sched.submit([1, 2, 3], 5, on_event=blocking)
        assert entered.wait(30)
        waiting = sched.submit([4, 5], 5)
        with pytest.raises(QueueFull):
            sched.submit([6], 5)
        waiting.cancel()
        gate.set()
        assert list(waiting.events(timeout=30))[-1] == ("done", "cancelled")
        while first.finish_reason is None:
            time.sleep(0.01)
        assert first.finish_reason == "length" and len(first.generated) == 5
        greedy = random_session(1).generate([7, 8], 6)
        stopper = sched.submit([7, 8], 6, stop_ids=[greedy[2]])
        got = stopper.result(timeout=30)
        assert got == greedy[:greedy.index(greedy[2]) + 1] and stopper.finish_reason == "stop"
        for bad, status in ((([], 3), 601), (([1], 0), 601), (([1], 600), 606),
                            (([DIMS["vocab"]], 3), 601)):
            with pytest.raises(ResidentError) as e:
                sched.submit(*bad)
            assert e.value.status == status
        load = sched.load()
        assert (load["slots"], load["active"], load["waiting"]) == (1, 0, 0)
        assert load["stats"]["engine_seconds"] > 0 and load["stats"]["cancelled"] == 1
    finally:
        gate.set()
        sched.close()
    with pytest.raises(RuntimeError):
        sched.submit([1], 1)


@pytest.mark.cuda
def test_an_engine_failure_ends_the_running_jobs_and_the_scheduler_serves_on():
    # The CUDA emulator fails the n-th next CUDA call on request: a 608 inside a step must end
    # the jobs that were running with that error, leave the slot's cache consistent, and the
    # next job must decode what the session decodes alone.
    from algenta import _core
    from algenta.errors import ResidentUnavailableError

    if _core.session.cuda_backend()["kind"] != "emulator":
        pytest.skip("failure injection is a hook of the CUDA emulator build")
    s = random_session(1, device="cuda")
    want = random_session(1, device="cuda").generate([4, 2], 5)
    sched = Scheduler(s)
    try:
        assert _core.session.cuda_emulator_fail_after(3)
        first = sched.submit([4, 2], 5)
        with pytest.raises(ResidentUnavailableError) as e:
            first.result(timeout=120)
        assert e.value.status == 608 and first.finish_reason == "error"
        _core.session.cuda_emulator_fail_after(0)
        assert sched.submit([4, 2], 5).result(timeout=120) == want
    finally:
        _core.session.cuda_emulator_fail_after(0)
        sched.close()


# ---- the HTTP server ------------------------------------------------------------------------
starlette = pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
tokenizers = pytest.importorskip("tokenizers")

from algenta.serve import TextStream, build_app  # noqa: E402

WORDS = [f"w{i}" for i in range(DIMS["vocab"])]
KEY = "sekrit"
TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
            "{% if add_generation_prompt %}w3{% endif %}")


def word_tokenizer():
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins the words with spaces
    return tk


def text_of(ids):
    return " ".join(WORDS[t] for t in ids)


class Live:
    """uvicorn serving an app on a loopback port, in a thread of this process."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def request(self, method, path, body=None, *, key=KEY, raw=None, headers=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = dict(headers or {})
        if key:
            h["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else (None if body is None else json.dumps(body))
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        out = r.status, dict(r.getheaders()), r.read()
        c.close()
        return out

    def json(self, method, path, body=None, **kw):
        st, h, data = self.request(method, path, body, **kw)
        return st, h, json.loads(data)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def live():
    session = random_session(2, max_ctx=64)
    sched = Scheduler(session, max_queue=0)
    app = build_app(sched, word_tokenizer(), model_name="tiny", eos_ids=[60],
                    chat_template=TEMPLATE, api_key=KEY, max_body=4096)
    srv = Live(app)
    srv.sched, srv.session = sched, session
    yield srv
    srv.stop()


def test_completions_match_the_session_alone(live):
    solo = random_session(1)
    prompt = [5, 9, 1, 33]
    want = solo.generate(prompt, 8, stop_ids=[60])
    st, _, r = live.json("POST", "/v1/completions", {"model": "tiny", "prompt": text_of(prompt),
                                                     "max_tokens": 8, "temperature": 0})
    assert st == 200 and r["object"] == "text_completion"
    assert r["choices"][0]["text"] == text_of([t for t in want if t != 60])
    assert r["choices"][0]["finish_reason"] == ("stop" if want[-1] == 60 else "length")
    assert r["usage"] == {"prompt_tokens": 4, "completion_tokens": len(want),
                          "total_tokens": 4 + len(want)}
    # token ids as the prompt, sampled with a seed: the same as the session's own sampler
    want = solo.generate(prompt, 8, temperature=0.8, seed=11, top_k=7, stop_ids=[60])
    st, _, r = live.json("POST", "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                     "max_tokens": 8, "temperature": 0.8,
                                                     "seed": 11, "top_k": 7})
    assert st == 200 and r["choices"][0]["text"] == text_of([t for t in want if t != 60])


def test_concurrent_clients_each_get_what_they_get_alone(live):
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(2, 60, k)) for k in (3, 11, 6, 2, 20, 8)]
    solo = random_session(1)
    want = [text_of([t for t in solo.generate(p, 12, temperature=0.9, seed=i, stop_ids=[60])
                     if t != 60]) for i, p in enumerate(prompts)]
    got = [None] * len(prompts)

    def client(i):
        while True:  # two slots and no queue: a 429 means "retry", as a client would
            st, h, r = live.json("POST", "/v1/completions", {
                "model": "tiny", "prompt": [int(t) for t in prompts[i]], "max_tokens": 12,
                "temperature": 0.9, "seed": i})
            if st != 429:
                break
            assert h.get("retry-after") == "1"
            time.sleep(0.01)
        got[i] = (st, r["choices"][0]["text"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == [(200, w) for w in want]


def sse(live, body, path="/v1/chat/completions"):
    c = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    c.request("POST", path, body=json.dumps(body), headers={"Authorization": f"Bearer {KEY}"})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    return c, r


def sse_chunks(live, body, path="/v1/chat/completions"):
    """A whole stream's chunks, parsed, once it has ended with [DONE]."""
    c, r = sse(live, body, path)
    events = [e[len("data: "):] for e in r.read().decode().split("\n\n")
              if e.startswith("data: ")]
    c.close()
    assert events[-1] == "[DONE]", events[-1:]
    return [json.loads(e) for e in events[:-1]]


def capture_jobs(sched, monkeypatch) -> list:
    """The jobs the scheduler's submit returns from now on, in order."""
    jobs = []
    submit = sched.submit

    def capture(*a, **k):
        jobs.append(submit(*a, **k))
        return jobs[-1]

    monkeypatch.setattr(sched, "submit", capture)
    return jobs


def test_chat_streamed_and_not_agree_and_stop_strings_cut(live):
    body = {"model": "tiny", "messages": [{"role": "system", "content": "w4 w4"},
                                          {"role": "user", "content": [{"type": "text",
                                                                        "text": "w7 w8"}]}],
            "max_tokens": 10, "temperature": 0.6, "seed": 9}
    st, _, whole = live.json("POST", "/v1/chat/completions", body)
    assert st == 200 and whole["object"] == "chat.completion"
    msg = whole["choices"][0]["message"]
    assert msg["role"] == "assistant"
    solo = random_session(1)
    ids = [1, 4, 4, 2, 1, 7, 8, 2, 3]  # the template's rendering, tokenized
    want = solo.generate(ids, 10, temperature=0.6, seed=9, stop_ids=[60])
    assert msg["content"] == text_of([t for t in want if t != 60])
    chunks = sse_chunks(live, {**body, "stream": True,
                               "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks[:-1])
    assert text == msg["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    # a stop string: the text ends before it, finish_reason "stop"
    words = msg["content"].split()
    cut = words[3]
    st, _, r = live.json("POST", "/v1/chat/completions", {**body, "stop": [" " + cut, "zz"]})
    first = msg["content"].index(" " + cut)
    assert r["choices"][0]["message"]["content"] == msg["content"][:first]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_text_stream_holds_back_a_possible_stop_string():
    ts = TextStream(word_tokenizer(), stops=["w5 w6"])
    assert ts.push(3) == ("w3", False)
    assert ts.push(5) == (" ", False)  # " w5" may begin the stop string
    assert ts.push(7) == ("w5 w7", False)
    assert ts.push(5) == (" ", False)
    assert ts.push(6) == ("", True)
    assert ts.text.startswith("w3 w5 w7 w5 w6") and ts.finish() == ""


def test_text_stream_is_the_whole_decode_for_byte_level_tokens():
    # byte-level BPE: a multi-byte character spans tokens and decodes to U+FFFD until complete
    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    tk.train_from_iterator(["plain words here"], tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    text = "h\u00e9llo \U0001F642 w\u00f6rld, \u4e16\u754c words here"
    ids = tk.encode(text).ids
    assert len(ids) > len(text.encode()) // 2  # the emoji and CJK took several byte tokens
    ts = TextStream(tk)
    got = "".join(ts.push(t)[0] for t in ids) + ts.finish()
    assert got == tk.decode(ids) == text
    ts = TextStream(tk, stops=["\u754c w"])  # a stop string across tokens and characters
    got = ""
    for t in ids:
        piece, stopped = ts.push(t)
        got += piece
        if stopped:
            break
    assert stopped and got == text[:text.index("\u754c w")]


def test_errors_answer_in_openai_shape_and_the_server_keeps_serving(live):
    ok = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
    cases = [
        (dict(raw=b"{not json"), 400, None),
        (dict(body={**ok, "max_tokens": "5"}), 400, "max_tokens"),
        (dict(body={**ok, "temperature": 3}), 400, "temperature"),
        (dict(body={**ok, "prompt": ["w1", "w2"]}), 400, "prompt"),
        (dict(body={**ok, "n": 99}), 400, "n"),
        (dict(body={**ok, "stop": ["a"] * 5}), 400, "stop"),
        (dict(body={**ok, "max_tokens": 63}), 400, "max_tokens"),
        (dict(body={**ok, "model": "gpt-4"}), 404, "model"),
        (dict(raw=b"{" + b" " * 5000 + b"}"), 413, None),
        (dict(body=ok, key=None), 401, None),
        (dict(body=ok, key="wrong"), 401, None),
    ]
    for kw, status, param in cases:
        st, _, r = live.json("POST", "/v1/completions", **kw)
        assert st == status, (kw, r)
        assert set(r["error"]) - {"status"} == {"message", "type", "param", "code"}
        assert r["error"]["param"] == param
    st, _, r = live.json("POST", "/v1/completions", {**ok, "max_tokens": 63})
    assert "63" in r["error"]["message"] and "606" in r["error"]["message"] and \
        r["error"]["code"] == "context_length_exceeded" and r["error"]["status"] == 606
    st, _, r = live.json("GET", "/v1/models")
    assert st == 200 and [m["id"] for m in r["data"]] == ["tiny"]
    assert live.json("GET", "/v1/models", key=None)[0] == 401
    st, _, r = live.json("GET", "/health", key=None)
    assert st == 200 and r["status"] == "ok" and r["active"] == 0
    assert live.json("GET", "/nowhere")[0] == 404
    assert live.json("POST", "/v1/completions", ok)[0] == 200


def test_a_client_leaving_mid_stream_frees_its_slot(live, monkeypatch):
    jobs = capture_jobs(live.sched, monkeypatch)
    before = live.sched.stats["cancelled"]
    with live.session.hold():  # the worker cannot run a step until the client has left
        c, r = sse(live, {"model": "tiny", "messages": [{"role": "user", "content": "w9"}],
                          "max_tokens": 50, "temperature": 0, "stream": True})
        assert r.read(6) == b"data: "  # the role chunk: the stream is open
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        deadline = time.time() + 20
        while not (jobs and jobs[0].cancelled) and time.time() < deadline:
            time.sleep(0.01)
        assert jobs[0].cancelled  # noticed while no token had been produced
    while live.sched.load()["active"] and time.time() < deadline:
        time.sleep(0.01)
    assert live.sched.load()["active"] == 0
    assert live.sched.stats["cancelled"] == before + 1 and len(jobs[0].generated) < 50


@pytest.mark.smoke
def test_openai_client(live):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key=KEY)
    r = client.completions.create(model="tiny", prompt="w5 w9", max_tokens=4, temperature=0)
    want = random_session(1).generate([5, 9], 4, stop_ids=[60])
    assert r.choices[0].text == text_of([t for t in want if t != 60])
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w2"}], max_tokens=5,
        temperature=0, stream=True) if ch.choices]
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                    "content": "w2"}],
                                           max_tokens=5, temperature=0)
    assert "".join(parts) == whole.choices[0].message.content


# ---- the command ----------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_serves_a_checkpoint_and_exits_0_on_sigterm(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_residentk_loader import CFG, make_ckpt

    make_ckpt(tmp_path)
    tk = word_tokenizer()
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    cmd = [sys.executable, "-m", "algenta", "serve", "--model", str(tmp_path)]
    # the memory question is answered before anything is read
    big = subprocess.run(cmd + ["--slots", "1024", "--max-ctx", "65536"], capture_output=True,
                         text=True, timeout=120)
    assert big.returncode == 2 and "slots fit" in big.stderr and "Traceback" not in big.stderr
    from algenta import _core

    if not _core.session.cuda_backend()["usable"]:  # refused by name, before loading
        gpu = subprocess.run(cmd + ["--device", "cuda", "--slots", "2"], capture_output=True,
                             text=True, timeout=120)
        assert gpu.returncode == 2 and "device='cuda'" in gpu.stderr, gpu.stderr
        assert "Traceback" not in gpu.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(cmd + ["--port", str(port), "--slots", "2", "--name", "m"],
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("POST", "/v1/completions", body=json.dumps(
                    {"model": "m", "prompt": "w3 w4", "max_tokens": 3, "temperature": 0}))
                r = c.getresponse()
                break
            except OSError:
                assert time.time() < deadline and p.poll() is None, p.stderr.read()
                time.sleep(0.1)
        body = json.loads(r.read())
        solo = ResidentSession.from_pretrained(tmp_path, progress=False)
        want = solo.generate([3, 4], 3)
        assert r.status == 200 and body["choices"][0]["text"] == \
            " ".join(WORDS[t] for t in want)
        assert CFG["vocab"] == len(WORDS)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
