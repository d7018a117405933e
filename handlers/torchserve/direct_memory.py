"""What TorchServe 0.12's frontend holds in Netty's direct memory while it receives request
bodies and hands them to a worker, as arithmetic: how many bodies of a size fit at once within
-XX:MaxDirectMemorySize. The pod's nginx gate (pod/config.py, kserve/nginx.conf) admits that many
and cs-kserve (compiled_serving/kserve.py) prints it. Measured on the CPU with the shipped pod
(tests/test_pod.py's flood): 16 concurrent bodies of 8.7 MB, and 128 of 999,999 bytes, ran a
100 MiB frontend out ("Cannot reserve 16777216 bytes of direct buffer memory")."""
from __future__ import annotations

MIB = 1 << 20
# Netty's direct memory in TorchServe's frontend beside the large bodies: its pool's chunks (16 MiB
# each) for the small requests and answers in flight. compiled_serving/kserve.py sizes
# -XX:MaxDirectMemorySize as this plus a few bodies of the pod's limit.
DIRECT_POOL_MIB = 64
# A body of this many bytes or more is "large": nginx's gate (kserve/nginx.conf) lets only
# large_bodies_at_once of them reach TorchServe at once.
LARGE_BODY_BYTES = 1_000_000
# Smaller bodies share DIRECT_POOL_MIB: (smallest body of the tier, MiB of the pool its bodies may
# hold). The gate counts each tier apart (by the digits of its Content-Length); bodies under the
# last tier pass uncounted, in what is left of the pool (one 16 MiB chunk of Netty's).
POOL_TIERS = ((100_000, DIRECT_POOL_MIB // 2), (10_000, DIRECT_POOL_MIB // 4))


def large_bodies_at_once(direct_mib: int, limit: int, batch_size: int) -> tuple:
    """(n, the arithmetic in words): the most bodies of `limit` bytes TorchServe's frontend can
    hold at once within `direct_mib` MiB of direct memory. Each body in flight holds its bytes in
    Netty's direct buffers while the frontend receives it, and a batch of up to `batch_size` of
    them is encoded whole into one more direct buffer for the worker; DIRECT_POOL_MIB stays for
    everything else: DIRECT_POOL_MIB + n x body + min(n, batch_size) x body <= direct_mib.
    0 where not even one fits."""
    body = -(-limit // MIB)
    n = 0
    while DIRECT_POOL_MIB + (n + 1) * body + min(n + 1, batch_size) * body <= direct_mib:
        n += 1
    words = (f"{DIRECT_POOL_MIB} MiB pool + {n} x {body} MiB bodies received + min({n}, batchSize {batch_size}) "
             f"x {body} MiB in the encoding of a batch = {DIRECT_POOL_MIB + n * body + min(n, batch_size) * body} MiB "
             f"<= {direct_mib} MiB direct memory (-XX:MaxDirectMemorySize)")
    return n, words


def bodies_within(budget_bytes: int, body: int, batch_size: int) -> int:
    """The most bodies of `body` bytes with n x body (received) + min(n, batch_size) x body (a
    batch's encoding) <= budget_bytes."""
    n = 0
    while (n + 1) * body + min(n + 1, batch_size) * body <= budget_bytes:
        n += 1
    return n


def pool_tiers(batch_size: int) -> tuple:
    """((smallest, largest body, n), ...) of POOL_TIERS, and their arithmetic in words."""
    tiers, words, high = [], [], LARGE_BODY_BYTES - 1
    for low, mib in POOL_TIERS:
        n = bodies_within(mib * MIB, high, batch_size)
        tiers.append((low, high, n))
        words.append(f"{n} of {low:,}-{high:,} bytes ({n} + min({n}, {batch_size})) x {high:,} <= {mib} MiB")
        high = low - 1
    return tuple(tiers), "; ".join(words)
