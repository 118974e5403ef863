"""``nvtx_range`` as a decorator: the wrapped function runs inside the range."""

import functools


def wrap(cm, func):
    """``func`` wrapped so that each call runs inside the context manager ``cm``."""

    @functools.wraps(func)
    def inner(*args, **kwargs):
        with cm:
            return func(*args, **kwargs)

    return inner
