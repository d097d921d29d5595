"""SGLang adapter: an in-worker receiver behind SGLang's custom weight loader,
layouts learned from SGLang's own loaders, and an HTTP driver.

Start the server with ``--custom-weight-loader reshard.adapters.sglang.hook.load``
(``custom_weight_loader=[HOOK]`` for ``sglang.Engine``); then, on a trainer
rank, ``SglangEngine(url).refit_async(n, config)`` while every trainer rank
calls ``Sender.push(n)``. See ``docs/sglang.md``.
"""

from reshard.adapters.sglang.driver import HOOK, MixedWeightsError, SglangEngine

__all__ = ["HOOK", "MixedWeightsError", "SglangEngine"]
