"""bench/kernel_issue.py without a GPU or nvdisasm: its reading of a disassembly (the loop, its longest path, the
opcodes under predicates) on a small hand-written listing in nvdisasm's format, and the issue budget from the
profiles' datasheet figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kernel_issue as ki  # noqa: E402

# A loop (.L_x_1 back to itself) holding an if/else: the "then" side 3 instructions (a load and two multiplies),
# the "else" side 1; the longest path takes the "then" side. A second loop, before it, has no HMMA.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   ISETP.GE.AND P1, PT, R2, 0x10, PT ;
        /*0030*/              @!P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0040*/                   LDS R4, [R5] ;
        /*0050*/                   ISETP.NE.AND P0, PT, R6, RZ, PT ;
        /*0060*/               @P0 BRA `(.L_x_2) ;
        /*0070*/                   LDG.E.64.CONSTANT R8, desc[UR4][R10.64] ;
        /*0080*/                   HMMA.1688.F32 R12, R8, R4, R12 ;
        /*0090*/                   HMMA.1688.F32 R12, R8, R4, R12 ;
        /*00a0*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*00b0*/                   FFMA R12, R12, R4, R12 ;
.L_x_3:
        /*00c0*/                   VIADD R7, R7, 0x1 ;
        /*00d0*/                   ISETP.GE.AND P2, PT, R7, R3, PT ;
        /*00e0*/              @!P2 BRA `(.L_x_1) ;
        /*00f0*/                   EXIT ;
"""


def test_parse_and_opcodes():
    ins, labels = ki.parse_sass(LISTING)
    assert len(ins) == 16 and labels == {".L_x_0": 1, ".L_x_1": 4, ".L_x_2": 11, ".L_x_3": 12}
    assert ki.opcode(ins[3]) == "BRA" and ki.opcode(ins[8]) == "HMMA" and ki.opcode(ins[7]) == "LDG"
    assert ki.loops(ins, labels) == [(1, 3), (4, 14)]


def test_hot_loop_takes_the_longest_path():
    loop = ki.hot_loop(LISTING, "HMMA")
    # LDS, ISETP, @P0 BRA (not taken), LDG, HMMA, HMMA, BRA, VIADD, ISETP, back edge: 10; the else side gives 7
    assert loop["instructions"] == 10 and loop["markers"] == 2
    assert loop["mix"]["HMMA"] == 2 and loop["mix"]["BRA"] == 3 and "FFMA" not in loop["mix"]
    with pytest.raises(ValueError, match="no loop with a IMMA"):
        ki.hot_loop(LISTING, "IMMA")


def test_budget_from_the_profiles():
    t4, h100 = ki.issue_per_kib("t4"), ki.issue_per_kib("h100")
    # the clock from the datasheet fp32 rate: T4 8.1 TFLOP/s over 40 SMs x 64 x 2, H100 67 over 132 x 128 x 2
    assert t4["clock_ghz"] == pytest.approx(1.582, abs=1e-3) and h100["clock_ghz"] == pytest.approx(1.983, abs=1e-3)
    assert t4["budget_per_kib"] == pytest.approx(4 * 40 * 1.582e9 / 320e9 * 1024, rel=1e-3)
    assert h100["budget_per_kib"] == pytest.approx(4 * 132 * 1.983e9 / 3350e9 * 1024, rel=1e-3)
    with pytest.raises(SystemExit, match="p40"):   # Pascal: two-issue schedulers, not in the table
        ki.issue_per_kib("p40")


def test_bad_arguments_are_one_line():
    with pytest.raises(SystemExit, match="7.5 and up"):
        ki.main(["--cc", "6.1"])
    with pytest.raises(SystemExit, match="unknown kernel 'nope'"):
        ki.main(["--kernels", "nope"])


def test_an_unknown_profile_is_one_line_from_the_command():
    import subprocess
    script = Path(__file__).resolve().parents[1] / "bench" / "kernel_issue.py"
    res = subprocess.run([sys.executable, str(script), "--gpus", "nosuch"], capture_output=True, text=True)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.startswith("kernel_issue: unknown GPU 'nosuch'") and res.stderr.count("\n") == 1
