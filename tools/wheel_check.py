#!/usr/bin/env python3
"""Checks and one rewrite for the wheels tools/build-wheels makes.

    wheel_check.py WHEEL --contents            no object files, archives, tests or build paths
    wheel_check.py WHEEL --max-glibc 2.28      every shared object's glibc needs, listed with the
                                               symbols behind the newest version; fails past it
    wheel_check.py WHEEL --local-version cu13  rewrites WHEEL as NAME-VERSION+cu13 (METADATA,
                                               .dist-info, RECORD), removing the original
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fail(msg):
    sys.exit(f"wheel_check: {msg}")


def check_contents(whl):
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        bad = [n for n in names if n.endswith((".o", ".a", ".obj", ".cu", ".cpp", ".hpp"))
               or "/tests/" in f"/{n}" or n.startswith("build/")]
        if bad:
            fail(f"{os.path.basename(whl)} holds files a wheel must not: {bad[:5]}")
        needle = ROOT.encode()
        leaks = [n for n in names if needle in z.read(n)]
        if leaks:
            fail(f"{os.path.basename(whl)}: the source path {ROOT} is inside {leaks[:5]}")
    print(f"wheel_check: {os.path.basename(whl)}: {len(names)} files, "
          f"{os.path.getsize(whl) / 2**20:.1f} MiB, no objects, tests or build paths")


def glibc_needs(path):
    """{version: [symbols]} of the GLIBC_* versions a shared object requires."""
    ver_of = {}
    out = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        m = re.search(r"\*UND\*\s+[0-9a-f]+\s+\(?(GLIBC_[0-9.]+)\)?\s+(\S+)$", line)
        if m:
            ver_of.setdefault(m.group(1), []).append(m.group(2))
    return ver_of


def key(v):
    return tuple(int(x) for x in v.split("_")[1].split("."))


def check_glibc(whl, floor):
    with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(whl) as z:
        z.extractall(d)
        worst = "GLIBC_2.0"
        for base, _, files in os.walk(d):
            for f in files:
                if ".so" not in f:
                    continue
                p = os.path.join(base, f)
                needs = glibc_needs(p)
                if not needs:
                    continue
                top = max(needs, key=key)
                worst = max(worst, top, key=key)
                print(f"wheel_check: {os.path.relpath(p, d)} needs {top} for "
                      f"{', '.join(sorted(set(needs[top]))[:6])}")
        if key(worst) > key("GLIBC_" + floor):
            fail(f"{os.path.basename(whl)} needs {worst}, past the glibc {floor} floor")
        print(f"wheel_check: {os.path.basename(whl)}: glibc floor {worst[6:]} (<= {floor})")


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def set_local_version(whl, label):
    d, base = os.path.split(whl)
    dist, version, rest = base.split("-", 2)
    if "+" in version:
        fail(f"{base} already has a local version")
    new_version = f"{version}+{label}"
    old_info, new_info = f"{dist}-{version}.dist-info/", f"{dist}-{new_version}.dist-info/"
    out = os.path.join(d, f"{dist}-{new_version}-{rest}")
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        records = []
        for info in zin.infolist():
            name, data = info.filename, zin.read(info.filename)
            if name.startswith(old_info):
                name = new_info + name[len(old_info):]
            if name == new_info + "RECORD":
                continue
            if name == new_info + "METADATA":
                data, n = re.subn(rb"^Version: .*$", f"Version: {new_version}".encode(), data,
                                  count=1, flags=re.M)
                if n != 1:
                    fail("METADATA has no Version line")
            zi = zipfile.ZipInfo(name, info.date_time)
            zi.external_attr, zi.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            zout.writestr(zi, data)
            records.append(record_line(name, data))
        records.append(f"{new_info}RECORD,,")
        zout.writestr(new_info + "RECORD", "\n".join(records) + "\n")
    os.remove(whl)
    print(f"wheel_check: {base} -> {os.path.basename(out)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel")
    ap.add_argument("--contents", action="store_true")
    ap.add_argument("--max-glibc", metavar="X.Y")
    ap.add_argument("--local-version", metavar="LABEL")
    a = ap.parse_args()
    if a.contents:
        check_contents(a.wheel)
    if a.max_glibc:
        check_glibc(a.wheel, a.max_glibc)
    if a.local_version:
        set_local_version(a.wheel, a.local_version)


if __name__ == "__main__":
    main()
