"""Torch wheel advice from the one table in edgerl/wheels.py: each GPU class and driver, and the table's own facts."""

import re

import pytest

from edgerl.device.device import arch_covers
from edgerl.device.wheels import BUILDS, JETPACK6_INDEX, PYTORCH_INDEX, builds_covering, cuda_version, wheel_advice

CU126 = f"pip install 'torch<2.15' --index-url {PYTORCH_INDEX}cu126"
CU130 = f"pip install torch --index-url {PYTORCH_INDEX}cu130"
CU128 = f"pip install 'torch<2.12' --index-url {PYTORCH_INDEX}cu128"
CU118 = f"pip install 'torch<2.8' --index-url {PYTORCH_INDEX}cu118"

# cc, driver CUDA (None: unknown), integrated, machine -> command (None: no wheel), words the reason must hold
ADVICE = [
    ((5, 2), "12.4", False, "x86_64", CU126, ["sm_52 runs the sm_50 code in the cu126", "torch 2.14"]),
    ((6, 1), "12.8", False, "x86_64", CU126, ["sm_60 code", "cu128, cu130, cu132 wheels have no sm_61 code"]),
    ((6, 1), None, False, "x86_64", CU126, ["cu126"]),
    ((6, 0), "11.4", False, "x86_64", CU118, ["torch up to 2.7", "cu126 needs driver R525+"]),
    ((6, 1), "10.2", False, "x86_64", None, ["upgrade the driver to R525 or newer", CU126]),
    ((7, 0), "13.0", False, "x86_64", CU126, ["cu130, cu132 wheels have no sm_70 code"]),
    ((7, 5), "13.0", False, "x86_64", CU130, ["torch 2.9 and later", "R580"]),
    ((7, 5), "12.6", False, "x86_64", CU126, ["cu130 needs driver R580+", "this one reports 12.6"]),
    ((7, 5), None, False, "x86_64", CU126, [f"with driver R580+ (CUDA 13.0), {CU130}"]),
    ((8, 9), "12.2", False, "x86_64", CU126, ["sm_89 runs the sm_86 code"]),
    ((9, 0), "13.0", False, "x86_64", CU130, ["its own code"]),
    ((10, 0), "13.0", False, "x86_64", CU130, ["sm_100 runs its own code in the cu130"]),
    ((12, 0), None, False, "x86_64", CU130, [f"CUDA 12.8-12.9 instead: {CU128}"]),
    ((12, 0), "12.8", False, "x86_64", CU128, ["torch 2.7-2.11", "CUDA 12.8+", "cu130 needs driver R580+"]),
    ((12, 0), "12.9", False, "x86_64", CU128, ["torch 2.11"]),
    ((12, 0), "12.6", False, "x86_64", None, ["CUDA 12.8 or newer", "upgrade the driver to R580", CU130]),
    ((12, 1), "13.0", False, "aarch64", CU130, ["sm_121 runs the sm_120 code"]),
    ((8, 7), None, True, "aarch64", f"pip install torch --index-url {JETPACK6_INDEX}", ["JetPack 6"]),
    ((8, 7), "12.6", False, "aarch64", f"pip install torch --index-url {JETPACK6_INDEX}", ["Jetson Orin"]),  # NVML only
    ((5, 3), None, True, "aarch64", None, ["Orin only"]),
    ((7, 2), "11.4", True, "aarch64", None, ["Jetson Xavier"]),
    ((7, 5), "12.6", False, "aarch64", None, ["aarch64", "CC 8.0 and newer"]),
    ((3, 7), "11.4", False, "x86_64", None, ["CC 5.0 or newer", "cu118 (torch up to 2.7)"]),
    ((3, 5), None, False, "x86_64", None, ["none in edgerl's table"]),
]


@pytest.mark.parametrize("cc,driver,integrated,machine,command,words", ADVICE)
def test_wheel_advice(cc, driver, integrated, machine, command, words):
    a = wheel_advice(cc, driver, integrated=integrated, machine=machine)
    assert a.command == command, a.reason
    for w in words:
        assert w in a.reason, a.reason
    assert a.fix().startswith(command) if command else a.fix() == a.reason


DRIVERS = [None, "11.4", "12.0", "12.2", "12.6", "12.8", "12.9", "13.0", "13.2"]
KNOWN = [(5, 0), (5, 2), (6, 0), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3),
         (12, 0), (12, 1)]


@pytest.mark.parametrize("cc", KNOWN)
def test_every_command_installs_code_for_the_gpu_on_this_driver(cc):
    for driver in DRIVERS:
        a = wheel_advice(cc, driver)
        if a.command is None:
            continue
        m = re.fullmatch(r"pip install (?:torch|'torch<(\d+)\.(\d+)') --index-url " + re.escape(PYTORCH_INDEX) +
                         r"(cu\d+)", a.command)
        assert m, a.command
        tag, pin = m.group(3), (int(m.group(1)), int(m.group(2))) if m.group(1) else None
        rows = [b for b in BUILDS if b.tag == tag and arch_covers(b.archs, cc)]
        assert rows, f"{a.command} has no code for {cc}"
        newest = max(rows, key=lambda b: (b.last is None, b.last or (0, 0)))
        # the pin lets exactly the versions whose wheels have code for this GPU through
        assert pin == (None if newest.last is None else (newest.last[0], newest.last[1] + 1))
        drv = cuda_version(driver)
        if drv is not None:
            assert drv >= newest.driver_cuda, (cc, driver, a.command)
        # cu128 was last built for torch 2.11: no advice may let pip look for a newer one there
        if tag == "cu128":
            assert pin is not None and pin <= (2, 12)
        if tag == "cu126":
            assert pin == (2, 15)


def test_the_table_matches_hardware_md():
    by = {(b.tag, b.last) for b in BUILDS}
    assert ("cu126", (2, 14)) in by and ("cu128", (2, 11)) in by and ("cu118", (2, 7)) in by
    assert max(b.last for b in BUILDS if b.tag == "cu128") == (2, 11)
    cu130 = next(b for b in BUILDS if b.tag == "cu130")
    assert cu130.first == (2, 9) and cu130.last is None and cu130.driver == "R580"
    assert next(b for b in BUILDS if b.tag == "cu132").first == (2, 12)
    # Maxwell, Pascal and Volta: only cu126 (and cu118, and sm_70 in cu128 2.8-2.10) among these builds
    assert {b.tag for b in builds_covering((5, 2))} == {"cu118", "cu126"}
    assert {(b.tag, b.first) for b in builds_covering((7, 0)) if b.tag == "cu128"} == {("cu128", (2, 8))}
    # Blackwell is never in cu126
    assert "cu126" not in {b.tag for b in builds_covering((12, 0))}
    # ranges of one tag do not overlap
    for tag in {b.tag for b in BUILDS}:
        rows = sorted((b for b in BUILDS if b.tag == tag), key=lambda b: b.first or (0, 0))
        for a, b in zip(rows, rows[1:]):
            assert a.last is not None and a.last < b.first, tag


def test_cuda_version_parsing():
    assert cuda_version("12.6") == (12, 6) and cuda_version("13") == (13, 0)
    assert cuda_version(None) is None and cuda_version("n/a") is None
