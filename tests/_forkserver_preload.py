"""What the fork server of tests/_dist.py imports before it forks any rank: torch, and megatron-core
where it is installed (~5 s of CPU per process on the CI box; the Megatron tests' ranks all import
it, and no other test's rank looks at it); pytest and ep_plugin, which every rank's test module
imports: ~0.25 CPU-s a rank on the CI box, whose PYTHONDONTWRITEBYTECODE has every process compile
ep_plugin's source anew, over 100 ranks in the CPU suite. ep_plugin reads no environment variable at
import, so a rank holds the same modules as if it had imported them itself. A rank forked from the
server gets the test's environment (tests/_dist.py, _Forked.attach), plus what these imports added to
the server's own (megatron-core sets TORCHINDUCTOR_CACHE_DIR, say): SERVER_ENV is the server's
environment before them."""
import os

SERVER_ENV = dict(os.environ)

import pytest  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

import ep_plugin  # noqa: E402,F401

try:
    import megatron.core  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.transformer  # noqa: F401
except ImportError:
    pass

# Every object made so far goes to the garbage collector's permanent generation, which no collection
# visits. A forked rank shares these pages with the server until it writes to them, and a collection
# writes to every object it visits: the rank's gc.collect() (tests/_dist.py) and the collections of its
# interpreter shutdown copied the whole heap, page by page, ~2 s of CPU per rank (6 idle ranks: 14.7 CPU-s,
# 3.5 with the freeze). What the rank itself makes (its process groups, buffers) is collected as before.
# A rank's shutdown leaves the frozen objects alone: on a machine with triton installed (CI's set-up has
# none), nanobind may print "leaked N instances" of triton's types as a rank exits, harmlessly.
import gc  # noqa: E402

gc.collect()
gc.freeze()
