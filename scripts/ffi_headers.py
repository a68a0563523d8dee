#!/usr/bin/env python3
"""Extracts one jaxlib release's XLA FFI headers (by default the build's pin, 0.10.2) into a folder.

`pip install .` compiles the extensions against jax 0.10.2's headers (pyproject.toml's build
requirements), whatever jax runs them; a build without isolation takes the installed jax's. To
build the former without isolation (on a machine that cannot reach the registries, such as the
GPU machine), fetch the headers where pip can, carry the folder, and point CMake at them:

    python3 scripts/ffi_headers.py build/ffi-0.10.2
    JAX_CAUSAL_CONV_FFI_INCLUDE_DIR=$PWD/build/ffi-0.10.2 \\
        python3 -m pip install --no-build-isolation --no-deps .

The folder holds the `xla/ffi/api` headers (about 200 KB), the same on every platform.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile

PINNED = "0.10.2"
PREFIX = "jaxlib/include/"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dest", help="the folder to write (its xla/ffi/api/*.h)")
    parser.add_argument("--jaxlib", default=PINNED, help=f"the jaxlib release (default {PINNED})")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary", ":all:", "--dest", tmp, f"jaxlib=={args.jaxlib}"],
                       check=True)
        (wheel,) = glob.glob(os.path.join(tmp, "jaxlib-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            headers = [n for n in archive.namelist() if n.startswith(PREFIX + "xla/ffi/")]
            if not headers:
                print(f"{os.path.basename(wheel)} has no XLA FFI headers", file=sys.stderr)
                return 1
            for name in headers:
                target = os.path.join(args.dest, name[len(PREFIX):])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with archive.open(name) as src, open(target, "wb") as out:
                    out.write(src.read())
    with open(os.path.join(args.dest, "xla", "ffi", "api", "c_api.h")) as f:
        text = f.read()
    # The version is for the message only: a release whose c_api.h spells it otherwise still has
    # its headers written.
    found = [re.search(rf"#define XLA_FFI_API_{part} (\d+)", text) for part in ("MAJOR", "MINOR")]
    version = ".".join(m.group(1) for m in found) if all(found) else "(version not found)"
    print(f"jaxlib {args.jaxlib}: {len(headers)} headers, XLA FFI API {version}, in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
