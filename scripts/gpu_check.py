"""What a CUDA machine checks before staging on GPUs: the torch copier, registration, a request.

Run `python scripts/gpu_check.py [--device cuda:0]` where torch sees a GPU.
It checks, printing a table of each:

1. copier: ``TorchCopier("cuda:N")`` packs and unpacks GPU rows (every other
   row, a scattered half, a shuffled half; 16 to 4100 bytes) and its bytes are
   compared with the numpy copier's on host copies of the same memory;
2. register: CUDA tensors as Regions on NIXL and on Mooncake, each backend if
   it imports and opens here (otherwise: skipped, and why);
3. staged: a TP 1 -> 2 request over NHD pages on the GPU through Sessions on
   each backend that registered (no loopback: it reaches host memory only),
   staged (``staging="always"``), compared byte for byte on the GPU.

``--device cpu --backends loopback`` runs the same code on host memory (the
torch copier, a loopback pair): how tests/test_gpu_check.py keeps it working
on machines without a GPU.

Exit status: 0 when every check that ran matched, 1 on any mismatch or
failure, 2 when there is no CUDA device (or no torch) to check, with a
one-line "no CUDA device" message rather than a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

NO_DEVICE = 2
MISMATCH = 1
PAGE, HEADS, DIM, PAGES = 16, 8, 64, 32  # NHD pages of fp16 heads: 128-byte pieces per token


def cuda_problem(device: str) -> str | None:
    """Why ``device`` cannot be checked here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'xferkit[torch]')"
    if device == "cpu":  # a dry run of this script's own code on host memory
        return None
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees none (CUDA build: {torch.version.cuda or 'no'})"
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"torch sees {torch.cuda.device_count()} CUDA devices, not {device}"
    return None


def _rows(base: int, rows: np.ndarray, length: int) -> np.ndarray:
    return np.uint64(base) + rows.astype(np.uint64) * np.uint64(length)


def _pieces(
    pool: int, stage: int, rows: np.ndarray, packed: np.ndarray, length: int, pack: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A pack's (pool rows -> packed staging) or an unpack's pieces."""
    at_pool, at_stage = _rows(pool, rows, length), _rows(stage, packed, length)
    nbytes = np.full(len(rows), length, dtype=np.uint64)
    return (at_pool, at_stage, nbytes) if pack else (at_stage, at_pool, nbytes)


def check_copier(device: str, mib: int) -> list[dict[str, Any]]:
    """Each case on the GPU against the numpy copier on host copies of the same bytes."""
    import torch

    from xferkit.copier import CPU, copier_for

    gpu = copier_for(device, using="torch")
    rng = np.random.default_rng(0)
    out = []
    for length in (16, 128, 256, 4100):
        count = (mib << 20) // length
        pool_host = rng.integers(0, 256, 2 * count * length, dtype=np.uint8)
        for pattern in ("every-other", "scattered", "shuffled"):
            if pattern == "every-other":
                rows = np.arange(0, 2 * count, 2)
            elif pattern == "scattered":
                rows = np.sort(rng.choice(2 * count, count, replace=False))
            else:
                rows = rng.permutation(2 * count)[:count]
            packed = rng.permutation(count) if pattern == "shuffled" else np.arange(count)
            host = {"pool": pool_host, "stage": np.zeros(count * length, dtype=np.uint8)}
            dev = {k: torch.from_numpy(v).to(device) for k, v in host.items()}
            for direction in ("pack", "unpack"):
                if direction == "unpack":  # scatter back into a cleared pool
                    host["pool"] = np.zeros_like(pool_host)
                    dev["pool"].zero_()
                pool = (int(host["pool"].ctypes.data), int(dev["pool"].data_ptr()))
                stage = (int(host["stage"].ctypes.data), int(dev["stage"].data_ptr()))
                cpu_args, gpu_args = (
                    _pieces(p, s, rows, packed, length, direction == "pack")
                    for p, s in zip(pool, stage, strict=True)
                )
                CPU.copy(*cpu_args)
                gpu.copy(*gpu_args)  # warm: the first call loads the kernels
                start = time.perf_counter()
                gpu.copy(*gpu_args)
                took = time.perf_counter() - start
                same = all(np.array_equal(dev[k].cpu().numpy(), host[k]) for k in host)
                out.append(
                    {
                        "check": f"copier {direction} {length} B {pattern}",
                        "ok": same,
                        "detail": f"{count:,} pieces, {count * length / took / 1e9:.1f} GB/s",
                    }
                )
    return out


def _manifest(tensors: Sequence[Any], tp_rank: int, tp_size: int) -> Any:
    from xferkit import Manifest, Region

    regions = [
        Region.from_array(t, pool="kv", name=n, layer=0, tp_axis=1)
        for t, n in zip(tensors, "kv", strict=True)
    ]
    return Manifest.build(regions, tp_rank=tp_rank, tp_size=tp_size)


def _pages(device: str, heads: int, fill: bool) -> list[Any]:
    import torch

    shape = (PAGES, PAGE, heads, DIM)
    if not fill:
        return [torch.zeros(shape, dtype=torch.int16, device=device) for _ in "kv"]
    return [
        torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=device) for _ in "kv"
    ]


def check_register(backend: str, device: str) -> dict[str, Any]:
    """Whether ``backend`` opens here and registers CUDA regions (skipped, and why, if not)."""
    import xferkit as xk

    try:
        opened = xk.open_backend(backend)
    except Exception as e:  # not installed, no agent, no NIC: a skip, with its reason
        return {"check": f"register {backend}", "ok": None, "detail": f"skipped: {e}"}
    try:
        opened.register(_manifest(_pages(device, HEADS, fill=True), 0, 1))
    except Exception as e:
        return {"check": f"register {backend}", "ok": None, "detail": f"skipped: {e}"}
    finally:
        opened.close()
    return {"check": f"register {backend}", "ok": True, "detail": f"regions on {device}"}


def check_staged(backend: str, device: str) -> dict[str, Any]:
    """A TP 1 -> 2 request of NHD pages on the GPU, staged, through Sessions on ``backend``."""
    import torch

    import xferkit as xk
    from xferkit.session import Session, State

    src = _pages(device, HEADS, fill=True)
    dsts = [_pages(device, HEADS // 2, fill=False) for _ in range(2)]
    sessions: list[Session] = []
    try:
        pre = Session(xk.open_backend(backend), _manifest(src, 0, 1), staging="always")
        sessions.append(pre)
        decs = [
            Session(xk.open_backend(backend), _manifest(d, r, 2), staging="always")
            for r, d in enumerate(dsts)
        ]
        sessions += decs
        src_slots, dst_slots = list(range(12)), [PAGES - 1 - 2 * i for i in range(12)]
        recvs = [d.expect("gpu", [pre.address], {"kv": dst_slots}) for d in decs]
        send = pre.offer("gpu")
        send.write({"kv": src_slots}, last=True)
        states = [h.wait(60) for h in (send, *recvs)]
        if device != "cpu":
            torch.cuda.synchronize(device)
        if set(states) != {State.DONE}:
            errors = [str(h.error) for h in (send, *recvs) if h.error is not None]
            return {"check": f"staged {backend}", "ok": False, "detail": f"{states} {errors}"}
        half = HEADS // 2
        same = all(
            torch.equal(dst[dst_slots], whole[src_slots][:, :, r * half : (r + 1) * half, :])
            for r, tensors in enumerate(dsts)
            for dst, whole in zip(tensors, src, strict=True)
        )
        routes = send.routes
        staged = routes.staged > 0
        detail = f"{routes.staged} chunks staged, {routes.direct} direct"
        return {"check": f"staged {backend}", "ok": same and staged, "detail": detail}
    except Exception as e:
        return {"check": f"staged {backend}", "ok": False, "detail": f"{type(e).__name__}: {e}"}
    finally:
        for s in sessions:
            s.close()


def _print(rows: list[dict[str, Any]]) -> None:
    width = max(len(r["check"]) for r in rows)
    for r in rows:
        mark = {True: "ok", False: "MISMATCH", None: "skipped"}[r["ok"]]
        print(f"{r['check']:<{width}}  {mark:<8}  {r['detail']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="cuda:0", help="the GPU to check (cuda:N; cpu: a dry run)"
    )
    parser.add_argument("--backends", default="nixl,mooncake", help="comma-separated")
    parser.add_argument("--mib", type=int, default=8, help="bytes packed per copier case")
    args = parser.parse_args(argv)
    problem = cuda_problem(args.device)
    if problem is not None:
        print(f"gpu_check: no CUDA device to check: {problem}", file=sys.stderr)
        return NO_DEVICE
    rows = check_copier(args.device, args.mib)
    for backend in args.backends.split(","):
        registered = check_register(backend, args.device)
        rows.append(registered)
        if registered["ok"]:
            rows.append(check_staged(backend, args.device))
        else:
            rows.append({"check": f"staged {backend}", "ok": None, "detail": "not registered"})
    _print(rows)
    bad = [r["check"] for r in rows if r["ok"] is False]
    print(f"gpu_check: {len(bad)} failed" + (f": {', '.join(bad)}" if bad else ""))
    return MISMATCH if bad else 0


if __name__ == "__main__":
    sys.exit(main())
