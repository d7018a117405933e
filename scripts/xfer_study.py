"""Where does the pageable -> pinned -> device time go? (GPU experiment)"""
import time, statistics, threading, json, sys
import torch
dev = torch.device("cuda:0")
N = 64 * 3 * 224 * 224  # fp16 elements, 19.3 MB
body = bytearray(torch.randn(N).half().numpy().tobytes())
src = torch.frombuffer(body, dtype=torch.float16)
pin = torch.empty(N, dtype=torch.float16, pin_memory=True)
pin2 = torch.empty(N, dtype=torch.float16, pin_memory=True)
d = torch.empty(N, dtype=torch.float16, device=dev)
d2 = torch.empty(N, dtype=torch.float16, device=dev)
s = torch.cuda.Stream(dev)
def med(fn, n=40):
    for _ in range(5): fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(ts), 4)
R = {}
nt = torch.get_num_threads()
for t in (1, 2, 4, 8, 16, 32):
    if t > nt * 2: continue
    torch.set_num_threads(t); R[f"host_copy_threads{t}"] = med(lambda: pin.copy_(src))
torch.set_num_threads(nt)
R["h2d_pinned"] = med(lambda: d.copy_(pin, non_blocking=True))
R["h2d_pageable"] = med(lambda: d.copy_(src))
def seq():
    pin.copy_(src); d.copy_(pin, non_blocking=True)
R["copy_then_h2d"] = med(seq)
def overlap():  # DMA of one pinned buffer while the host fills another
    with torch.cuda.stream(s):
        d2.copy_(pin2, non_blocking=True)
    pin.copy_(src)
    s.synchronize()
R["h2d_during_host_copy"] = med(overlap)
for t in (4, 8):
    torch.set_num_threads(t); R[f"h2d_during_host_copy_threads{t}"] = med(overlap)
torch.set_num_threads(nt)
def pieces(k):
    step = (N + k - 1) // k
    def fn():
        with torch.cuda.stream(s):
            for a in range(0, N, step):
                b = min(N, a + step)
                pin[a:b].copy_(src[a:b]); d[a:b].copy_(pin[a:b], non_blocking=True)
        s.synchronize()
    return fn
for k in (1, 2, 4, 8):
    R[f"pieces{k}"] = med(pieces(k))
# how long the issuing call of a non-blocking H2D blocks the host
def issue():
    t0 = time.perf_counter(); d.copy_(pin, non_blocking=True); R.setdefault("_issue", []).append((time.perf_counter()-t0)*1e3)
med(issue, 20); R["h2d_issue_call_ms"] = round(statistics.median(R.pop("_issue")), 4)
cudart = torch.cuda.cudart()
def register():
    ptr = src.data_ptr()
    cudart.cudaHostRegister(ptr, N * 2, 0)
    d.copy_(src, non_blocking=True); torch.cuda.synchronize()
    cudart.cudaHostUnregister(ptr)
try:
    R["host_register_h2d_unregister"] = med(register, 10)
except Exception as e:
    R["host_register_error"] = str(e)
R["threads"] = nt
print(json.dumps(R, indent=1))
