"""The exchange protocol in torch on the cpu backend: the GPU kernel's steps, one chunk, one program.

push our segment for every peer into its scratch slot, write its meta lane, set its signal lane
to the epoch; wait (watchdog) for every source's lane; check signatures; combine; exit rendezvous.
"""
from __future__ import annotations

import torch

from ..mesh import ErrorKind, Event, Mesh
from ..mesh.control import signature_dtype
from .plan import Plan
from .workspace import Workspace


def exchange_cpu(mesh: Mesh, ws: Workspace, x: torch.Tensor, out: torch.Tensor, plan: Plan, epoch: int) -> None:
    w, r, lay = mesh.world_size, mesh.rank, mesh.layout
    parity = epoch % 2
    ctrl, peers = mesh._ctrl_np, mesh._ctrl_peers_np
    xf, of = x.reshape(-1), out.reshape(-1)
    skip = mesh.fault_skip_notify_rank == r
    dt = signature_dtype(x.dtype)
    if int(ctrl[0]) == 0:
        for d in range(w):  # push
            if d == r:
                continue
            cnt = plan.send_cnt[d]
            peers[d][lay.meta + 4 * r + 2 * parity] = epoch
            peers[d][lay.meta + 4 * r + 2 * parity + 1] = plan.signature(cnt, dt)
            if cnt:
                ws.slot(d, parity, r, x.dtype)[:cnt].copy_(xf[plan.send_off[d]:][:cnt])
                if not skip:
                    ws.signal_lanes_np(d)[0 * w + r] = epoch
        ok = True
        mine = ws.signal_lanes_np(r)
        for s in range(w):  # wait and check
            cnt = plan.recv_cnt[s]
            if s == r or cnt == 0:
                continue
            if not mesh.spin_until(mine, 0, [s], epoch, Event.encode(Event.CHUNK, 0), epoch, mesh.watchdog_s):
                ok = False
                break
            m_epoch, m_sig = int(ctrl[lay.meta + 4 * s + 2 * parity]), int(ctrl[lay.meta + 4 * s + 2 * parity + 1])
            want = plan.signature(plan.send_cnt[r] if plan.op.reduces else cnt, dt)
            if m_epoch != epoch or m_sig != want:
                mesh.record_error(ErrorKind.SHAPE, Event.encode(Event.CHUNK, 0), m_sig, want, s, epoch)
                ok = False
                break
        if ok:  # combine
            n, o = plan.send_cnt[r], plan.recv_off[r]
            own = xf[plan.send_off[r]:][:n]
            if plan.op.reduces:
                acc = own.to(torch.float32)
                for s in range(w):
                    if s != r:
                        acc = acc + ws.slot(r, parity, s, x.dtype)[:n].to(torch.float32)
                of[o:o + n].copy_(acc)
            else:
                for s in range(w):
                    cnt = plan.recv_cnt[s]
                    src = own if s == r else ws.slot(r, parity, s, x.dtype)[:cnt]
                    of[plan.recv_off[s]:plan.recv_off[s] + cnt].copy_(src)
    for d in range(w):  # exit rendezvous
        peers[d][lay.exit + r] = epoch
    mesh.spin_until(ctrl, lay.exit, [s for s in range(w) if s != r], epoch, Event.encode(Event.EXIT, 0), epoch,
                    2 * mesh.watchdog_s)
