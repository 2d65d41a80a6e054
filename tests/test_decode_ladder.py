"""launch/decode_ladder.py (the decode-GEMM bandwidth ladder for the GPU): every kernel right under
the interpreter, and every configuration compiles for sm_90 within an SM's shared memory."""
import os
import pathlib
import re
import subprocess
import sys

import pytest
import triton
from triton.backends.compiler import GPUTarget

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
import decode_ladder  # noqa: E402


def test_every_rung_matches_float32_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "decode_ladder.py"), "--M", "5", "--K", "2048",
                        "--N", "256", "--dtype", "float32"], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    errs = [float(e) for e in re.findall(r"rel err (\S+)", p.stdout)]
    assert len(errs) == len(decode_ladder.LADDER) and max(errs) < 1e-5, p.stdout


@pytest.mark.parametrize("rung", decode_ladder.LADDER, ids=lambda r: f"{r[0].fn.__name__}-{r[1]}x{r[2]}x{r[3]}-s{r[5]}")
def test_every_rung_fits_an_sm(rung):
    kernel, bm, bn, bk, warps, stages, _ = rung
    sig = dict(x="*bf16", w="*bf16", part="*fp32", M="i32", K="i32", N="i32", SPLITS="constexpr", BLOCK_M="constexpr",
               BLOCK_N="constexpr", BLOCK_K="constexpr", NUM_PROGRAMS="constexpr")
    attrs = {(k,): [["tt.divisibility", 16]] for k in (0, 1, 2, 4, 5)}
    src = triton.compiler.ASTSource(kernel, sig, attrs=attrs, constexprs=dict(
        SPLITS=4, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGRAMS=132))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    assert compiled.metadata.shared <= 232448
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"]
