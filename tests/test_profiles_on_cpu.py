"""edgerl/profile_data/*.toml: memory as NVML reports it, names matched exactly, aliases that resolve, loud errors."""

import dataclasses
import importlib.resources
import re

import pytest

from edgerl.device.device import GiB, MiB, Software, device_from_spec
from edgerl.core.errors import ProfileError
from edgerl.device.profiles import _parse, device_from_profile, get_profile, list_profiles, match_profile

# profile -> (NVML total in MiB under the default ECC setting, ECC on by default, NVML total with ECC off)
# as cited in each file's comments (docs/hardware.md, Usable memory, and public nvidia-smi / deviceQuery printouts)
MEMORY = {
    "p40": (22919, True, 24451), "p100": (16280, True, None), "v100-16gb": (16130, True, 16130),
    "v100-32gb": (32510, True, 32510), "t4": (15109, True, 16384), "a10": (23028, True, None),
    "l4": (23034, True, None), "gtx1080ti": (11170, False, None), "rtx2080ti": (11019, False, None),
    "gtx1660": (5941, False, None), "gtx1660ti": (5941, False, None), "gtx1660super": (5941, False, None),
    "rtx3090": (24264, False, None), "rtx4090": (24564, False, None), "a100-40gb": (40536, True, None),
    "a100-80gb": (81252, True, None), "h100": (81559, True, None), "h200": (143771, True, None),
    "jetson-orin": (62841, False, None), "m40": (22939, True, None),
}


def test_every_gpu_profile_is_in_the_memory_table():
    assert {p.name for p in list_profiles() if p.kind == "cuda"} == set(MEMORY)


@pytest.mark.parametrize("name", sorted(MEMORY))
def test_memory_is_the_cited_nvml_total(name):
    p = get_profile(name)
    mib, ecc, ecc_off = MEMORY[name]
    assert (p.memory_mib, p.ecc_default, p.ecc_off_mib) == (mib, ecc, ecc_off)
    assert p.memory_bytes == mib * MiB
    dev = device_from_profile(p, Software(), 64 * GiB)
    assert dev.total_memory == mib * MiB
    # the figure is written in the file next to its source, not only in this test
    text = (importlib.resources.files("edgerl.profile_data") / f"{name}.toml").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("memory_mib"))
    assert "#" in line and len(line.split("#", 1)[1].strip()) > 20, line


def test_ecc_gain():
    assert get_profile("p40").ecc_off_gain_bytes == (24451 - 22919) * MiB
    assert get_profile("v100-16gb").ecc_off_gain_bytes == 0         # HBM2: ECC costs no capacity
    assert get_profile("a10").ecc_off_gain_bytes is None             # not known
    assert get_profile("rtx3090").ecc_off_gain_bytes is None         # no ECC to turn off


def test_every_alias_resolves_to_its_own_profile_and_no_two_collide():
    seen = {}
    for p in list_profiles():
        for key in (p.name, p.display, *p.aliases):
            assert get_profile(key) is p, key
            norm = re.sub(r"[^a-z0-9]", "", key.lower())
            assert seen.setdefault(norm, p.name) == p.name, f"{key!r} names both {seen[norm]} and {p.name}"


def _device(name, profile, memory_mib=None):
    p = get_profile(profile)
    dev = device_from_profile(p, Software(), 64 * GiB)
    return dataclasses.replace(dev, name=name, total_memory=(memory_mib or p.memory_mib) * MiB, source="probe")


@pytest.mark.parametrize("profile", sorted(MEMORY))
def test_each_nvml_name_matches_its_profile(profile):
    names = get_profile(profile).nvml_names
    assert names
    for name in names:
        assert match_profile(_device(name, profile)).name == profile
        if not name.startswith("NVIDIA "):  # newer drivers prefix GeForce names with "NVIDIA "
            assert match_profile(_device("NVIDIA " + name, profile)).name == profile


@pytest.mark.parametrize("name,cc,memory_mib,expected", [
    ("GeForce RTX 3090", (8, 6), 24268, "rtx3090"),          # older drivers' name and total
    ("NVIDIA GeForce RTX 3090", (8, 6), 24576, "rtx3090"),   # drivers 580+
    ("Tesla P40", (6, 1), 24451, "p40"),                     # ECC turned off
    ("NVIDIA L40S", (8, 9), 46068, None),                    # "L4" is inside "L40S"
    ("NVIDIA L40", (8, 9), 46068, None),
    ("NVIDIA RTX A1000", (8, 6), 8192, None),                # "A10" is inside "A1000"
    ("NVIDIA A10G", (8, 6), 22731, None),                    # another board with other facts
    ("NVIDIA T400 4GB", (7, 5), 3914, None),                 # "T4" is inside "T400"
    ("Tesla T4", (7, 5), 15360, "t4"),                       # older drivers' total
    ("NVIDIA H200 NVL", (9, 0), 143771, None),
    ("NVIDIA H100 PCIe", (9, 0), 81559, None),
    ("Tesla P100-PCIE-12GB", (6, 0), 12198, None),
    ("Tesla M40", (5, 2), 11448, None),                      # the 12 GB M40
    ("Orin", (8, 7), 7620, None),                            # Orin Nano 8GB: same name, not the 64 GB module
    ("Orin", (8, 7), 62841, "jetson-orin"),
    ("GeForce GTX 1660 Ti", (7, 5), 6144, "gtx1660ti"),
    ("NVIDIA GeForce GTX 1660 SUPER", (7, 5), 5944, "gtx1660super"),
])
def test_names_match_exactly(name, cc, memory_mib, expected):
    dev = device_from_spec(f"cc={cc[0]}.{cc[1]},memory={memory_mib}MiB,name=\"{name}\"", Software(), 64 * GiB)
    p = match_profile(dev)
    assert (p.name if p else None) == expected


def test_sm75_parts_without_tensor_cores_on_every_path():
    # profile, spec and (tests/test_probe_on_cpu.py) probe all go through one rule
    for name in ("gtx1660", "gtx1660ti", "gtx1660super"):
        assert not device_from_profile(get_profile(name), Software(), 64 * GiB).tensor_cores
    for name in ("GeForce GTX 1660 Ti", "NVIDIA T400 4GB", "Quadro T1000", "NVIDIA T1200 Laptop GPU",
                 "Quadro T2000 with Max-Q Design", "NVIDIA GeForce MX450", "NVIDIA GeForce MX550",
                 "NVIDIA GeForce GTX 1650"):
        assert not device_from_spec(f'cc=7.5,memory=4GiB,name="{name}"', Software(), 8 * GiB).tensor_cores, name
    for name in ("Tesla T4", "NVIDIA GeForce RTX 2080 Ti", "Quadro RTX 4000", "NVIDIA TITAN RTX"):
        assert device_from_spec(f'cc=7.5,memory=8GiB,name="{name}"', Software(), 8 * GiB).tensor_cores, name


def test_the_three_gtx1660s_have_their_own_facts():
    facts = {n: (p.sm_count, p.memory_bandwidth_gbs) for n in ("gtx1660", "gtx1660ti", "gtx1660super")
             for p in [get_profile(n)]}
    assert facts == {"gtx1660": (22, 192), "gtx1660ti": (24, 288), "gtx1660super": (22, 336)}


def test_jetson_profile_shares_its_memory_with_the_host():
    dev = device_from_profile(get_profile("jetson-orin"), Software(), 128 * GiB)
    assert dev.integrated and dev.host_memory == dev.total_memory == 62841 * MiB


def test_m40_is_maxwell_planned_like_pascal():
    dev = device_from_profile(get_profile("m40"), Software(), 64 * GiB)
    assert dev.cc == (5, 2) and not dev.fp16_native and not dev.fp16_fast and not dev.tensor_cores
    assert dev.smem_per_block_optin == 48 * 1024 and dev.sm_count == 24


@pytest.mark.parametrize("text,message", [
    ('name = "x"\n[hardware]\ncc = "6.1"\nmemory_gib = 24\n', "unknown \\[hardware\\] key 'memory_gib'"),
    ('name = "x"\n[hardware]\ncc = "6.1"\nmemory_mib = 22.4\n', "memory_mib=22.4 must be a whole number of MiB"),
    ('name = "x"\n[hardware]\ncc = "6.1"\n', "missing or bad 'memory_mib'"),
    ('name = "x"\n[hardware]\ncc = "6.1"\nmemory_mib = 11170\necc_off_mib = 12000\n', "ecc_default is not true"),
    ('name = "x"\n[hardware]\ncc = "3.7"\nmemory_mib = 11441\n', "below 5.0"),
])
def test_malformed_profiles_say_what_to_fix(text, message):
    with pytest.raises((ProfileError, ValueError), match=message):
        _parse("x", text)
