"""Ids of the requests and replies on the hot path: unique, not secret.

uuid4 reads the kernel's random source at every call (~4 us here, three ids a request);
these come from one generator seeded from it at start-up. Stored ids (batches, files)
keep uuid4."""

from __future__ import annotations

import random

_random = random.Random()  # seeded from os.urandom


def random_hex(num_chars: int) -> str:
    """`num_chars` random lowercase hex digits."""
    return f"{_random.getrandbits(4 * num_chars):0{num_chars}x}"
