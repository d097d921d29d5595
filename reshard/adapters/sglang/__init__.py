"""SGLang adapter: an in-worker receiver behind SGLang's custom weight loader,
layouts learned from SGLang's own loaders, and an HTTP driver.

Start the server with ``--custom-weight-loader reshard.adapters.sglang.hook.load``
(``custom_weight_loader=[HOOK]`` for ``sglang.Engine``); then, on trainer
rank 0, ``sender.push(n, engines=SglangEngines(["http://engine:30000"]))``
while the other trainer ranks call ``sender.push(n)``. See ``docs/sglang.md``.
"""

from reshard.adapters.sglang.driver import HOOK, SglangEngine, SglangEngines
from reshard.errors import MixedWeightsError

__all__ = ["HOOK", "MixedWeightsError", "SglangEngine", "SglangEngines"]
