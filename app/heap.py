"""Keep Python's cycle collector off the heap that lives as long as the server does.

A server's process holds some 370,000 objects from start-up to exit: torch, the models, the
application. The cycle collector walks every one of them in each full collection, which on a
small CPU takes about 0.2 s with the GIL held: no request is parsed, no image decoded and no
batch prepared meanwhile. Under load, collections of the younger generations also showed up
as a fifth of the event loop's time. Frozen objects (``gc.freeze``) sit in a permanent
generation that no collection visits, so what start-up made is frozen as soon as it exists.

While the imports run, collecting is pointless (nothing they make is garbage yet) and costs
0.2-0.4 s of a cold start, so ``app.main`` defers collection until ``create_app`` has built
the application.

A model version that is unloaded leaves frozen objects behind. Reference counting frees its
engine, runtime sessions and batcher at once; what is left in reference cycles (small: a
version's bookkeeping) only the collector can free, so after an unload or a reload the
registry thaws the heap, collects and freezes again, but only once no model has a request
admitted, queued or computing: the full collection holds the GIL for tenths of a second.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger("batchserve")


def defer_collection() -> None:
    """No collections until ``freeze`` (the imports of a start are all long-lived)."""
    gc.disable()


def freeze() -> None:
    """Move every object alive now out of the collector's way, and collect from here on."""
    gc.freeze()
    gc.enable()


def collect_and_freeze() -> None:
    """Free what became garbage among the frozen objects (a model version was unloaded),
    then freeze what is left. Takes a full collection's time (tenths of a second)."""
    started = time.perf_counter()
    gc.unfreeze()
    freed = gc.collect()
    freeze()
    logger.debug("collected %d objects in %.3f s", freed, time.perf_counter() - started)


def thaw() -> None:
    """Let the collector see every object again (the server is stopping)."""
    gc.unfreeze()
