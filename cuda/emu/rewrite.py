"""Build step of the CUDA emulator (ALGENTA_CUDA_EMU): turns a .cu/.cuh file into host C++ that
compiles against cuda/emu/cuda_runtime.h, changing only the two constructs no header can give a
meaning in C++:

  kernel<<<grid, block, smem, stream>>>(args)
      -> ::algenta_emu::launch("kernel", kernel, grid, block, smem, stream)(args)
  __shared__ T name[A][B];            (a block's static shared memory)
      -> auto& name = ::algenta_emu::shared_var<T[A][B]>("file:line:name");
  extern __shared__ T name[];         (the launch's dynamic shared memory)
      -> T* const name = ::algenta_emu::dynamic_smem<T>();

Everything else, kernel bodies included, is copied unchanged. Comments and string literals are
never rewritten. Line numbers are preserved and a #line directive names the original file, so
compiler errors, __FILE__/__LINE__ (the emulator's barrier sites) and debuggers point at the .cu.

usage: python rewrite.py SOURCE.cu OUTPUT.cpp
"""

from __future__ import annotations

import os
import re
import sys

_LAUNCH = re.compile(
    r"(?P<k>\b[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)*(?:\s*<[^<>;(){}]*>)?)\s*"
    r"<<<(?P<cfg>.*?)>>>\s*\(", re.S)
_EXTERN = re.compile(
    r"\bextern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?(?P<t>[A-Za-z_][\w:\s]*?)\s+"
    r"(?P<n>[A-Za-z_]\w*)\s*\[\s*\]\s*;")
_SHARED = re.compile(
    r"\b__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?(?P<t>[^;\[\]{}()]*?)\s*\b"
    r"(?P<n>[A-Za-z_]\w*)\s*(?P<d>(?:\[[^\]]*\]\s*)*);")


def _mask(src: str) -> str:
    """src with every comment and string/char literal replaced by spaces (newlines kept), so the
    patterns below only ever match code, at the same offsets as in src."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def _keep_lines(old: str, new: str) -> str:
    """new, padded with the newlines old spanned, so every later line keeps its number."""
    return new + "\n" * (old.count("\n") - new.count("\n"))


def rewrite(src: str, name: str) -> str:
    masked = _mask(src)
    edits = []  # (start, end, replacement) on src

    for m in _LAUNCH.finditer(masked):
        k = src[m.start("k"):m.end("k")].strip()
        cfg = src[m.start("cfg"):m.end("cfg")]
        rep = f'::algenta_emu::launch("{k}", {k}, {cfg})('
        edits.append((m.start(), m.end(), _keep_lines(src[m.start():m.end()], rep)))

    extern_spans = []
    for m in _EXTERN.finditer(masked):
        t, n = m.group("t").strip(), m.group("n")
        rep = f"{t}* const {n} = ::algenta_emu::dynamic_smem<{t}>();"
        edits.append((m.start(), m.end(), _keep_lines(src[m.start():m.end()], rep)))
        extern_spans.append((m.start(), m.end()))

    for m in _SHARED.finditer(masked):
        if any(a <= m.start() < b for a, b in extern_spans):
            continue
        t, n = m.group("t").strip(), m.group("n")
        dims = re.sub(r"\s+", " ", m.group("d")).strip()
        if not t:
            raise SystemExit(f"{name}: cannot parse the __shared__ declaration {m.group(0)!r}")
        line = src.count("\n", 0, m.start()) + 1
        key = f"{os.path.basename(name)}:{line}:{n}"
        rep = f'auto& {n} = ::algenta_emu::shared_var<{t}{dims}>("{key}");'
        edits.append((m.start(), m.end(), _keep_lines(src[m.start():m.end()], rep)))

    edits.sort()
    for (a0, a1, _), (b0, _, _) in zip(edits, edits[1:]):
        if b0 < a1:
            raise SystemExit(f"{name}: overlapping rewrites at offsets {a0} and {b0}")
    out, at = [], 0
    for a, b, rep in edits:
        out.append(src[at:a])
        out.append(rep)
        at = b
    out.append(src[at:])
    path = os.path.abspath(name).replace("\\", "/")
    return f'#line 1 "{path}"\n' + "".join(out)


def main(argv) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    src_path, out_path = argv[1], argv[2]
    with open(src_path, encoding="utf-8") as f:
        text = rewrite(f.read(), src_path)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
