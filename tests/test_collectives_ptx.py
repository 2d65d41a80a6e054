"""Compile-only checks of the GPU primitives and the exchange kernel (sm_90 PTX, no GPU needed).

Triton 3.6 bundles ptxas, so `triton.compile(ASTSource(fn, signature, constexprs, attrs),
target=GPUTarget("cuda", 90, 32))` works on a CPU machine.
"""
import re
from collections import Counter

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from etdist.kernels.exchange import exchange_kernel
from etdist.kernels.sync import notify, wait

SM90 = GPUTarget("cuda", 90, 32)


@triton.jit
def _wait_then_notify(flag, ctrl, table, rank, world, target, spins, USE_ASM: tl.constexpr, SCOPE: tl.constexpr):
    wait(flag, target, spins, ctrl, table, rank, world, 0, 0, target, SCOPE, USE_ASM)
    notify(flag + 1, target, True, SCOPE)
    notify(flag + 2, 1, False, SCOPE)


def _ptx(fn, signature, constexprs, attrs=None, **options):
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=SM90, options=options).asm["ptx"]


@pytest.mark.parametrize("scope", ["sys", "gpu"], ids=["scope-sys", "scope-gpu"])  # a bare "gpu" id reads as the marker
def test_wait_is_acquire_and_notify_is_release_at_the_scope(scope):
    sig = dict(flag="*i32", ctrl="*i32", table="*i64", rank="i32", world="i32", target="i32", spins="i32",
               USE_ASM="constexpr", SCOPE="constexpr")
    ptx = _ptx(_wait_then_notify, sig, {"USE_ASM": True, "SCOPE": scope})
    assert f"ld.acquire.{scope}.global.b32" in ptx
    assert re.search(rf"atom\.global\.{scope}\.release\.exch\.b32", ptx)
    assert re.search(rf"atom\.global\.{scope}\.release\.add", ptx)
    assert "bar.sync" in ptx  # the release covers every thread's stores
    # errors go to peers too: sys-scope, whatever the wait's scope
    assert re.search(r"atom\.global\.(relaxed\.)?sys\.(relaxed\.)?cas\.b32", ptx)


def test_atomic_poll_variant_compiles_to_an_acquire():
    sig = dict(flag="*i32", ctrl="*i32", table="*i64", rank="i32", world="i32", target="i32", spins="i32",
               USE_ASM="constexpr", SCOPE="constexpr")
    ptx = _ptx(_wait_then_notify, sig, {"USE_ASM": False, "SCOPE": "sys"})
    assert "ld.global.sys.acquire.b32" in ptx  # Triton turns an acquire add-of-zero into an acquire load


def _exchange_ptx(reduce: bool, align: int, direct: bool = False):
    ptrs = ["x_ptr", "out_ptr", "plan_ptr", "scratch_ptr", "scratch_table", "sig_ptr", "sig_table", "ctrl_ptr",
            "ctrl_table"]
    types = ["*bf16", "*bf16", "*i64", "*bf16", "*i64", "*i32", "*i64", "*i32", "*i64"]
    sig = dict(zip(ptrs, types), out_table="*i64", call_error_ptr="*i32")
    sig.update({k: "i32" for k in ["meta_off", "exit_off", "grid_off", "epoch_off", "entry_off", "call_off", "seq_off",
                                   "rank", "world", "op_sig", "call_sig", "max_spins", "skip_notify"]}, nchunks="i64")
    sig.update({k: "constexpr" for k in ["REDUCE", "RENDEZVOUS", "DIRECT", "USE_ASM", "BLOCK", "ALIGN", "PALIGN"]})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}  # what a launch with aligned tensors gets
    const = dict(REDUCE=reduce, RENDEZVOUS=True, DIRECT=direct, USE_ASM=True, BLOCK=8192, ALIGN=align, PALIGN=2 * align)
    return _ptx(exchange_kernel, sig, const, attrs, num_warps=4)


@pytest.mark.parametrize("reduce", [True, False])
def test_exchange_kernel_signals_across_gpus_and_moves_16_byte_vectors(reduce):
    ptx = _exchange_ptx(reduce, align=8)
    assert "ld.acquire.sys.global.b32" in ptx  # waits on lanes peers notify
    assert re.search(r"atom\.global\.sys\.release\.exch\.b32", ptx)  # epoch-stamped notify
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)  # local grid counter
    moves = Counter(re.findall(r"\b(ld\.global(?:\.v4)?\.b(?:16|32)|st\.global(?:\.v4)?\.b(?:16|32))", ptx))
    assert moves["ld.global.v4.b32"] and moves["st.global.v4.b32"], moves
    assert not moves["ld.global.b16"], moves  # no scalar bf16 traffic on the aligned path


def test_exchange_kernel_unaligned_variant_compiles():
    assert "ld.acquire.sys.global.b32" in _exchange_ptx(True, align=1)


def test_direct_all_gather_variant_vectorises():
    ptx = _exchange_ptx(False, align=8, direct=True)
    assert "st.global.v4.b32" in ptx and "ld.acquire.sys.global.b32" in ptx
