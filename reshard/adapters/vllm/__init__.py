"""vLLM adapter: worker extension, ``reshard`` weight-transfer backend, layout learning.

``--worker-extension-cls reshard.adapters.vllm.ReshardWorkerExtension`` or
``--weight-transfer-config '{"backend": "reshard"}'`` (registered through the
``vllm.general_plugins`` entry point). Both paths share
:class:`reshard.adapters.vllm.receiver.VllmReceiver`.
"""

from reshard.adapters.vllm.extension import ReshardWorkerExtension

__all__ = ["ReshardWorkerExtension"]
