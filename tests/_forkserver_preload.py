"""What the fork server of tests/_dist.py imports before it forks any rank: torch, and megatron-core
where it is installed (~5 s of CPU per process on the CI box; the Megatron tests' ranks all import
it, and no other test's rank looks at it). A rank forked from the server gets the test's environment
(tests/_dist.py, _Forked.attach), plus what these imports added to the server's own (megatron-core sets
TORCHINDUCTOR_CACHE_DIR, say): SERVER_ENV is the server's environment before them."""
import os

SERVER_ENV = dict(os.environ)

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

try:
    import megatron.core  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.transformer  # noqa: F401
except ImportError:
    pass
