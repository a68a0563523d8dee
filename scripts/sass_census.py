#!/usr/bin/env python3
"""Counts a CUDA kernel's SASS instructions by kind, loop by loop, without a GPU.

Compiles the conv kernels' CUDA files (or --source) to cubins for one architecture, disassembles
the kernels whose demangled names match --kernel with cuobjdump, finds their loops (a predicated
branch back to an earlier address) and prints, for each loop of at least --min-loop instructions,
its size and its instructions by kind (FP32 arithmetic, MUFU, conversions, shuffles, moves, address
arithmetic, memory, ...), also divided by --per (the elements a lane handles per iteration, to
compare with ncu's instructions executed per element), and its global loads in rounds (those
issued before a wait on one of them, read from the control bits). The same rounds are printed for
the code before the first innermost loop (the prologue: where a kernel's first loads wait on each
other; in address order, so both arms of a branch count, and without calls, which wait on every
scoreboard and here are slow paths such as a 64-bit division's). The whole kernel's count comes
last.

Each innermost loop's schedule is replayed for one warp alone from its control bits: every
instruction issues its stall count after the one before, and waits for the scoreboards it names,
which a variable-latency result sets --mufu-latency, --lds-latency, --global-latency or
--other-latency cycles after its issue (a register read for a store or a copy, 4 cycles). The
replay runs the body three times and prints the third iteration's cycles: a loop that one warp
runs in fewer cycles than the warps sharing a scheduler need to issue it (their count times its
instructions) is bound by issue, one that takes more by its dependency chains. It does not model
the cp.async groups' waits (DEPBAR: the ring's rows taken as arrived), barriers, bank conflicts,
dual issue or the other warps' interference.

    python3 scripts/sass_census.py --kernel 'backward_channel_first_kernel<__nv_bfloat16, 4, false'

--object reads an object file or cubin already built (by nvcc -c, or the package's build)
instead of compiling: one compile then serves every kernel's census.

    python3 scripts/sass_census.py --object /tmp/kernels.o --kernel 'update_token_kernel'

The CUDA toolkit here (nvcc) has no cuobjdump; pip has it (the wheel needs no GPU; cuobjdump
also needs nvdisasm on its PATH, from the nvidia-cuda-nvdisasm wheel):

    python3 -m pip install --target /tmp/cuda-tools nvidia-cuda-cuobjdump
    python3 scripts/sass_census.py --cuobjdump /tmp/cuda-tools/nvidia/cu13/bin/cuobjdump ...

Counts are static (instructions in the loop body, not executed ones); a loop's iterations times
its size, plus the code outside it, should come close to ncu's smsp__inst_executed.

--against OBJECT instead lists the kernels matching --kernel whose SASS differs between the first
build (--object, or the compile) and OBJECT, with their instruction counts: which kernels a
change touches (a trial's static check), two builds of the same code comparing equal (branch
targets and the per-build hash in anonymous namespaces' names are not compared).

    python3 scripts/sass_census.py --object /tmp/main.cubin --against /tmp/trial.cubin --kernel .
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (kind, test on the opcode's base name and the operands); the first match names an instruction's
# kind.
KINDS = [
    ("fp32 arithmetic", lambda base, op, args: base in ("FFMA", "FMUL", "FADD", "FMNMX")),
    ("mufu (ex2, rcp, ...)", lambda base, op, args: base == "MUFU"),
    ("fp32 select", lambda base, op, args: base == "FSEL"),
    ("conversion (F2F, F2FP, I2F, ...)",
     lambda base, op, args: base in ("F2F", "F2FP", "I2F", "F2I", "PRMT")),
    ("16-bit unpack (shift, mask)",
     lambda base, op, args: base in ("SHF", "LOP3") or (op == "IMAD.U32" and "0x10000" in args)),
    ("shuffle", lambda base, op, args: base == "SHFL"),
    ("select (SEL)", lambda base, op, args: base == "SEL"),
    ("move", lambda base, op, args: base in ("MOV", "CS2R", "UMOV") or op == "IMAD.MOV.U32"),
    ("compare (ISETP, FSETP)", lambda base, op, args: base in ("ISETP", "FSETP", "PLOP3")),
    ("integer / address arithmetic",
     lambda base, op, args: base in ("IADD3", "IMAD", "LEA", "IADD", "IABS", "IMNMX")),
    ("global load", lambda base, op, args: base == "LDG"),
    ("global store", lambda base, op, args: base == "STG"),
    ("shared memory",
     lambda base, op, args: base in ("LDS", "STS", "LDGSTS", "LDGDEPBAR", "DEPBAR")),
    ("local memory (spills)", lambda base, op, args: base in ("LDL", "STL")),
    ("constant load", lambda base, op, args: base in ("LDC", "ULDC")),
    ("branch, sync",
     lambda base, op, args: base in ("BRA", "BSSY", "BSYNC", "EXIT", "WARPSYNC", "BAR", "NOP")),
]

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")  # an instruction's guard, as in @!P0 or @UP1
BRANCH_BACK = re.compile(r"^@!?U?P\w+\s+BRA\b.*?(0x[0-9a-f]+)")
# An instruction that takes a code address (a branch, a call, a convergence barrier's target).
TARGETED = re.compile(r"^(@!?U?P\w+\s+)?(BRA|BSSY|CALL|JMP)\b")
ANONYMOUS = re.compile(r"_GLOBAL__N__[0-9a-f]+_")  # nvcc's per-build hash in the name


def kind_of(text: str) -> str:
    op, _, args = PREDICATE.sub("", text).partition(" ")
    for kind, test in KINDS:
        if test(op.split(".")[0], op, args):
            return kind
    return "other"


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Each function of cuobjdump -sass output: (address, instruction text) in order."""
    out: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = LINE.search(line)
        if m and name is not None:
            out[name].append((int(m.group(1), 16), m.group(2)))
    return out


def controls(sass: str) -> dict[str, dict[int, int]]:
    """Each function's control bits by address (sm_70 and later: the top 23 bits of the second
    word of an instruction's encoding, the line after it)."""
    out: dict[str, dict[int, int]] = {}
    name = None
    address = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = {}
            continue
        m = LINE.search(line)
        if m:
            address = int(m.group(1), 16)
            continue
        m = re.match(r"\s*/\* (0x[0-9a-f]{16}) \*/\s*$", line)
        if m and name is not None and address is not None:
            out[name][address] = int(m.group(1), 16) >> 41
            address = None
    return out


def load_rounds(body: list[tuple[int, str]], control: dict[int, int]) -> list[int]:
    """The loop body's global loads in rounds: a round ends where an instruction waits on the
    scoreboard of a load issued in it (the loads of the next round issue after that latency).
    Control bits: write scoreboard bits 5-7 (7: none), wait mask bits 11-16."""
    rounds = [0]
    pending = set()  # the scoreboards of this round's loads
    for address, text in body:
        bits = control.get(address, 0)
        if any(bits >> (11 + board) & 1 for board in pending):
            rounds.append(0)
            pending.clear()
        if base_op(text) == "LDG":
            rounds[-1] += 1
            pending.add(bits >> 5 & 7)
    return [n for n in rounds if n]


def nested_in(loop: tuple[int, int], loops: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The loops (start, end) inside `loop`, other than itself."""
    start, end = loop
    return [(s, e) for s, e in loops if (s, e) != loop and start <= s and e <= end]


def prologue(code: list[tuple[int, str]],
             loops: list[tuple[int, int]]) -> list[tuple[int, str]]:
    """The instructions before the first innermost loop, calls left out (see the docstring)."""
    innermost = [loop for loop in loops if not nested_in(loop, loops)]
    if not innermost:
        return []
    first = min(start for start, _ in innermost)
    return [(a, t) for a, t in code if a < first and base_op(t) != "CALL"]


def base_op(text: str) -> str:
    return PREDICATE.sub("", text).split(" ")[0].split(".")[0]


def replay(body: list[tuple[int, str]], control: dict[int, int],
           latency: dict[str, int]) -> tuple[int, int]:
    """(one warp's cycles for the loop body's third pass, the body's stall counts) - see the
    module docstring. Control bits: stall count bits 0-3, write scoreboard bits 5-7 and read
    scoreboard bits 8-10 (7: none), wait mask bits 11-16."""
    ready = [0] * 6  # the cycle each scoreboard clears
    clock = 0
    for _ in range(3):
        start = clock
        for address, text in body:
            bits = control.get(address, 0)
            waits = [ready[board] for board in range(6) if bits >> (11 + board) & 1]
            clock = max([clock] + waits)
            op = base_op(text)
            if (write := bits >> 5 & 7) != 7:
                ready[write] = clock + latency.get(op, latency["other"])
            if (read := bits >> 8 & 7) != 7:
                ready[read] = clock + 4
            clock += max(bits & 15, 1)
    return clock - start, sum(control.get(address, 0) & 15 for address, _ in body)


def demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("c++filt")
    if filt is None:
        return {n: n for n in names}
    result = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True,
                            check=True)
    return dict(zip(names, result.stdout.splitlines()))


def census(instructions: list[tuple[int, str]]) -> collections.Counter:
    return collections.Counter(kind_of(text) for _, text in instructions)


def changed_functions(before: str, after: str) -> list[tuple[str, int, int]]:
    """The functions whose instructions differ between two cuobjdump -sass listings, as (name,
    instructions before, after), 0 where a listing lacks the function; code addresses in
    branches and the anonymous namespaces' hash are not compared."""
    def normal(sass: str) -> dict[str, list[str]]:
        return {ANONYMOUS.sub("_GLOBAL__N__", name):
                [re.sub(r"0x[0-9a-f]+", "0x", text) if TARGETED.match(text) else text
                 for _, text in code]
                for name, code in functions(sass).items()}

    a, b = normal(before), normal(after)
    return [(name, len(a.get(name, [])), len(b.get(name, [])))
            for name in sorted(a.keys() | b.keys()) if a.get(name) != b.get(name)]


def print_census(title: str, counts: collections.Counter, per: float) -> None:
    total = sum(counts.values())
    print(f"  {title}: {total} instructions, {total / per:.2f} per element")
    for kind, n in counts.most_common():
        print(f"    {kind:36s} {n:5d} {n / per:7.2f}")


def disassemble(cuobjdump: str, path: str) -> str:
    return subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True,
                          check=True).stdout


def compile_and_disassemble(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The SASS of each --source compiled for --arch, or None (nvcc's errors printed) if one
    fails."""
    try:
        import jaxlib  # the XLA FFI headers ship with jaxlib
        ffi_include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    except ImportError:
        parser.error("jaxlib is not importable: its include directory has the XLA FFI headers")
    sass = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in args.source:
            cubin = os.path.join(tmp, os.path.basename(source) + ".cubin")
            built = subprocess.run([args.nvcc, "-O3", "-std=c++17", "--expt-relaxed-constexpr",
                                    f"-arch={args.arch}", "-cubin",
                                    "-I", os.path.join(ROOT, "cuda"), "-I", ffi_include, source,
                                    "-o", cubin],
                                   capture_output=True, text=True, check=False)
            if built.returncode != 0:  # its warnings (the XLA FFI headers have some) only then
                print(built.stderr, file=sys.stderr)
                return None
            sass.append(disassemble(args.cuobjdump, cubin))
    return "\n".join(sass)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", required=True,
                        help="a regular expression searched in the demangled kernel names")
    parser.add_argument("--source", nargs="+",
                        default=[os.path.join(ROOT, "cuda", f"{op}_cuda.cu")
                                 for op in ("forward", "backward")],
                        help="the CUDA files to compile (default: the conv kernels' two)")
    parser.add_argument("--object", default=None,
                        help="an object file or cubin to disassemble instead of compiling --source")
    parser.add_argument("--against", default=None, metavar="OBJECT",
                        help="list the matching kernels whose SASS differs from this object's "
                             "instead of counting")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--per", type=float, default=8.0,
                        help="elements a lane handles per loop iteration (8: bf16 channel-first)")
    parser.add_argument("--min-loop", type=int, default=40,
                        help="loops with fewer instructions are not printed")
    parser.add_argument("--mufu-latency", type=int, default=20,
                        help="cycles from a MUFU's issue to its result, for the replay")
    parser.add_argument("--lds-latency", type=int, default=33,
                        help="cycles from a shared load's issue to its data, for the replay")
    parser.add_argument("--global-latency", type=int, default=300,
                        help="cycles from a global load's issue to its data (an L2 hit), for "
                             "the replay")
    parser.add_argument("--other-latency", type=int, default=12,
                        help="cycles for any other variable-latency result, for the replay")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    args = parser.parse_args(argv)
    if shutil.which(args.cuobjdump) is None and not os.path.exists(args.cuobjdump):
        parser.error(f"no cuobjdump at {args.cuobjdump!r}: see this script's docstring for the "
                     "pip wheel that has it")
    for given, path in (("--object", args.object), ("--against", args.against)):
        if path is not None and not os.path.exists(path):
            parser.error(f"{given} {path!r} does not exist")
    if args.object is not None:
        sass = disassemble(args.cuobjdump, args.object)
    else:
        sass = compile_and_disassemble(args, parser)
        if sass is None:
            return 1
    pattern = re.compile(args.kernel)
    if args.against is not None:
        changes = changed_functions(sass, disassemble(args.cuobjdump, args.against))
        names = demangle([name for name, _, _ in changes])
        changes = [c for c in changes if pattern.search(names[c[0]])]
        for name, before, after in changes:
            print(f"{before:6d} -> {after:6d}  {names[name]}")
        print(f"{len(changes)} kernels matching {args.kernel!r} differ")
        return 0
    funcs = functions(sass)
    control = controls(sass)
    names = demangle(list(funcs))
    matched = [f for f in funcs if pattern.search(names[f])]
    if not matched:
        print(f"no kernel matches {args.kernel!r} among {len(funcs)}", file=sys.stderr)
        return 1
    latency = {"MUFU": args.mufu_latency, "LDS": args.lds_latency, "LDG": args.global_latency,
               "other": args.other_latency}
    for f in matched:
        code = funcs[f]
        print(names[f])
        loops = []  # (start, end) of each backward branch's body
        for address, text in code:
            m = BRANCH_BACK.search(text)
            if m and int(m.group(1), 16) < address:
                loops.append((int(m.group(1), 16), address))
        if rounds := load_rounds(prologue(code, loops), control[f]):
            print(f"  before the first inner loop, global loads by round: {rounds}")
        for start, end in loops:
            body = [(a, t) for a, t in code if start <= a <= end]
            inner = len(nested_in((start, end), loops))
            if len(body) >= args.min_loop:
                nested = f" (holds {inner} inner loops, counted again)" if inner else ""
                print_census(f"loop {start:#06x}-{end:#06x}{nested}", census(body), args.per)
                if rounds := load_rounds(body, control[f]):
                    print(f"    global loads by round (each after a wait on the last): {rounds}")
                if inner:  # a straight replay would pass its inner loops once
                    continue
                cycles, stalls = replay(body, control[f], latency)
                print(f"    one warp's replay: {cycles} cycles an iteration, {stalls} of them "
                      f"stall counts")
        print_census("whole kernel (static)", census(code), args.per)
    return 0


if __name__ == "__main__":
    sys.exit(main())
