"""The vLLM releases mtpstate supports, one folder each, side by side:
``v0_34_0/``, ``v0_33_0/`` and ``v0_32_0/``, each with its patch (``mrv2.patch``, the
upstream-PR form of what the plugin applies in memory) and its
:class:`Release` (the fingerprints of every definition the patch changes,
mtpstate computes in vLLM's place, or mtpstate's sampler writer and uploads
rely on). Code stays shared: what differs between releases is only here,
and where code meets a difference it detects the feature, not the version.

Register: what each release's patch changes, why it differs, when it can go.

=======  ==============================================  ===================
release  differs from the next release                   can go when
=======  ==============================================  ===================
0.34.0   (the reference)                                 0.34 is not run
0.33.0   finish/add/update_requests hunks of the patch   0.33 is not run
         rewritten for 0.33's methods; the sampler
         keeps no may_mask_logits; get_logprobs_dims
         takes include_token_ids; UvaBufferPool has no
         _next_buf (see ``v0_33_0.RELEASE.differences``)
0.32.0   the hunk that builds mtpstate's state moved     0.32 is not run
         after initialize_kv_cache's PCP manager;
         get_top_k_top_p takes no vocab size and
         answers (top_k, top_p) (see
         ``v0_32_0.RELEASE.differences``)
=======  ==============================================  ===================

Adding one: docs/vllm.md, "Adding a vLLM release".
"""

from __future__ import annotations

import dataclasses

from mtpstate.integrations.vllm.releases import v0_32_0, v0_33_0, v0_34_0
from mtpstate.integrations.vllm.releases.release import Release

__all__ = ["RELEASES", "Release"]

# version -> its Release, oldest first
RELEASES: dict[str, Release] = {
    m.RELEASE.version: dataclasses.replace(m.RELEASE, package=m.__name__) for m in (v0_32_0, v0_33_0, v0_34_0)
}
