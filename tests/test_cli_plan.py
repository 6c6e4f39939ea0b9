"""`algenta plan`, run as a user runs it: a subprocess of `python -m algenta`."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from algenta.lossk import cross_entropy as lce
from algenta.residentk import contract as rc
from algenta.residentk import probe as rp

Q06 = (1024, 16, 8, 128, 3072, 28, 151936)
Q8 = (4096, 32, 8, 128, 12288, 36, 151936)


def algenta(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "algenta", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def plan_json(*args):
    r = algenta("plan", *args, "--json")
    assert r.stderr == "", r.stderr
    return r.returncode, json.loads(r.stdout)


def test_human_output_qwen3_06b():
    r = algenta("plan", "qwen3-0.6b")
    assert r.returncode == 0 and r.stderr == ""
    out = r.stdout
    assert "Qwen3-0.6B" in out and "600 resident_ok" in out
    assert re.search(r"standard\s+171\b", out) and re.search(r"split-K attention\s+199\b", out)
    assert re.search(r"^total\s+625,410,048\s+2,501,640,192\s+2\.33 GiB$", out, re.M)
    assert re.search(r"^KV cache at ctx 512\s+29,360,128\s", out, re.M)
    assert re.search(r"^weights\s+596,049,920\s", out, re.M)
    # The size table is aligned: every row's right-aligned columns end at the same offsets.
    rows = [l for l in out.splitlines() if l.rstrip().endswith("GiB")]
    assert len(rows) >= 7 and len({len(l) for l in rows}) == 1
    probe_status = rp.resident_session_probe(*Q06).status
    assert f"this build/host   {probe_status} " in out


def test_json_keys_and_seed_numbers():
    code, rep = plan_json("qwen3-0.6b")
    assert code == 0
    assert rep["dispatch_budget"] == 171 and rep["dispatch_budget_deep"] == 199
    assert rep["resident_f32_elems"] == 625_410_048 == rc.residentk_weight_elems(*Q06)
    assert rep["resident_bytes"] == 4 * 625_410_048
    assert rep["kv_cache_elems"] == 29_360_128
    assert rep["status"] == 600 and rep["status_name"] == "resident_ok"
    assert rep["ctx"] == 512 and rep["ctx_bucket"] == 512
    assert rep["build"]["kernels_compiled"] is rp.resident_gpu_kernels_compiled()
    assert "loss" not in rep and "gpu" not in rep and "tp" not in rep


@pytest.mark.smoke
def test_python_m_and_console_script_agree():
    exe = shutil.which("algenta")
    if exe is None:
        pytest.skip("console script not on PATH")
    a = subprocess.run([exe, "plan", "qwen3-0.6b", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert a.returncode == 0 and json.loads(a.stdout) == plan_json("qwen3-0.6b")[1]


def test_ctx_and_bucket():
    code, rep = plan_json("qwen3-0.6b", "--ctx", "3000")
    assert rep["ctx_bucket"] == 4096
    assert rep["kv_cache_elems"] == rc.residentk_cache_elements(28, 8, 128, 3000)
    assert rep["kv_cache_bucket_elems"] == rc.residentk_cache_elements(28, 8, 128, 4096)
    assert rep["resident_f32_elems"] == rc.residentk_weight_elems(*Q06, 3000)
    r = algenta("plan", "qwen3-0.6b", "--ctx", "3000")
    assert "KV cache at bucket 4,096" in r.stdout


def test_gpu_mem_fit_headroom_and_largest_ctx():
    code, rep = plan_json("qwen3-8b", "--ctx", "8192", "--gpu-mem", "80GiB")
    g = rep["gpu"]
    assert g["budget_bytes"] == 80 * 2**30
    assert g["need_bytes"] == 4 * rc.residentk_weight_elems(*Q8, 8192, tied=False)
    assert g["fits"] is True and code == 0
    assert g["headroom_bytes"] == g["budget_bytes"] - g["need_bytes"]
    assert g["max_ctx"] == rc.residentk_max_ctx_fitting(*Q8, 80 * 2**30, tied=False)
    # The largest context is the largest bucket that fits: the next one up does not.
    assert 4 * rc.residentk_weight_elems(*Q8, g["max_ctx"], tied=False) <= g["budget_bytes"]
    if g["max_ctx"] < 65536:
        assert 4 * rc.residentk_weight_elems(*Q8, 2 * g["max_ctx"], tied=False) > g["budget_bytes"]
    code, rep = plan_json("qwen3-8b", "--gpu-mem", "16GB")
    assert rep["gpu"]["fits"] is False and rep["gpu"]["max_ctx"] == 0 and code == 1
    assert rep["gpu"]["budget_bytes"] == 16 * 10**9
    r = algenta("plan", "qwen3-8b", "--gpu-mem", "16GB")
    assert "does NOT fit" in r.stdout and "short by" in r.stdout


@pytest.mark.slow
def test_slots_fit_and_the_most_that_do():
    # the weights once, one KV cache per sequence at the bucket (3,000 -> 4,096 positions)
    code, rep = plan_json("qwen3-0.6b", "--slots", "16", "--ctx", "3000", "--weights", "int8",
                          "--kv", "bf16", "--mem", "16GiB")
    sl = rep["slots"]
    fp = rc.residentk_footprint(*Q06, 4096, format="int8", kv_format="bf16")
    assert sl["weight_bytes"] == fp["weight_bytes"] and sl["kv_bytes_per_slot"] == fp["kv_bytes"]
    assert sl["kv_bytes_per_slot"] == 2 * rc.residentk_cache_elements(28, 8, 128, 4096)
    assert sl["need_bytes"] == fp["weight_bytes"] + 16 * fp["kv_bytes"]
    assert sl["fits"] is True and code == 0 and sl["budget_of"] == "host"
    most = sl["max_slots"]
    assert fp["weight_bytes"] + most * fp["kv_bytes"] <= 16 * 2**30
    assert fp["weight_bytes"] + (most + 1) * fp["kv_bytes"] > 16 * 2**30
    code, rep = plan_json("qwen3-0.6b", "--slots", "64", "--ctx", "4096", "--gpu-mem", "8GiB")
    assert rep["slots"]["fits"] is False and code == 1 and rep["slots"]["budget_of"] == "gpu"
    assert 0 < rep["slots"]["max_slots"] < 64
    r = algenta("plan", "qwen3-0.6b", "--slots", "64", "--ctx", "4096", "--mem", "8GiB")
    assert "does NOT fit" in r.stdout and "most sequences at ctx 4,096" in r.stdout
    code, rep = plan_json("qwen3-0.6b", "--slots", "4")
    assert rep["slots"]["fits"] is None and rep["slots"]["max_slots"] is None and code == 0


@pytest.mark.parametrize("text,nbytes", [("80GiB", 80 * 2**30), ("80G", 80 * 2**30),
                                         ("80GB", 80 * 10**9), ("81920MiB", 80 * 2**30),
                                         ("24", 24 * 2**30), ("0.5TiB", 2**39)])
def test_gpu_mem_units(text, nbytes):
    assert plan_json("qwen3-0.6b", "--gpu-mem", text)[1]["gpu"]["budget_bytes"] == nbytes


def test_tensor_parallel_share():
    code, rep = plan_json("qwen3-8b", "--tp", "4")
    full = rc.residentk_footprint(*Q8, tied=False)
    share = rc.residentk_footprint(*Q8, tied=False, tp=4)
    assert rep["tp"]["n"] == 4
    assert rep["tp"]["resident_f32_elems"] == share["total"]
    assert rep["tp"]["weight_terms"]["mlp"] * 4 == full["mlp"]
    assert rep["tp"]["kv_cache_elems"] * 4 == full["kv_cache"]
    assert rep["resident_f32_elems"] == full["total"]   # the whole model is still reported
    r = algenta("plan", "qwen3-8b", "--tp", "4")
    assert "per GPU (tp=4)" in r.stdout


def test_train_tokens_reports_lossk_peak_logits():
    code, rep = plan_json("qwen3-0.6b", "--train-tokens", "2048", "--chunk", "256")
    lo = rep["loss"]
    assert {k: lo[k] for k in ("chunked_cells", "materialized_cells", "ratio", "n_chunks",
                               "status")} == {"chunked_cells": 38895616.0,
                                              "materialized_cells": 311164928.0, "ratio": 8.0,
                                              "n_chunks": 8, "status": 580}
    assert lo["max_chunk"] == 883 and lo["status_name"] == "ok"
    # Without --chunk, the largest chunk the logit budget admits.
    lo = plan_json("qwen3-0.6b", "--train-tokens", "2048")[1]["loss"]
    assert lo["chunk"] == 883 and dict(lce.ce_peak_logit_cells(2048, 151936, 883)).items() <= lo.items()
    # A chunk past the logit budget is reported (587), not refused as bad input.
    lo = plan_json("qwen3-0.6b", "--train-tokens", "4096", "--chunk", "2048")[1]["loss"]
    assert lo["status"] == 587 and lo["status_name"] == "chunk_exceeds_logit_budget"


def test_dims_equal_preset():
    _, a = plan_json("qwen3-0.6b")
    _, b = plan_json("--dims", ",".join(map(str, Q06)))
    for k in ("resident_f32_elems", "dispatch_budget", "kv_cache_elems", "status"):
        assert a[k] == b[k]
    _, c = plan_json("--dims", ",".join(map(str, Q8)), "--untied")
    assert c["resident_f32_elems"] == rc.residentk_weight_elems(*Q8, tied=False)


def _config(tmp_path, **over):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "hidden_size": 4096,
           "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 36,
           "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
           "tie_word_embeddings": False, "vocab_size": 151936}
    cfg.update(over)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_config_file_untied_and_rope_parameters(tmp_path):
    p = _config(tmp_path)
    code, rep = plan_json("--config", str(p))
    assert code == 0 and rep["shape"]["tied"] is False and rep["shape"]["rope_theta"] == 1e6
    assert rep["resident_f32_elems"] == rc.residentk_weight_elems(*Q8, tied=False)
    # Newer transformers nest rope_theta in rope_parameters; a directory finds its config.json.
    _config(tmp_path, rope_theta=None, rope_parameters={"rope_theta": 5e6, "rope_type": "default"},
            tie_word_embeddings=True)
    code, rep = plan_json("--config", str(tmp_path))
    assert rep["shape"]["rope_theta"] == 5e6 and rep["shape"]["tied"] is True
    assert rep["resident_f32_elems"] == rc.residentk_weight_elems(*Q8)


def test_refused_shape_exit_1_with_reason():
    r = algenta("plan", "--dims", "1024,5,2,128,3072,2,151936")
    assert r.returncode == 1 and r.stderr == ""
    assert "603 resident_head_geometry_unsupported" in r.stdout and "multiple" in r.stdout
    code, rep = plan_json("--dims", "1024,5,2,128,3072,2,151936")
    assert code == 1 and rep["status"] == 603 and rep["resident_f32_elems"] == 0


def test_tier_refusal_still_sized():
    code, rep = plan_json("qwen3-32b")
    assert code == 1 and rep["status"] == 602 and rep["sized_beyond_tier"] is True
    assert "ALGENTA_SMEM_TIER_BYTES=102400" in rep["reason"]
    q32 = (5120, 64, 8, 128, 25600, 64, 151936)
    assert rep["resident_f32_elems"] == rc.residentk_footprint(*q32, tied=False,
                                                               check_tier=False)["total"]


@pytest.mark.parametrize("args,needle", [
    (["plan", "qwen3-70b"], "unknown model preset"),
    (["plan"], "exactly one model shape"),
    (["plan", "qwen3-0.6b", "--dims", "1,2,3,4,5,6,7"], "exactly one model shape"),
    (["plan", "--dims", "1,2,3"], "7 comma-separated"),
    (["plan", "--dims", "1024,16,8,128,-5,28,151936"], "d_ff must be >= 1"),
    (["plan", "--dims", "1024,16,8,abc,3072,28,151936"], "d_head must be an integer"),
    (["plan", "--dims", "1024,16,8,128,3072,28,99999999999999999999"], "below 2**63"),
    (["plan", "qwen3-0.6b", "--ctx", "-1"], "--ctx"),
    (["plan", "qwen3-0.6b", "--ctx", "ten"], "--ctx"),
    (["plan", "qwen3-0.6b", "--ctx", "70000"], "65,536"),
    (["plan", "qwen3-0.6b", "--tp", "3"], "--tp 3 must divide"),
    (["plan", "qwen3-0.6b", "--tp", "0"], "--tp"),
    (["plan", "qwen3-0.6b", "--gpu-mem", "lots"], "--gpu-mem"),
    (["plan", "qwen3-0.6b", "--gpu-mem", "-5GB"], "--gpu-mem"),
    (["plan", "qwen3-0.6b", "--train-tokens", "0"], "--train-tokens"),
    (["plan", "qwen3-0.6b", "--slots", "0"], "--slots"),
    (["plan", "qwen3-0.6b", "--slots", "1025"], "RESIDENT_MAX_SLOTS"),
    (["plan", "qwen3-0.6b", "--slots", "2", "--mem", "lots"], "--mem"),
    (["plan", "qwen3-0.6b", "--chunk", "64"], "--chunk needs --train-tokens"),
    (["plan", "--config", "/nonexistent/config.json"], "No such file"),
    (["plan", "qwen3-0.6b", "--frobnicate"], "unrecognized arguments"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_exit_2_one_line(args, needle):
    r = algenta(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr


@pytest.mark.parametrize("content,needle", [
    ('{"hidden_size": 1024,', "not valid JSON"),
    ('{"hidden_size": 1024}', "num_attention_heads"),
    ("[1, 2]", "JSON object"),
    ('{"hidden_size": "big", "num_attention_heads": 16, "intermediate_size": 3072, '
     '"num_hidden_layers": 28, "vocab_size": 151936}', "hidden_size"),
    ('{"hidden_size": -1024, "num_attention_heads": 16, "head_dim": 128, '
     '"intermediate_size": 3072, "num_hidden_layers": 28, "vocab_size": 151936}', "hidden_size"),
    ("\udcff not utf8", ""),
])
def test_malformed_config_exit_2(tmp_path, content, needle):
    p = tmp_path / "config.json"
    p.write_bytes(content.encode("utf-8", "surrogateescape"))
    r = algenta("plan", "--config", str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


def test_config_read_stops_at_its_size_limit(tmp_path):
    # /dev/zero never ends: read without a limit it would fill memory until the process died.
    r = algenta("plan", "--config", "/dev/zero")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "607" in r.stderr and "MiB" in r.stderr
    big = tmp_path / "config.json"
    big.write_bytes(b'{"pad": "' + b" " * (5 * 2**20) + b'"}')
    r = algenta("plan", "--config", str(big))
    assert r.returncode == 2 and "larger than 4 MiB" in r.stderr


def test_list_presets():
    r = algenta("plan", "--list")
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert len(lines) == 7 and len({len(l) for l in lines[1:]}) <= 2
    assert re.search(r"^qwen3-8b\s+4,096\s+32/8\s+128\s+12,288\s+36\s+151,936\s+separate$",
                     r.stdout, re.M)


def test_help_and_version():
    r = algenta("plan", "--help")
    assert r.returncode == 0 and "qwen3-0.6b" in r.stdout and "--gpu-mem" in r.stdout
    r = algenta("--version")
    assert r.returncode == 0 and r.stdout.startswith("algenta ")
    r = algenta()
    assert r.returncode == 2 and "plan" in r.stderr


def test_main_in_process(capsys):
    from algenta.cli import main

    assert main(["plan", "qwen3-1.7b", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["resident_f32_elems"] == rc.residentk_weight_elems(2048, 16, 8, 128, 6144, 28, 151936)
    assert main(["plan", "nope"]) == 2
    assert "unknown model preset" in capsys.readouterr().err


# ---- --weights: bytes in the weight format ---------------------------------------------------

def _int8_bytes(rows, cols):  # written from the definition: 1 byte + a float32 scale per 32 a row
    return rows * cols + 4 * rows * -(-cols // 32)


def test_weights_default_is_f32_and_bytes_are_four_times_elements():
    code, rep = plan_json("qwen3-0.6b", "--ctx", "3000")
    assert code == 0 and rep["weight_format"] == "f32"
    assert plan_json("qwen3-0.6b", "--ctx", "3000", "--weights", "f32")[1] == rep
    b = rep["bytes"]
    assert b["weights"] == 4 * rep["weights_f32_elems"]
    assert b["weight_terms"] == {k: 4 * v for k, v in rep["weight_terms"].items()}
    assert b["total"] == rep["resident_bytes"] and b["total_bucket"] == rep["resident_bucket_bytes"]
    assert b["kv_cache"] == 4 * rep["kv_cache_elems"]
    assert b["kv_cache_bucket"] == 4 * rep["kv_cache_bucket_elems"]


def test_weights_int8_json_qwen3_06b_exact():
    code, rep = plan_json("qwen3-0.6b", "--weights", "int8")
    assert code == 0 and rep["weight_format"] == "int8"
    b = rep["bytes"]
    # Every row of Qwen3-0.6B is 1,024, 2,048 or 3,072 long (whole blocks): int8 costs 9/8 bytes
    # an element; 28 layers x (q (2048, 1024), k, v (1024, 1024), o (1024, 2048), gate, up
    # (3072, 1024), down (1024, 3072)) and the (151936, 1024) embedding; norms float32.
    attn = 28 * (2048 * 1024 + 2 * 1024 * 1024 + 1024 * 2048) * 9 // 8
    mlp = 28 * 3 * 3072 * 1024 * 9 // 8
    embed = 151936 * 1024 * 9 // 8
    assert b["weight_terms"] == {"attn": attn, "mlp": mlp, "norms": 4 * 65_536, "embed": embed,
                                 "lm_head": 0}
    assert b["weights"] == attn + mlp + 4 * 65_536 + embed == 670_744_576
    assert b["kv_cache"] == 4 * 29_360_128 and b["total"] == 788_185_088
    assert b["total_bucket"] == b["total"]   # ctx 512 is its own bucket
    # Every pre-existing key keeps its float32 meaning.
    _, f32 = plan_json("qwen3-0.6b")
    assert {k: v for k, v in rep.items() if k not in ("weight_format", "bytes")} == \
        {k: v for k, v in f32.items() if k not in ("weight_format", "bytes")}


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "int8"])
def test_weights_json_untied_ctx_bucket_and_tp(fmt):
    code, rep = plan_json("qwen3-8b", "--ctx", "3000", "--tp", "2", "--weights", fmt)
    assert code == 0 and rep["weight_format"] == fmt
    whole = rc.residentk_footprint(*Q8, 3000, tied=False, format=fmt)
    whole_b = rc.residentk_footprint(*Q8, 4096, tied=False, format=fmt)
    assert rep["bytes"]["weights"] == whole["weight_bytes"]
    assert rep["bytes"]["total"] == whole["total_bytes"]
    assert rep["bytes"]["total_bucket"] == whole_b["total_bytes"]
    assert rep["bytes"]["kv_cache_bucket"] == 4 * rc.residentk_cache_elements(36, 8, 128, 4096)
    share = rc.residentk_footprint(*Q8, 3000, tied=False, tp=2, format=fmt)
    share_b = rc.residentk_footprint(*Q8, 4096, tied=False, tp=2, format=fmt)
    t = rep["tp"]["bytes"]
    assert t["weights"] == share["weight_bytes"] and t["total"] == share["total_bytes"]
    assert t["total_bucket"] == share_b["total_bytes"]
    for b in (rep["bytes"], t):
        assert sum(b["weight_terms"].values()) == b["weights"]
    # Independently: per GPU, q/o are (2048, 4096)/(4096, 2048), k/v (512, 4096), gate/up
    # (6144, 4096), down (4096, 6144); embedding and lm_head (151936, 4096) each, replicated.
    mats = [(2048, 4096), (512, 4096), (512, 4096), (4096, 2048), (6144, 4096), (6144, 4096),
            (4096, 6144)]
    width = {"f32": 4, "bf16": 2, "f16": 2}
    nb = (lambda r, c: _int8_bytes(r, c)) if fmt == "int8" else (lambda r, c: width[fmt] * r * c)
    norms = 4 * (36 * (2 * 4096 + 2 * 128) + 4096)
    weights = 36 * sum(nb(r, c) for r, c in mats) + 2 * nb(151936, 4096) + norms
    assert t["weights"] == weights
    assert t["total_bucket"] == weights + 4 * 36 * 2 * 4096 * 4 * 128
    # The float32 keys do not move with the format.
    assert rep["tp"]["resident_bucket_bytes"] == 4 * share_b["total"]


def test_weights_ragged_rows_int8():
    # d_model 1000, h_q*d_head 40, d_ff 2730: no row a multiple of 32, so each pays a partial block.
    dims = "1000,5,5,8,2730,3,50261"
    code, rep = plan_json("--dims", dims, "--weights", "int8", "--ctx", "100")
    assert code == 0
    layer = (_int8_bytes(40, 1000) + 2 * _int8_bytes(40, 1000) + _int8_bytes(1000, 40)
             + 2 * _int8_bytes(2730, 1000) + _int8_bytes(1000, 2730))
    weights = 3 * layer + _int8_bytes(50261, 1000) + 4 * (3 * (2 * 1000 + 2 * 8) + 1000)
    assert rep["bytes"]["weights"] == weights
    assert rep["bytes"]["total"] == weights + 4 * 3 * 2 * 100 * 5 * 8
    assert rep["bytes"]["total_bucket"] == weights + 4 * 3 * 2 * 512 * 5 * 8


@pytest.mark.slow
def test_weights_gpu_mem_fit_and_largest_ctx():
    # Qwen3-8B in 16 GB: float32 does not fit at all; int8 does, with room for more context.
    code, rep = plan_json("qwen3-8b", "--gpu-mem", "16GB")
    assert code == 1 and rep["gpu"]["fits"] is False and rep["gpu"]["max_ctx"] == 0
    code, rep = plan_json("qwen3-8b", "--gpu-mem", "16GB", "--weights", "int8")
    g = rep["gpu"]
    need = rc.residentk_footprint(*Q8, 512, tied=False, format="int8")["total_bytes"]
    assert code == 0 and g["fits"] is True and g["need_bytes"] == need == rep["bytes"]["total_bucket"]
    assert g["headroom_bytes"] == 16 * 10**9 - need
    assert g["max_ctx"] == rc.residentk_max_ctx_fitting(*Q8, 16 * 10**9, tied=False, format="int8")
    assert g["max_ctx"] >= 512
    f = lambda c: rc.residentk_footprint(*Q8, c, tied=False, format="int8")["total_bytes"]  # noqa: E731
    assert f(g["max_ctx"]) <= 16 * 10**9 and (g["max_ctx"] == 65536 or f(2 * g["max_ctx"]) > 16 * 10**9)
    # Per GPU with --tp: the need is the per-GPU bucket footprint in the format.
    code, rep = plan_json("qwen3-8b", "--ctx", "8192", "--tp", "2", "--gpu-mem", "12GiB",
                          "--weights", "bf16")
    assert rep["gpu"]["need_bytes"] == rep["tp"]["bytes"]["total_bucket"] == \
        rc.residentk_footprint(*Q8, 8192, tied=False, tp=2, format="bf16")["total_bytes"]
    assert rep["gpu"]["max_ctx"] == rc.residentk_max_ctx_fitting(*Q8, 12 * 2**30, tied=False, tp=2,
                                                                 format="bf16")
    # A smaller format never fits less context (Qwen3-0.6B in 2.5 GiB: 1,024 / 4,096 / 8,192).
    caps = [plan_json("qwen3-0.6b", "--gpu-mem", "2560MiB", "--weights", w)[1]["gpu"]["max_ctx"]
            for w in ("f32", "bf16", "int8")]
    assert caps == [1024, 4096, 8192]


def test_weights_human_output():
    r = algenta("plan", "qwen3-0.6b", "--weights", "int8", "--gpu-mem", "8GB")
    assert r.returncode == 0 and r.stderr == ""
    out = r.stdout
    assert re.search(r"^resident, int8 weights\s+elements\s+bytes\s+size$", out, re.M)
    assert re.search(r"^total\s+625,410,048\s+788,185,088\s+0\.73 GiB$", out, re.M)
    assert re.search(r"^weights\s+596,049,920\s+670,744,576\s+0\.62 GiB$", out, re.M)
    assert re.search(r"^KV cache at ctx 512\s+29,360,128\s+117,440,512\s", out, re.M)
    assert re.search(r"^  embedding \(tied to lm_head\)\s+155,582,464\s+175,030,272\s", out, re.M)
    rows = [l for l in out.splitlines() if l.rstrip().endswith("GiB") and "," in l.split()[-3]]
    assert len(rows) >= 7 and len({len(l) for l in rows}) == 1
    assert "all float32 at bucket 512: 2.33 GiB" in out
    assert "one GPU, int8 weights" in out
    cap = rc.residentk_max_ctx_fitting(*Q06, 8 * 10**9, format="int8")
    assert re.search(rf"largest context that fits\s+{cap:,}\s+positions", out)
    # --tp: the per-GPU column is in the format too.
    r = algenta("plan", "qwen3-8b", "--weights", "bf16", "--tp", "2")
    share = rc.residentk_footprint(*Q8, tied=False, tp=2, format="bf16")
    assert re.search(rf"^total\s+[\d,]+\s+[\d,]+\s+[\d.]+ GiB\s+{share['total_bytes'] / 2**30:.2f} GiB$",
                     r.stdout, re.M)
    assert "resident, bf16 weights" in r.stdout


def test_kv_format_counts_kv_bytes():
    # --kv changes the KV cache's bytes (2 an element for bf16 and f16), never its elements, and
    # the fit answers follow: Qwen3-8B at 32,768 positions holds 9 GiB of float32 KV, 4.5 in bf16.
    code, f32 = plan_json("qwen3-8b", "--ctx", "32768", "--weights", "bf16", "--gpu-mem", "24GiB")
    code2, half = plan_json("qwen3-8b", "--ctx", "32768", "--weights", "bf16", "--kv", "bf16",
                            "--gpu-mem", "24GiB")
    assert half["kv_format"] == "bf16" and f32["kv_format"] == "f32"
    assert half["kv_cache_elems"] == f32["kv_cache_elems"] == 36 * 2 * 8 * 128 * 32768
    assert f32["bytes"]["kv_cache"] == 4 * f32["kv_cache_elems"] == 9 * 2**30
    assert half["bytes"]["kv_cache"] == 2 * half["kv_cache_elems"]
    assert half["bytes"]["weights"] == f32["bytes"]["weights"]
    want = rc.residentk_footprint(*Q8, 32768, tied=False, format="bf16", kv_format="bf16")
    assert half["bytes"]["total"] == want["total_bytes"] == want["weight_bytes"] + want["kv_bytes"]
    assert (code, f32["gpu"]["fits"]) == (1, False) and (code2, half["gpu"]["fits"]) == (0, True)
    assert half["gpu"]["max_ctx"] == rc.residentk_max_ctx_fitting(
        *Q8, 24 * 2**30, tied=False, format="bf16", kv_format="bf16") == 32768
    assert f32["gpu"]["max_ctx"] == 16384
    r = algenta("plan", "qwen3-8b", "--ctx", "32768", "--weights", "bf16", "--kv", "f16")
    assert "resident, bf16 weights, f16 KV cache" in r.stdout
    assert re.search(r"^KV cache at ctx 32,768\s+2,415,919,104\s+4,831,838,208\s", r.stdout, re.M)
    r = algenta("plan", "qwen3-0.6b", "--kv", "int8")
    assert r.returncode == 2 and "--kv" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ValueError):
        rc.residentk_footprint(*Q8, 512, kv_format="int8")


@pytest.mark.parametrize("bad", ["fp8", "F32", "int4", "", "float32"])
def test_weights_unknown_format_exit_2_one_line(bad):
    r = algenta("plan", "qwen3-0.6b", "--weights", bad)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--weights" in r.stderr
    assert all(f"'{f}'" in r.stderr for f in ("f32", "bf16", "f16", "int8"))


def test_weights_plan_function_refuses_unknown_format():
    from algenta import ResidentError
    from algenta.cli_plan import plan
    from algenta.residentk import presets

    with pytest.raises(ResidentError) as e:
        plan(presets.preset("qwen3-0.6b"), weights="fp8")
    assert e.value.status == 601 and "'int8'" in str(e.value)
