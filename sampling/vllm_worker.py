"""What a vLLM server started for a Waypoint run adds to its workers: one call, ``waypoint_reload``, that reloads the
policy's weights from a directory and then re-derives what a tied head computed from them. vLLM's reload refreshes
only the modules it loads into: on its CPU build a head tied to the embedding keeps the packed copy of the weights it
loaded first (``sampling.vllm_engine``'s ``retie``, which the colocated engine runs the same way). Start the server
with it (``waypoint`` installed beside vLLM):

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model CHECKPOINT ... \
        --worker-extension-cls waypoint.sampling.vllm_worker.WaypointWorker
"""

from __future__ import annotations

from waypoint.sampling.vllm_engine import retie, tied_groups


class WaypointWorker:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``: ``self`` is the worker."""

    def waypoint_reload(self, weights_path: str) -> None:
        if not hasattr(self, "_waypoint_tied"):  # before the first reload, which may part what the model ties
            self._waypoint_tied = tied_groups(self)
        self.reload_weights(weights_path=weights_path)
        if self._waypoint_tied:
            retie(self, self._waypoint_tied)
