"""scripts/sass_census.py's readings of SASS control bits (the loop replay and the global loads'
rounds), on small hand-made listings in cuobjdump's format: no GPU or CUDA toolkit needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_census.py"
spec = importlib.util.spec_from_file_location("sass_census", SCRIPT)
sass_census = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_census)

NONE = 7  # no scoreboard


def control_bits(stall: int, write: int = NONE, read: int = NONE, waits: tuple = ()) -> int:
    return stall | write << 5 | read << 8 | sum(1 << (11 + board) for board in waits)


def listing(instructions) -> str:
    """cuobjdump -sass text of one function: (instruction, control bits) at 16-byte steps, each
    line followed by its second encoding word, whose top 23 bits are the control bits."""
    lines = ["\t\tFunction : kernel"]
    for i, (text, bits) in enumerate(instructions):
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;"
                     f"                   /* 0x{i:016x} */")
        lines.append(f"                                              /* 0x{bits << 41:016x} */")
    return "\n".join(lines)


def parsed(instructions):
    sass = listing(instructions)
    return sass_census.functions(sass)["kernel"], sass_census.controls(sass)["kernel"]


LATENCY = {"MUFU": 20, "LDS": 33, "LDG": 300, "other": 12}


@pytest.mark.parametrize("mufu", [20, 40])
def test_replay_waits_for_a_scoreboard(mufu):
    body, control = parsed([
        ("MUFU.EX2 R1, R2", control_bits(1, write=0)),
        ("FFMA R3, R1, R4, R5", control_bits(4, waits=(0,))),
        ("@P0 BRA 0x0", control_bits(5)),
    ])
    cycles, stalls = sass_census.replay(body, control, dict(LATENCY, MUFU=mufu))
    # The MUFU issues at 0, the FFMA when its result is ready, the branch 4 cycles later.
    assert (cycles, stalls) == (mufu + 4 + 5, 10)


def test_replay_counts_stalls_and_read_scoreboards():
    body, control = parsed([
        ("STG.E.64 desc[UR4][R2.64], R6", control_bits(2, read=1)),
        ("IADD3 R6, R6, 0x1, RZ", control_bits(3, waits=(1,))),
        ("LDS.64 R8, [R9]", control_bits(1, write=2)),
        ("FADD R10, R8, R10", control_bits(6, waits=(2,))),
        ("@P0 BRA 0x0", control_bits(5)),
    ])
    cycles, stalls = sass_census.replay(body, control, LATENCY)
    # The IADD3 waits until the store has read R6 (4 cycles), the FADD for the shared load.
    assert stalls == 2 + 3 + 1 + 6 + 5
    assert cycles == 4 + 3 + 33 + 6 + 5


def test_replay_carries_a_scoreboard_into_the_next_pass():
    # The load's result is waited for at the top of the next pass: the steady state pays the
    # latency the loop does not cover.
    body, control = parsed([
        ("FFMA R3, R1, R4, R5", control_bits(4, waits=(3,))),
        ("LDS R1, [R9]", control_bits(1, write=3)),
        ("@P0 BRA 0x0", control_bits(5)),
    ])
    cycles, _ = sass_census.replay(body, control, LATENCY)
    assert cycles == 4 + 33


def test_load_rounds():
    body, control = parsed([
        ("LDG.E R1, desc[UR4][R2.64]", control_bits(1, write=0)),
        ("LDG.E R5, desc[UR4][R6.64]", control_bits(1, write=1)),
        ("FADD R7, R1, R5", control_bits(4, waits=(0, 1))),
        ("@P1 LDG.E R8, desc[UR4][R2.64+0x4]", control_bits(1, write=0)),
        ("FADD R7, R7, R8", control_bits(4, waits=(0,))),
    ])
    assert sass_census.load_rounds(body, control) == [2, 1]


def test_prologue_rounds_end_at_a_wait_and_leave_out_calls():
    code, control = parsed([
        ("LDG.E.64 R2, desc[UR4][R10.64]", control_bits(1, write=0)),
        ("LDG.E.64 R4, desc[UR4][R12.64]", control_bits(1, write=0)),
        ("@!P1 CALL.REL.NOINC 0x100", control_bits(1, waits=(0,))),  # a slow path's call
        ("LDG.E.U16 R6, desc[UR4][R14.64]", control_bits(1, write=1)),
        ("SHF.L.U32 R7, R2, 0x10, RZ", control_bits(1, waits=(0,))),  # the first wait
        ("LDG.E.U16 R8, desc[UR4][R16.64]", control_bits(1, write=2)),
        ("FADD R9, R9, R7", control_bits(4)),  # the loop, 0x60-0x70
        ("@P0 BRA 0x60", control_bits(5)),
        ("LDG.E R1, desc[UR4][R18.64]", control_bits(1, write=3)),  # after it: not counted
    ])
    loops = [(0x60, 0x70)]
    before = sass_census.prologue(code, loops)
    assert [a for a, _ in before] == [0x00, 0x10, 0x30, 0x40, 0x50]
    assert sass_census.load_rounds(before, control) == [3, 1]
    assert sass_census.prologue(code, []) == []


def test_changed_functions_ignore_branch_targets_and_the_anonymous_hash():
    def two_functions(name, first, second):
        return "\n".join([listing(first).replace("Function : kernel", f"Function : {name}"),
                          listing(second).replace("Function : kernel", "Function : other")])

    plain = [("FADD R1, R2, R3", control_bits(1)), ("@P0 BRA 0x40", control_bits(5)),
             ("SHF.L.U32 R4, R4, 0x10, RZ", control_bits(1))]
    moved = [("FADD R1, R2, R3", control_bits(1)), ("@P0 BRA 0x80", control_bits(5)),
             ("SHF.L.U32 R4, R4, 0x10, RZ", control_bits(1))]
    shifted = [("FADD R1, R2, R3", control_bits(1)), ("@P0 BRA 0x40", control_bits(5)),
               ("SHF.L.U32 R4, R4, 0x8, RZ", control_bits(1))]
    build_a = two_functions("_ZN2ns22_GLOBAL__N__bc25600e_1_k", plain, plain)
    build_b = two_functions("_ZN2ns22_GLOBAL__N__6e6cc300_1_k", moved, plain)
    assert sass_census.changed_functions(build_a, build_b) == []
    build_c = two_functions("_ZN2ns22_GLOBAL__N__6e6cc300_1_k", moved, shifted)
    assert sass_census.changed_functions(build_a, build_c) == [("other", 3, 3)]
    build_d = listing(plain)  # one function, "kernel", in neither of the others
    assert sass_census.changed_functions(build_a, build_d) == [
        ("_ZN2ns22_GLOBAL__N__1_k", 3, 0), ("kernel", 0, 3), ("other", 3, 0)]
