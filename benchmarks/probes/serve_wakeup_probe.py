"""What handing one engine step's events to the HTTP event loop costs the engine loop's thread (CPU only): 256
streams, one call_soon_threadsafe per event (a wake-up write each) against server/http.py's Mailbox (one wake-up per
batch), while the event loop's thread runs.

    python benchmarks/probes/serve_wakeup_probe.py
"""

import asyncio
import statistics
import threading
import time

from tpweave.server.http import Mailbox

STREAMS = 256


def main() -> None:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def make_queues():
        return [asyncio.Queue() for _ in range(STREAMS)]

    queues = asyncio.run_coroutine_threadsafe(make_queues(), loop).result()
    mailbox = Mailbox(loop)

    def per_event():
        for i, q in enumerate(queues):
            loop.call_soon_threadsafe(q.put_nowait, (i, ("tokens", [1])))

    def batched():
        for i, q in enumerate(queues):
            mailbox.post(q, (i, ("tokens", [1])))

    for name, fn in (("call_soon_threadsafe", per_event), ("mailbox", batched)) * 2:
        samples = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
            time.sleep(0.002)  # the event loop drains the queues between steps, as between engine steps
        print(f"{name:22s} median {statistics.median(samples):8.1f} us per step of {STREAMS} events", flush=True)
    loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
