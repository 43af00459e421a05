"""scripts/decode_kernel_resources.py compiles paged_decode's kernel for Hopper on a machine without a GPU and reads
its resources back from the binary."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
if not (TOOLS / "ptxas").exists() or not (TOOLS / "cuobjdump").exists():
    pytest.skip("this Triton install ships no ptxas/cuobjdump", allow_module_level=True)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _resources(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tests' kernels are interpreted
    out = subprocess.run([sys.executable, str(REPO / "scripts/decode_kernel_resources.py"), "--head-dim", "64", *args],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    rows = []
    for line in out.splitlines()[1:]:
        fields, loop = line.split(" | loop: ")
        row = dict(field.split("=") for field in fields.split())
        row["loop"] = dict(re.findall(r"(\w+) (\d+)", loop))
        rows.append(row)
    return rows


def test_fp8_and_bf16_kernels_compile_for_hopper_and_report_their_resources():
    (fp8,) = _resources("--fp8", "--settings", "w4_s2")
    (bf16,) = _resources("--settings", "w4_s2")
    assert fp8["setting"] == "b128_w4_s2" and bf16["setting"] == "b64_w4_s2"  # the module's tile sizes
    for r in (fp8, bf16):
        assert 0 < int(r["registers"]) <= 255 and int(r["shared_bytes"]) > 0
        assert "HMMA" in r["loop"]  # the products run on the tensor cores, inside the loop found
    assert "F2FP" in fp8["loop"]  # the e4m3 tile is widened there


def test_programs_per_sm_follow_registers_and_warps():
    for r in _resources("--fp8", "--settings", "w2,w4"):
        warps = int(r["setting"].split("_w")[1].split("_")[0])
        per_warp = -(-int(r["registers"]) // 8) * 8 * 32
        assert 1 <= int(r["programs_per_sm"]) <= 65536 // (per_warp * warps)
