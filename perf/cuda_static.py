"""A device-free performance model of the CUDA kernels, read from their compiled SASS.

A CI host has no GPU; the kernels' speed can still be estimated from what nvcc makes of them.
One H200 has run them (2026-12-04): the model's figures are printed beside its measurements
(MEASURED_H200), and they are far apart. Decode: the matvecs stream near HBM bandwidth (f32
minus bf16 time over their byte difference gives about 4.1 TB/s) but each of the 171 graph nodes
a token costs about 6 us, not the 2 us (or 0.25-1 us under PDL) assumed below, so a bf16 token
takes 1.30 ms, not 0.31-0.59 ms. lossk's bf16 tiles: 6.8-7.9x slower than the issue-rate ceiling
below, which models neither shared-memory bandwidth nor bank conflicts nor stalls. Read every
estimate here as an upper bound that a device has shown loose. For each kernel of
cuda/session_cuda.cu (the session's one translation unit: its kernels are session_kernels.cuh's
stage headers), cuda/lossk_cuda.cu and cuda/lossk_distill.cu compiled for sm_90 (and sm_80):
registers, shared memory and spills (ptxas --resource-usage), the occupancy they allow, and the SASS
of its main loop (cuobjdump -sass): instructions per tensor-core MMA (or per FMA), bytes per global
load instruction, global loads a warp issues per iteration. Then, for sm_90, an estimate against the
H200's limit, from the model below (the sm_80 rows show the SASS and occupancy at the same SM
limits, no estimate).

    python perf/cuda_static.py [--arch sm_90,sm_80] [--json]

Needs nvcc, cuobjdump and nvdisasm (the toolkit's, or the PyPI packages nvidia-cuda-cuobjdump
and nvidia-cuda-nvdisasm, which .ci/run installs); without them it says so and exits 0.

The model (assumptions, all stated; figures are estimates, never measurements):

- Device: H200 SXM, 132 SMs at 1.98 GHz boost, HBM 4.8 TB/s, per SM 65,536 registers, 2,048
  threads, 32 blocks, 228 KiB shared memory (1 KiB reserved per block); registers allocated per
  warp in units of 256. Dense bf16 tensor peak 989 TFLOP/s.
- Issue: each SM issues at most 4 warp instructions a clock (one per scheduler). A main loop of N
  instructions per warp an iteration (loops nested in it counted as often as they run: the tile's
  staging loops, see expanded_insns) holding M mma.sync m16n8k16 (4,096 flops each) can keep the
  tensor pipe at most min(1, 4 M / N) busy, where the pipe takes one such MMA per SM per clock at
  the datasheet peak (989e12 / (132 x 1.98e9) = 3,784 flops a clock: within 8% of 4,096). Memory
  latency, barriers' stalls and bank conflicts are not modeled for the GEMMs: their estimate is an
  upper bound, the issue-rate ceiling times an occupancy factor (resident warps / 8, capped at 1:
  fewer than 8 warps per SM cannot cover the tensor pipe's latency). lossk's tile is read on its
  interior tiles' loop: of a 4,096 x 4,096 x 151,936 product only the last row and column of tiles
  take the checked loop (a chunk of c tokens: 1 of ceil(c / 64) rows).
- lossk's bf16 loss with gradients at 4,096 x 4,096 x 151,936 (loss_estimate): per chunk its
  three tile GEMMs in waves of SMs x blocks an SM at the tiles' estimates, or d_weight's float32
  accumulator traffic where longer, plus the chunk's float32 logits stored, read and rewritten
  by the softmax gradient at HBM rate; operands from L2.
- SIMT GEMMs (lossk's float32/float64 tiles, the session's float32 and int8 prefill tiles):
  the FP32 and dp4a pipes take 4 warp instructions a clock per SM, FP64 2 on H200, so the
  share of their peak is the multiply-add share of the main loop's instructions (FP64 counted
  twice), the issue-rate ceiling again.
- Memory-bound kernels (decode matvecs): Little's law. HBM at 4.8 TB/s with ~700 ns of load
  latency needs 3.4 MB in flight, 25.5 KB per SM. A resident warp keeps the global loads of one
  main-loop iteration in flight (the loads issued before the first use of their results); the
  estimated share of HBM bandwidth is min(1, in-flight bytes per SM / 25.5 KB), in the kernel
  rows at full occupancy (what the kernel allows), in the decode step with the blocks each
  launch actually has.
- Decode step at the Qwen3-0.6B shape: each matvec's weight bytes at the share of HBM its launch
  can hold (launch_share: the kernel's in-flight bytes per lane, at most its slice of a row, times
  the blocks its grid puts on an SM, at most its occupancy), plus 2 us of launch gap per graph
  node (171 nodes a token on the standard path; a CUDA graph's node-to-node gap on Hopper is about
  1-2 us): the time a token takes and its share of the HBM roofline (the format's weight bytes /
  4.8 TB/s). The decode kernels are programmatic dependent launches (common.cuh): each launches
  while the one before runs, its matvec blocks prefetch their rows' first 16 KB into L2, then
  wait. What of a boundary stays exposed (the previous grid's completion and the release of the
  wait) is not knowable without a device: the estimate is printed for 1, 0.5 and 0.25 us, with the
  prefetched bytes streaming during that exposed part (decode_estimate).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- the device -------------------------------------------------------------------------------
H200 = dict(sms=132, clock_hz=1.98e9, hbm_bytes_s=4.8e12, load_latency_s=700e-9,
            regs_per_sm=65536, threads_per_sm=2048, blocks_per_sm=32,
            smem_per_sm=228 * 1024, smem_reserved_per_block=1024, bf16_peak_flops=989e12)
MMA_FLOPS = 4096  # mma.sync m16n8k16: 16 x 8 x 16 multiply-adds
GRAPH_GAP_S = 2e-6

# Threads a block of each kernel has (cpp/include/algenta/session_cuda_plan.hpp, lossk_tile.cuh)
# and the dynamic shared memory it is launched with at the Qwen3-0.6B shape (D 1024, A 2048,
# F 3072; stage_bytes of the staged vector).
BLOCK_THREADS = {"k_norm_qkv": 256, "k_norm_gateup": 256, "k_matvec_residual": 256,
                 "k_head_argmax": 256, "k_attn_partial": 128, "k_gemm_wide": 256,
                 "k_gemm_narrow": 256, "k_gemm_q8": 256, "k_tile": 256, "k_distill_row": 256}


def stage_bytes(k: int, fmt: str) -> int:
    b = 16 * math.ceil(k / 4)
    return b + (16 * math.ceil(k / 16) + 4 * math.ceil(k / 32) if fmt == "int8" else 0)


FORMATS = {"0": "f32", "2": "bf16", "3": "f16", "4": "int8"}  # algenta::Dtype's values
# GEMMs (bound by arithmetic); the other kernels stream memory (decode's matvecs, attention).
COMPUTE_KERNELS = ("k_tile", "k_gemm_wide", "k_gemm_q8")


TOOLS = ("nvcc", "cuobjdump", "nvdisasm")  # cuobjdump -sass disassembles with nvdisasm


def tool(name: str):
    path = shutil.which(name)
    if path:
        return path
    try:  # the PyPI packages nvidia-cuda-cuobjdump / -nvdisasm put it here
        import nvidia
        for base in nvidia.__path__:
            for sub in ("cu13", "cu12", "cuda_cuobjdump", "cuda_nvdisasm"):
                p = os.path.join(base, sub, "bin", name)
                if os.path.exists(p):
                    return p
    except ImportError:
        pass
    return None


# ---- compile and read --------------------------------------------------------------------------
def tool_env(**extra) -> dict:
    """The environment the toolkit's programs run in: this one without a preloaded sanitizer
    runtime (tools/sanitize-test preloads ASan into the test process, and nvcc's own binaries
    crash under it), plus extra."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    env.update(extra)
    return env


# Where compiled cubins are kept between runs (one nvcc of session_cuda.cu takes most of a minute
# on two cores, and CI's suite and this script ask for the same ones): under build/, keyed by
# everything the compile reads, so an edit anywhere in cuda/ or cpp/include/ compiles afresh.
CACHE_DIR = os.environ.get("ALGENTA_CUBIN_CACHE", os.path.join(ROOT, "build", "cubin-cache"))


def _compile_key(cmd_flags: list, nvcc: str) -> str:
    h = hashlib.sha256()
    h.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                            env=tool_env()).stdout.encode())
    h.update("\0".join(cmd_flags).encode())
    for top in ("cuda", os.path.join("cpp", "include")):
        for d, dirs, files in sorted(os.walk(os.path.join(ROOT, top))):
            dirs.sort()
            for f in sorted(files):
                path = os.path.join(d, f)
                h.update(os.path.relpath(path, ROOT).encode() + b"\0")
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:32]


def compile_cubin(src: str, arch: str, out_dir: str):
    """(cubin path, {mangled name: {regs, smem, spill}}) of one .cu for one arch; the cubin and
    nvcc's resource report come from CACHE_DIR when the same sources were compiled before."""
    cubin = os.path.join(out_dir, os.path.basename(src).replace(".cu", f"_{arch}.cubin"))
    nvcc = tool("nvcc")
    flags = ["-std=c++17", f"-arch={arch}", "-cubin", "--resource-usage",
             "-I" + os.path.join(ROOT, "cpp", "include"), "-I" + os.path.join(ROOT, "cuda"),
             "-DALGENTA_SMEM_TIER_BYTES=49152", os.path.join(ROOT, src)]
    key = _compile_key(flags, nvcc)
    cached = os.path.join(CACHE_DIR, key)
    if os.path.exists(cached + ".cubin") and os.path.exists(cached + ".log"):
        shutil.copyfile(cached + ".cubin", cubin)
        with open(cached + ".log") as fh:
            report = fh.read()
    else:
        r = subprocess.run([nvcc, *flags, "-o", cubin], capture_output=True, text=True,
                           env=tool_env())
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src}:\n{r.stderr[-2000:]}")
        report = r.stdout + "\n" + r.stderr
        os.makedirs(CACHE_DIR, exist_ok=True)
        # Written under a temporary name and renamed: a reader never sees half a file, and the
        # log last, since its presence is what says the entry is whole.
        tmp = f"{cached}.{os.getpid()}.tmp"
        shutil.copyfile(cubin, tmp)
        os.replace(tmp, cached + ".cubin")
        with open(tmp, "w") as fh:
            fh.write(report)
        os.replace(tmp, cached + ".log")
    res, cur = {}, None
    for line in report.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            cur = res.setdefault(m.group(1), {"regs": 0, "smem": 0, "spill": 0})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            cur["spill"] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return cubin, res


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass(cubin: str) -> dict:
    """{mangled name: [(address, opcode, operands)]}."""
    # cuobjdump -sass runs nvdisasm, which it looks for on PATH
    nvdisasm_dir = os.path.dirname(tool("nvdisasm"))
    env = tool_env(PATH=nvdisasm_dir + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass failed on {cubin}: {r.stderr.strip()}")
    out, cur = {}, None
    for line in r.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = _INSN.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def load_bytes(op: str) -> int:
    """Bytes per lane of a global load opcode (LDG.E.128 -> 16, LDG.E.U16 -> 2, LDG.E -> 4)."""
    for tag, b in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if tag in op:
            return b
    return 4


def is_mma(op: str) -> bool:
    return op.startswith(("HMMA", "IMMA", "DMMA"))


def fma_count(body) -> int:
    return sum(o.startswith(("FFMA", "DFMA", "IDP")) for _, o, _ in body)


def main_loop(insns, compute: bool = False):
    """The loop a kernel spends its time in (a backward branch's span of instructions): for a
    tensor-core kernel the smallest loop holding its MMAs (the k loop, with the staging loops
    nested in it); otherwise, of the innermost loops (holding no other), the one with the most
    global-load bytes an iteration, then the most FMAs."""
    spans = []
    for addr, op, operands in insns:
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", operands)
            if m and int(m.group(1), 16) < addr:
                spans.append((int(m.group(1), 16), addr))
    body = {sp: [(a, o, x) for a, o, x in insns if sp[0] <= a <= sp[1]] for sp in spans}
    with_mma = [sp for sp in spans if any(is_mma(o) for _, o, _ in body[sp])]
    if with_mma:
        return body[min(with_mma, key=lambda sp: sp[1] - sp[0])]
    if compute:  # a SIMT GEMM: the loop with the most multiply-adds
        return body[max(spans, key=lambda sp: (fma_count(body[sp]), -len(body[sp])))] \
            if spans else []
    inner = [(lo, hi) for lo, hi in spans
             if not any((l2, h2) != (lo, hi) and lo <= l2 and h2 <= hi for l2, h2 in spans)]
    if not inner:
        return []

    def key(sp):
        b = body[sp]
        ldg = sum(load_bytes(o) for _, o, _ in b if o.startswith("LDG"))
        fma = sum(o.startswith(("FFMA", "DFMA", "IDP", "HFMA2")) for _, o, _ in b)
        return (ldg, fma, -len(b))
    return body[max(inner, key=key)]


# lossk's tile (lossk_tile.cuh): BM x BN outputs, NT threads, BK deep a k-step (32 for 16-bit
# operands, 16 for TF32 and SIMT). Tensor-core tiles have two k loops: interior tiles' (16-byte
# loads one k-step ahead, unrolled, no nested loop), which main_loop picks as the smallest loop
# holding MMAs and which nearly every tile of a large product takes, and edge tiles' checked
# loop, whose two nested staging loops (A's then B's) expanded_insns counts.
TILE_BM, TILE_BN, TILE_NT = 64, 256, 256


def expanded_insns(insns_all, loop, what: str) -> float:
    """Warp instructions one iteration of a tensor-core main loop issues, loops nested in it
    counted as often as they run. The tile's nested loops stage A (BM x BK) and B (BN x BK): a
    thread stages BM BK / NT and BN BK / NT elements, one global load each, as many an iteration
    as the loop's body has loads (the unroll nvcc chose), so its trip count is their ratio."""
    lo, hi = loop[0][0], loop[-1][0]
    nested = []
    for addr, op, operands in insns_all:
        m = re.search(r"0x([0-9a-f]+)", operands) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < addr and lo < int(m.group(1), 16) and addr < hi:
            nested.append((int(m.group(1), 16), addr))
    nested.sort()
    bk = 16 if what.startswith("tf32") else 32
    elems = [TILE_BM * bk / TILE_NT, TILE_BN * bk / TILE_NT]
    total = float(len(loop))
    for i, (a, b) in enumerate(nested[:2]):
        body = [o for q, o, _ in insns_all if a <= q <= b]
        loads = max(1, sum(o.startswith("LDG") for o in body))
        trips = math.ceil(elems[i] / loads)
        total += len(body) * (trips - 1)
    return total


def tile_smem(variant: str) -> int:
    """The dynamic shared memory k_tile is launched with (lossk_tile.cuh, tile_smem_bytes): for
    tensor cores two staged k-steps, each operand in its global layout with rows padded by 16
    bytes; for SIMT one k-step; at least the epilogue's 32-row float slice."""
    mma, _, product = variant.partition("/")
    epi = 32 * (TILE_BN + 4) * 4
    if mma == "simt":  # float (the larger of the two SIMT variants, double, is 16 x 320 x 8)
        return max(epi, 16 * (TILE_BM + TILE_BN) * 8)
    bk, esz = (16, 4) if mma == "tf32" else (32, 2)
    pad = 16 // esz
    a_km = product == "d_weight"
    b_kn = product in ("d_hidden", "d_weight")
    a = bk * (TILE_BM + pad) if a_km else TILE_BM * (bk + pad)
    b = bk * (TILE_BN + pad) if b_kn else TILE_BN * (bk + pad)
    return max(epi, 2 * esz * (a + b))


def occupancy(regs: int, smem_static: int, smem_dyn: int, threads: int) -> dict:
    d = H200
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = d["regs_per_sm"] // (regs_per_warp * warps)
    by_threads = d["threads_per_sm"] // threads
    smem = smem_static + smem_dyn + d["smem_reserved_per_block"]
    by_smem = d["smem_per_sm"] // smem
    blocks = max(0, min(d["blocks_per_sm"], by_regs, by_threads, by_smem))
    limit = min((by_regs, "registers"), (by_threads, "threads"), (by_smem, "shared memory"),
                (d["blocks_per_sm"], "blocks"))[1]
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps, "limited_by": limit}


def short(mangled: str):
    """(kernel name, format or product) from a mangled name."""
    name = mangled
    for m in re.finditer(r"k_[a-z0-9_]", mangled):  # a <length><name> whose name is k_...
        p = m.start()
        for d in (2, 1):
            if p >= d and mangled[p - d:p].isdigit():
                cand = mangled[p:p + int(mangled[p - d:p])]
                if re.fullmatch(r"k_[a-z0-9_]+", cand):
                    name = cand
                    break
    f = re.search(r"DtypeE(\d)E", mangled)
    what = FORMATS.get(f.group(1), "") if f else ""
    rows = re.search(r"DtypeE\dELi(\d+)E", mangled)  # a row kernel's width R (decode's is 1)
    if rows and rows.group(1) != "1":
        what += "/rows" + rows.group(1)
    if name == "k_tile":
        mma = re.search(r"TileProductILi(\d)E", mangled)
        what = {"0": "simt", "1": "bf16", "2": "f16", "3": "tf32"}.get(mma.group(1), "") \
            if mma else ""
        # TileProduct<MMA, T, XA, ALayout, XB, BLayout, EPI, XC>: EPI 0 is the logits' epilogue;
        # with EPI 1 (a store), A laid out KM is d_weight's, MK d_hidden's
        epi = re.search(r"BLayoutE\dELi(\d)E", mangled)
        if epi:
            what += "/" + ("logits" if epi.group(1) == "0" else
                           "d_weight" if "ALayoutE1E" in mangled else "d_hidden")
    return name, what


SOURCES = ("cuda/session_cuda.cu", "cuda/lossk_cuda.cu", "cuda/lossk_distill.cu")


def analyze(arch: str, tmp: str, sources=SOURCES) -> list:
    """One row per kernel instantiation of the sources, compiled for arch."""
    rows = []
    for src in sources:
        cubin, res = compile_cubin(src, arch, tmp)
        for mangled, insns in sass(cubin).items():
            name, what = short(mangled)
            if name not in BLOCK_THREADS:
                continue
            if src.endswith("lossk_distill.cu") and name != "k_distill_row":
                continue  # its tiles are lossk_cuda.cu's instantiations, reported from there
            if name == "k_tile" and src.endswith("session_cuda.cu"):
                what = "bf16/prefill"  # the session's bf16 prefill on lossk's tile
            r = res.get(mangled, {"regs": 0, "smem": 0, "spill": 0})
            compute = name in COMPUTE_KERNELS
            loop = main_loop(insns, compute)
            mma = sum(is_mma(o) for _, o, _ in loop)
            fma = sum(o.startswith(("FFMA", "DFMA", "HFMA2")) and ".MMA" not in o
                      for _, o, _ in loop)
            idp = sum(o.startswith("IDP") for _, o, _ in loop)
            ldg = [load_bytes(o) for _, o, _ in loop if o.startswith("LDG")]
            lds = sum(o.startswith("LDS") or o.startswith("LDSM") for _, o, _ in loop)
            bars = sum(o.startswith("BAR") for _, o, _ in loop)
            threads = BLOCK_THREADS[name]
            dyn = 0
            # a row kernel of width R stages R rows (at the 0.6B shape all 8 fit)
            width = int(what.split("/rows")[1]) if "/rows" in what else 1
            fmt = what.split("/")[0]
            if name in ("k_norm_qkv", "k_norm_gateup", "k_head_argmax"):
                dyn = width * stage_bytes(1024, fmt)
            elif name == "k_matvec_residual":
                dyn = width * stage_bytes(3072, fmt)
            elif name == "k_attn_partial":
                dyn = 4 * (128 + 4 * 128 + 8)
            elif name == "k_tile":
                dyn = tile_smem(what)
            occ = occupancy(r["regs"], r["smem"], dyn, threads)
            row = {"arch": arch, "kernel": name, "variant": what, "registers": r["regs"],
                   "smem_static": r["smem"], "smem_dynamic": dyn, "spill_bytes": r["spill"],
                   **occ, "loop_insns": len(loop), "mma": mma, "fma": fma + idp, "ldg": len(ldg),
                   "ldg_bytes_per_lane": sum(ldg), "lds": lds, "barriers": bars,
                   "bytes_per_load": sum(ldg) * 32 / len(ldg) if ldg else 0.0}
            if mma:
                insns = expanded_insns(insns_all=insns, loop=loop, what=what)
                row["loop_insns_per_iteration"] = insns
                row["insns_per_mma"] = insns / mma
            if arch != "sm_90":  # the device model is the H200's: other archs get the SASS only
                rows.append(row)
                continue
            if mma:
                issue = min(1.0, 4 * mma / row["loop_insns_per_iteration"])
                row["estimate_tensor_share"] = issue * min(1.0, occ["warps_per_sm"] / 8)
            elif compute:  # FP32 and dp4a pipes take 4 warp instructions a clock, FP64 2
                dfma = sum(o.startswith("DFMA") for _, o, _ in loop)
                n = max(1, len(loop))
                row["estimate_simt_share"] = min(1.0, (fma + idp - dfma) / n + 2 * dfma / n)
            elif ldg:
                need = H200["hbm_bytes_s"] * H200["load_latency_s"] / H200["sms"]
                flight = occ["warps_per_sm"] * 32 * sum(ldg)
                row["in_flight_bytes_per_sm"] = flight
                row["estimate_hbm_share"] = min(1.0, flight / need)
            rows.append(row)
    return rows


# The kernels a decode step launches (session_cuda_decode.cuh, enqueue_rows), every one but
# k_embed as a programmatic dependent launch; k_embed calls the wait too (a no-op when nothing
# precedes it).
DECODE_KERNELS = ("k_embed", "k_norm_qkv", "k_qk_norm_rope", "k_attn_partial", "k_attn_merge",
                  "k_matvec_residual", "k_out_norm_residual", "k_norm_gateup", "k_rmsnorm_rows",
                  "k_head_argmax")
_GLOBAL_ACCESS = ("LDG", "STG", "LD.", "ST.", "ATOM", "RED", "LDGSTS")


def pdl_discipline(arch: str, tmp: str, src: str = "cuda/session_cuda.cu") -> dict:
    """{(kernel, variant): {"wait", "l2_prefetch", "global_before_wait"}} for the decode kernels,
    read from the SASS: whether the kernel has griddepcontrol.wait (ACQBULK on sm_90), whether
    it prefetches into L2 (CCTL ... PF2), and how many global-memory instructions come before
    its first wait in program order (the prologue is straight-line code: any there would read
    what the kernel before may still be writing)."""
    cubin, _ = compile_cubin(src, arch, tmp)
    out = {}
    for mangled, insns in sass(cubin).items():
        name, what = short(mangled)
        if name not in DECODE_KERNELS:
            continue
        ops = [o for _, o, _ in insns]
        wait = next((i for i, o in enumerate(ops) if o.startswith("ACQBULK")), None)
        before = ops if wait is None else ops[:wait]
        out[(name, what)] = {
            "wait": wait is not None,
            "l2_prefetch": any(o.startswith("CCTL") and "PF2" in o for o in ops),
            "global_before_wait": sum(o.startswith(_GLOBAL_ACCESS) for o in before)}
    return out


# A decode step's nodes at the Qwen3-0.6B shape on the standard path (session_cuda_decode.cuh,
# enqueue_rows): per layer the four matvecs and q/k norm + RoPE and attention; then the final
# norm and the head; k_embed first. Every node but k_embed is a programmatic dependent launch.
QWEN3 = dict(D=1024, Hq=16, Hkv=8, Dh=128, F=3072, L=28, V=151936)
PDL_PREFETCH_BYTES = 16 * 1024  # common.cuh: what a PDL matvec block asks L2 for before waiting
PDL_GAPS_S = (1e-6, 0.5e-6, 0.25e-6)  # exposed boundary under PDL: assumed, not known


def qwen3_plan(fmt: str) -> dict:
    """The CUDA session's launch plan at the Qwen3-0.6B shape on the H200's SMs (host arithmetic,
    any build)."""
    from algenta import _core
    c = QWEN3
    return _core.session.cuda_plan.make_plan(c["D"], c["Hq"], c["Hkv"], c["Dh"], c["F"], c["L"],
                                             c["V"], 1e-6, 1e6, True, 512, H200["sms"],
                                             weights=fmt)


def decode_matvecs(plan: dict) -> list:
    """(kernel, its launch plan, K, weight matrices it reads, launches a token) of each decode
    matvec at the Qwen3-0.6B shape: per layer qkv, o_proj, gate/up (two matrices), down; the
    head once."""
    c = QWEN3
    D, A, F, L = c["D"], c["Hq"] * c["Dh"], c["F"], c["L"]
    return [("k_norm_qkv", plan["qkv_mv"], D, 1, L), ("k_matvec_residual", plan["o_mv"], A, 1, L),
            ("k_norm_gateup", plan["gateup_mv"], D, 2, L),
            ("k_matvec_residual", plan["down_mv"], F, 1, L),
            ("k_head_argmax", plan["head_mv"], D, 1, 1)]


def launch_share(row: dict, mv: dict, row_bytes: float) -> float:
    """The share of HBM bandwidth one matvec launch can hold (Little's law, as the kernel rows'
    estimate) with the blocks it has: its grid spread over the SMs, at most its occupancy, and a
    lane's bytes in flight, one main-loop iteration's loads but at most its slice of a row (a
    row split over mv["split"] warps gives each lane 1/split of its share)."""
    need = H200["hbm_bytes_s"] * H200["load_latency_s"] / H200["sms"]
    resident = min(row["blocks_per_sm"], mv["grid"] / H200["sms"])
    lane = min(row["ldg_bytes_per_lane"], row_bytes / mv["split"] / 32)
    return min(1.0, resident * BLOCK_THREADS[row["kernel"]] * lane / need)


def decode_estimate(rows: list, gap_s: float = GRAPH_GAP_S, pdl: bool = False) -> dict:
    """Per weight format: a Qwen3-0.6B decode token by the model (see the module docstring).

    Without PDL every node pays gap_s (GRAPH_GAP_S, 2 us). With PDL (pdl=True) the first node
    pays GRAPH_GAP_S and every other node gap_s, the part of the boundary its early launch does
    not hide; a matvec's blocks, resident before the wait, have asked L2 for the first
    PDL_PREFETCH_BYTES of their rows, which stream during that exposed gap, so up to
    gap_s x bandwidth of the matvec's bytes are off its own time. An upper bound: the prefetching
    blocks are assumed resident beside the retiring kernel."""
    c = QWEN3
    out = {}
    bw = H200["hbm_bytes_s"]
    for fmt, bpe in (("f32", 4.0), ("bf16", 2.0), ("f16", 2.0), ("int8", 1.125)):
        share = {r["kernel"]: r for r in rows if r["variant"] == fmt and r["arch"] == "sm_90"}
        mvs = decode_matvecs(qwen3_plan(fmt))
        if any(k not in share for k, *_ in mvs):
            continue
        # (kernel, bytes, launch plan, K, matrices a block prefetches) of each matvec a token
        # makes
        launches = [(k, mv["rows"] * K * n_mats * bpe, mv, K, n_mats)
                    for k, mv, K, n_mats, times in mvs for _ in range(times)]
        nodes = 6 * c["L"] + 3
        t = GRAPH_GAP_S + (nodes - 1) * gap_s if pdl else nodes * gap_s
        for k, nbytes, mv, K, n_mats in launches:
            hidden = (min(nbytes, n_mats * mv["grid"] * PDL_PREFETCH_BYTES, gap_s * bw)
                      if pdl else 0.0)
            t += (nbytes - hidden) / (max(launch_share(share[k], mv, K * bpe), 1e-9) * bw)
        weight = sum(x[1] for x in launches)
        out[fmt] = {"ms_per_token": 1e3 * t, "tok_s": 1.0 / t,
                    "share_of_hbm_roofline": weight / bw / t}
    return out


# lossk's tile (lossk_tile.cuh): BM x BN outputs a block; the GEMM sizes of the issue's target.
TILE_BM, TILE_BN = 64, 256
LOSS_SHAPE = dict(N=4096, D=4096, V=151936)
# The shape of a published peer figure: Liger-Kernel's Hopper kernel, forward + backward of
# 4,096 x 4,096 x 128,256 in 18.3 ms on an H200 (measured there, not here).
PEER_SHAPE, PEER_S = dict(N=4096, D=4096, V=128256), 18.3e-3


def loss_estimate(rows: list, N: int, D: int, V: int) -> dict:
    """bf16 fused linear cross-entropy with gradients, N tokens x d_model D x vocab V, by the
    model: per chunk (the largest the contract allows, a multiple of 16 as the device rounds
    bf16 chunks) its three tile GEMMs (logits, d_hidden, d_weight) and the float32 logit traffic
    between them. A GEMM of ctas = ceil(M / 64) x ceil(N / 256) tiles runs in waves of (SMs x
    its blocks an SM); a wave takes one tile's flops at its blocks' share of the SM's rate (the
    kernel row's interior-tile estimate; edge tiles taken as interior ones), or its memory time
    when longer: d_weight reads and rewrites its float32 accumulator (V x D) every chunk. The
    chunk's logits are stored (c x V float32) and rewritten in place by the softmax gradient
    (read + write), at HBM rate. Operand reads are assumed served from L2."""
    from algenta import _core
    tile = {r["variant"].split("/")[1]: r for r in rows
            if r["kernel"] == "k_tile" and r["arch"] == "sm_90" and
            r["variant"].startswith("bf16/") and r["variant"] != "bf16/prefill"}
    peak, sms, bw = H200["bf16_peak_flops"], H200["sms"], H200["hbm_bytes_s"]
    c0 = _core.lossk.loss_max_chunk(N, V)
    c0 = min(N, max(16, c0 - c0 % 16))  # lossk_launch.cuh's device_chunk_for, bf16
    t = {"logits": 0.0, "d_hidden": 0.0, "d_weight": 0.0, "logit_traffic": 0.0}
    eff = {}
    for t0 in range(0, N, c0):
        c = min(c0, N - t0)
        for name, m, n, k, mem in (("logits", c, V, D, 0.0), ("d_hidden", c, D, V, 0.0),
                                   ("d_weight", V, D, c, 2.0 * 4 * V * D)):
            r = tile[name]
            ctas = math.ceil(m / TILE_BM) * math.ceil(n / TILE_BN)
            slots = sms * r["blocks_per_sm"]
            waves = math.ceil(ctas / slots)
            wave_s = 2.0 * TILE_BM * TILE_BN * k / (r["estimate_tensor_share"] * peak / slots)
            t[name] += max(waves * wave_s, mem / bw)
            eff.setdefault(name, []).append(ctas / (waves * slots))
        t["logit_traffic"] += 3.0 * 4 * c * V / bw
    flops = 2.0 * N * D * V
    total = sum(t.values())
    return {"chunk": c0, "seconds": t, "wave_efficiency": {k: min(v) for k, v in eff.items()},
            "forward_share": flops / t["logits"] / peak, "total_s": total,
            "total_share": 3 * flops / total / peak}


# ---- the model against a device ---------------------------------------------------------------
# What an H200 measured (NVIDIA H200, 132 SMs, driver 580.159.04, CUDA 13.0; tools/gpu-check on
# 2026-12-04 at ff432c3: perf/bench_decode_gpu.py --new 64 --reps 3, perf/bench_lossk_gpu.py
# --reps 3), copied from that run's output: the figures the model is to be corrected toward.
MEASURED_H200 = {
    "decode_tok_s": {"f32": 629.3, "bf16": 771.0, "f16": 809.5, "int8": 515.6},
    "d2d_copy_bytes_s": 4235.9e9,
    "lossk_shape": dict(N=8192, D=4096, V=151936),
    "lossk_ms": {"forward": 119.82, "forward_backward": 605.62},
    "peers_ms": {"torch.matmul logits": 13.00, "Liger-Kernel forward+backward": 64.39,
                 "Cut Cross-Entropy forward+backward": 60.82},
}


def against_device(rows: list) -> dict:
    """The model's figures beside MEASURED_H200's. For decode, what the measurement implies per
    graph node: (measured time - the model's matvec time with no gaps) / nodes, the figure the
    model assumes is 2 us without PDL and 0.25-1 us with it."""
    nodes = 6 * QWEN3["L"] + 3
    no_gap = decode_estimate(rows, 0.0)
    dec = {}
    for fmt, tps in MEASURED_H200["decode_tok_s"].items():
        if fmt not in no_gap:
            continue
        ms = 1e3 / tps
        dec[fmt] = {"measured_ms": ms, "model_ms": decode_estimate(rows)[fmt]["ms_per_token"],
                    "model_pdl_1us_ms": decode_estimate(rows, 1e-6, pdl=True)[fmt]["ms_per_token"],
                    "implied_us_per_node": 1e3 * (ms - no_gap[fmt]["ms_per_token"]) / nodes}
    out = {"decode": dec}
    if any(r["variant"] == "bf16/logits" and r["arch"] == "sm_90" for r in rows):
        le = loss_estimate(rows, **MEASURED_H200["lossk_shape"])
        m = MEASURED_H200["lossk_ms"]
        out["lossk"] = {"forward": {"measured_ms": m["forward"],
                                    "model_ms": 1e3 * le["seconds"]["logits"]},
                        "forward_backward": {"measured_ms": m["forward_backward"],
                                             "model_ms": 1e3 * le["total_s"]}}
    return out


def gap_for_share(rows: list, fmt: str, share: float):
    """The largest exposed PDL boundary (seconds) at which fmt's decode reaches share of the HBM
    roofline in the model, or None when even a zero gap does not (bisection; the share falls as
    the gap grows)."""
    def at(g):
        return decode_estimate(rows, g, pdl=True).get(fmt, {}).get("share_of_hbm_roofline", 0.0)
    if at(0.0) < share:
        return None
    lo, hi = 0.0, GRAPH_GAP_S
    if at(hi) >= share:
        return hi
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if at(mid) >= share else (lo, mid)
    return lo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90,sm_80")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    missing = [t for t in TOOLS if tool(t) is None]
    if missing:
        print(f"cuda_static: {', '.join(missing)} not found (pip install nvidia-cuda-cuobjdump "
              f"nvidia-cuda-nvdisasm; nvcc is the CUDA toolkit's): nothing estimated")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for arch in a.arch.split(",") for r in analyze(arch, tmp)]
    report = {"device": H200, "kernels": rows, "decode_qwen3_0.6b": decode_estimate(rows),
              "decode_qwen3_0.6b_pdl": {f"{g * 1e6:g}us": decode_estimate(rows, g, pdl=True)
                                        for g in PDL_GAPS_S},
              "pdl_gap_for_bf16_75pct_s": gap_for_share(rows, "bf16", 0.75)}
    if any(r["variant"] == "bf16/logits" and r["arch"] == "sm_90" for r in rows):
        report["lossk_bf16"] = loss_estimate(rows, **LOSS_SHAPE)
        report["lossk_bf16_peer_shape"] = loss_estimate(rows, **PEER_SHAPE)
    if any(r["arch"] == "sm_90" for r in rows):
        report["against_h200"] = against_device(rows)
    if a.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print("Static model (estimates, not measurements; assumptions in perf/cuda_static.py)")
    print(f"{'arch':<6} {'kernel':<18} {'variant':<14} {'regs':>4} {'spill':>5} {'CTA/SM':>6} "
          f"{'warps':>5} {'loop':>5} {'MMA':>4} {'insn/MMA':>8} {'LDG':>4} {'B/LDG':>6} "
          f"{'estimate':>18}")
    for r in sorted(rows, key=lambda r: (r["arch"], r["kernel"], r["variant"])):
        est = (f"{100 * r['estimate_tensor_share']:.0f}% tensor peak"
               if "estimate_tensor_share" in r else
               f"{100 * r['estimate_simt_share']:.0f}% FMA peak" if "estimate_simt_share" in r
               else f"{100 * r['estimate_hbm_share']:.0f}% HBM" if "estimate_hbm_share" in r
               else "")
        ipm = f"{r['insns_per_mma']:.1f}" if r.get("insns_per_mma") else ""
        print(f"{r['arch']:<6} {r['kernel']:<18} {r['variant']:<14} {r['registers']:>4} "
              f"{r['spill_bytes']:>5} {r['blocks_per_sm']:>6} {r['warps_per_sm']:>5} "
              f"{r['loop_insns']:>5} {r['mma']:>4} {ipm:>8} {r['ldg']:>4} "
              f"{r['bytes_per_load']:>6.0f} {est:>18}")
    print("\nDecode of one Qwen3-0.6B token (sm_90 matvec estimates + 171 graph gaps of 2 us):")
    for fmt, e in report["decode_qwen3_0.6b"].items():
        print(f"  {fmt:<5} {e['ms_per_token']:.3f} ms/token, {e['tok_s']:.0f} tok/s, "
              f"{100 * e['share_of_hbm_roofline']:.0f}% of the HBM roofline")
    print("\nThe same with programmatic dependent launch (170 of the 171 nodes), by the exposed "
          "part of each boundary (assumed; a device measures it):")
    for g, est in report["decode_qwen3_0.6b_pdl"].items():
        print(f"  {g:>7} " + ", ".join(f"{fmt} {e['ms_per_token']:.3f} ms "
                                       f"({100 * e['share_of_hbm_roofline']:.0f}%)"
                                       for fmt, e in est.items()))
    g75 = report["pdl_gap_for_bf16_75pct_s"]
    if g75 is not None:
        print(f"  bf16 weights reach 75% of the HBM roofline while a boundary exposes at most "
              f"{g75 * 1e6:.2f} us")
    le = report.get("lossk_bf16")
    if le:
        sh = LOSS_SHAPE
        print(f"\nlossk bf16 forward + backward, {sh['N']:,} x {sh['D']:,} x {sh['V']:,} "
              f"(chunks of {le['chunk']}), sm_90 tile estimates with waves and float32 traffic:")
        for k, v in le["seconds"].items():
            w = le["wave_efficiency"].get(k)
            print(f"  {k:<14} {1e3 * v:7.2f} ms" + (f"  (waves at least {100 * w:.0f}% full)"
                                                   if w is not None else ""))
        print(f"  total          {1e3 * le['total_s']:7.2f} ms: {100 * le['total_share']:.0f}% of "
              f"the bf16 tensor peak; the forward's GEMM {100 * le['forward_share']:.0f}%")
        lp, sh = report["lossk_bf16_peer_shape"], PEER_SHAPE
        print(f"  at {sh['N']:,} x {sh['D']:,} x {sh['V']:,}: {1e3 * lp['total_s']:.2f} ms "
              f"({100 * lp['total_share']:.0f}%); Liger-Kernel's Hopper kernel is published at "
              f"{1e3 * PEER_S:.1f} ms there on an H200")
    dev = report.get("against_h200")
    if dev:
        print("\nThe model against an H200 (measured 2026-12-04, MEASURED_H200): decode ms/token")
        print(f"  {'format':<6} {'measured':>9} {'model':>7} {'PDL 1us':>8} "
              f"{'implied us/node':>16}")
        for fmt, d in dev["decode"].items():
            print(f"  {fmt:<6} {d['measured_ms']:>9.3f} {d['model_ms']:>7.3f} "
                  f"{d['model_pdl_1us_ms']:>8.3f} {d['implied_us_per_node']:>16.1f}")
        sh = MEASURED_H200["lossk_shape"]
        for k, d in dev.get("lossk", {}).items():
            print(f"  lossk bf16 {k} at {sh['N']:,} x {sh['D']:,} x {sh['V']:,}: measured "
                  f"{d['measured_ms']:.1f} ms, model {d['model_ms']:.1f} ms "
                  f"({d['measured_ms'] / d['model_ms']:.1f}x the model)")
        print("  peers in the same run: " + ", ".join(
            f"{k} {v:.1f} ms" for k, v in MEASURED_H200["peers_ms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
