"""The timed loop the H2D benches and probes share: each call's destination poisoned first and
the GPU idle (synchronised) before the clock starts, a synchronisation before it stops, the
result checked against `ref` on the device after every call (outside the timing)."""

import time


def timed_into(torch, fn, dst, ref, reps, *, before=None, what="copy", poison=-7):
    """Seconds of each of `reps` calls of `fn` into `dst`. `before(i)`, when given, runs after
    the poisoning and before the clock starts (it sets the source's cache state)."""
    ts = []
    for i in range(reps):
        dst.fill_(poison)
        torch.cuda.synchronize()
        if before is not None:
            before(i)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
        if not torch.equal(dst, ref):
            raise AssertionError(f"{what}: wrong result")
    return ts
