"""Check the collectives across real processes, on any backend. Run under a launcher:

    torchrun --nproc_per_node=4 -m etdist.collectives.selfcheck [--case ok|skip-notify|shape|dtype|empty-shape]
    mpiexec -n 2 python -m etdist.collectives.selfcheck --case skip-notify --watchdog 2
    TRITON_INTERPRET=1 torchrun ... --exchange triton --small   # the GPU kernel, interpreted
    mpiexec -n 2 python -m etdist.collectives.selfcheck --workspace-mb 0.05   # big messages in rounds

Each rank builds its inputs from its rank number, so every rank computes the expected results by
itself. Fault cases expect every rank to raise the named error within the watchdog; the exit code
is 0 when what happened is what the case expects. Prints one line per rank.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from ..mesh import MeshError, PeerTimeoutError, ShapeMismatchError, init_mesh
from ..mesh.errors import CallMismatchError
from . import all_gather, all_reduce, all_to_all, ops, reduce_scatter


def _inputs(rank: int, n: int, dtype, device, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype).to(device)


def _counts(src: int, world: int, salt: int):
    """Rows rank `src` sends to each rank: uneven, some zero."""
    return [((src * 7 + d * 3 + salt) % 5) for d in range(world)]


def check_all(mesh, sizes=(1, 7, 4096, 12_345), dtypes=(torch.float32, torch.bfloat16), repeats=2) -> int:
    w, r, dev = mesh.world_size, mesh.rank, mesh.device
    n_checked = 0
    for rep in range(repeats):
        for dtype in dtypes:
            for n in sizes:
                salt = rep * 31 + n
                xs = [_inputs(s, w * n, dtype, "cpu", salt) for s in range(w)]
                total = sum(t.to(torch.float64) for t in xs)
                x = xs[r].to(dev)
                got = reduce_scatter(x.view(w, n)).cpu().to(torch.float64)
                _expect(got.reshape(-1), total.view(w, n)[r], f"reduce_scatter n={n} {dtype}")
                got = all_reduce(x).cpu().to(torch.float64)
                _expect(got, total, f"all_reduce n={w * n} {dtype}")
                if rep == 0 and dtype == dtypes[0]:   # the same two collectives as above, composed
                    got = all_reduce(x, two_shot=True).cpu().to(torch.float64)
                    _expect(got, total, f"all_reduce two_shot n={w * n} {dtype}")
                    n_checked += 1
                got = all_gather(x[:n]).cpu()
                _expect(got, torch.cat([t[:n] for t in xs]), f"all_gather n={n} {dtype}")
                if rep == 0:  # into a symmetric out: peers write it directly
                    sym = mesh.empty((w * n,), dtype)
                    got = all_gather(x[:n], sym).cpu()
                    _expect(got, torch.cat([t[:n] for t in xs]), f"all_gather into symmetric out n={n} {dtype}")
                send = _counts(r, w, salt)
                rows = torch.arange(sum(send) * 3, dtype=torch.float32).view(-1, 3) + 1000 * r
                got = all_to_all(rows.to(dtype).to(dev), send).cpu()
                want = []
                for s in range(w):
                    sc = _counts(s, w, salt)
                    theirs = torch.arange(sum(sc) * 3, dtype=torch.float32).view(-1, 3) + 1000 * s
                    want.append(theirs[sum(sc[:r]):][:sc[r]])
                _expect(got, torch.cat(want).to(dtype), f"all_to_all {dtype}")
                n_checked += 4
    if w > 1:   # two shots of a length R does not divide: refused on every rank before anything runs
        try:
            all_reduce(torch.ones(3 * w + 1, device=dev), two_shot=True)
            raise AssertionError("all_reduce two_shot of an indivisible length returned")
        except MeshError as e:
            assert "multiple of the world size" in str(e), e
    mesh.barrier()
    return n_checked


def check_graph(mesh) -> str:
    """Our ops captured in a CUDA graph and replayed: the epoch lives on the device, so replays stay
    correct (NCCL-style graph use)."""
    w, r, dev = mesh.world_size, mesh.rank, mesh.device
    x = _inputs(r, 4096 * w, torch.float32, dev, 5)
    total = sum(_inputs(s, 4096 * w, torch.float64, "cpu", 5) for s in range(w))
    out_ar = torch.empty_like(x)
    out_rs = torch.empty(4096, device=dev)
    all_reduce(x, out_ar, check=False)  # warm up: compile, prepare (same flags as in the graph)
    reduce_scatter(x, out_rs, check=False)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(3):
            all_reduce(x, out_ar, check=False)
            reduce_scatter(x, out_rs, check=False)
    for i in range(5):
        out_ar.fill_(float("nan"))
        out_rs.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        mesh.check()
        _expect(out_ar.cpu(), total, f"graph replay {i} all_reduce")
        _expect(out_rs.cpu(), total.view(w, -1)[r], f"graph replay {i} reduce_scatter")
    mesh.barrier()
    return "5 graph replays of 6 ops exact"


def _expect(got, want, what):
    if got.shape != want.shape or not torch.equal(got.to(torch.float64), want.to(torch.float64)):
        diff = (got.to(torch.float64) - want.to(torch.float64)).abs().max().item() if got.shape == want.shape else None
        raise AssertionError(f"{what}: wrong result (max abs diff {diff}, shapes {tuple(got.shape)} {tuple(want.shape)})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="ok", choices=["ok", "skip-notify", "shape", "dtype", "big-count", "skip-call",
                                                     "empty-shape", "graph", "same-gpu"])
    ap.add_argument("--watchdog", type=float, default=10.0)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--small", action="store_true", help="fewer, smaller cases (for the Triton interpreter)")
    ap.add_argument("--workspace-mb", type=float, default=None, help="init_mesh(workspace_mb=...)")
    ap.add_argument("--exchange", default="torch", choices=["torch", "triton"],
                    help="cpu backend: triton runs the GPU exchange kernel (with TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    ops.CPU_EXCHANGE = args.exchange
    t0 = time.monotonic()
    expect = {"ok": None, "graph": None, "skip-notify": PeerTimeoutError, "shape": CallMismatchError,
              "dtype": CallMismatchError, "big-count": CallMismatchError, "skip-call": CallMismatchError,
              "empty-shape": ShapeMismatchError, "same-gpu": MeshError}[args.case]
    if args.case == "same-gpu":  # every rank asks for GPU 0: init_mesh must refuse on every rank
        try:
            init_mesh(backend=args.backend, watchdog_s=args.watchdog, device="cuda:0").close()
            outcome, msg = None, "init_mesh accepted two ranks on one GPU"
        except MeshError as e:
            outcome, msg = MeshError, str(e)
        good = outcome is expect
        print(f"SELFCHECK case=same-gpu {'RAISED MeshError' if outcome else 'OK'} "
              f"{'as expected' if good else 'UNEXPECTED'}: {msg}", flush=True)
        return 0 if good else 1
    mesh = init_mesh(backend=args.backend, watchdog_s=args.watchdog, workspace_mb=args.workspace_mb)
    r, w = mesh.rank, mesh.world_size
    outcome, msg = None, ""
    try:
        if args.case == "ok":
            small = dict(sizes=(7, 4096 + 8), dtypes=(torch.float32,), repeats=2) if args.small else {}
            msg = f"{check_all(mesh, **small)} results exact"
        elif args.case == "graph":
            msg = check_graph(mesh)
        elif args.case == "skip-notify":
            mesh.fault_skip_notify_rank = w - 1
            all_reduce(torch.ones(1000, device=mesh.device))
        elif args.case == "shape":
            all_reduce(torch.ones(1000 + 5000 * (r == 0), device=mesh.device))
        elif args.case == "dtype":  # the same element count in another dtype: its bytes are not ours
            dtype = torch.float32 if r == 0 else torch.bfloat16
            all_reduce(torch.ones(1000, dtype=dtype, device=mesh.device))
        elif args.case == "big-count":  # counts equal modulo 2**24 (the exchange's own check): the call's differ
            all_reduce(torch.ones(16 + (1 << 24) * (r == 0), device=mesh.device))
        elif args.case == "skip-call":  # the last rank skips an all_reduce: caught at the next call, which differs
            if r != w - 1:
                all_reduce(torch.ones(8, device=mesh.device))
            all_gather(torch.ones(8, device=mesh.device))
        elif args.case == "empty-shape":
            mesh.empty((4, 4 + r), torch.float32)
    except MeshError as e:
        outcome, msg = type(e), str(e)
    finally:
        try:
            mesh.close()
        except MeshError:
            pass
    dt = time.monotonic() - t0
    good = outcome is expect
    status = "OK" if outcome is None else f"RAISED {outcome.__name__}"
    print(f"SELFCHECK rank {r}/{w} {mesh.backend} case={args.case} {status} in {dt:.1f}s "
          f"{'as expected' if good else 'UNEXPECTED'}: {msg}", flush=True)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
