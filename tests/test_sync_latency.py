"""etdist.bench.sync_latency (what one dependent step costs, on 2 GPUs): its cross-rank ping-pongs
hand over the right payloads and task ids under the interpreter, and its GPU kernels compile for
sm_90 with the orderings we time (acquire polls, release notifies, sys-scope queue atomics)."""
import os
import pathlib
import subprocess
import sys

import pytest
import triton
from triton.backends.compiler import GPUTarget

from etdist.bench import sync_latency

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cross_rank_ping_pongs_deliver_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", ETDIST_WATCHDOG_S="60", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m",
                        "etdist.bench.sync_latency", "--check"], capture_output=True, text=True, timeout=600, env=env,
                       cwd=ROOT)
    assert p.returncode == 0 and "OK sync latency (4 cases" in p.stdout, (p.stdout + p.stderr)[-4000:]


_COMMON = dict(bad="*i32", ctrl="*i32", ctrl_peers="*i64", rank="i32", n="i32", base="i32", max_spins="i32")


@pytest.mark.parametrize("scope,cross,words", [("gpu", False, 0), ("sys", True, 1024)])
def test_ping_pong_compiles_with_acquire_polls_and_release_notifies(scope, cross, words):
    sig = dict(lanes="*i32", lanes_peers="*i64", data="*i32", data_peers="*i64", **_COMMON, WORDS="constexpr",
               BLOCK="constexpr", CROSS="constexpr", SCOPE="constexpr", USE_ASM="constexpr")
    src = triton.compiler.ASTSource(sync_latency._pingpong, sig, constexprs=dict(
        WORDS=words, BLOCK=1024 if words else 16, CROSS=cross, SCOPE=scope, USE_ASM=True))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    assert f"ld.acquire.{scope}.global.b32" in ptx                         # the wait's poll
    assert f"atom.global.{scope}.release.add.u32" in ptx                    # the notify


def test_queue_ping_pong_compiles_with_sys_scope_queue_atomics():
    sig = dict(qs="*i64", qs_peers="*i64", **_COMMON, QSIZE="constexpr", CROSS="constexpr")
    src = triton.compiler.ASTSource(sync_latency._queue_pingpong, sig, constexprs=dict(QSIZE=64, CROSS=True))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    assert "atom.global.sys.relaxed.add.u64" in ptx      # push: the tail
    assert "atom.global.sys.release.exch.b64" in ptx     # push: the slot published
    assert "ld.global.sys.acquire.b64" in ptx            # claim: the slot's poll
