"""Building a model whose weights are loaded next: parameters allocated, their random draws skipped.

``nn.Linear`` and ``nn.Embedding`` draw their initial weights when built (``kaiming_uniform_``,
``normal_``); a loader overwrites every one of them at once. For the default target
(SmolLM2-135M, fp32, one thread) the draws took ~1 s of each load, as long as reading the
checkpoint. transformers skips them the same way when it loads (``no_init_weights``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch.nn import init

#: the random draws of ``torch.nn.init`` that module constructors make (deterministic fills such
#: as ``ones_`` / ``zeros_`` are cheap and stay)
RANDOM_DRAWS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
)

_lock = threading.Lock()


def _keep(tensor, *args, **kwargs):
    return tensor


@contextlib.contextmanager
def skip_random_init() -> Iterator[None]:
    """Within the block, ``torch.nn.init``'s random draws leave tensors as allocated
    (uninitialised memory): for constructing a model whose every parameter is loaded right after
    (a strict ``load_state_dict``). Process-wide while it lasts (one block at a time, under a
    lock): no other thread should build a model it means to keep random meanwhile."""
    with _lock:
        saved = {name: getattr(init, name) for name in RANDOM_DRAWS}
        try:
            for name in RANDOM_DRAWS:
                setattr(init, name, _keep)
            yield
        finally:
            for name, fn in saved.items():
                setattr(init, name, fn)
