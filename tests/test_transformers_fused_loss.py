"""algenta.transformers.apply_fused_loss against the stock transformers models it patches.

Every supported architecture is built from a tiny random config (prime vocabulary, two layers,
tied and untied heads, Gemma 2/3 with a final-logit soft cap that bites) and re-initialised so the
logits are O(1) (transformers' std-0.02 init gives near-uniform logits that would hide a wrong
shift or a missing cap). The batch is ragged (right padding, attention mask, -100 on the pads
and on a masked prompt). Checked against the unpatched model: loss and every parameter's
gradient (float32 to float32 rounding; float64 to 1e-10 against a float64 reference of the same
loss, since transformers' own loss casts logits to float32), num_items_in_batch (one batch and a
manual two-micro-batch accumulation), Trainer with gradient accumulation (needs accelerate; skipped
without it), generate(), eval mode, return_logits/return_dict, shift_labels, ignore_index, a
biased head, bfloat16, and the refusals. Skipped where torch or transformers is absent."""

from __future__ import annotations

import copy
import inspect
import math
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional

import algenta.torch as at  # noqa: E402
import qwen3_reference as qref  # noqa: E402
import algenta.transformers as atf  # noqa: E402

V = 211  # prime: no vocab block or chunk divides it
B, S = 3, 9
LENGTHS = (9, 6, 4)

_COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
# architecture -> (config class name, its own keywords). Gemma's sliding window is wider than
# the batch: in float64, transformers' Gemma 2/3 attention gives NaN for a query whose window
# holds only padding, and the NaN reaches the real tokens of that row through 0 * NaN in the
# next layer (the stock loss is NaN there too); nothing here is about the window.
SPECS = {
    "LlamaForCausalLM": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "MistralForCausalLM": ("MistralConfig", dict(tie_word_embeddings=False)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(tie_word_embeddings=False)),
    "GemmaForCausalLM": ("GemmaConfig", dict(tie_word_embeddings=True)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(final_logit_softcapping=3.0,
                                               query_pre_attn_scalar=8, sliding_window=16)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(final_logit_softcapping=3.0,
                                                   query_pre_attn_scalar=8, sliding_window=16)),
}
ARCHS = [a for a in SPECS if hasattr(transformers, a) and hasattr(transformers, SPECS[a][0])]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # These models are tiny: a second intra-op thread only adds synchronisation, which on a
    # loaded two-core machine costs more than the work (generate() took ~1.5 s instead of ~0.05 s).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make(arch, dtype=torch.float32, seed=0):
    cfg_name, kw = SPECS[arch]
    cfg = getattr(transformers, cfg_name)(**_COMMON, **kw)
    torch.manual_seed(seed)
    m = getattr(transformers, arch)(cfg)
    qref.o1_init_(m)
    return m.to(dtype).train()


def batch(seed=1, lengths=LENGTHS, seq=S, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (len(lengths), seq), generator=g)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids[mask == 0] = 0
    labels = ids.clone()
    labels[mask == 0] = ignore
    labels[0, :2] = ignore  # a masked prompt inside a sequence, not only padding
    return {"input_ids": ids, "attention_mask": mask}, labels


def pair(arch, dtype=torch.float32, **kw):
    stock = make(arch, dtype)
    return stock, atf.apply_fused_loss(copy.deepcopy(stock), **kw)


def assert_grads_close(got, ref, rel):
    """Each parameter's gradient within rel of the largest entry of the reference gradient."""
    names = dict(ref.named_parameters())
    n = 0
    for name, p in got.named_parameters():
        g, r = p.grad, names[name].grad
        assert g is not None and r is not None, name
        scale = float(r.abs().max())
        assert scale > 0, name
        err = float((g - r).abs().max())
        assert err <= rel * scale, f"{name}: max |diff| {err:.3e} > {rel:.0e} * {scale:.3e}"
        n += 1
    assert n == len(names)


class _NoVocabRows:
    """Records every tensor autograd saves for backward; flags one that holds per-token logits
    (a [..., rows > 1, vocab] tensor: the head's weight is [vocab, d_model], not [.., vocab])."""

    def __enter__(self):
        self.seen = []

        def pack(t):
            if t.dim() >= 2 and t.shape[-1] == V and t.shape[-2] > 1:
                self.seen.append(tuple(t.shape))
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


# ---- loss and gradients --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_float32_loss_and_gradients_equal_stock(arch):
    stock, fused = pair(arch)
    inputs, labels = batch()
    with _NoVocabRows() as saved:
        out = fused(**inputs, labels=labels)
    assert saved.seen == [], f"logits were saved for backward: {saved.seen}"
    assert out.logits is None
    with _NoVocabRows() as saved_stock:
        ref = stock(**inputs, labels=labels)
    assert saved_stock.seen, "the logits probe sees nothing in the stock model: it proves nothing"
    assert out.loss.dtype == ref.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=0.0)
    out.loss.backward()
    ref.loss.backward()
    assert_grads_close(fused, stock, 2e-5)


def _reference_f64(model, inputs, labels, *, num_items=None):
    """The stock model's float64 logits (soft cap included) and transformers' shift, with the
    loss kept in float64 (ForCausalLMLoss itself casts the logits to float32)."""
    logits = model(**inputs).logits
    assert logits.dtype == torch.float64
    per = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                          ignore_index=-100, reduction="sum" if num_items else "mean")
    return per / num_items if num_items else per


@pytest.mark.parametrize("arch", ARCHS)
def test_float64_loss_and_gradients_to_1e10(arch):
    stock, fused = pair(arch, torch.float64)
    inputs, labels = batch()
    out = fused(**inputs, labels=labels)
    ref = _reference_f64(stock, inputs, labels)
    assert out.loss.dtype == torch.float64
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * abs(ref.item())
    out.loss.backward()
    ref.backward()
    assert_grads_close(fused, stock, 1e-10)
    # The stock labels path on the same float64 model agrees only to float32 rounding.
    stock_loss = copy.deepcopy(stock)(**inputs, labels=labels).loss
    assert stock_loss.dtype == torch.float32
    assert abs(stock_loss.item() - out.loss.item()) <= 1e-5 * abs(ref.item())


@pytest.mark.parametrize("arch", ARCHS)
def test_num_items_in_batch_and_gradient_accumulation(arch):
    stock, fused = pair(arch)
    # Two micro-batches with different counted-label totals: a per-micro-batch mean would weigh
    # their tokens differently from the sum over the whole accumulated batch.
    micro = [batch(seed=1), batch(seed=2, lengths=(3, 8, 2))]
    total = sum(int((lab[:, 1:] != -100).sum()) for _, lab in micro)
    assert len({int((lab[:, 1:] != -100).sum()) for _, lab in micro}) == 2
    for inputs, labels in micro:
        n = torch.tensor(total)  # Trainer passes a tensor
        out = fused(**inputs, labels=labels, num_items_in_batch=n)
        ref = stock(**inputs, labels=labels, num_items_in_batch=n)
        torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=0.0)
        out.loss.backward()
        ref.loss.backward()
    assert_grads_close(fused, stock, 2e-5)
    # The semantics, not just agreement: the sum over counted tokens divided by num_items (an
    # int this time), which differs from the mean.
    inputs, labels = micro[0]
    with torch.no_grad():
        got = fused(**inputs, labels=labels, num_items_in_batch=total).loss
        mean = fused(**inputs, labels=labels).loss
    count = int((labels[:, 1:] != -100).sum())
    assert count != total
    torch.testing.assert_close(got, mean * count / total, rtol=1e-6, atol=0.0)


def test_float64_num_items_in_batch_to_1e10():
    stock, fused = pair("Qwen3ForCausalLM", torch.float64)
    inputs, labels = batch()
    n = int((labels[:, 1:] != -100).sum()) + 5
    out = fused(**inputs, labels=labels, num_items_in_batch=torch.tensor(n))
    ref = _reference_f64(stock, inputs, labels, num_items=n)
    assert abs(out.loss.item() - ref.item()) <= 1e-10 * abs(ref.item())
    out.loss.backward()
    ref.backward()
    assert_grads_close(fused, stock, 1e-10)


@pytest.mark.smoke
def test_biased_head():
    stock = make("LlamaForCausalLM")
    with torch.no_grad():
        head = torch.nn.Linear(32, V, bias=True)
        head.weight.copy_(stock.lm_head.weight)
        head.bias.normal_(0.0, 1.0)
    stock.lm_head = head
    fused = atf.apply_fused_loss(copy.deepcopy(stock))
    inputs, labels = batch()
    out, ref = fused(**inputs, labels=labels), stock(**inputs, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=0.0)
    out.loss.backward()
    ref.loss.backward()
    assert fused.lm_head.bias.grad is not None
    assert_grads_close(fused, stock, 2e-5)


def test_shift_labels_and_ignore_index_keywords():
    stock, fused = pair("Qwen3ForCausalLM")
    inputs, labels = batch(ignore=-1)
    # ForCausalLMLoss's ignore_index keyword: -1 marks what counts for nothing.
    out = fused(**inputs, labels=labels, ignore_index=-1)
    ref = stock(**inputs, labels=labels, ignore_index=-1)
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=0.0)
    # Pre-shifted labels (padding-free collators): scored without a further shift, given as the
    # input's shape or flattened.
    inputs, labels = batch()
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    for sl in (shifted, shifted.reshape(-1)):
        out = fused(**inputs, labels=labels, shift_labels=sl)
        ref = stock(**inputs, labels=labels, shift_labels=sl)
        torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=0.0)
    plain = fused(**inputs, labels=labels).loss
    torch.testing.assert_close(out.loss, plain, rtol=2e-6, atol=0.0)


def test_wrong_label_shape_is_refused_clearly():
    _, fused = pair("Qwen3ForCausalLM")
    inputs, labels = batch()
    with pytest.raises(ValueError, match="one label per input position"):
        fused(**inputs, labels=labels[:, :-1])


def test_chunk_changes_nothing():
    _, fused = pair("Gemma2ForCausalLM")
    one = atf.apply_fused_loss(copy.deepcopy(fused), chunk=1)
    assert one.forward.chunk == 1 and fused.forward.chunk is None
    inputs, labels = batch()
    a, b = fused(**inputs, labels=labels).loss, one(**inputs, labels=labels).loss
    assert torch.equal(a, b)
    a.backward()
    b.backward()
    for (n, p), q in zip(fused.named_parameters(), one.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_bfloat16_model_close_to_stock():
    stock, fused = pair("Qwen3ForCausalLM", torch.bfloat16)
    inputs, labels = batch()
    out, ref = fused(**inputs, labels=labels), stock(**inputs, labels=labels)
    assert out.loss.dtype == ref.loss.dtype == torch.float32
    # The stock loss rounds the logits to bfloat16 before casting them up; the fused one
    # computes them in float32: they differ by bfloat16 rounding of the logits.
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-2, atol=0.0)
    out.loss.backward()
    ref.loss.backward()
    g, r = fused.lm_head.weight.grad.float(), stock.lm_head.weight.grad.float()
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    assert float(F.cosine_similarity(g.flatten(), r.flatten(), dim=0)) > 0.99


# ---- what stays stock ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_generate_unchanged(arch):
    model = make(arch).eval()
    prompt = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    before = model.generate(prompt, **kw)
    atf.apply_fused_loss(model)
    # generate() asks the signature whether it may pass logits_to_keep.
    assert "logits_to_keep" in inspect.signature(model.forward).parameters
    after = model.generate(prompt, **kw)
    assert torch.equal(before, after)
    model.train()  # generation never passes labels: the stock path in training mode too
    assert torch.equal(model.generate(prompt, **kw), before)


def test_eval_mode_and_no_labels_run_the_stock_forward():
    stock, fused = pair("Gemma2ForCausalLM")
    inputs, labels = batch()
    stock.eval(), fused.eval()
    with torch.no_grad():
        out, ref = fused(**inputs, labels=labels), stock(**inputs, labels=labels)
    assert out.logits is not None
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    fused.train(), stock.train()
    with torch.no_grad():
        out, ref = fused(**inputs), stock(**inputs)
    assert out.loss is None and torch.equal(out.logits, ref.logits)
    # logits_to_keep other than 0: the stock path (it slices the hidden states first).
    with torch.no_grad():
        out = fused(**inputs, logits_to_keep=1)
    assert out.logits.shape == (B, 1, V)


def test_return_logits_and_return_dict():
    stock, fused = pair("Gemma2ForCausalLM")
    inputs, labels = batch()
    out = fused(**inputs, labels=labels, return_logits=True)
    ref = stock(**inputs, labels=labels)
    # The soft-capped logits, attached to the graph.
    assert out.logits.requires_grad
    torch.testing.assert_close(out.logits, ref.logits, rtol=0.0, atol=0.0)
    assert float(ref.logits.detach().abs().max()) > 2.0  # the cap (3.0) bends these logits
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=0.0)
    tup = fused(**inputs, labels=labels, return_dict=False)
    assert isinstance(tup, tuple)
    torch.testing.assert_close(tup[0], ref.loss, rtol=2e-6, atol=0.0)
    assert all(not (torch.is_tensor(t) and t.shape[-1:] == (V,)) for t in tup)
    tup = fused(**inputs, labels=labels, return_dict=False, return_logits=True)
    assert torch.equal(tup[1], ref.logits)


def test_patched_model_copies_and_reapplies():
    _, fused = pair("Qwen3ForCausalLM")
    assert atf.apply_fused_loss(fused, chunk=7) is fused and fused.forward.chunk == 7
    twin = copy.deepcopy(fused)
    assert twin.forward.model is twin and fused.forward.model is fused
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)
    inputs, labels = batch()
    a, b = fused(**inputs, labels=labels).loss, twin(**inputs, labels=labels).loss
    assert not torch.equal(a, b)  # the copy's forward reads the copy's head
    assert fused.state_dict().keys() == make("Qwen3ForCausalLM").state_dict().keys()


def test_replaced_loss_function_or_head_falls_back_to_stock_with_a_warning():
    stock, fused = pair("LlamaForCausalLM")
    inputs, labels = batch()

    def double(logits, labels, vocab_size, **kw):
        return 2.0 * transformers.loss.loss_utils.ForCausalLMLoss(logits, labels, vocab_size, **kw)

    fused.loss_function = double
    stock.loss_function = double
    with pytest.warns(RuntimeWarning, match="loss_function"):
        out = fused(**inputs, labels=labels)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, stock(**inputs, labels=labels).loss, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not on every step
        fused(**inputs, labels=labels)

    _, fused = pair("LlamaForCausalLM")
    fused.lm_head.register_forward_hook(lambda mod, i, o: None)
    with pytest.warns(RuntimeWarning, match="hooks"):
        assert fused(**inputs, labels=labels).logits is not None


# ---- Trainer -------------------------------------------------------------------------------------

def _train(model, tmp_path, tag, data):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / tag), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=3, learning_rate=3e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True)

    def collate(rows):
        n = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), n, dtype=torch.long)
        mask = torch.zeros(len(rows), n, dtype=torch.long)
        labels = torch.full((len(rows), n), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            ids[i, :k] = torch.tensor(r["input_ids"])
            mask[i, :k] = 1
            labels[i, :k] = torch.tensor(r["labels"])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=collate)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def _dataset():
    g = torch.Generator().manual_seed(5)
    rows = []
    for n in (9, 4, 7, 3, 8, 5, 6, 2, 9, 4, 7, 5):  # ragged: micro-batches count differently
        ids = torch.randint(3, V, (n,), generator=g).tolist()
        labels = list(ids)
        labels[: n // 3] = [-100] * (n // 3)  # a masked prompt
        rows.append({"input_ids": ids, "labels": labels})
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_with_gradient_accumulation_matches_stock(arch, tmp_path, monkeypatch):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    stock, fused = pair(arch)
    data = _dataset()
    calls = []
    real = at.linear_cross_entropy

    def spy(*args, **kw):
        calls.append(kw["reduction"])
        return real(*args, **kw)

    monkeypatch.setattr(at, "linear_cross_entropy", spy)
    ref_curve, _ = _train(stock, tmp_path, "stock", data)
    assert calls == []
    curve, trainer = _train(fused, tmp_path, "fused", data)
    # Trainer saw **kwargs in the stock signature, so it passed num_items_in_batch (the fused
    # loss then sums), on every micro-batch of every step.
    assert trainer.model_accepts_loss_kwargs
    assert calls == ["sum"] * (3 * 2)
    assert len(curve) == len(ref_curve) == 3
    for a, b in zip(curve, ref_curve):
        assert math.isclose(a, b, rel_tol=1e-5), (curve, ref_curve)
    for (n, p), q in zip(fused.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)


# ---- refusals ------------------------------------------------------------------------------------

def test_unsupported_architecture_is_refused_naming_the_supported_ones():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=16)
    with pytest.raises(ValueError) as e:
        atf.apply_fused_loss(transformers.GPT2LMHeadModel(cfg))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in atf.SUPPORTED_ARCHITECTURES:
        assert arch in msg
    with pytest.raises(TypeError, match="transformers model"):
        atf.apply_fused_loss(torch.nn.Linear(3, 4))


def test_other_refusals():
    class Custom(transformers.Qwen3ForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    with pytest.raises(ValueError, match="overrides forward"):
        atf.apply_fused_loss(Custom(make("Qwen3ForCausalLM").config))
    m = make("Qwen3ForCausalLM")
    m.forward = lambda *a, **k: None
    with pytest.raises(ValueError, match="already replaced"):
        atf.apply_fused_loss(m)
    m = make("Qwen3ForCausalLM")
    m.loss_function = lambda *a, **k: None
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        atf.apply_fused_loss(m)
    m = make("Qwen3ForCausalLM")
    m.lm_head.register_forward_pre_hook(lambda mod, i: None)
    with pytest.raises(ValueError, match="hooks"):
        atf.apply_fused_loss(m)
    m = make("Qwen3ForCausalLM")
    m.lm_head = torch.nn.Sequential(m.lm_head)
    with pytest.raises(ValueError, match="not an nn.Linear"):
        atf.apply_fused_loss(m)
    from algenta import LossError

    # The chunk is refused when it is given, with the kernel's status, not at the first step.
    for chunk, status in ((0, 581), (10**12, None), (2**70, None)):
        m = make("Qwen3ForCausalLM")
        with pytest.raises(LossError) as e:
            atf.apply_fused_loss(m, chunk=chunk)
        want = at.linear_cross_entropy if status is None else None
        assert status is None or e.value.status == status
        assert "chunk" in str(e.value) and "forward" not in m.__dict__
        if want is not None:  # the same refusal the loss itself gives
            with pytest.raises(LossError) as e2:
                want(torch.zeros(2, 32), m.lm_head.weight.detach(), torch.zeros(2, dtype=int),
                     chunk=chunk)
            assert e.value.status == e2.value.status
    patched = atf.apply_fused_loss(make("Qwen3ForCausalLM"), chunk=4)
    with pytest.raises(LossError):
        atf.apply_fused_loss(patched, chunk=10**12)
    assert patched.forward.chunk == 4
    with pytest.raises(TypeError, match="chunk"):
        atf.apply_fused_loss(make("Qwen3ForCausalLM"), chunk=2.0)


@pytest.mark.parametrize("num_items", [None, 0, 5])
def test_sequences_of_one_position_give_the_stock_nan_and_zero_gradients(num_items):
    # Nothing is scored (the only position has no next token): the stock loss averages over no
    # token, NaN with zero gradients, and a Trainer run goes on; so must the fused one.
    stock = make("Qwen3ForCausalLM")
    fused = atf.apply_fused_loss(copy.deepcopy(stock))
    ids = torch.randint(3, V, (2, 1), generator=torch.Generator().manual_seed(4))
    kw = {} if num_items is None else dict(num_items_in_batch=torch.tensor(num_items))
    losses = []
    for m in (stock, fused):
        m.zero_grad(set_to_none=False)
        loss = m(input_ids=ids, labels=ids, **kw).loss
        loss.backward()
        losses.append(loss)
        assert all(not p.grad.any() for p in m.parameters() if p.grad is not None)
    assert torch.equal(losses[0], losses[1]) or (losses[0].isnan() and losses[1].isnan())


def test_import_algenta_imports_neither_torch_nor_transformers():
    code = ("import sys, algenta, algenta.transformers\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "assert 'Qwen3ForCausalLM' in algenta.transformers.SUPPORTED_ARCHITECTURES\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
