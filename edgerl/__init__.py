"""edgerl: hardware-adaptive RL fine-tuning of LLMs on the GPUs people actually have.

    import edgerl
    run = edgerl.prepare("run.toml", train={"steps": 20})   # plan, checks, run folder (docs/python.md)
    run.train()
"""

from typing import Any

from edgerl.core import VERSION as __version__

__all__ = ["__version__", "prepare"]


def prepare(config: Any = None, **kwargs: Any) -> Any:
    """A prepared run (edgerl.train.api.prepare): `run.train()` trains it. Imported on first use, so that
    `import edgerl` stays light."""
    from edgerl.core.platforms import check_can_train
    check_can_train("edgerl.prepare (training)")
    from edgerl.train.api import prepare as _prepare
    return _prepare(config, **kwargs)
