"""A verifier checker that hangs or crashes on demand, for fault-injection tests.

Resolved by name ("faulty_checker:check") inside the reward worker processes, so it imports
nothing heavy: each worker that is killed (timeout) or dies is restarted and imports it again.
"""

import os
import time


def check(pred: str, gold) -> bool:
    """'hang' sleeps far past any timeout, 'die' kills the worker, 'raise' raises; else pred == gold."""
    if pred == "hang":
        time.sleep(3600)
    if pred == "die":
        os._exit(3)
    if pred == "raise":
        raise RuntimeError("checker bug")
    return pred == str(gold)
