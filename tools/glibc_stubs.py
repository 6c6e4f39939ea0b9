#!/usr/bin/env python3
"""Link-time stand-ins for glibc that expose only what an older glibc had, so a shared object
linked on a new host runs on that older glibc (the wheels' manylinux floor).

Why: a symbol reference binds, at link time, to the *default* version of that symbol in the
libc the linker reads. On this host (glibc 2.36) pthread_create is pthread_create@@GLIBC_2.34,
exp is exp@@GLIBC_2.29, and so on, so anything linked here (our objects, and the static
libstdc++ and CUDA runtime archives linked into _core) needs glibc 2.34 to load. glibc still
carries the older versions (pthread_create@GLIBC_2.2.5, exp@GLIBC_2.2.5) for old binaries. A
stub library that declares, for each symbol, the newest version not past the floor as the default
makes the linker bind exactly what a build on a glibc-<floor> system would have bound; the
real libraries are still what loads at run time.

Each stub is a shared object with the real library's soname whose symbols are empty: it is read
by the linker and never loaded. A symbol with no version at or below the floor (a function added
later) is left out, so a use of it fails the link by name instead of raising the floor silently.

usage: tools/glibc_stubs.py OUT_DIR [--floor 2.28]
Then link with -L OUT_DIR (it holds libc.so, libm.so, libpthread.so, libdl.so, librt.so).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

LIBS = {  # soname -> the link name the compiler driver asks for (-lc, -lm, ...)
    "libc.so.6": "libc.so",
    "libm.so.6": "libm.so",
    "libpthread.so.0": "libpthread.so",
    "libdl.so.2": "libdl.so",
    "librt.so.1": "librt.so",
}
# objdump -T: value, flags, section, size, version (parenthesized when not the default), name
ROW = re.compile(r"^[0-9a-f]+\s+(?P<flags>.{7})\s+(?P<sec>\S+)\s+(?P<size>[0-9a-f]+)\s+"
                 r"\(?(?P<ver>[A-Z_]+[0-9.]*)\)?\s+(?P<name>\S+)$")


def ver_key(v: str):
    return tuple(int(x) for x in v.split("_", 1)[1].split("."))


def find_lib(soname: str) -> str:
    out = subprocess.run(["gcc", f"-print-file-name={soname}"], capture_output=True, text=True)
    path = out.stdout.strip()
    if not os.path.isabs(path):
        for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
            if os.path.exists(os.path.join(d, soname)):
                return os.path.join(d, soname)
        sys.exit(f"glibc_stubs: {soname} not found")
    return path


def symbols(path: str, floor):
    """name -> (version, is_object, size): the newest GLIBC version at or below the floor."""
    best = {}
    dump = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True)
    for line in dump.stdout.splitlines():
        m = ROW.match(line.strip())
        if not m or m["sec"] == "*UND*" or m["sec"] == "*ABS*":
            continue
        ver = m["ver"]
        if not ver.startswith("GLIBC_2") or ver_key(ver) > floor:
            continue
        flags = m["flags"]
        if not any(c in flags for c in "FOi"):  # functions, ifuncs (memcpy...), objects
            continue  # TLS and section symbols: none of ours reference them
        name = m["name"]
        if name not in best or ver_key(ver) > ver_key(best[name][0]):
            best[name] = (ver, "O" in flags, int(m["size"], 16))
    return best


def build_stub(soname: str, real: str, floor, out_dir: str, work: str) -> int:
    syms = symbols(real, floor)
    asm = [".text"]
    versions = set()
    for i, (name, (ver, is_obj, size)) in enumerate(sorted(syms.items())):
        versions.add(ver)
        local = f"__stub_{i}"
        if is_obj:
            asm += [".data", f".globl {local}", f".type {local},@object",
                    f".size {local},{max(size, 1)}", f"{local}: .zero {max(size, 1)}", ".text"]
        else:
            asm += [f".globl {local}", f".type {local},@function", f"{local}: ret"]
        asm.append(f".symver {local},{name}@@{ver}")
    nodes = sorted(versions, key=ver_key)
    # the version nodes only (the .symver directives place every symbol); the __stub_N helper
    # names stay global and unversioned, harmless in a library that is only ever linked against
    vmap = [f"{v} {{ }}{f' {nodes[k - 1]}' if k else ''};" for k, v in enumerate(nodes)]
    base = os.path.join(work, soname)
    with open(base + ".s", "w") as f:
        f.write("\n".join(asm) + "\n")
    with open(base + ".map", "w") as f:
        f.write("\n".join(vmap) + "\n")
    subprocess.run(["gcc", "-shared", "-nostdlib", "-o", os.path.join(out_dir, soname),
                    base + ".s", f"-Wl,--version-script={base}.map", f"-Wl,-soname,{soname}"],
                   check=True)
    return len(syms)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--floor", default="2.28", help="oldest glibc to run on (default 2.28)")
    args = ap.parse_args()
    floor = ver_key("GLIBC_" + args.floor)
    out = os.path.abspath(args.out_dir)
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for soname, link_name in LIBS.items():
            n = build_stub(soname, find_lib(soname), floor, out, work)
            link = os.path.join(out, link_name)
            if soname == "libc.so.6":
                # libc.so is a linker script upstream too: the static part (atexit and friends)
                # and the dynamic loader come from the host, unchanged
                nonshared = find_lib("libc_nonshared.a")
                with open(link, "w") as f:
                    f.write(f"GROUP ( {out}/libc.so.6 {nonshared} "
                            f"AS_NEEDED ( {find_lib('ld-linux-x86-64.so.2')} ) )\n")
            else:
                if os.path.lexists(link):
                    os.remove(link)
                os.symlink(soname, link)
            print(f"glibc_stubs: {soname}: {n} symbols at or below glibc {args.floor}")


if __name__ == "__main__":
    main()
