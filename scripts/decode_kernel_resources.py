"""Registers, shared memory and the main loop's instruction mix of paged_decode's kernel, compiled for a GPU
architecture on any machine: Triton ships ptxas and cuobjdump, so no GPU is needed.

    python scripts/decode_kernel_resources.py [--head-dim 128] [--heads 32 --kv-heads 8] [--fp8]
        [--settings b128_w4_s2,b64_w4_s5] [--arch 90]

``--settings`` names launch settings as ``scripts/bench_attention.py`` does (``b<tokens>_w<warps>_s<stages>``).
Pointers and strides are compiled as 16-byte aligned, as the engine's tensors launch them. The figures are this
machine's Triton's: compare them with the Triton version the GPU runs.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("decode_kernel_resources.py compiles kernels: unset TRITON_INTERPRET")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9+ asks; fusion is what earlier versions did

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.engine.attention import paged_decode as pd  # noqa: E402

# Per SM on Hopper (H100/H200): 64K 32-bit registers, 228 KB shared memory (1 KB of it reserved a program), 64 warps.
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
SM_WARPS = 64
ALIGNED = {"q_ptr", "q_stride", "kv_ptr", "kv_stride", "pos_ptr", "row_ptr", "loc_ptr", "cos_sin_ptr", "table_ptr",
           "table_stride", "cache_ptr", "plane_stride", "kv_scale_ptr", "part_ptr", "count_ptr", "out_ptr"}


def compile_kernel(a: argparse.Namespace, tokens: int, warps: int, stages: int):
    """``_chunk_attend`` as ``paged_decode`` launches it for a bf16 model, 8 chunks a sequence."""
    group = a.heads // a.kv_heads
    types = {"q_ptr": "*bf16", "q_stride": "i32", "kv_ptr": "*bf16", "kv_stride": "i32", "pos_ptr": "*i32",
             "row_ptr": "*i32", "loc_ptr": "*i64", "cos_sin_ptr": "*fp32", "table_ptr": "*i32", "table_stride": "i32",
             "cache_ptr": "*fp8e4nv" if a.fp8 else "*bf16", "plane_stride": "i32", "kv_scale_ptr": "*fp32",
             "part_ptr": "*fp32", "count_ptr": "*i32", "out_ptr": "*bf16", "scale": "fp32"}
    constants = dict(HQ=a.heads, HKV=a.kv_heads, GROUP=group, GROUP_P2=triton.next_power_of_2(group), D=a.head_dim,
                     QROWS=max(16, triton.next_power_of_2(group)), PAGE=a.page_size, CHUNK=1024, CHUNKS_P2=8,
                     BLOCK_N=tokens, KV_FP8=a.fp8, INTERPRET=False,
                     PDL=a.arch >= 90)  # griddepcontrol: Hopper and later
    names = pd._chunk_attend.arg_names
    source = ASTSource(
        fn=pd._chunk_attend, signature={**types, **dict.fromkeys(constants, "constexpr")},
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ALIGNED},
    )
    return triton.compile(source, target=GPUTarget("cuda", a.arch, 32),
                          options={"num_warps": warps, "num_stages": stages})


def cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body: the loop over a chunk's tiles."""
    code = [(int(m[1], 16), m[2], line) for line in sass.splitlines()
            if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line))]
    loops = [(int(t[1], 16), at) for at, op, line in code
             if op == "BRA" and (t := re.search(r"BRA\s+0x([0-9a-f]+)", line)) and int(t[1], 16) < at]
    if not loops:
        return collections.Counter()
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return collections.Counter(op.split(".")[0] for at, op, _ in code if start <= at <= end)


def describe(a: argparse.Namespace, setting: str) -> dict:
    warps, stages = pd.launch_config(a.head_dim, 1024, a.fp8)
    chosen = {"b": pd.FP8_BLOCK_TOKENS if a.fp8 else pd.BLOCK_TOKENS, "w": warps, "s": stages}
    chosen.update({part[0]: int(part[1:]) for part in setting.split("_") if part})
    kernel = compile_kernel(a, chosen["b"], chosen["w"], chosen["s"])
    usage = re.search(r"REG:(\d+).*?LOCAL:(\d+)", cuobjdump(kernel.asm["cubin"], "-res-usage"))
    registers, spilled = int(usage[1]), int(usage[2])
    shared = kernel.metadata.shared
    per_warp = -(-registers // 8) * 8 * 32  # allocated in steps of 8 registers a thread
    programs = min(SM_REGISTERS // (per_warp * chosen["w"]), SM_SHARED_BYTES // (shared + 1024), SM_WARPS // chosen["w"])
    loop = main_loop(cuobjdump(kernel.asm["cubin"], "-sass"))
    return {"setting": f"b{chosen['b']}_w{chosen['w']}_s{chosen['s']}", "registers": registers,
            "spilled_bytes": spilled, "shared_bytes": shared, "programs_per_sm": programs,
            "loop_instructions_per_128_tokens": sum(loop.values()) * 128 // chosen["b"],
            "loop_top": loop.most_common(6)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--fp8", action="store_true", help="an e4m3 cache")
    p.add_argument("--settings", default="", help="comma-separated b<tokens>_w<warps>_s<stages>; '' is the rule's")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    a = p.parse_args()
    print(f"triton {triton.__version__}, sm{a.arch}, head_dim {a.head_dim}, {'e4m3' if a.fp8 else 'bf16'} cache")
    for setting in a.settings.split(","):
        r = describe(a, setting)
        top = " ".join(f"{op} {n}" for op, n in r.pop("loop_top"))
        print(" ".join(f"{k}={v}" for k, v in r.items()), f"| loop: {top}")


if __name__ == "__main__":
    main()
