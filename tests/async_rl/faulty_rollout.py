"""A rollout backend whose weight update fails half-way, once, for the fault tests: the ``hf``
backend, except that the update to version ``EK_TEST_FAIL_UPDATE_VERSION`` raises after its
first chunk was staged (as a transfer that breaks mid-stream)."""

from __future__ import annotations

import os

from backends.rollout.hf import HFRollout


class FailsHalfway(HFRollout):
    _chunks = 0

    def begin_weight_update(self, version: int) -> None:
        super().begin_weight_update(version)
        self._chunks = 0

    def update_weights(self, chunk) -> None:
        self._chunks += 1
        if self._chunks == 2 and str(self._staging_version) == os.environ.get("EK_TEST_FAIL_UPDATE_VERSION"):
            raise ConnectionError(f"injected: the transfer of weights version {self._staging_version} broke after one chunk")
        super().update_weights(chunk)
